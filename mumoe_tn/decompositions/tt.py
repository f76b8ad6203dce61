"""Tensor-train μMoE: an open chain of cores over n1 … nE, i, o (a TR with R_1 = 1)."""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.decompositions._ring import chain, chain_ranks
from mumoe_tn.decompositions.registry import register
from mumoe_tn.decompositions.tr import PAPER_EXPERT_RANK
from mumoe_tn.network import ExpertNetwork, normalize_expert_dims

__all__ = ["tt"]


@register("tt")
def tt(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
    *,
    expert_rank: int = PAPER_EXPERT_RANK,
) -> ExpertNetwork:
    """TTμMoE network: cores ``G_n1 (N_1, R_1) … G_i (R_E, I, R_{E+1}), G_o (R_{E+1}, O)``.

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        ``E + 1`` ranks ``(R_1, …, R_{E+1})``, or one int ``R`` meaning ``R_{E+1} = R`` (the
        bond between input and output cores) and every other rank ``expert_rank``.
    expert_rank : int, optional
        Rank of the bonds between expert cores when ``rank`` is an int (default 4).

    Returns
    -------
    ExpertNetwork
    """
    n_bonds = len(normalize_expert_dims(expert_dims)) + 1
    ranks = chain_ranks("tt", rank, n_bonds, expert_rank)
    return chain("tt", expert_dims, in_features, out_features, ranks, closed=False)
