"""The μMoE layer: a drop-in replacement for ``nn.Linear``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mumoe_tn.costs.baselines import linear as linear_cost
from mumoe_tn.costs.matching import match_exact, match_layer
from mumoe_tn.decompositions.resolve import Decomposition, Rank
from mumoe_tn.layers.base import MuMoEBase
from mumoe_tn.layers.construction import LayerArguments, LayerSpec, layer_spec
from mumoe_tn.layers.experts import FactorizedExperts
from mumoe_tn.layers.options import (
    EXACT,
    LayerOptions,
    Match,
    check_allocatable,
    check_match_only_options,
    match_target,
    resolve_network,
    split_rank_and_match,
)
from mumoe_tn.network import ExpertNetwork

__all__ = ["MuMoE"]


class MuMoE(MuMoEBase):
    """A μMoE layer: a drop-in replacement for ``nn.Linear(in_features, out_features)``.

    ``a_e = φ(norm(G_eᵀ z))`` for every expert mode ``e``, then
    ``y = W ×_1 a_1 … ×_E a_E ×_{E+1} [z; 1]`` with ``W`` held in factorized form. With
    ``bias=True`` (default) each expert's bias is folded into the input leg (``I + 1``).

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the input and output features.
    expert_dims : int or Sequence[int]
        Number of experts ``N``, or ``(N_1, …, N_E)`` for a hierarchical layer.
    decomposition : str or Format or ExpertNetwork or Callable, optional
        A registered name (``"cp"`` default, ``"tr"``, ``"tt"``, ``"tucker"``, or any format you
        registered), a [`Format`][mumoe_tn.decompositions.format.Format], a spec string such as
        ``"n1 a b, a i c, b c o"`` (bond sizes from ``rank``), a ready [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork]
        whose legs match the layer, or a builder ``(expert_dims, in, out, rank) -> ExpertNetwork``.
    rank : int or Sequence[int] or Mapping[str, int] or "exact", optional
        Ranks for the decomposition (a mapping of bond -> size for spec strings). Not needed
        with an [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork]; with ``match=`` it sets the bonds matching leaves
        alone (1 by default). ``"exact"``: the smallest ranks of the bonds matching would scale at
        which every expert can equal any ``I × O`` matrix — what makes upcycling exact, for any
        network (see [`mumoe_tn.costs.match_exact`][mumoe_tn.costs.matching.match_exact]).
    match : "linear" or int or float, optional
        Parameter-match instead of giving ranks: ``"linear"`` matches
        ``nn.Linear(in_features, out_features)`` with gating counted, an int is a parameter
        budget, a float a fraction of the Linear's parameters (as tensorly-torch's
        ``rank=0.5``). The format chooses the bonds to scale (CP ``R``, TR/TT the input–output
        bond, Tucker and custom networks every bond) unless ``match_bonds`` names them; see
        [`mumoe_tn.costs.matching`][mumoe_tn.costs.matching] (a
        [`MatchingWarning`][mumoe_tn.costs.matching.MatchingWarning] reports a missed target or collapsed experts).
    options : LayerOptions, optional
        The options every μMoE layer shares, documented in
        [`LayerOptions`][mumoe_tn.layers.options.LayerOptions]: ``match_bonds``, ``rank_multiple``,
        ``bias`` (default True), the gate (``activation``, ``gate_norm``, ``gate_init``, ``gate``,
        ``gate_input``), ``input_norm``, ``init``, ``expert_noise``, ``optimize``, ``max_plans``,
        ``memory_limit``, ``device`` and ``dtype``.
    **keywords
        Any field of [`LayerOptions`][mumoe_tn.layers.options.LayerOptions] by name (``bias=False``,
        ``gate=TopKGate(2)``, ``device="cuda"``, …; these win over ``options``); every other keyword
        is passed to the named builder (e.g. ``expert_rank=`` for TR/TT).

    Attributes
    ----------
    last_coefficients : tuple of torch.Tensor or None
        The (detached) expert coefficients of the last eager forward pass in the calling thread,
        one per expert mode (before any ablation; a compiled call records none).
    ablation : object or None
        An active counterfactual ablation (see [`mumoe_tn.analysis.ablation`][mumoe_tn.analysis.ablation]): it masks
        coefficients inside the contraction, or removes single experts' contributions, and
        never touches the weights.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        expert_dims: int | Sequence[int] | None = None,
        decomposition: Decomposition = "cp",
        rank: Rank | None = None,
        *,
        match: Match = None,
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        spec = layer_spec(
            type(self), in_features, None, out_features, expert_dims, decomposition, rank,
            match=match, options=options, keywords=keywords,
        )  # fmt: skip
        self._build(spec)

    #: The one factorized layer's role.
    spec_roles = ("layer",)

    @classmethod
    def resolve_networks(cls, arguments: LayerArguments) -> tuple[tuple[tuple[str, ExpertNetwork], ...], int | None]:
        """The layer's network (exact or matched ranks applied) and the budget matched; see `layer_spec`."""
        options, in_features, out_features = arguments.options, arguments.in_features, arguments.out_features
        bias, match_bonds, rank_multiple = options.bias, options.match_bonds, options.rank_multiple
        rank, match = split_rank_and_match(arguments.rank, arguments.match, "MuMoE")
        build_rank = 1 if match is not None and rank is None else rank
        network = resolve_network(
            arguments.decomposition, arguments.expert_dims, in_features, out_features, build_rank, bias=bias,
            options=arguments.builder_options,
        )  # fmt: skip
        target = None
        if match == EXACT:
            network = match_exact([network], bonds=match_bonds, multiple=rank_multiple)[1][0]
        elif match is not None:
            reference = linear_cost(in_features, out_features, bias=bias).params
            target = match_target(match, reference, "linear", "MuMoE")
            matched = match_layer(
                network, target, bonds=match_bonds, bias=bias, gate=arguments.gate, input_norm=options.input_norm,
                rank_multiple=rank_multiple,
            )  # fmt: skip
            network = matched.networks[0]
        else:
            check_match_only_options(match_bonds, rank_multiple)
        check_allocatable(network)
        return (("layer", network),), target

    def _build(self, spec: LayerSpec) -> None:
        super()._build(spec)
        self.out_features = spec.out_features
        self.experts = spec.experts("layer")

    @property
    def network(self) -> ExpertNetwork:
        """The expert network (its leg ``i`` includes the bias column when ``bias=True``)."""
        return self.experts.network

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.experts,)

    def _input_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.experts,)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``.

        ``mask`` (shape ``x.shape[:-1]``, True/1 = real token) keeps padding out of the gate's
        statistics, losses and records (see [`mumoe_tn.masking`][mumoe_tn.masking]); by default the
        enclosing [`token_mask`][mumoe_tn.masking.token_mask] context's, if any.
        """
        z, coefficients = self._gate(x, mask)
        return self._contract(self.experts, z, coefficients)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias}"
