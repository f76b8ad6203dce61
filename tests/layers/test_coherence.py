"""Coherence: whatever is done to a layer, its output is that of a cache-free layer with the same state.

A layer keeps values derived from its weights (folded gate projections, padded cores, core-only
intermediates, fused matrices, plans) under one invalidation key. The property draws a layer —
every shipped format flat and hierarchical, a registered toy format, every shipped gate, a
registered subclass of the top-k gate and a user's gate of the program's gate protocol, plain,
MLP, gated and MxD blocks — and a sequence of what users and the library's own loops do to
layers. After each operation (and, for an operation that adds something for a while, while it
is there) it compares the layer's outputs, with and without gradients, with a fresh layer built
the same way, loaded from its ``state_dict``, put in the same mode and called with gradients on
(the path that calls every module and derives nothing for inference).
"""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import rank_of, shipped_formats
from torch import nn
from toy_plugins import TOY_FORMAT, ScaledSoftmaxGate, ToyTopKGate, registered_toys

from mumoe_tn import Gate, MixtureOfDecoders, MuMoE, MuMoEGatedMLP, MuMoEMLP, ReLUTopKGate, TopKGate
from mumoe_tn.distillation.losses import AuxK
from mumoe_tn.distillation.training import ReplacementTrainer
from mumoe_tn.gates.modules import LogitBatchNorm

IN, HIDDEN, OUT = 6, 8, 5

Prepare = Callable[[nn.Module], None]


@pytest.fixture(scope="module", autouse=True)
def toy_registrations():
    with registered_toys():  # registered only while this module runs
        yield


GATES: dict[str, Callable[[int], object]] = {
    "entmax15 batch-norm": lambda modes: Gate(),
    "sparsemax layer-norm": lambda modes: Gate(activation="sparsemax", norm="layer"),
    "softmax": lambda modes: Gate(activation="softmax", norm="none"),
    "top-k": lambda modes: TopKGate(k=(2,) * modes),
    "relu top-k": lambda modes: ReLUTopKGate(k=(2,) * modes),
    "toy top-k": lambda modes: ToyTopKGate(k=(2,) * modes),
    "toy program gate": lambda modes: ScaledSoftmaxGate(),
}

BLOCKS = ("moe", "mlp", "gated", "mxd")


def _builder(block: str, fmt: str, dims: int | tuple[int, ...], gate: str) -> Callable[[], nn.Module]:
    """``build() -> layer``: a copy of one layer built on the first call and never called itself.

    Every copy is cache-free (the original never ran) and has the same initial weights; copying
    is some fifty times faster than building, which plans the contractions.
    """
    modes = 1 if isinstance(dims, int) else len(dims)
    rank = 2 if fmt == TOY_FORMAT else rank_of(fmt, 2)
    pristine: list[nn.Module] = []

    def make() -> nn.Module:
        torch.manual_seed(0)
        spec = GATES[gate](modes)
        if block == "moe":
            return MuMoE(IN, OUT, dims, fmt, rank, gate=spec)
        if block == "mlp":
            return MuMoEMLP(IN, HIDDEN, OUT, dims, fmt, rank, gate=spec)
        if block == "gated":
            return MuMoEGatedMLP(IN, HIDDEN, OUT, dims, fmt, rank, gate=spec)
        return MixtureOfDecoders(IN, HIDDEN, OUT, dims, gate=spec)

    def build() -> nn.Module:
        if not pristine:
            pristine.append(make())
        return copy.deepcopy(pristine[0])

    return build


HOOKS = ("forward hook", "forward pre-hook", "substituted forward")
OPERATIONS = (
    "fused adamw step",
    "distillation step",
    "distillation step with aux-k",
    "foreach sgd step",
    "eval forward",
    "train no-grad forward",
    "batch-norm statistics update",
    "functional call",
    *(f"{hook} on the {target}" for hook in HOOKS for target in ("gate", "experts")),
    "swapped gate",
    "swapped experts",
    "load_state_dict",
    "in-place update",
    ".data assignment",
    "dtype round trip",
    "device move",
    "deepcopy",
    "pickle",
    "train/eval switch",
)

DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _inputs(seed: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, IN, generator=torch.Generator().manual_seed(seed))


def _reference(build: Callable[[], nn.Module], layer: nn.Module, prepare: Prepare | None = None) -> nn.Module:
    """A fresh layer with ``layer``'s state, dtype, device and mode (and ``prepare`` done to it)."""
    parameter = next(layer.parameters())
    fresh = build().to(device=parameter.device, dtype=parameter.dtype)
    fresh.load_state_dict(layer.state_dict())
    fresh.train(layer.training)
    if prepare is not None:
        prepare(fresh)
    return fresh


