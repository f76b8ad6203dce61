"""Tensor-ring μMoE: a ring of three-leg cores over n1 … nE, i, o."""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.decompositions._ring import chain, chain_ranks
from mumoe_tn.decompositions.registry import ClosedForms, register
from mumoe_tn.network import ExpertNetwork, normalize_expert_dims

__all__ = ["tr"]

PAPER_EXPERT_RANK = 4


def _ranks(net: ExpertNetwork) -> list[int]:
    return [net.sizes[f"r{k}"] for k in range(1, net.n_expert_modes + 3)]


def _paper_fma(net: ExpertNetwork) -> int:
    """``Σ_e R_e N_e R_{e+1} + R_{E+1} I R_{E+2} + Σ_{e=2}^{E+1} R_1 R_e R_{e+1} + R_{E+2} O R_1``.

    For ``E = 1`` this is the paper's ``R1NR2 + R2IR3 + R1R2R3 + R1OR3`` (Table
    decomp-tradeoff); for ``E > 1`` the mode-2 products and the left-to-right chain of
    ``R_1 × R_{e+1}`` matrix products of Eq. full-fast-TR. Nothing is omitted.
    """
    r = _ranks(net)
    n_modes = net.n_expert_modes
    total = sum(r[e] * n * r[e + 1] for e, n in enumerate(net.expert_dims))
    total += r[n_modes] * net.in_features * r[n_modes + 1]
    total += sum(r[0] * r[e] * r[e + 1] for e in range(1, n_modes + 1))
    return total + r[n_modes + 1] * net.out_features * r[0]


def _rank_bound(net: ExpertNetwork) -> int:
    """Expert rank bound ``min{R_{E+2}·min{R_1, …, R_{E+1}}, I, O}``.

    For ``E = 1`` this is the paper's ``min{R3·min{R1, R2}, I, O}`` ("TRμMoEs: rank analysis").
    """
    r = _ranks(net)
    return min(r[-1] * min(r[:-1]), net.in_features, net.out_features)


@register("tr", ClosedForms(_paper_fma, _paper_fma, _rank_bound, lambda net: (f"r{net.n_expert_modes + 2}",)))
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
