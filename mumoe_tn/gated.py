"""A gated μMoE MLP block (SwiGLU / GeGLU): three factorized layers sharing one set of coefficients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.costs import layer_parameters, linear, scaled_bonds, solve_rank
from mumoe_tn.gating import ExpertGate
from mumoe_tn.layers import Decomposition, FactorizedExperts, Rank, resolve_network
from mumoe_tn.network import ExpertNetwork

__all__ = ["MuMoEGatedMLP", "gated_mlp_parameters"]


def gated_mlp_parameters(
    gate: ExpertNetwork,
    up: ExpertNetwork,
    down: ExpertNetwork,
    *,
    bias: bool = True,
    input_norm: bool = False,
) -> int:
    """Parameters of a :class:`MuMoEGatedMLP` on these networks: three expert tensors, one gate.

    Parameters
    ----------
    gate, up : ExpertNetwork
        The layers ``I → H`` (gate and up projections).
    down : ExpertNetwork
        The layer ``H → O``.
    bias : bool, optional
        Whether leg ``i`` of each network holds a folded bias column.
    input_norm : bool, optional
        Count an input LayerNorm.

    Returns
    -------
    int
    """
    shared = layer_parameters(gate, bias=bias, gate=True, input_norm=input_norm).total
    return shared + sum(layer_parameters(net, bias=bias, gate=False).total for net in (up, down))


def _scaled(network: ExpertNetwork) -> tuple[str, ...]:
    """The bonds matching scales: the format's default, else every bond (as for Tucker)."""
    try:
        return scaled_bonds(network)
    except ValueError:
        return network.bonds


