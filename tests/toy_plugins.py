"""A user's plugins for the layer tests: a format and two gates, registered only while a test holds them.

- ``TOY_FORMAT`` names a format (``A: n… i a, B: a o``: every expert mode meets the input in one
  core) whose class is made, and so registered, inside `registered_toys`.
- `ToyTopKGate` is the softmax top-k router under a short name of its own (a subclass of a
  registered gate).
- `ScaledSoftmaxGate` builds `ScaledSoftmax`, a gate module that is no library gate: it
  implements the program's gate protocol (`mumoe_tn.gates.gate_protocol.ProgramGate`), so
  inference may fuse it.

Nothing registers at import: registrations made at import would leak into every other test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mumoe_tn import TopKGate
from mumoe_tn.decompositions import Format, normalise_ranks, unregister
from mumoe_tn.gates.gate_protocol import ModeLogits, mode_parts
from mumoe_tn.gates.registry import register_gate, unregister_gate
from mumoe_tn.network import ExpertNetwork, physical_sizes

__all__ = ["TOY_FORMAT", "ScaledSoftmax", "ScaledSoftmaxGate", "ToyTopKGate", "registered_toys"]

TOY_FORMAT = "toy_plugin_bridge"


@dataclass(frozen=True)
class ToyTopKGate(TopKGate):
    """A user's registered gate: the softmax top-k router under a name of its own."""

    short_name = "toy_plugin_topk"


class ScaledSoftmax(nn.Module):
    """``a_e = softmax(s · (W_e z + b_e))`` per mode, with the steps of the program's gate protocol."""

    def __init__(self, in_features: int, expert_dims: tuple[int, ...], scale: float, **factory: Any) -> None:
        super().__init__()
        self.expert_dims = tuple(expert_dims)
        self.scale = scale
        self.weight = nn.Parameter(torch.randn(sum(expert_dims), in_features, **factory) / in_features**0.5)
        self.bias = nn.Parameter(torch.randn(sum(expert_dims), **factory))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = (z @ self.weight.T + self.bias) * self.scale
        return tuple(torch.softmax(part, dim=-1) for part in logits.split(self.expert_dims, dim=-1))

    def projection_applies(self, z: torch.Tensor) -> bool:
        return not self.training and not torch.is_grad_enabled()

    def projection(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        return (self.weight.detach() * self.scale).to(compute), (self.bias.detach() * self.scale).to(compute), True

    def normalise(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> ModeLogits:
        return logits

    def activation_map(self, logits: torch.Tensor) -> Callable[[ModeLogits], list[torch.Tensor]]:
        return lambda normed: [torch.softmax(part, dim=-1) for part in mode_parts(normed, self.expert_dims)]

    def record(self, logits: ModeLogits, coefficients: list[torch.Tensor], mask: torch.Tensor | None) -> None:
        pass


@dataclass(frozen=True)
class ScaledSoftmaxGate:
    """The descriptor of `ScaledSoftmax` (a user's gate)."""

    scale: float = 1.5

    def parameter_count(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        return (in_features + 1) * sum(expert_dims)

    def fma_per_token(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        return in_features * sum(expert_dims)

    def build(self, in_features: int, expert_dims: tuple[int, ...], *, device: Any = None, dtype: Any = None):
        return ScaledSoftmax(in_features, expert_dims, self.scale, device=device, dtype=dtype)


@contextmanager
def registered_toys() -> Iterator[None]:
    """`TOY_FORMAT`, `ToyTopKGate` and `ScaledSoftmaxGate` registered inside the block, and removed after it."""

    class BridgeFormat(Format, name=TOY_FORMAT):  # (the class statement registers it)
        """A user's format: ``A: n… i a, B: a o``."""

        def network(self, expert_dims, in_features, out_features, rank, **options):
            (a,) = normalise_ranks(self.name, rank, 1)
            sizes = physical_sizes(expert_dims, in_features, out_features)
            modes = " ".join(f"n{e + 1}" for e in range(len(expert_dims)))
            return ExpertNetwork({"A": f"{modes} i a", "B": "a o"}, {**sizes, "a": a})

    try:
        register_gate(ToyTopKGate)
        register_gate(ScaledSoftmaxGate)
        yield
    finally:
        unregister_gate(ScaledSoftmaxGate)
        unregister_gate(ToyTopKGate)
        unregister(TOY_FORMAT)
