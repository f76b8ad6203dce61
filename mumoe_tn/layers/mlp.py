"""μMoE MLP blocks: the paper's two-layer block and the gated (SwiGLU / GeGLU) block, one gate each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.costs import layer_parameters, linear, scaled_bonds, solve_rank
from mumoe_tn.costs.baselines import mlp as mlp_cost
from mumoe_tn.costs.matching import match_block
from mumoe_tn.decompositions.resolve import Decomposition, Rank
from mumoe_tn.gates.specs import GateSpec
from mumoe_tn.layers.base import MuMoEBase
from mumoe_tn.layers.experts import FactorizedExperts
from mumoe_tn.layers.options import (
    LayerOptions,
    Match,
    block_networks,
    match_target,
)
from mumoe_tn.network import ExpertNetwork

__all__ = ["MuMoEGatedMLP", "MuMoEMLP", "gated_mlp_parameters"]


class _MLPBlock(MuMoEBase):
    """What both MLP blocks share: their arguments, matching, gate and expert layers ``I → H → O``.

    A subclass names its default hidden activation, the dense block it replaces (for
    ``match="mlp"``), its matching, and builds its factorized layers from the networks ``I → H``
    and ``H → O``.
    """

    #: The hidden activation when none is given.
    default_hidden_activation: type[nn.Module] = nn.GELU

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        expert_dims: int | Sequence[int] | None = None,
        decomposition: Decomposition = "cp",
        rank: Rank | None = None,
        *,
        match: Match = None,
        hidden_activation: nn.Module | None = None,
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        options, decomposition_options = LayerOptions.from_keywords(options, keywords)
        bias, input_norm, rank_multiple = options.bias, options.input_norm, options.rank_multiple
        factory = options.factory()
        out_features = in_features if out_features is None else out_features
        name = type(self).__name__
        if hidden_activation is not None and not isinstance(hidden_activation, nn.Module):
            example = f"nn.{self.default_hidden_activation.__name__}()"
            raise TypeError(
                f"hidden_activation must be an nn.Module instance such as {example}, got {hidden_activation!r}"
            )
        gate = options.gate_spec()
        sizes = (in_features, hidden_features, out_features)

        def matcher(first: ExpertNetwork, second: ExpertNetwork, match: Any, bonds: Any) -> tuple:
            target = match_target(match, self._reference_parameters(*sizes, bias=bias), "mlp", name)
            options = {"bias": bias, "gate": gate, "input_norm": input_norm, "multiple": rank_multiple}
            return self._match_block(first, second, target, bonds, **options)

        first, second = block_networks(
            decomposition, expert_dims, sizes, rank, match, options.match_bonds, rank_multiple,
            bias=bias, options=decomposition_options, layer=name, matcher=matcher,
        )  # fmt: skip
        self.hidden_features, self.out_features = hidden_features, out_features
        gating = {"gate": gate, "gate_input": options.gate_input, "input_norm": input_norm, "factory": factory}
        self._setup_gate(in_features, first.expert_dims, bias=bias, **gating)
        layer = options.expert_options()
        self._build_layers(
            lambda net: FactorizedExperts(net, fan_in=in_features, **layer),
            lambda net: FactorizedExperts(net, fan_in=hidden_features, **layer),
            first,
            second,
        )
        self.hidden_activation = self.default_hidden_activation() if hidden_activation is None else hidden_activation

    @staticmethod
    def _reference_parameters(in_features: int, hidden_features: int, out_features: int, *, bias: bool) -> int:
        raise NotImplementedError

    @staticmethod
    def _match_block(
        first: ExpertNetwork, second: ExpertNetwork, target: int, bonds: Any, **options: Any
    ) -> tuple[ExpertNetwork, ExpertNetwork]:
        raise NotImplementedError

    def _build_layers(self, inner: Any, outer: Any, first: ExpertNetwork, second: ExpertNetwork) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
            f"out_features={self.out_features}, bias={self.bias}"
        )


class MuMoEMLP(_MLPBlock):
    """The paper's two-layer μMoE block (Section "Large language/vision μMoE networks").

    ``a = φ(norm(Gᵀ z))`` once per token, shared by both layers:
    ``y = W2 ×_1 a ×_2 [act(W1 ×_1 a ×_2 [z; 1]); 1]`` — a drop-in for a transformer or
    mixer MLP ``Linear(I, H) → GELU → Linear(H, O)``.

    Parameters
    ----------
    in_features, hidden_features : int
        Input and hidden sizes.
    out_features : int, optional
        Output size (default ``in_features``).
    expert_dims : int or Sequence[int]
        ``N`` or ``(N_1, …, N_E)``, shared by both layers.
    decomposition : str or Format or ExpertNetwork or Callable, optional
        As for [`MuMoE`][mumoe_tn.layers.moe.MuMoE] (both layers use it; a ready network gives its structure and bond
        sizes, its legs are set to each layer's sizes).
    rank : int or Sequence[int] or Mapping[str, int] or "exact", optional
        Ranks of both layers; ``"exact"`` as for [`MuMoE`][mumoe_tn.layers.moe.MuMoE] (one rank that suits both).
    match : "mlp" or int or float, optional
        Parameter-match instead: ``"mlp"`` matches the MLP block ``I → H → O`` (one rank for
        both layers, the one gate counted), an int is a budget, a float a fraction of the MLP
        block's parameters.
    hidden_activation : nn.Module, optional
        Non-linearity between the layers (default ``nn.GELU()``).
    options : LayerOptions, optional
        The options every μMoE layer shares ([`LayerOptions`][mumoe_tn.layers.options.LayerOptions]);
        here ``match_bonds`` and ``rank_multiple`` apply to both layers, ``bias`` folds a bias into
        both layers' input legs and the one gate is shared by both layers.
    **keywords
        Fields of ``LayerOptions`` by name, and the builder's options, as for
        [`MuMoE`][mumoe_tn.layers.moe.MuMoE].

    Attributes
    ----------
    last_coefficients : tuple of torch.Tensor or None
        The (detached) shared coefficients of the last forward pass in the calling thread.
    ablation : object or None
        An active counterfactual ablation, applied to both layers (see [`MuMoE`][mumoe_tn.layers.moe.MuMoE]).
    """

    default_hidden_activation = nn.GELU

    @staticmethod
    def _reference_parameters(in_features: int, hidden_features: int, out_features: int, *, bias: bool) -> int:
        return mlp_cost(in_features, hidden_features, out_features, bias=bias).params

    @staticmethod
    def _match_block(
        first: ExpertNetwork, second: ExpertNetwork, target: int, bonds: Any, **options: Any
    ) -> tuple[ExpertNetwork, ExpertNetwork]:
        matched = match_block(
            first, second, target, bonds=bonds, bias=options["bias"], gate=options["gate"],
            rank_multiple=options["multiple"],
        )  # fmt: skip
        return matched.networks

    def _build_layers(self, inner: Any, outer: Any, first: ExpertNetwork, second: ExpertNetwork) -> None:
        self.experts1 = inner(first)
        self.experts2 = outer(second)

    @property
    def expert_layers(self) -> dict[str, FactorizedExperts]:
        """The two factorized layers by role: ``up``, ``down``."""
        return {"up": self.experts1, "down": self.experts2}

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.experts1, self.experts2)

    def _input_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.experts1,)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``.

        ``mask``: which tokens are real, as for [`MuMoE`][mumoe_tn.layers.moe.MuMoE].
        """
        z, coefficients = self._gate(x, mask)
        hidden = self.hidden_activation(self._contract(self.experts1, z, coefficients))
        return self._contract(self.experts2, hidden, coefficients)


def gated_mlp_parameters(
    gate_layer: ExpertNetwork,
    up: ExpertNetwork,
    down: ExpertNetwork,
    *,
    bias: bool = True,
    gate: bool | GateSpec = True,
    input_norm: bool = False,
) -> int:
    """Parameters of a `MuMoEGatedMLP` on these networks: three expert tensors, one gate.

    Parameters
    ----------
    gate_layer, up : ExpertNetwork
        The layers ``I → H`` (gate and up projections).
    down : ExpertNetwork
        The layer ``H → O``.
    bias : bool, optional
        Whether leg ``i`` of each network holds a folded bias column.
    gate : bool or GateSpec, optional
        The shared gate, counted once (see [`mumoe_tn.gates.specs`][mumoe_tn.gates.specs]).
    input_norm : bool, optional
        Count an input LayerNorm.

    Returns
    -------
    int
    """
    shared = layer_parameters(gate_layer, bias=bias, gate=gate, input_norm=input_norm).total
    return shared + sum(layer_parameters(net, bias=bias, gate=False).total for net in (up, down))


class MuMoEGatedMLP(_MLPBlock):
    """Gated μMoE MLP block: ``y = down(act(gate(z)) ⊙ up(z))`` with μMoE layers.

    One set of expert coefficients per token is shared by the three factorized layers
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
    decomposition : str or Format or ExpertNetwork or Callable, optional
        As for [`MuMoE`][mumoe_tn.layers.moe.MuMoE] (a ready network gives the structure and bond
        sizes; its legs are set to each layer's sizes).
    rank : int or Sequence[int] or Mapping[str, int] or "exact", optional
        Ranks of the three layers (with ``match=``: the bonds matching leaves alone); ``"exact"`` as
        for [`MuMoE`][mumoe_tn.layers.moe.MuMoE].
    match : "mlp" or int or float, optional
        Parameter-match the gated MLP block ``2·(I·H + H) + H·O + O`` (one rank for all three
        layers, the one gate counted), a parameter budget, or a fraction of the block's count.
    hidden_activation : nn.Module, optional
        The ``act`` of the gate projection (default ``nn.SiLU()``: SwiGLU).
    options : LayerOptions, optional
        The options every μMoE layer shares ([`LayerOptions`][mumoe_tn.layers.options.LayerOptions]);
        here ``bias`` folds a bias into every layer's input leg (Llama's MLP has none) and the one
        gate is shared by the three layers.
    **keywords
        Fields of ``LayerOptions`` by name, and the builder's options, as for
        [`MuMoE`][mumoe_tn.layers.moe.MuMoE].

    Attributes
    ----------
    last_coefficients : tuple of torch.Tensor or None
        The (detached) shared coefficients of this thread's last forward pass.
    """

    default_hidden_activation = nn.SiLU

    @staticmethod
    def _reference_parameters(in_features: int, hidden_features: int, out_features: int, *, bias: bool) -> int:
        reference = 2 * linear(in_features, hidden_features, bias=bias).params
        return reference + linear(hidden_features, out_features, bias=bias).params

    @staticmethod
    def _match_block(
        first: ExpertNetwork, second: ExpertNetwork, target: int, bonds: Any, **options: Any
    ) -> tuple[ExpertNetwork, ExpertNetwork]:
        return _match(first, second, target, bonds, **options)

    def _build_layers(self, inner: Any, outer: Any, first: ExpertNetwork, second: ExpertNetwork) -> None:
        self.gate_proj = inner(first)
        self.up_proj = inner(first)
        self.down_proj = outer(second)

    @property
    def expert_layers(self) -> dict[str, FactorizedExperts]:
        """The three factorized layers by role: ``gate``, ``up``, ``down``."""
        return {"gate": self.gate_proj, "up": self.up_proj, "down": self.down_proj}

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.gate_proj, self.up_proj, self.down_proj)

    def _input_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``.

        ``mask``: which tokens are real, as for [`MuMoE`][mumoe_tn.layers.moe.MuMoE].
        """
        z, coefficients = self._gate(x, mask)
        gate = self._contract(self.gate_proj, z, coefficients)
        up = self._contract(self.up_proj, z, coefficients)
        return self._contract(self.down_proj, self.hidden_activation(gate) * up, coefficients)


def _match(
    first: ExpertNetwork,
    second: ExpertNetwork,
    target: int,
    bonds: Sequence[str] | None,
    *,
    bias: bool,
    gate: GateSpec,
    input_norm: bool,
    multiple: int,
) -> tuple[ExpertNetwork, ExpertNetwork]:
    """Scale the bonds of all three layers by one rank to ``target`` parameters."""
    names = scaled_bonds(first, bonds)
    scaled_bonds(second, names)

    def resized(r: int) -> tuple[ExpertNetwork, ExpertNetwork]:
        return first.with_sizes(**dict.fromkeys(names, r)), second.with_sizes(**dict.fromkeys(names, r))

    def count(r: int) -> int:
        up, down = resized(r)
        return gated_mlp_parameters(up, up, down, bias=bias, gate=gate, input_norm=input_norm)

    return resized(solve_rank(count, target, what=f"a gated {first.name} block scaling {names}", multiple=multiple))
