"""Tensor-ring μMoE: a ring of three-leg cores over n1 … nE, i, o."""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.decompositions._ring import chain, chain_ranks
from mumoe_tn.decompositions.registry import register
from mumoe_tn.network import ExpertNetwork, normalize_expert_dims

__all__ = ["tr"]

PAPER_EXPERT_RANK = 4


@register("tr")
def tr(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
    *,
    expert_rank: int = PAPER_EXPERT_RANK,
) -> ExpertNetwork:
    """TRμMoE network (paper Eq. fast-TR and its hierarchical form Eq. full-fast-TR).

    Cores ``G_n1 (R_1, N_1, R_2) … G_nE (R_E, N_E, R_{E+1})``, ``G_i (R_{E+1}, I, R_{E+2})`` and
    ``G_o (R_{E+2}, O, R_1)``, in tensorly's ``(r_k, n_k, r_{k+1})`` layout; bonds ``r1 … r{E+2}``.

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        ``E + 2`` ranks ``(R_1, …, R_{E+2})``, or one int ``R`` meaning
        ``R_{E+2} = R`` (the bond between input and output cores, which bounds the expert
        matrix rank) and every other rank ``expert_rank``: the paper's ``R1 = R2 = 4``.
    expert_rank : int, optional
        Rank of the bonds touching expert cores when ``rank`` is an int (default 4).

    Returns
    -------
    ExpertNetwork
    """
    n_bonds = len(normalize_expert_dims(expert_dims)) + 2
    ranks = chain_ranks("tr", rank, n_bonds, expert_rank)
    return chain("tr", expert_dims, in_features, out_features, ranks, closed=True)
