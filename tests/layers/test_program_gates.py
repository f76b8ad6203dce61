"""A gate module that implements the program's gate protocol gets the fused inference path, named nowhere.

The toy gate here is a user's: a descriptor registered for the duration of the tests, building a
module that is no ``ExpertGate`` (a temperature-scaled softmax with a bias). The references are
written out from its formula and the dense expert tensor, not from the layer's paths.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mumoe_tn import MuMoE
from mumoe_tn.gates import Gate
from mumoe_tn.gates.gate_protocol import ModeLogits, ProgramGate, mode_parts
from mumoe_tn.gates.registry import register_gate, unregister_gate

DTYPE = torch.float64


class TemperedSoftmax(nn.Module):
    """``a_e = softmax((W_e z + b_e) / T)`` per mode, with the protocol's steps."""

    def __init__(self, in_features: int, expert_dims: tuple[int, ...], temperature: float, **factory: Any) -> None:
        super().__init__()
        self.expert_dims = tuple(expert_dims)
        self.temperature = temperature
        self.weight = nn.Parameter(torch.randn(sum(expert_dims), in_features, **factory))
        self.bias = nn.Parameter(torch.randn(sum(expert_dims), **factory))
        self.malformed = False

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = (z @ self.weight.T + self.bias) / self.temperature
        return tuple(torch.softmax(part, dim=-1) for part in logits.split(self.expert_dims, dim=-1))

    def projection_applies(self, z: torch.Tensor) -> bool:
        return not self.training and not torch.is_grad_enabled()

    def projection(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        weight = (self.weight.detach() / self.temperature).to(compute)
        if self.malformed:
            weight = weight[:, 1:]
        return weight, (self.bias.detach() / self.temperature).to(compute), True

    def normalise(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> ModeLogits:
        return logits

    def activation_map(self, logits: torch.Tensor) -> Callable[[ModeLogits], list[torch.Tensor]]:
        return lambda normed: [torch.softmax(part, dim=-1) for part in mode_parts(normed, self.expert_dims)]

    def record(self, logits: ModeLogits, coefficients: list[torch.Tensor], mask: torch.Tensor | None) -> None:
        self.recorded = len(coefficients)


@dataclass(frozen=True)
class TemperedGate:
    """The descriptor of `TemperedSoftmax` (a user's gate: registered by the fixture only)."""

    temperature: float = 2.0

    def parameter_count(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        return (in_features + 1) * sum(expert_dims)

    def fma_per_token(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        return in_features * sum(expert_dims)

    def build(self, in_features: int, expert_dims: tuple[int, ...], *, device: Any = None, dtype: Any = None):
        return TemperedSoftmax(in_features, expert_dims, self.temperature, device=device, dtype=dtype)


@pytest.fixture
def tempered_gate():
    register_gate(TemperedGate)
    yield TemperedGate(temperature=2.5)
    unregister_gate(TemperedGate)


class _ProductsOf(TorchDispatchMode):
    """Counts the matrix products that read ``x``."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.storage = x.untyped_storage().data_ptr()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm"):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() == self.storage for t in tensors):
                self.count += 1
        return func(*args, **(kwargs or {}))


def _formula_coefficients(gate: TemperedSoftmax, x: torch.Tensor) -> list[torch.Tensor]:
    logits = (x @ gate.weight.detach().T + gate.bias.detach()) / gate.temperature
    return [torch.exp(p) / torch.exp(p).sum(-1, keepdim=True) for p in logits.split(gate.expert_dims, dim=-1)]


def _dense_output(layer: MuMoE, x: torch.Tensor, coefficients: list[torch.Tensor]) -> torch.Tensor:
    """``y = W ×_1 a_1 … ×_E a_E ×_{E+1} [x; 1]`` with the materialised expert tensor."""
    modes = string.ascii_lowercase[: len(coefficients)]
    z = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=-1) if layer.bias else x
    equation = ",".join(f"z{m}" for m in modes) + f",zx,{modes}xy->zy"
    return torch.einsum(equation, *coefficients, z, layer.experts.to_dense().detach())


@pytest.mark.parametrize(("dims", "decomposition"), [((5,), "cp"), ((2, 3), "cp"), ((4,), "tr")])
def test_a_registered_user_gate_takes_the_fused_path_and_equals_its_formula(tempered_gate, dims, decomposition):
    torch.manual_seed(0)
    layer = MuMoE(7, 4, dims, decomposition, 3, gate=tempered_gate, dtype=DTYPE).eval()
    assert isinstance(layer.gate, ProgramGate)
    x = torch.randn(6, 7, dtype=DTYPE)
    with torch.no_grad():
        layer(x)  # the first call of a signature makes the program's entry
        with _ProductsOf(x) as products:
            y = layer(x)
    assert products.count == 1, f"x was multiplied {products.count} times: the gate was not fused"
    expected = _formula_coefficients(layer.gate, x)
    torch.testing.assert_close(y, _dense_output(layer, x, expected))
    for got, want in zip(layer.last_coefficients, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert layer.gate.recorded == len(dims)
    general = layer(x.clone().requires_grad_(True))  # gradients on: the gate runs as a module
    torch.testing.assert_close(general.detach(), y)


def test_a_user_gate_whose_projection_has_the_wrong_shape_is_named_in_the_error(tempered_gate):
    layer = MuMoE(7, 4, 5, "cp", 3, gate=tempered_gate, dtype=DTYPE).eval()
    layer.gate.malformed = True
    with torch.no_grad(), pytest.raises(ValueError, match=r"TemperedSoftmax's projection.*shape \(5, 6\).*\(5, 7\)"):
        layer(torch.randn(2, 7, dtype=DTYPE))


def test_a_gate_that_records_losses_is_fused_in_eval_and_records_the_general_paths_losses():
    torch.manual_seed(1)
    layer = MuMoE(7, 4, (3, 3), "cp", 3, gate=Gate(balance_loss=True, z_loss=True), dtype=DTYPE)
    layer(torch.randn(16, 7, dtype=DTYPE))  # training statistics for the BatchNorm of the logits
    layer.eval()
    x = torch.randn(6, 7, dtype=DTYPE)
    general = layer(x.clone().requires_grad_(True))
    expected = {name: loss.detach() for name, loss in layer.gate_losses().items()}
    layer(torch.randn(6, 7, dtype=DTYPE, requires_grad=True))  # records other losses
    with torch.no_grad():
        layer(x)
        with _ProductsOf(x) as products:
            y = layer(x)
    assert products.count == 1, f"x was multiplied {products.count} times: the gate was not fused"
    torch.testing.assert_close(y, general.detach())
    assert set(expected) == {"balance", "z"}
    for name, loss in layer.gate_losses().items():
        torch.testing.assert_close(loss, expected[name])
