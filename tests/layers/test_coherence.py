"""Coherence: whatever is done to a layer, its output is that of a cache-free layer with the same state.

A layer keeps values derived from its weights (folded gate projections, padded cores, core-only
intermediates, fused matrices, plans) under one invalidation key. The property draws a layer —
every shipped format flat and hierarchical, a registered toy format, every shipped gate and a
registered toy gate, plain, MLP, gated and MxD blocks — and a sequence of what users and the
library's own loops do to layers, and after each operation compares the layer's outputs (train and
eval, with and without gradients) with a fresh layer built the same way and loaded from its
``state_dict``.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import rank_of, shipped_formats
from torch import nn

from mumoe_tn import Gate, MixtureOfDecoders, MuMoE, MuMoEGatedMLP, MuMoEMLP, ReLUTopKGate, TopKGate
from mumoe_tn.decompositions import Format, normalise_ranks, unregister
from mumoe_tn.distillation.losses import AuxK
from mumoe_tn.distillation.training import ReplacementTrainer
from mumoe_tn.gates.registry import register_gate, unregister_gate
from mumoe_tn.network import ExpertNetwork, physical_sizes

IN, HIDDEN, OUT = 6, 8, 5


@dataclass(frozen=True)
class CoherenceTopKGate(TopKGate):
    """A user's registered gate: the softmax top-k router under a name of its own."""

    short_name = "coherence_topk"


@pytest.fixture(scope="module", autouse=True)
def toy_registrations():
    class BridgeFormat(Format, name="coherence_bridge"):  # registered here: only while this module runs
        """A user's format: ``A: n… i a, B: a o`` — every expert mode meets the input in one core."""

        def network(self, expert_dims, in_features, out_features, rank, **options):
            (a,) = normalise_ranks(self.name, rank, 1)
            sizes = physical_sizes(expert_dims, in_features, out_features)
            modes = " ".join(f"n{e + 1}" for e in range(len(expert_dims)))
            return ExpertNetwork({"A": f"{modes} i a", "B": "a o"}, {**sizes, "a": a})

    register_gate(CoherenceTopKGate)
    yield
    unregister_gate(CoherenceTopKGate)
    unregister("coherence_bridge")


def _formats() -> tuple[str, ...]:
    return (*shipped_formats(), "coherence_bridge")


GATES: dict[str, Callable[[int], object]] = {
    "entmax15 batch-norm": lambda modes: Gate(),
    "sparsemax layer-norm": lambda modes: Gate(activation="sparsemax", norm="layer"),
    "softmax": lambda modes: Gate(activation="softmax", norm="none"),
    "top-k": lambda modes: TopKGate(k=(2,) * modes),
    "relu top-k": lambda modes: ReLUTopKGate(k=(2,) * modes),
    "toy gate": lambda modes: CoherenceTopKGate(k=(2,) * modes),
}

BLOCKS = ("moe", "mlp", "gated", "mxd")


def _builder(block: str, fmt: str, dims: int | tuple[int, ...], gate: str) -> Callable[[], nn.Module]:
    modes = 1 if isinstance(dims, int) else len(dims)
    rank = 2 if fmt == "coherence_bridge" else rank_of(fmt, 2)

    def build() -> nn.Module:
        torch.manual_seed(0)
        spec = GATES[gate](modes)
        if block == "moe":
            return MuMoE(IN, OUT, dims, fmt, rank, gate=spec)
        if block == "mlp":
            return MuMoEMLP(IN, HIDDEN, OUT, dims, fmt, rank, gate=spec)
        if block == "gated":
            return MuMoEGatedMLP(IN, HIDDEN, OUT, dims, fmt, rank, gate=spec)
        return MixtureOfDecoders(IN, HIDDEN, OUT, dims, gate=spec)

    return build


OPERATIONS = (
    "fused adamw step",
    "distillation step",
    "distillation step with aux-k",
    "foreach sgd step",
    "eval forward",
    "train no-grad forward",
    "functional call",
    "hook on the gate",
    "hook on the experts",
    "load_state_dict",
    "in-place update",
    ".data assignment",
    "dtype round trip",
    "deepcopy",
    "pickle",
    "train/eval switch",
)


def _inputs(seed: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, IN, generator=torch.Generator().manual_seed(seed))


def _reference(build: Callable[[], nn.Module], layer: nn.Module) -> nn.Module:
    fresh = build().to(next(layer.parameters()).dtype)
    fresh.load_state_dict(layer.state_dict())
    return fresh.train(layer.training)


def _assert_coherent(build: Callable[[], nn.Module], layer: nn.Module, x: torch.Tensor, what: str) -> None:
    """Outputs of ``layer`` equal a fresh layer's with its state, with and without gradients, in its mode."""
    for grad in (False, True):
        reference = _reference(build, layer)  # (a train-mode call moves BatchNorm statistics: fresh each time)
        with torch.set_grad_enabled(grad):
            got, expected = layer(x), reference(x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"after {what}: {m}")


