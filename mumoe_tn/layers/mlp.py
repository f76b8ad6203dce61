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
from mumoe_tn.layers.construction import LayerArguments, LayerSpec, layer_spec
from mumoe_tn.layers.experts import FactorizedExperts
from mumoe_tn.layers.options import LayerOptions, Match, block_networks, match_target
from mumoe_tn.network import ExpertNetwork

__all__ = ["MuMoEGatedMLP", "MuMoEMLP", "gated_mlp_parameters"]


def _plain_reference(in_features: int, hidden_features: int, out_features: int, *, bias: bool) -> int:
    """Parameters of the MLP block ``I → H → O``."""
    return mlp_cost(in_features, hidden_features, out_features, bias=bias).params


def _gated_reference(in_features: int, hidden_features: int, out_features: int, *, bias: bool) -> int:
    """Parameters of the gated MLP block: two layers ``I → H`` and one ``H → O``."""
    return (
        2 * linear(in_features, hidden_features, bias=bias).params
        + linear(hidden_features, out_features, bias=bias).params
    )


def _match_plain(first: ExpertNetwork, second: ExpertNetwork, target: int, bonds: Any, **counted: Any) -> tuple:
    """Scale the bonds of both layers by one rank to ``target`` parameters (the input norm is not counted)."""
    multiple, _ = counted.pop("multiple"), counted.pop("input_norm")
    return match_block(first, second, target, bonds=bonds, rank_multiple=multiple, **counted).networks


def _match_gated(
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


class _MLPBlock(MuMoEBase):
    """What both MLP blocks share: their arguments, matching, gate and expert layers ``I → H → O``.

    A subclass names its default hidden activation, the parameters of the dense block it replaces
    (for ``match="mlp"``), its matching, and its factorized layers by attribute and role: the
    ``down`` layer is built on the network ``H → O``, the others on ``I → H``.
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
        spec = layer_spec(
            type(self), in_features, hidden_features, out_features, expert_dims, decomposition, rank,
            match=match, options=options, keywords=keywords, hidden_activation=hidden_activation,
        )  # fmt: skip
        self._build(spec)

    #: ``(attribute, role)`` of every factorized layer, in order (the first network ``I → H``, ``down`` ``H → O``).
    layer_attributes: tuple[tuple[str, str], ...] = ()

    #: ``(in_features, hidden_features, out_features, *, bias) -> parameters`` of the dense block replaced.
    reference_parameters: Any = None

    #: ``(first, second, target, bonds, *, bias, gate, input_norm, multiple) -> (first, second)``: the matching.
    match_block: Any = None

    @classmethod
    def resolve_networks(cls, arguments: LayerArguments) -> tuple[tuple[tuple[str, ExpertNetwork], ...], int | None]:
        """The networks ``I → H`` and ``H → O`` by role and the budget matched; see `layer_spec`."""
        options = arguments.options
        bias, rank_multiple = options.bias, options.rank_multiple
        sizes = (arguments.in_features, arguments.hidden_features, arguments.out_features)
        targets = []

        def matcher(first: ExpertNetwork, second: ExpertNetwork, match: Any, bonds: Any) -> tuple:
            target = match_target(match, cls.reference_parameters(*sizes, bias=bias), "mlp", arguments.layer)
            targets.append(target)
            shared = {"bias": bias, "gate": arguments.gate, "input_norm": options.input_norm}
            return cls.match_block(first, second, target, bonds, multiple=rank_multiple, **shared)

        first, second = block_networks(
            arguments.decomposition, arguments.expert_dims, sizes, arguments.rank, arguments.match,
            options.match_bonds, rank_multiple, bias=bias, options=arguments.builder_options, layer=arguments.layer,
            matcher=matcher,
        )  # fmt: skip
        networks = tuple((role, second if role == "down" else first) for _, role in cls.layer_attributes)
        return networks, (targets[0] if targets else None)

    def _build(self, spec: LayerSpec) -> None:
        super()._build(spec)
        self.hidden_features, self.out_features = spec.hidden_features, spec.out_features
        for attribute, role in self.layer_attributes:
            setattr(self, attribute, spec.experts(role))
        activation = spec.hidden_activation
        self.hidden_activation = self.default_hidden_activation() if activation is None else activation

    @property
    def expert_layers(self) -> dict[str, FactorizedExperts]:
        """The factorized layers by role (``up``, ``down``; a gated block's ``gate``, ``up``, ``down``)."""
        return {role: getattr(self, attribute) for attribute, role in self.layer_attributes}

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
        The (detached) shared coefficients of the last eager forward pass in the calling thread
        (a compiled call records none).
    ablation : object or None
        An active counterfactual ablation, applied to both layers (see [`MuMoE`][mumoe_tn.layers.moe.MuMoE]).
    """

    default_hidden_activation = nn.GELU
    layer_attributes = (("experts1", "up"), ("experts2", "down"))
    spec_roles = ("up", "down")
    reference_parameters = staticmethod(_plain_reference)
    match_block = staticmethod(_match_plain)

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
    in_features, hidden_features, out_features, expert_dims, decomposition
        As for [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP]: the sizes ``I``, ``H`` and ``O`` (default
        ``I``), the expert modes and the network shared by the three layers.
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
        The (detached) shared coefficients of this thread's last eager forward pass (a compiled
        call records none).
    """

    default_hidden_activation = nn.SiLU
    activation_example = "nn.SiLU()"
    layer_attributes = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
    spec_roles = ("gate", "up", "down")
    reference_parameters = staticmethod(_gated_reference)
    match_block = staticmethod(_match_gated)

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
