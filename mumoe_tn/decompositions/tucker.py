"""Tucker μMoE: a core tensor with one factor matrix per leg."""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.decompositions.registry import ClosedForms, normalize_ranks, register
from mumoe_tn.network import ExpertNetwork, _physical_sizes

__all__ = ["tucker"]


def _fma(net: ExpertNetwork) -> int:
    """FMAs per token, derived here (the paper gives none).

    ``Σ_e N_e R_e + I R_I + Σ_{k=0}^{E} P / Π_{j<k} R_j + R_O O`` with ``P = Π R`` over all
    ``E + 2`` core modes: the factor products, then the core contracted with the vectors of
    modes ``n1 … nE, i`` in that order, then the output factor.
    """
    legs = [*net.expert_legs, "i", "o"]
    ranks = [net.sizes[f"s_{leg}"] for leg in legs]
    total = sum(n * r for n, r in zip(net.expert_dims, ranks, strict=False))
    total += net.in_features * ranks[-2] + ranks[-1] * net.out_features
    remaining = 1
    for r in ranks:
        remaining *= r
    for r in ranks[:-1]:
        total += remaining
        remaining //= r
    return total


def _rank_bound(net: ExpertNetwork) -> int:
    """Expert rank bound ``min{I, R_I, R_O, O}``.

    The paper's ``min{min(I, R_I), min(R_I, R_O·R_N), min(O, R_O)}`` ("Tucker μMoEs: rank
    analysis") reduces to this.
    """
    return min(net.in_features, net.sizes["s_i"], net.sizes["s_o"], net.out_features)


@register("tucker", ClosedForms(_fma, _fma, _rank_bound))
def tucker(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
) -> ExpertNetwork:
    """TuckerμMoE network: ``W = Z ×_1 U_n1 … ×_E U_nE ×_{E+1} U_i ×_{E+2} U_o``.

    The core ``core`` has labels ``(s_n1, …, s_nE, s_i, s_o)`` and each factor ``U_<leg>`` has
    labels ``(leg, s_<leg>)`` (tensorly's layout).

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        ``E + 2`` ranks ``(R_n1, …, R_nE, R_I, R_O)`` or one int for all.

    Returns
    -------
    ExpertNetwork
    """
    sizes = _physical_sizes(expert_dims, in_features, out_features)
    legs = list(sizes)
    ranks = normalize_ranks("tucker", rank, len(legs))
    core_labels = tuple(f"s_{leg}" for leg in legs)
    cores = {"core": core_labels, **{f"U_{leg}": (leg, f"s_{leg}") for leg in legs}}
    sizes.update(zip(core_labels, ranks, strict=True))
    return ExpertNetwork(cores, sizes, name="tucker")