def _step(layer: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    training = layer.training
    layer.train()
    optimizer.zero_grad()
    layer(x).square().mean().backward()
    optimizer.step()
    layer.train(training)


def _apply(operation: str, layer: nn.Module, build: Callable[[], nn.Module], x: torch.Tensor) -> nn.Module:
    """Do ``operation`` to ``layer`` (checking what it returns where it returns something); the layer after it."""
    if operation == "fused adamw step":
        _step(layer, torch.optim.AdamW(layer.parameters(), lr=0.05, fused=True), x)
    elif operation in ("distillation step", "distillation step with aux-k"):
        # The distillation trainer: fused AdamW, and with the auxiliary-k term a functional call and a
        # no-grad forward with substituted codes between the backward and the step (every unit dead).
        losses = ["normalised-mse", AuxK(dead_after=1, k_aux=2)] if operation.endswith("aux-k") else "normalised-mse"
        training = layer.training
        trainer = ReplacementTrainer(layer, recipe="plain", steps=1, losses=losses)
        trainer.step(x, torch.randn(x.shape[0], OUT, generator=torch.Generator().manual_seed(7)))
        layer.train(training)
    elif operation == "foreach sgd step":
        _step(layer, torch.optim.SGD(layer.parameters(), lr=0.5, foreach=True), x)
    elif operation == "eval forward":
        training = layer.eval().training
        with torch.no_grad():
            layer(x)
        layer.train(training)
    elif operation == "train no-grad forward":  # moves BatchNorm statistics; what distillation's auxiliary term does
        training = layer.train().training
        with torch.no_grad():
            layer(x)
        layer.train(training)
    elif operation == "functional call":
        substituted = {name: p.detach() * 1.5 for name, p in layer.named_parameters()}
        with torch.no_grad():
            got = torch.func.functional_call(layer, substituted, (x,))
            reference = _reference(build, layer)
            reference.load_state_dict(substituted, strict=False)
            torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-5)
    elif operation in ("hook on the gate", "hook on the experts"):
        target = (
            layer.gate
            if operation == "hook on the gate"
            else next(m for m in layer.modules() if type(m).__name__ == "FactorizedExperts")
        )
        reference = _reference(build, layer)
        twin = dict(zip(layer.modules(), reference.modules(), strict=True))[target]

        def scale(module, args, output):
            return tuple(2 * t for t in output) if isinstance(output, tuple) else 2 * output

        handles = [target.register_forward_hook(scale), twin.register_forward_hook(scale)]
        with torch.no_grad():
            got, expected = layer(x), reference(x)
        for handle in handles:
            handle.remove()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    elif operation == "load_state_dict":
        state = {k: v * 0.5 if v.is_floating_point() else v for k, v in layer.state_dict().items()}
        layer.load_state_dict(state)
    elif operation == "in-place update":
        with torch.no_grad():
            for p in layer.parameters():
                p.mul_(-0.75)
    elif operation == ".data assignment":
        for p in layer.parameters():
            p.data = p.data * 1.25
    elif operation == "dtype round trip":
        layer.double()
        with torch.no_grad():
            layer(x.double())
        layer.float()
    elif operation == "deepcopy":
        layer = copy.deepcopy(layer)
    elif operation == "pickle":
        layer = pickle.loads(pickle.dumps(layer))
    elif operation == "train/eval switch":
        layer.train(not layer.training)
    else:  # pragma: no cover - the strategy draws from OPERATIONS
        raise AssertionError(operation)
    return layer


@st.composite
def layers(draw):
    block = draw(st.sampled_from(BLOCKS))
    fmt = "mxd" if block == "mxd" else draw(st.sampled_from(_formats()))
    dims = draw(st.sampled_from([4, (2, 3)]))
    return block, fmt, dims, draw(st.sampled_from(sorted(GATES)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    drawn=layers(), operations=st.lists(st.sampled_from(OPERATIONS), min_size=1, max_size=6), seed=st.integers(0, 99)
)
def test_every_sequence_of_operations_leaves_the_layer_coherent(drawn, operations, seed):
    build = _builder(*drawn)
    layer = build().eval()
    x = _inputs(seed)
    with torch.no_grad():
        layer(x)  # every cache warm before the first operation
    for operation in operations:
        layer = _apply(operation, layer, build, x)
        _assert_coherent(build, layer, x, operation)
        layer.eval()
        _assert_coherent(build, layer, x, f"{operation}, then eval")


@pytest.mark.parametrize("fused", [True, False])
def test_an_eval_forward_between_fused_optimiser_steps_sees_every_step(fused):
    """Torch's fused optimisers bump no version counter: the derived values must still follow each step."""
    build = _builder("mlp", "cp", 4, "entmax15 batch-norm")
    layer = build()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.05, fused=fused)
    x = _inputs(1)
    for _ in range(3):
        _step(layer, optimizer, x)
        layer.eval()
        with torch.no_grad():
            got = layer(x)
        torch.testing.assert_close(got, _reference(build, layer)(x), rtol=1e-4, atol=1e-5)
        layer.train()


def test_a_hook_on_the_experts_sees_every_inference_call():
    build = _builder("moe", "tr", 4, "entmax15 batch-norm")
    layer = build().eval()
    seen = []
    experts = next(m for m in layer.modules() if type(m).__name__ == "FactorizedExperts")
    handle = experts.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    with torch.no_grad():
        layer(_inputs(2))
        layer(_inputs(3))
    handle.remove()
    with torch.no_grad():
        layer(_inputs(4))
    assert seen == [torch.Size([5, OUT])] * 2
