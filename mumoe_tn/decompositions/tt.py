"""Tensor-train μMoE: an open chain of cores over n1 … nE, i, o (a TR with R_1 = 1)."""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.decompositions._ring import chain, chain_ranks
from mumoe_tn.decompositions.registry import ClosedForms, register
from mumoe_tn.decompositions.tr import PAPER_EXPERT_RANK
from mumoe_tn.network import ExpertNetwork, normalize_expert_dims

__all__ = ["tt"]


def _fma(net: ExpertNetwork) -> int:
    """FMAs per token, derived here (the paper gives none).

    With ranks ``R_1 … R_{E+1}``:
    ``N_1R_1 + Σ_{e≥2} (R_{e-1}N_eR_e + R_{e-1}R_e) + R_E I R_{E+1} + R_E R_{E+1} + R_{E+1} O``,
    i.e. the mode-2 products, the vector-matrix chain along the experts, ``z`` into the input
    core, the expert vector into that result, and the output core. Nothing is omitted.
    """
    n_modes = net.n_expert_modes
    r = [net.sizes[f"r{k}"] for k in range(1, n_modes + 2)]
    dims = net.expert_dims
    total = dims[0] * r[0]
    total += sum(r[e - 1] * dims[e] * r[e] + r[e - 1] * r[e] for e in range(1, n_modes))
    total += r[n_modes - 1] * net.in_features * r[n_modes] + r[n_modes - 1] * r[n_modes]
    return total + r[n_modes] * net.out_features


def _rank_bound(net: ExpertNetwork) -> int:
    """``min{R_{E+1}, I, O}``: only the bond between input and output cores joins them."""
    return min(net.sizes[f"r{net.n_expert_modes + 1}"], net.in_features, net.out_features)


@register("tt", ClosedForms(_fma, _fma, _rank_bound, lambda net: (f"r{net.n_expert_modes + 1}",)))
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
