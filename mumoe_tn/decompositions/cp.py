"""CP (canonical polyadic) μMoE: one factor matrix per leg, all sharing one rank label."""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.decompositions.registry import ClosedForms, normalize_ranks, register
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork, _physical_sizes

__all__ = ["cp"]


def _paper_fma(net: ExpertNetwork) -> int:
    """``R(ΣN_e + I + O)`` (paper Table decomp-tradeoff, Eq. fast-CP / full-fast-cp)."""
    return net.sizes["r"] * (sum(net.expert_dims) + net.in_features + net.out_features)


def _hand_fma(net: ExpertNetwork) -> int:
    """FMAs of the paper's order, lower-order terms included.

    ``E + 1`` vectors ``U·a_e``, ``U·z`` of length ``R``, their ``E`` elementwise products
    (``E·R``, which the paper omits), then ``R·O``.
    """
    return _paper_fma(net) + net.n_expert_modes * net.sizes["r"]


def _rank_bound(net: ExpertNetwork) -> int:
    """``min{I, O, R}`` (paper, "CPμMoEs: rank analysis")."""
    return min(net.in_features, net.out_features, net.sizes["r"])


@register("cp", ClosedForms(_paper_fma, _hand_fma, _rank_bound, lambda net: ("r",)))
def cp(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
) -> ExpertNetwork:
    """CPμMoE network (paper Eq. fast-CP and its hierarchical form Eq. full-fast-cp).

    ``W = Σ_r u^(1)_r ∘ … ∘ u^(E)_r ∘ u^(E+1)_r ∘ u^(E+2)_r`` with factor matrices
    ``U_n1 … U_nE, U_i, U_o`` of shape ``(leg, R)`` (tensorly's layout). The rank label ``r``
    is a hyperedge shared by all ``E + 2`` cores.

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        The CP rank ``R`` (a one-element sequence is accepted too).

    Returns
    -------
    ExpertNetwork
        ``R·(ΣN_e + I + O)`` parameters.
    """
    (r,) = normalize_ranks("cp", rank, 1)
    sizes = _physical_sizes(expert_dims, in_features, out_features)
    legs = [leg for leg in sizes if leg not in (INPUT_LEG, OUTPUT_LEG)] + [INPUT_LEG, OUTPUT_LEG]
    cores = {f"U_{leg}": (leg, "r") for leg in legs}
    return ExpertNetwork(cores, {**sizes, "r": r}, name="cp")
