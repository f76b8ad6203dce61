"""Mixture of Decoders (MxD): a Hadamard factorisation of the expert tensor.

Oldfield, Im, Li, Nicolaou, Patras, Chrysos, *Towards Interpretability Without Sacrifice: Faithful
Dense Layer Decomposition with Mixture of Decoders* (arXiv 2505.21364, 2025). The expert tensor is

    W[n1, …, nE, i, o] = D[i, o] · C_n1[n1, o] · … · C_nE[nE, o]

— one shared decoder ``D`` and one expert matrix ``C_ne`` per expert mode, all holding the output
leg ``o`` (a *shared* physical leg: a Khatri–Rao product along ``o``). Expert ``n`` is
``D · diag(c_n1 ⊙ … ⊙ c_nE)``: full rank ``min(I, O)`` for ``ΣN_e·O + I·O`` parameters, and the
forward pass is ``y = (Dᵀz) ⊙ (C_n1ᵀa_1) ⊙ … ⊙ (C_nEᵀa_E)``. With several expert modes
(hierarchical MxD) ``N_1·…·N_E`` full-rank experts cost a gate of ``I·ΣN_e``.

The network has no bond: parameter matching scales the expert modes (one size ``N`` for every
mode), as the authors choose ``N`` to match a transcoder's parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mumoe_tn.decompositions.format import Format
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork, physical_sizes

__all__ = ["MxDFormat", "mxd"]

#: Name of the decoder core ``D (i, o)``.
DECODER = "D"


def expert_core(leg: str) -> str:
    """Name of the expert core of expert leg ``leg`` (``"C_n1"`` for ``"n1"``)."""
    return f"C_{leg}"


class MxDFormat(Format, name="mxd"):
    """MxD: a decoder ``D (i, o)`` and one expert matrix ``C_<leg> (leg, o)`` per expert mode.

    Takes no rank (its only sizes are its legs): pass ``rank=None`` (or ``()``) and size it with
    ``expert_dims``, or let parameter matching choose the number of experts. Converting an MLP
    block with it gives a [`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders] (dense
    encoder, MxD decoder), as the authors build it.
    """

    mlp_block = "decoders"
    top_k_gate = "relu"  # the authors' TopK(ReLU(G x + b)) gate

    def network(
        self,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        rank: int | Sequence[int] | None = None,
        **options: Any,
    ) -> ExpertNetwork:
        """The decoder and the expert matrices; see the class docstring.

        ``rank`` is ``None`` or ``()`` (the network has no bond); ``1`` is accepted as the same, since
        parameter matching builds every format at rank 1 before it scales.
        """
        if options:
            raise TypeError(f"mxd takes no options, got {sorted(options)}")
        if not (rank is None or rank == 1 or (isinstance(rank, Sequence) and not isinstance(rank, str) and not rank)):
            raise ValueError(
                f"mxd has no bond, so it takes no rank, got {rank!r}; size it with expert_dims "
                "(the number of experts), or let match= choose them"
            )
        sizes = physical_sizes(expert_dims, in_features, out_features)
        experts = [leg for leg in sizes if leg not in (INPUT_LEG, OUTPUT_LEG)]
        cores = {DECODER: (INPUT_LEG, OUTPUT_LEG), **{expert_core(leg): (leg, OUTPUT_LEG) for leg in experts}}
        return ExpertNetwork(cores, sizes)

    def ranks_of(self, network: ExpertNetwork) -> tuple[int, ...]:
        """``()``: the network has no bond."""
        return ()

    def closed_form_fma(self, network: ExpertNetwork) -> int:
        """``O·(I + ΣN_e)``: ``Dᵀz`` and every ``C_eᵀa_e`` (the paper's dense count of the forward)."""
        return network.out_features * (network.in_features + sum(network.expert_dims))

    def hand_fma(self, network: ExpertNetwork) -> int:
        """With the ``E`` elementwise products of length ``O`` that join them."""
        return self.closed_form_fma(network) + network.n_expert_modes * network.out_features

    def closed_form_rank_bound(self, network: ExpertNetwork) -> int:
        """``min(I, O)``: every expert ``D·diag(c)`` has the rank of ``D`` for ``c`` without zeros."""
        return min(network.in_features, network.out_features)

    def search_structures(
        self, expert_dims: tuple[int, ...], expert_ranks: Sequence[int]
    ) -> list[tuple[str, int | tuple[int, ...] | None]]:
        """One structure, with no bond: the design evaluates it at its fixed size."""
        return [("mxd" if len(expert_dims) == 1 else "hierarchical mxd", None)]

    def matched_bonds(self, network: ExpertNetwork) -> tuple[str, ...]:
        """The expert legs: matching chooses the number of experts."""
        return network.expert_legs

    def upcycle_capacity(self, network: ExpertNetwork) -> int:
        """Every matrix: ``min(I, O)`` components."""
        return min(network.in_features, network.out_features)

    def upcycle(self, network: ExpertNetwork, cores: Mapping[str, Any], left: Any, right: Any) -> None:
        """``D = left · rightᵀ`` and every expert matrix all ones: every expert is ``D``."""
        cores[DECODER].copy_(left @ right.T)
        for leg in network.expert_legs:
            cores[expert_core(leg)].fill_(1.0)


def mxd(expert_dims: int | Sequence[int], in_features: int, out_features: int) -> ExpertNetwork:
    """MxD network: decoder ``D (i, o)`` and expert matrices ``C_<leg> (leg, o)``.

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E`` (several: hierarchical MxD).
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.

    Returns
    -------
    ExpertNetwork
        ``O·(I + ΣN_e)`` parameters, carrying [`MxDFormat`][mumoe_tn.decompositions.mxd.MxDFormat].

    Examples
    --------
    >>> net = mxd((64, 64), 768, 768)
    >>> net.to_spec(), net.n_experts, net.n_params
    ('D: i o, C_n1: n1 o, C_n2: n2 o', 4096, 688128)
    """
    return MxDFormat.get().build(expert_dims, in_features, out_features, None)