def _assert_coherent(
    build: Callable[[], nn.Module],
    layer: nn.Module,
    x: torch.Tensor,
    what: str,
    prepare: Prepare | None = None,
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    grads: tuple[bool, ...] = (False, True),
) -> None:
    """``call(layer, x)`` (default ``layer(x)``) equals the reference's output, for each grad mode in ``grads``.

    The reference is a fresh layer with ``layer``'s state and mode, ``prepare`` done to it, called
    with gradients on.
    """
    for grad in grads:
        reference = _reference(build, layer, prepare)  # (a train-mode call moves BatchNorm statistics: fresh each time)
        with torch.enable_grad():
            expected = (reference(x) if call is None else call(reference, x)).detach()
        with torch.set_grad_enabled(grad):
            got = (layer(x) if call is None else call(layer, x)).detach()
        context = f"{what} (grad {grad}, training {layer.training})"
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m, at=context: f"{at}: {m}")


def _step(layer: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    training = layer.training
    layer.train()
    optimizer.zero_grad()
    layer(x).square().mean().backward()
    optimizer.step()
    layer.train(training)


def _doubled(output: object) -> object:
    return tuple(2 * t for t in output) if isinstance(output, tuple) else 2 * output


def _targets(layer: nn.Module, target: str, seed: int) -> list[str]:
    """The names of the gate, or of one expert layer (which one: by ``seed``)."""
    if target == "gate":
        return ["gate"]
    experts = [name for name, m in layer.named_modules() if type(m).__name__ == "FactorizedExperts"]
    return [experts[seed % len(experts)]]


def _hooked(hook: str, names: list[str]) -> Callable[[nn.Module], Callable[[], None]]:
    """``add(layer) -> remove``: ``hook`` on the submodules ``names`` of a layer, and how to take it off."""

    def add(layer: nn.Module) -> Callable[[], None]:
        undo = []
        for name in names:
            module = layer.get_submodule(name)
            if hook == "forward hook":
                undo.append(module.register_forward_hook(lambda m, args, output: _doubled(output)).remove)
            elif hook == "forward pre-hook":
                handle = module.register_forward_pre_hook(
                    lambda m, args, kwargs: ((args[0] * 0.5, *args[1:]), kwargs), with_kwargs=True
                )
                undo.append(handle.remove)
            else:  # code substitution: the instance's own forward, which calls the class's and doubles it

                def forward(self, *args, **kwargs):
                    return _doubled(type(self).forward(self, *args, **kwargs))

                module.forward = types.MethodType(forward, module)
                undo.append(lambda module=module: delattr(module, "forward"))
        return lambda: [remove() for remove in undo]

    return add


def _swap(layer: nn.Module, name: str) -> nn.Module:
    """Put a copy of submodule ``name`` with other weights in its place; the submodule taken out."""
    parent, _, attribute = name.rpartition(".")
    holder = layer.get_submodule(parent)
    original = getattr(holder, attribute)
    other = copy.deepcopy(original)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-0.5)
    setattr(holder, attribute, other)
    return original


def _apply(operation: str, layer: nn.Module, build: Callable[[], nn.Module], x: torch.Tensor, seed: int) -> nn.Module:
    """Do ``operation`` to ``layer``, checking the layer while anything it adds is there; the layer after it."""
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
    elif operation in ("train no-grad forward", "batch-norm statistics update"):
        # Both move BatchNorm running statistics (the first is what distillation's auxiliary term does).
        training = layer.train().training
        with torch.set_grad_enabled(operation == "batch-norm statistics update"):
            layer(x)
        layer.train(training)
    elif operation == "functional call":
        substituted = {name: p.detach() * 1.5 for name, p in layer.named_parameters()}
        _assert_coherent(
            build,
            layer,
            x,
            operation,
            prepare=lambda reference: reference.load_state_dict(substituted, strict=False),
            call=lambda module, inputs: torch.func.functional_call(module, substituted, (inputs,)),
        )
    elif operation.startswith(HOOKS):
        hook, _, target = operation.partition(" on the ")
        add = _hooked(hook, _targets(layer, target, seed))
        remove = add(layer)
        _assert_coherent(build, layer, x, operation, prepare=add)
        remove()
    elif operation in ("swapped gate", "swapped experts"):
        (name,) = _targets(layer, operation.removeprefix("swapped "), seed)
        original = _swap(layer, name)
        _assert_coherent(build, layer, x, operation)
        parent, _, attribute = name.rpartition(".")
        setattr(layer.get_submodule(parent), attribute, original)  # and put back
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
        _assert_coherent(build, layer, x.double(), "in float64")
        layer.float()
    elif operation == "device move":
        for device in DEVICES:
            layer.to(device)
            _assert_coherent(build, layer, x.to(device), f"on {device}")
        layer.to("cpu")
    elif operation == "deepcopy":
        layer = copy.deepcopy(layer)
    elif operation == "pickle":
        layer = pickle.loads(pickle.dumps(layer))
    elif operation == "train/eval switch":
        layer.train(not layer.training)
    else:  # pragma: no cover - the strategy draws from OPERATIONS
        raise AssertionError(operation)
    return layer


