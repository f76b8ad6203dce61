"""Compiled layers: one graph per mode and grad mode, none recompiled after warm-up.

``torch.compile(layer, fullgraph=True)`` traces the whole call, in eval and in training, for every
format (the shipped ones and a registered toy) and every gate (the shipped ones, a registered
subclass of the top-k gate and a user's gate of the program's gate protocol), on the plain,
MLP and gated blocks with one and with two expert modes. After one warm-up pass over
train/eval, grad/no-grad and two batch sizes of one bucket, the same calls — with eager calls of
the same layer in between — compile nothing new: no graph is added, as counted both by a
backend that compiles nothing (the graph runs eagerly, so the test is about guards, not about
inductor) and by dynamo's own counters.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import pytest
import torch
from strategies import rank_of, shipped_formats
from torch._dynamo.utils import counters
from toy_plugins import TOY_FORMAT, ScaledSoftmaxGate, ToyTopKGate, registered_toys

from mumoe_tn import Gate, MixtureOfDecoders, MuMoE, MuMoEGatedMLP, MuMoEMLP, ReLUTopKGate, TopKGate

IN, HIDDEN, OUT = 6, 8, 5

GATES: dict[str, Callable[[int], object]] = {
    "entmax15": lambda modes: Gate(),
    "sparsemax": lambda modes: Gate(activation="sparsemax", norm="layer"),
    "softmax": lambda modes: Gate(activation="softmax", norm="none"),
    "top-k": lambda modes: TopKGate(k=(2,) * modes),
    "relu top-k": lambda modes: ReLUTopKGate(k=(2,) * modes),
    "toy top-k": lambda modes: ToyTopKGate(k=(2,) * modes),
    "toy program gate": lambda modes: ScaledSoftmaxGate(),
}
#: a gate whose compiled training calls keep a record: its load-balancing loss
RECORDING_GATES = {"balance loss": lambda modes: Gate(balance_loss=True)}
FORMATS = (*shipped_formats(), TOY_FORMAT)
#: (training, grad, rows): both modes, both grad modes, two batch sizes of the bucket of 4
CALLS = [(training, grad, rows) for training, grad in itertools.product((False, True), repeat=2) for rows in (3, 4)]


@pytest.fixture(scope="module", autouse=True)
def toy_registrations():
    with registered_toys():  # registered only while this module runs
        yield


def _cases() -> list:
    """Every format × gate; the block and the expert modes taken in turn, so each format and gate meets each."""
    cases = []
    for i, (fmt, gate) in enumerate(itertools.product(FORMATS, GATES)):
        block = "mxd" if fmt == "mxd" else ("moe", "mlp", "gated")[i % 3]
        dims = 4 if i % 2 else (2, 3)
        cases.append(pytest.param(fmt, gate, block, dims))
    return cases


def _layer(fmt: str, gate: str, block: str, dims: int | tuple[int, ...]) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = {**GATES, **RECORDING_GATES}[gate](1 if isinstance(dims, int) else len(dims))
    rank = 2 if fmt == TOY_FORMAT else rank_of(fmt, 2)
    if block == "mxd":
        return MixtureOfDecoders(IN, HIDDEN, OUT, dims, gate=spec)
    if block == "mlp":
        return MuMoEMLP(IN, HIDDEN, OUT, dims, fmt, rank, gate=spec)
    if block == "gated":
        return MuMoEGatedMLP(IN, HIDDEN, OUT, dims, fmt, rank, gate=spec)
    return MuMoE(IN, OUT, dims, fmt, rank, gate=spec)


@pytest.mark.parametrize(("fmt", "gate", "block", "dims"), _cases(), ids=lambda value: str(value))
def test_a_compiled_layer_compiles_nothing_after_warm_up(fmt, gate, block, dims):
    torch._dynamo.reset()
    counters.clear()
    frames = []

    def counting(graph, example_inputs):
        frames.append(graph)
        return graph.forward

    layer = _layer(fmt, gate, block, dims)
    compiled = torch.compile(layer, backend=counting, fullgraph=True, dynamic=True)

    def run(with_eager: bool) -> None:
        for training, grad, rows in CALLS:
            layer.train(training)
            x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
            with torch.set_grad_enabled(grad):
                got = compiled(x)
                if with_eager:  # (an eager call between compiled ones, and the two agree)
                    torch.testing.assert_close(got, layer(x), rtol=1e-4, atol=1e-5)

    run(with_eager=False)
    warm, graphs = len(frames), counters["stats"]["unique_graphs"]
    assert 2 <= warm <= 4, f"{warm} graphs for two modes × two grad modes"  # (at least: train and eval differ)
    assert graphs == warm, f"dynamo counted {graphs} graphs, the backend was given {warm}"
    run(with_eager=True)
    run(with_eager=False)
    assert len(frames) == warm, f"recompiled after warm-up: {warm} graphs, then {len(frames)}"
    assert counters["stats"]["unique_graphs"] == graphs, f"dynamo counted {counters['stats']['unique_graphs']} graphs"


def _python_state(layer: torch.nn.Module) -> dict[tuple[str, str, str], int]:
    """Every attribute of every submodule (and every entry of its parameter, buffer and module dicts), by identity."""
    state = {}
    for name, module in layer.named_modules():
        for key, value in vars(module).items():
            state[(name, "attribute", key)] = id(value)
        for group in ("_parameters", "_buffers", "_modules"):
            for key, value in getattr(module, group).items():
                state[(name, group, key)] = id(value)
    return state


@pytest.mark.parametrize("gate", ["entmax15", "toy program gate", "balance loss"])
def test_a_compiled_call_changes_nothing_python_side(gate):
    torch._dynamo.reset()
    layer = _layer("cp", gate, "moe", 4)
    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=True)
    changed = {}
    for training, grad in itertools.product((False, True), repeat=2):
        layer.train(training)
        with torch.set_grad_enabled(grad):
            compiled(torch.randn(3, IN))  # warm-up: compiles
            before = _python_state(layer)
            compiled(torch.randn(4, IN))
        after = _python_state(layer)
        changed[(training, grad)] = sorted(
            key for key in before.keys() | after.keys() if before.get(key) != after.get(key)
        )
    # only what a backward pass reads, and only when one can follow: the gate's losses in training with grad
    losses = [("gate", "attribute", "_compiled_losses")] if gate == "balance loss" else []
    expected = {(training, grad): losses if training and grad else [] for training, grad in changed}
    assert changed == expected


def test_compiled_training_reads_the_gate_losses_of_the_last_call_eager_or_compiled():
    torch._dynamo.reset()
    layer = _layer("cp", "balance loss", "moe", 4).train()
    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=True)
    first, second = torch.randn(6, IN), torch.randn(5, IN)
    layer(first)
    eager_first = layer.gate_losses()["balance"].detach()
    reference = copy.deepcopy(layer)  # (the batch norm's running statistics move with every training call)
    compiled(second)
    got = layer.gate_losses()["balance"]
    reference(second)
    torch.testing.assert_close(got, reference.gate_losses()["balance"])
    assert not torch.equal(got.detach(), eager_first)  # (the two batches' losses differ: the check can fail)
    got.backward()  # the compiled call's loss reaches the gate's parameters
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.gate.parameters() if p.ndim == 2)
    layer(first)  # an eager call after it: its own record is the one read again
    torch.testing.assert_close(layer.gate_losses()["balance"].detach(), eager_first, rtol=1e-4, atol=1e-6)
