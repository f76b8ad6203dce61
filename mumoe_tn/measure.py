"""Measurements on built layers: the numerical rank of expert matrices."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from mumoe_tn.layers import FactorizedExperts

__all__ = ["expert_ranks"]


@torch.no_grad()
def expert_ranks(
    experts: FactorizedExperts,
    indices: Iterable[int | Sequence[int]] | None = None,
    *,
    rtol: float | None = None,
) -> dict[tuple[int, ...], int]:
    """Numerical rank of expert matrices, each computed alone (``W`` is never built).

    Parameters
    ----------
    experts : FactorizedExperts
        The expert tensor (e.g. ``layer.experts``).
    indices : iterable of int or tuple of int, optional
        Experts to measure; every expert by default (cost grows with their number).
    rtol : float, optional
        Relative singular-value tolerance. By default ``eps · max(I, O)`` with the ``eps`` of
        the experts' dtype: rounding noise of float32 cores is not counted as rank.

    Returns
    -------
    dict
        Expert multi-index -> rank of its ``I × O`` matrix.
    """
    if not isinstance(experts, FactorizedExperts):
        raise TypeError(f"expert_ranks needs a FactorizedExperts (e.g. layer.experts), got {type(experts).__name__}")
    if indices is None:
        indices = itertools.product(*(range(n) for n in experts.network.expert_dims))
    net = experts.network
    dtype = next(experts.parameters()).dtype
    if rtol is None:
        rtol = torch.finfo(dtype).eps * max(net.in_features, net.out_features)
    ranks = {}
    for index in indices:
        key = (index,) if isinstance(index, int) else tuple(index)
        matrix = experts.expert(key).to(torch.promote_types(dtype, torch.float32))
        ranks[key] = int(torch.linalg.matrix_rank(matrix, rtol=rtol))
    return ranks