def _cases() -> list[tuple[str, str, int | tuple[int, ...], str]]:
    """Layers that together cover every gate flat and hierarchical, every format and every block.

    Case ``i`` takes gate ``i mod 7``, format ``i mod 6`` (the shipped ones, MxD among them, and the
    toy), the MxD block for the MxD format and the μMoE blocks in turn for the others; the first
    seven cases have one expert mode, the next seven two.
    """
    formats = (*(f for f in shipped_formats() if f != "mxd"), TOY_FORMAT, "mxd")
    gates = sorted(GATES)
    cases = []
    for i in range(2 * len(gates)):
        fmt = formats[i % len(formats)]
        block = "mxd" if fmt == "mxd" else ("moe", "mlp", "gated")[sum(case[0] != "mxd" for case in cases) % 3]
        cases.append((block, fmt, 4 if i < len(gates) else (2, 3), gates[i % len(gates)]))
    return cases


@pytest.mark.parametrize("drawn", _cases(), ids=lambda case: "-".join(map(str, case)))
@settings(
    max_examples=max(6, settings().max_examples // 4), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(operations=st.lists(st.sampled_from(OPERATIONS), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_every_sequence_of_operations_leaves_the_layer_coherent(drawn, operations, seed):
    build = _builder(*drawn)
    layer = build().eval()
    x = _inputs(seed)
    with torch.no_grad():
        layer(x)  # every cache warm before the first operation
    for operation in operations:
        layer = _apply(operation, layer, build, x, seed)
        _assert_coherent(build, layer, x, f"after {operation}")
        layer.eval()
        _assert_coherent(build, layer, x, f"after {operation}, then eval")


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


@pytest.mark.parametrize("target", ["gate", "experts"])
@pytest.mark.parametrize("gate", ["entmax15 batch-norm", "toy program gate"])
def test_a_substituted_forward_is_called_in_eval_without_gradients(target, gate):
    build = _builder("moe", "cp", 4, gate)
    layer = build().eval()
    x = _inputs(5)
    with torch.no_grad():
        layer(x)
    add = _hooked("substituted forward", _targets(layer, target, 0))
    add(layer)
    _assert_coherent(build, layer, x, f"substituted forward on the {target}", prepare=add, grads=(False,))


def test_a_global_module_forward_hook_sees_the_gate_in_eval_without_gradients():
    build = _builder("moe", "cp", 4, "entmax15 batch-norm")
    layer = build().eval()
    x = _inputs(6)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.append(type(module).__name__)
    )
    try:
        with torch.no_grad():
            layer(x)
    finally:
        handle.remove()
    assert "ExpertGate" in seen and "FactorizedExperts" in seen, seen


@pytest.mark.parametrize("hook", ["forward hook", "forward pre-hook", "substituted forward"])
@pytest.mark.parametrize("gate", ["entmax15 batch-norm", "sparsemax layer-norm", "softmax"])
def test_a_hook_on_a_gate_norm_is_called_in_eval_without_gradients(hook, gate):
    build = _builder("moe", "cp", (3, 2), gate)
    layer = build()
    layer(_inputs(7, rows=16))  # running statistics away from their start
    layer.eval()
    x = _inputs(8)
    with torch.no_grad():
        layer(x)  # the eval call's derived values, made before the hook
    names = [f"gate.norms.{leg}" for leg in layer.gate.norms]
    add = _hooked(hook, names[:1])
    add(layer)
    _assert_coherent(build, layer, x, f"{hook} on a norm of the gate", prepare=add)


@pytest.mark.parametrize("block", ["moe", "gated"])
def test_a_new_eps_of_a_gate_norm_is_read_by_the_next_eval_call(block):
    build = _builder(block, "cp", (3, 2), "entmax15 batch-norm")
    layer = build()
    layer(_inputs(9, rows=16))  # running statistics away from their start
    layer.eval()
    x = _inputs(10)
    with torch.no_grad():
        layer(x)  # the eval call's derived values (the norms folded into the projection), made before the change

    def widen(module: nn.Module) -> None:
        for norm in module.gate.norms.values():
            norm.eps = 0.5

    widen(layer)
    _assert_coherent(build, layer, x, "a new eps of the gate's norms", prepare=widen)


class _ShiftedBatchNorm(LogitBatchNorm):
    """A user's norm: the batch norm doubled (a shift would not move a sparse map); ``eval_affine`` inherited."""

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input, mask) * 2.0


def test_a_norm_whose_forward_overrides_the_folded_map_is_called_in_eval_without_gradients():
    build = _builder("moe", "cp", (3, 2), "entmax15 batch-norm")
    layer = build()
    layer(_inputs(11, rows=16))  # running statistics away from their start
    for leg, norm in list(layer.gate.norms.items()):
        shifted = _ShiftedBatchNorm(norm.num_features, affine=norm.affine)
        shifted.load_state_dict(norm.state_dict())
        layer.gate.norms[leg] = shifted
    layer.eval()
    x = _inputs(12)
    with torch.no_grad():
        folded = layer(x)
    called = layer(x.clone().requires_grad_(True)).detach()  # (with gradients the norms are called as modules)
    torch.testing.assert_close(folded, called)
