"""The Mixture of Decoders block: a dense encoder, a μMoE decoder gated by the block's input.

Oldfield et al., *Towards Interpretability Without Sacrifice: Faithful Dense Layer Decomposition
with Mixture of Decoders* (arXiv 2505.21364, 2025). An MLP block ``Linear(I, H) → φ → Linear(H, O)``
becomes

    h = φ(E x + b)                       (or φ(E_g x + b_g) ⊙ (E_u x + b_u), the GLU variant)
    a = gate(x)                          (the gate reads the block's input, not h)
    y = W ×_1 a ×_2 h + b_out            W: the decoder's expert tensor (H × O per expert)

With the ``"mxd"`` format (``W[n, h, o] = C[n, o]·D[h, o]``) the decoder is
``y = (Dᵀh) ⊙ (Cᵀa) + b_out``; any other format or network works too, a mixture of CP or TR
decoders say. The encoder stays the dense layer it was, so upcycling is exact: ``E`` is copied,
``D = W₂ᵀ``, ``C = 1`` and ``b_out = b₂``, and a gate whose coefficients sum to one leaves the
block's output unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.costs import scaled_bonds, solve_bonds
from mumoe_tn.costs.baselines import linear as linear_cost
from mumoe_tn.costs.baselines import mlp as mlp_cost
from mumoe_tn.costs.matching import match_exact
from mumoe_tn.decompositions.resolve import Decomposition, Rank, resolve_network
from mumoe_tn.gates.specs import GateSpec, gate_parameter_count
from mumoe_tn.layers.base import MuMoEBase
from mumoe_tn.layers.construction import LayerArguments, LayerSpec, layer_spec
from mumoe_tn.layers.experts import FactorizedExperts
from mumoe_tn.layers.options import EXACT, LayerOptions, Match, check_match_only_options, match_target
from mumoe_tn.network import ExpertNetwork

__all__ = ["MixtureOfDecoders", "decoder_block_parameters"]


def decoder_block_parameters(
    decoder: ExpertNetwork,
    in_features: int,
    *,
    gated: bool = False,
    bias: bool = True,
    gate: bool | GateSpec = True,
    input_norm: bool = False,
) -> int:
    """Parameters of a [`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders] block.

    Parameters
    ----------
    decoder : ExpertNetwork
        The decoder's network ``H → O`` (no folded bias: its leg ``i`` is ``H``).
    in_features : int
        The block's input width ``I`` (the encoder's and the gate's).
    gated : bool, optional
        Two encoders (the GLU variant) instead of one.
    bias : bool, optional
        Encoder biases and the output bias.
    gate : bool or GateSpec, optional
        The gate, reading ``I`` features.
    input_norm : bool, optional
        An input LayerNorm (``2·I``).

    Returns
    -------
    int
    """
    hidden, out_features = decoder.in_features, decoder.out_features
    encoders = (2 if gated else 1) * linear_cost(in_features, hidden, bias=bias).params
    total = encoders + decoder.n_params + (out_features if bias else 0)
    total += gate_parameter_count(gate, in_features, decoder.expert_dims)
    return total + (2 * in_features if input_norm else 0)


class MixtureOfDecoders(MuMoEBase):
    """An MLP block whose decoder is a μMoE: ``y = W ×_1 a(x) ×_2 φ(E x + b) + b_out``.

    Parameters
    ----------
    in_features, hidden_features : int
        Input and hidden sizes.
    out_features : int, optional
        Output size (default ``in_features``).
    expert_dims : int or Sequence[int], optional
        ``N`` or ``(N_1, …, N_E)`` of the decoder (hierarchical MxD with several); optional
        with ``match=`` for a format that matches by the number of experts (``"mxd"``).
    decomposition : str or Format or ExpertNetwork or Callable, optional
        The decoder's network (default ``"mxd"``); anything [`MuMoE`][mumoe_tn.layers.moe.MuMoE] takes.
    rank : int or Sequence[int] or Mapping[str, int] or "exact", optional
        The decoder's ranks (``"mxd"`` has none).
    match : "mlp" or int or float, optional
        Parameter-match the MLP block ``I → H → O`` (for ``gated=True`` the gated MLP
        ``2·(I·H + H) + H·O + O``), a budget, or a fraction of the block's count; the encoders,
        gate and biases are counted. The decoder's bonds are scaled where it has some (CP, TR, …);
        a decoder without bonds (``"mxd"``) is matched by its number of experts, or, with
        ``expert_dims`` given, by the hidden width (an MxD block holds the MLP's matrices and its
        experts besides, so at equal parameters its hidden layer is narrower).
    gated : bool, optional
        The GLU variant: ``h = φ(E_g x + b_g) ⊙ (E_u x + b_u)`` (SwiGLU with φ = SiLU).
    hidden_activation : nn.Module, optional
        ``φ`` (default ``nn.GELU()``, or ``nn.SiLU()`` with ``gated=True``).
    options : LayerOptions, optional
        The options every μMoE layer shares ([`LayerOptions`][mumoe_tn.layers.options.LayerOptions]);
        here ``match_bonds`` names the labels ``match=`` scales, ``bias`` is the encoder biases and
        the output bias ``b_out``, ``init`` concerns the decoder, and the authors' gate is
        ``gate=ReLUTopKGate(k)`` (top-k of ``ReLU(G x + b)``, not renormalised).
    **keywords
        Fields of ``LayerOptions`` by name, and the builder's options, as for
        [`MuMoE`][mumoe_tn.layers.moe.MuMoE].

    Attributes
    ----------
    up_proj : nn.Linear
        The encoder ``E`` (the up projection of a GLU).
    gate_proj : nn.Linear or None
        The GLU's gate projection ``E_g`` (``gated=True``).
    decoder : FactorizedExperts
        The expert decoders.
    output_bias : nn.Parameter or None
        ``b_out``.

    Examples
    --------
    >>> block = MixtureOfDecoders(16, 64, expert_dims=32)
    >>> block.decoder.network.to_spec()
    'D: i o, C_n1: n1 o'
    >>> block(torch.randn(5, 16)).shape
    torch.Size([5, 16])
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        expert_dims: int | Sequence[int] | None = None,
        decomposition: Decomposition = "mxd",
        rank: Rank | None = None,
        *,
        match: Match = None,
        gated: bool = False,
        hidden_activation: nn.Module | None = None,
        options: LayerOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        spec = layer_spec(
            type(self), in_features, hidden_features, out_features, expert_dims, decomposition, rank,
            match=match, options=options, keywords=keywords, gated=gated, hidden_activation=hidden_activation,
        )  # fmt: skip
        self._build(spec)

    #: The one factorized layer's role.
    spec_roles = ("down",)

    #: The biases are the encoders' and ``b_out``: nothing is folded into the decoder's leg ``i``.
    folds_bias = False

    @classmethod
    def resolve_networks(cls, arguments: LayerArguments) -> tuple[tuple[tuple[str, ExpertNetwork], ...], int | None]:
        """The decoder's network ``H → O`` (exact or matched) and the budget matched; see `layer_spec`."""
        options, match, rank, expert_dims = arguments.options, arguments.match, arguments.rank, arguments.expert_dims
        match_bonds, rank_multiple = options.match_bonds, options.rank_multiple
        if expert_dims is None and match is None:
            raise TypeError("MixtureOfDecoders needs expert_dims, or match= to choose them")
        exact = isinstance(rank, str) and rank == EXACT
        rank = None if exact else rank
        build_rank = 1 if match is not None and rank is None else rank
        network = resolve_network(
            arguments.decomposition, 1 if expert_dims is None else expert_dims, arguments.hidden_features,
            arguments.out_features, build_rank, options=arguments.builder_options,
        )  # fmt: skip
        if exact and network.bonds:
            network = match_exact([network], bonds=match_bonds, multiple=rank_multiple)[1][0]
        target = None
        if match is not None:
            names = scaled_bonds(network, match_bonds)
            if expert_dims is not None and set(names) <= set(network.expert_legs):
                names = ("i",)  # the experts are given and there is no bond: the hidden width is solved
            counted = {"gated": arguments.gated, "bias": options.bias, "gate": arguments.gate}
            counted["input_norm"] = options.input_norm
            network, target = cls._matched(network, arguments.in_features, match, names, rank_multiple, counted)
        else:
            check_match_only_options(match_bonds, rank_multiple)
        return (("down", network),), target

    def _build(self, spec: LayerSpec) -> None:
        # The decoder's bias is outside the experts (b_out), so nothing is folded into its leg i.
        super()._build(spec)
        in_features, hidden_features, out_features = spec.in_features, spec.hidden_features, spec.out_features
        bias, factory = spec.bias, spec.factory()
        self.hidden_features, self.out_features, self.gated = hidden_features, out_features, spec.gated
        self.up_proj = nn.Linear(in_features, hidden_features, bias=bias, **factory)
        self.gate_proj = nn.Linear(in_features, hidden_features, bias=bias, **factory) if spec.gated else None
        self.decoder = spec.experts("down")
        self.output_bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
        default = nn.SiLU if spec.gated else nn.GELU
        activation = spec.hidden_activation
        self.hidden_activation = default() if activation is None else activation

    @staticmethod
    def _matched(
        network: ExpertNetwork,
        in_features: int,
        match: Match,
        names: Sequence[str],
        multiple: int,
        options: dict[str, Any],
    ) -> tuple[ExpertNetwork, int]:
        """``network`` with ``names`` (its leg ``i``: the hidden width, or its scaled labels) matched; the budget."""
        hidden, out_features, bias = network.in_features, network.out_features, options["bias"]
        reference = mlp_cost(in_features, hidden, out_features, bias=bias).params
        if options["gated"]:
            reference += linear_cost(in_features, hidden, bias=bias).params
        target = match_target(match, reference, "mlp", "MixtureOfDecoders")

        def count(sizes: dict[str, int]) -> int:
            return decoder_block_parameters(network.with_sizes(**sizes), in_features, **options)

        scaling = "the hidden width" if tuple(names) == ("i",) else f"{tuple(names)}"
        what = f"a mixture of {network.name} decoders scaling {scaling}"
        sizes, _ = solve_bonds(count, names, target, what=what, multiple=multiple)
        return network.with_sizes(**sizes), target

    @property
    def network(self) -> ExpertNetwork:
        """The decoder's expert network (``H → O``)."""
        return self.decoder.network

    @property
    def dense_layers(self) -> dict[str, nn.Linear]:
        """The dense encoders by role (``up``, and ``gate`` for a GLU), as conversion names them."""
        layers = {"up": self.up_proj}
        if self.gate_proj is not None:
            layers["gate"] = self.gate_proj
        return layers

    @property
    def expert_layers(self) -> dict[str, FactorizedExperts]:
        """The factorized layer by role: ``down``."""
        return {"down": self.decoder}

    def expert_vectors(self) -> dict[str, int]:
        """The decoder's expert-vector cores and the dim of their output leg: ``{"decoder.C_n1": 1, …}``.

        A core whose legs are one expert mode and the output ``o`` holds one vector ``c_n ∈ R^O``
        per expert (the ``"mxd"`` format's ``C``); the Mixture of Decoders authors keep each at norm
        1 (see [`unit_norm_parameters`][mumoe_tn.distillation.trainer.unit_norm_parameters]).
        Empty for a decoder without such cores (a CP or TR decoder).
        """
        network = self.network
        experts, output = set(network.expert_legs), "o"
        return {
            f"decoder.{name}": legs.index(output)
            for name, legs in network.cores.items()
            if len(legs) == 2 and output in legs and any(leg in experts for leg in legs)
        }

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.decoder,)

    def reset_parameters(self) -> None:
        """Re-initialise the gate, the encoders, the decoder and zero the output bias."""
        super().reset_parameters()
        for layer in self.dense_layers.values():
            layer.reset_parameters()
        if self.output_bias is not None:
            nn.init.zeros_(self.output_bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``.

        ``mask``: which tokens are real, as for [`MuMoE`][mumoe_tn.layers.moe.MuMoE].
        """
        z, coefficients = self._gate(x, mask)
        hidden = self.up_proj(z)
        if self.gate_proj is None:
            hidden = self.hidden_activation(hidden)
        else:
            hidden = self.hidden_activation(self.gate_proj(z)) * hidden
        y = self._contract(self.decoder, hidden, coefficients)
        return y if self.output_bias is None else y + self.output_bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
            f"out_features={self.out_features}, gated={self.gated}, bias={self.output_bias is not None}"
        )
