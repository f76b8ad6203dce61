"""Tucker μMoE: a core tensor with one factor matrix per leg."""

from __future__ import annotations

from collections.abc import Sequence

from mumoe_tn.decompositions.registry import normalize_ranks, register
from mumoe_tn.network import ExpertNetwork, _physical_sizes

__all__ = ["tucker"]


@register("tucker")
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