class MuMoEGatedMLP(nn.Module):
    """Gated μMoE MLP block: ``y = down(act(gate(z)) ⊙ up(z))`` with μMoE layers.

    ``a = φ(norm(Gᵀ z))`` is computed once per token and shared by the three factorized layers
    ``gate_proj``, ``up_proj`` (``I → H``) and ``down_proj`` (``H → O``) — a drop-in for the
    SwiGLU/GeGLU MLP of Llama, Mistral, Qwen, Gemma (``act`` SiLU or GELU).

    Parameters
    ----------
    in_features, hidden_features : int
        Input and hidden sizes.
    out_features : int, optional
        Output size (default ``in_features``).
    expert_dims : int or Sequence[int]
        ``N`` or ``(N_1, …, N_E)``, shared by the three layers.
    decomposition : str or Callable, optional
        As for :class:`~mumoe_tn.layers.MuMoE` (a name, spec string or builder).
    rank : int or Sequence[int] or Mapping[str, int] or "mlp"
        Ranks of the three layers, or ``"mlp"`` to parameter-match the gated MLP block
        ``2·(I·H + H) + H·O + O`` (one rank for all three layers, the one gate counted).
    bias : bool, optional
        Fold a bias into every layer's input leg (default True; Llama's MLP has none).
    activation : str or float, optional
        Gate activation φ (default ``"entmax15"``).
    gate_norm : {"batch", "layer", "none"}, optional
        Normalisation of the gate logits.
    input_norm : bool, optional
        LayerNorm on the block's input first.
    hidden_activation : nn.Module, optional
        The ``act`` of the gate projection (default ``nn.SiLU()``: SwiGLU).
    init, expert_noise, optimize, device, dtype, **decomposition_options
        As for :class:`~mumoe_tn.layers.MuMoE`.

    Attributes
    ----------
    last_coefficients : tuple of torch.Tensor or None
        The (detached) shared coefficients of the last forward pass.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        expert_dims: int | Sequence[int] | None = None,
        decomposition: Decomposition = "cp",
        rank: Rank = None,
        *,
        bias: bool = True,
        activation: str | float = "entmax15",
        gate_norm: str = "batch",
        input_norm: bool = False,
        hidden_activation: nn.Module | None = None,
        init: str = "auto",
        expert_noise: Sequence[float] | None = None,
        optimize: Any = "dp",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **decomposition_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(decomposition, ExpertNetwork):
            raise TypeError(
                "MuMoEGatedMLP builds three networks: pass a name, a spec string or a builder, not one network"
            )
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {bias!r}")
        if isinstance(rank, str) and rank != "mlp":
            raise ValueError(f"MuMoEGatedMLP matches rank='mlp' (the gated MLP block it replaces), got {rank!r}")
        if hidden_activation is not None and not isinstance(hidden_activation, nn.Module):
            raise TypeError(f"hidden_activation must be an nn.Module, got {type(hidden_activation).__name__}")
        factory = {"device": device, "dtype": dtype}
        out_features = in_features if out_features is None else out_features
        self.in_features, self.hidden_features, self.out_features = in_features, hidden_features, out_features
        self.bias = bias
        shared = {"bias": bias, "options": decomposition_options}
        first = resolve_network(decomposition, expert_dims, in_features, hidden_features, rank, **shared)
        second = resolve_network(decomposition, expert_dims, hidden_features, out_features, rank, **shared)
        if rank == "mlp":
            first, second = self._match(first, second, bias=bias, input_norm=input_norm)
        self.expert_dims = first.expert_dims
        self.input_norm = nn.LayerNorm(in_features, **factory) if input_norm else nn.Identity()
        self.gate = ExpertGate(in_features, first.expert_dims, activation, gate_norm, **factory)
        layer = {"init": init, "expert_noise": expert_noise, "optimize": optimize, **factory}
        self.gate_proj = FactorizedExperts(first, fan_in=in_features, **layer)
        self.up_proj = FactorizedExperts(first, fan_in=in_features, **layer)
        self.down_proj = FactorizedExperts(second, fan_in=hidden_features, **layer)
        self.hidden_activation = nn.SiLU() if hidden_activation is None else hidden_activation
        self.last_coefficients: tuple[torch.Tensor, ...] | None = None

    def _match(
        self, first: ExpertNetwork, second: ExpertNetwork, *, bias: bool, input_norm: bool
    ) -> tuple[ExpertNetwork, ExpertNetwork]:
        """Scale the bonds of all three layers by one rank to the gated block's parameter count."""
        bonds = _scaled(first)
        in_f, hidden, out_f = self.in_features, self.hidden_features, self.out_features
        target = 2 * linear(in_f, hidden, bias=bias).params + linear(hidden, out_f, bias=bias).params

        def resized(r: int) -> tuple[ExpertNetwork, ExpertNetwork]:
            return first.with_sizes(**dict.fromkeys(bonds, r)), second.with_sizes(**dict.fromkeys(bonds, r))

        def count(r: int) -> int:
            up, down = resized(r)
            return gated_mlp_parameters(up, up, down, bias=bias, input_norm=input_norm)

        return resized(solve_rank(count, target, what=f"a gated {first.name} block scaling {bonds}"))

    def reset_parameters(self) -> None:
        """Re-initialise the gate, the input norm and the three factorized layers."""
        for module in (*self.gate.projections.values(), *self.gate.norms.values(), self.input_norm):
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for experts in self.expert_layers.values():
            experts.reset_parameters()

    @property
    def expert_layers(self) -> dict[str, FactorizedExperts]:
        """The three factorized layers by role: ``gate``, ``up``, ``down``."""
        return {"gate": self.gate_proj, "up": self.up_proj, "down": self.down_proj}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"input must have shape (..., {self.in_features}), got {tuple(x.shape)}")
        z = self.input_norm(x)
        coefficients = self.gate(z)
        self.last_coefficients = tuple(a.detach() for a in coefficients)
        if not torch.is_autocast_enabled(z.device.type):
            coefficients = tuple(a.to(z.dtype) for a in coefficients)
        gate = self.gate_proj(z, coefficients, append_one=self.bias)
        up = self.up_proj(z, coefficients, append_one=self.bias)
        return self.down_proj(self.hidden_activation(gate) * up, coefficients, append_one=self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
            f"out_features={self.out_features}, bias={self.bias}"
        )
