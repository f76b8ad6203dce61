"""Measurements on built layers: the numerical rank of expert matrices."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Sequence

import torch

from mumoe_tn.layers import FactorizedExperts

__all__ = ["expert_ranks"]


def _is_index(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _expert_key(index: object, expert_dims: tuple[int, ...]) -> tuple[int, ...]:
    """``index`` as a multi-index within ``expert_dims`` (TypeError/ValueError naming it otherwise)."""
    if _is_index(index):
        key: tuple = (index,)
    elif isinstance(index, Sequence) and not isinstance(index, (str, bytes)) and all(_is_index(k) for k in index):
        key = tuple(index)
    else:
        raise TypeError(f"an expert index is an int or a tuple of ints (one per expert mode), got {index!r}")
    if len(key) != len(expert_dims):
        raise ValueError(f"expert index {index!r} needs {len(expert_dims)} int(s), one per expert mode {expert_dims}")
    if not all(0 <= k < n for k, n in zip(key, expert_dims, strict=True)):
        raise ValueError(f"expert index {index!r} is out of range for expert dims {expert_dims}")
    return tuple(int(k) for k in key)


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
    net = experts.network
    if indices is None:
        keys = list(itertools.product(*(range(n) for n in net.expert_dims)))
    elif isinstance(indices, (str, bytes, torch.Tensor)) or not isinstance(indices, Iterable):
        raise TypeError(f"indices must be an iterable of expert indices (ints or tuples of ints), got {indices!r}")
    else:
        keys = [_expert_key(index, net.expert_dims) for index in indices]
    dtype = next(experts.parameters()).dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"the expert cores must be floating point to measure ranks, got {dtype}")
    if rtol is None:
        rtol = torch.finfo(dtype).eps * max(net.in_features, net.out_features)
    elif isinstance(rtol, bool) or not isinstance(rtol, numbers.Real):
        raise TypeError(f"rtol must be a real number or None, got {rtol!r}")
    elif not (math.isfinite(rtol) and 0 <= rtol < 1):
        raise ValueError(f"rtol must be a relative tolerance in [0, 1), got {rtol}")
    ranks = {}
    for key in keys:
        matrix = experts.expert(key).to(torch.promote_types(dtype, torch.float32))
        ranks[key] = int(torch.linalg.matrix_rank(matrix, rtol=rtol))
    return ranks
