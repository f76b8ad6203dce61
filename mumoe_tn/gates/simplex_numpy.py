"""Sparsemax and 1.5-entmax of CPU rows in NumPy: the form of few rows, where calls cost more than arithmetic.

A decoding step gates one to a few dozen rows of a few hundred logits. There the cost of a map is
the number of calls, not their arithmetic, and a NumPy call on a few hundred numbers costs a
fraction of a torch call's dispatch. [`sorted_rows`][mumoe_tn.gates.simplex_numpy.sorted_rows]
sorts each row once and takes the exact closed-form threshold of the sorted prefixes (the rule
the torch forms of [`mumoe_tn.gates.simplex_torch`][mumoe_tn.gates.simplex_torch] take), so the
result equals the ``entmax`` package's. Up to [`SCALAR_ROWS`][mumoe_tn.gates.simplex_numpy] rows
(a token's few expert modes) walk their sorted entries one by one while the rule holds, as Python
floats read in one call: an entry at distance ``d`` below the row's maximum joins the ``k`` before
it while ``Σ_{j≤k} (d − d_j)²`` is at most 4 (1.5-entmax) or ``Σ_{j≤k} (d − d_j)`` is below 1
(sparsemax), the same support as the threshold rule's, and one threshold is taken at its end. For
a support of up to [`WALK_LENGTH`][mumoe_tn.gates.simplex_numpy] entries this costs less than the
vectorised steps' fixed run of calls, and a decoding row costs a sort, the read and the four or
five calls of its result; a longer support, more rows and non-finite rows take the vectorised steps,
on each row's top `WALK_LENGTH` entries only where every row's support ends among them (a
quarter of the prefix sums at 256 logits, which cost most).
[`backward_factors`][mumoe_tn.gates.simplex_numpy.backward_factors] and
[`factored_backward`][mumoe_tn.gates.simplex_numpy.factored_backward] are the backward of the
same rows: the closed-form vector-Jacobian product from factors kept by the forward pass, four
NumPy calls instead of eight torch calls (which the autograd engine runs at several times their
standalone cost at these sizes).

Rows with NaN or ``+inf`` (or only ``-inf``) give NaN in that row only, as in ``torch.softmax``;
huge finite logits do not overflow (see [`FLOOR`][mumoe_tn.gates.simplex_torch]).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from mumoe_tn.gates.simplex_torch import FLOOR

__all__ = [
    "FIRST_STEPS",
    "NUMPY_DTYPES",
    "SCALAR_ROWS",
    "WALK_LENGTH",
    "backward_factors",
    "factored_backward",
    "forward",
    "forward_keeping_factors",
    "sorted_rows",
]

#: Top entries of a row the one-row walk reads (as Python floats): a step of the walk costs a few
#: Python operations, the vectorised steps on a sorted row about as much as sixty of them.
WALK_LENGTH = 64

#: Entries the one-row walk takes before it checks whether the support reaches past `WALK_LENGTH`
#: (a trained gate's support of a few entries, and a BatchNorm'd gate's of 20–40 at initialisation,
#: mostly end before then).
FIRST_STEPS = 32

#: Most rows that take the one-row walk each before the vectorised steps do (on their top entries,
#: at four rows of 256 logits about as quick as four walks of a few entries each).
SCALAR_ROWS = 3

#: The largest finite value of each NumPy float dtype the one-row walk takes (by type code).
_LARGEST = {"f": float(np.finfo(np.float32).max), "d": float(np.finfo(np.float64).max)}


def _constant(value: float, code: str) -> np.ndarray:
    """``value`` as a read-only 0-d array of the NumPy type code ``code``."""
    array = np.full((), value, code)
    array.flags.writeable = False
    return array


class _Operands(NamedTuple):
    """The constants of the steps as 0-d arrays of one dtype: quicker operands than Python floats."""

    zero: np.ndarray
    quarter: np.ndarray
    half: np.ndarray
    one: np.ndarray
    four: np.ndarray
    floor: np.ndarray
    ceiling: np.ndarray


#: The steps' constants in each NumPy float dtype (by type code).
_OPERANDS = {
    code: _Operands(*(_constant(value, code) for value in (0.0, 0.25, 0.5, 1.0, 4.0, FLOOR, -FLOOR))) for code in "fd"
}

#: The torch dtypes NumPy computes in; half precision is widened to float32 first.
NUMPY_DTYPES = (torch.float32, torch.float64)


def forward(x: torch.Tensor, entmax: bool) -> torch.Tensor:
    """Sparsemax or 1.5-entmax (``entmax``) along the last dim of the CPU tensor ``x``, without autograd.

    Parameters
    ----------
    x : torch.Tensor
        CPU logits ``(…, N)`` of a floating dtype (half precision is mapped in float32 and rounded back).
    entmax : bool
        1.5-entmax when True, sparsemax when False.

    Returns
    -------
    torch.Tensor
        A new tensor, same shape and dtype as ``x``.
    """
    if x.ndim == 2 and x.shape[0] == 1 and (x.dtype is torch.float32 or x.dtype is torch.float64):
        if x.shape[1] and not x.requires_grad:  # one row (a decoding step): the fewest calls
            y = _single_row(x.numpy()[0], entmax)
            if y is not None:
                return torch.from_numpy(y[None])
    return _forward(x, entmax, False)[0]


def forward_keeping_factors(x: torch.Tensor, entmax: bool) -> tuple[torch.Tensor, tuple[np.ndarray, np.ndarray] | None]:
    """[`forward`][mumoe_tn.gates.simplex_numpy.forward], and the backward factors of its rows.

    The factors are those of [`backward_factors`][mumoe_tn.gates.simplex_numpy.backward_factors].

    Parameters
    ----------
    x : torch.Tensor
        As for `forward`.
    entmax : bool
        1.5-entmax when True, sparsemax when False.

    Returns
    -------
    tuple
        The map of ``x``, and its backward factors (None for half precision or a non-finite row).
    """
    return _forward(x, entmax, True)


def _forward(
    x: torch.Tensor, entmax: bool, keep_factors: bool
) -> tuple[torch.Tensor, tuple[np.ndarray, np.ndarray] | None]:
    dtype = x.dtype
    if x.numel() == 0:
        return torch.empty_like(x), None
    wide = dtype is torch.float32 or dtype is torch.float64
    if x.requires_grad:
        x = x.detach()
    values = (x if wide else x.float()).numpy()
    width = values.shape[-1]
    mapped = sorted_rows(values.reshape(-1, width), entmax).reshape(values.shape)
    factors = backward_factors(mapped, entmax) if keep_factors and wide else None
    y = torch.from_numpy(mapped)
    return (y if wide else y.to(dtype)), factors


def sorted_rows(rows: np.ndarray, entmax: bool) -> np.ndarray:
    """The map of every row of the 2-D float array ``rows``, as a new array.

    Parameters
    ----------
    rows : numpy.ndarray
        ``(rows, N)`` float32 or float64 logits (any strides).
    entmax : bool
        1.5-entmax when True, sparsemax when False.

    Returns
    -------
    numpy.ndarray
    """
    if rows.size == 0:
        return np.empty(rows.shape, rows.dtype)
    if rows.shape[0] == 1:  # (a decoding step of one expert mode)
        single = _single_row(rows[0], entmax)
        if single is not None:
            return single[None]
    elif rows.shape[0] <= SCALAR_ROWS:
        singles = [_single_row(row, entmax) for row in rows]  # None for a non-finite row too: the rows' steps
        if all(single is not None for single in singles):
            return singles[0][None] if len(singles) == 1 else np.stack(singles)
    # NaN rows are meant, and x − peak of a finite row may overflow to −inf (below the floor all
    # the same): NumPy need not warn
    with np.errstate(invalid="ignore", over="ignore"):
        return _vectorised_rows(rows, entmax)


def _single_row(row: np.ndarray, entmax: bool) -> np.ndarray | None:
    """One row, its support found by walking its sorted entries (None where a value is not finite).

    The walk reads the row's top `WALK_LENGTH` entries once, as Python floats, and takes
    `FIRST_STEPS` of them. Where the support goes on, the rule for the lowest of the top entries,
    from the entries taken so far, says whether it ends among them (the rule's sum over more
    entries is no smaller): then the walk goes on, else the vectorised steps on the sorted row
    find it. The sums are in float64 (Python floats).
    """
    ordered = np.sort(row)  # ascending: NaN sorts last, so it is the peak; -inf first
    head = ordered[-WALK_LENGTH:].tolist()
    peak, lowest = head[-1], ordered.item(0)
    if not (math.isfinite(peak) and math.isfinite(lowest)) or peak - lowest > _LARGEST[row.dtype.char]:
        return None  # NaN or ±inf, or x − peak would overflow: the rows' steps handle those
    width = len(ordered)
    entries = reversed(head)  # descending
    ended, count, total, total_sq = _walk(itertools.islice(entries, FIRST_STEPS), peak, entmax, 0, 0.0, 0.0)
    if not ended and count < width:
        if width <= WALK_LENGTH or _walk((head[0],), peak, entmax, count, total, total_sq)[0]:
            ended, count, total, total_sq = _walk(entries, peak, entmax, count, total, total_sq)
        if not ended and count < width:  # (the support may go past the top entries)
            count, total, total_sq = _sorted_row_sums(ordered, peak, entmax)
    return _mapped_row(row, peak, _shift(count, total, total_sq, entmax), entmax)


def _walk(
    entries: Iterable[float], peak: float, entmax: bool, count: int, total: float, total_sq: float
) -> tuple[bool, int, float, float]:
    """The walk on from ``count`` entries (``total``, ``total_sq``: Σd, Σd² of their distances ``d = peak − x``).

    An entry at distance ``d`` after ``k`` entries is in the support while ``Σ_{j≤k} (d − d_j)²``
    is at most 4 (1.5-entmax: the threshold the first ``k`` entries imply is not above the
    entry's) or ``Σ_{j≤k} (d − d_j)`` is below 1 (sparsemax). Returns whether an entry of
    ``entries`` failed the rule (the support ended), and the support's count, Σd and Σd².
    """
    if entmax:
        for value in entries:
            distance = peak - value
            if (count * distance - 2.0 * total) * distance + total_sq > 4.0:
                return True, count, total, total_sq
            total += distance
            total_sq += distance * distance
            count += 1
    else:
        for value in entries:
            distance = peak - value
            if count * distance - total >= 1.0:
                return True, count, total, total_sq
            total += distance
            count += 1
    return False, count, total, total_sq


def _support_reaches(top: np.ndarray, entmax: bool) -> bool:
    """Whether the support of a row takes every one of its top entries ``top`` (in ascending order).

    The rule of `_walk` for the lowest of them, its distances taken from that entry (those beyond
    the floor clamped to it: the rule fails all the same, and a huge row's squares do not overflow).
    """
    distance = top - top[0]
    np.minimum(distance, _OPERANDS[top.dtype.char].ceiling, out=distance)
    if entmax:
        return float(np.dot(distance, distance)) <= 4.0
    return float(np.add.reduce(distance)) < 1.0


def _sorted_row_sums(ordered: np.ndarray, peak: float, entmax: bool) -> tuple[int, float, float]:
    """The support's count, Σd and Σd² of one finite row from its entries in ascending order (vectorised)."""
    operands = _OPERANDS[ordered.dtype.char]
    distance = np.subtract(ordered.dtype.type(peak), ordered[::-1])  # descending entries: distances ascending
    np.minimum(distance, operands.ceiling, out=distance)  # beyond the floor is outside the support, whatever the rule
    total = np.add.accumulate(distance)
    rule = _counts(len(ordered), ordered.dtype.str) * distance
    rule -= total  # Σ_{j≤k} (d_k − d_j), sparsemax's rule
    if not entmax:
        count = int(np.count_nonzero(rule < operands.one))
        return count, total.item(count - 1), 0.0
    total_sq = np.add.accumulate(distance * distance)
    rule -= total
    rule *= distance
    rule += total_sq  # Σ_{j≤k} (d_k − d_j)² = k d_k² − 2 d_k Σd + Σd²
    count = int(np.count_nonzero(rule <= operands.four))
    return count, total.item(count - 1), total_sq.item(count - 1)


def _shift(count: int, total: float, total_sq: float, entmax: bool) -> float:
    """The shift ``t`` that a row's support implies (``count`` entries, Σd and Σd² of their distances to the peak).

    ``x − peak + t`` is ``2 (x/2 − τ)`` for 1.5-entmax and ``x − τ`` for sparsemax, ``τ`` the
    threshold of the map on the max-shifted row.
    """
    if entmax:  # the smaller root τ of Σ (x_j/2 − τ)² = 1 over the support
        return total / count + math.sqrt(max((4.0 - (total_sq - total * total / count)) / count, 0.0))
    return (total + 1.0) / count


def _mapped_row(row: np.ndarray, peak: float, shift: float, entmax: bool) -> np.ndarray:
    """``(x − peak + t)₊`` (sparsemax) or ``((x − peak + t)/2)₊²`` (1.5-entmax) of one row, as a new array."""
    scalar = row.dtype.type  # (NumPy scalars of the row's dtype: quicker operands than Python floats)
    y = np.subtract(row, scalar(peak))  # shifted first: x − peak is exact where it matters (entries near the peak)
    y += scalar(shift)
    operands = _OPERANDS[y.dtype.char]
    np.maximum(y, operands.zero, out=y)
    if entmax:
        y *= y
        y *= operands.quarter
    return y


def _mapped(x: np.ndarray, peak: np.ndarray, tau: np.ndarray, entmax: bool) -> np.ndarray:
    """``(x − peak − τ)₊`` (sparsemax) or ``((x − peak)/2 − τ)₊²`` (1.5-entmax), as a new array."""
    operands = _OPERANDS[x.dtype.char]
    y = x - peak  # shifted first: x − peak is exact where it matters (entries near the peak)
    if entmax:
        y *= operands.half
    y -= tau
    np.maximum(y, operands.zero, out=y)
    if entmax:
        y *= y
    return y


def _vectorised_rows(rows: np.ndarray, entmax: bool) -> np.ndarray:
    ascending = np.sort(rows, axis=-1)
    if rows.shape[-1] > WALK_LENGTH and _supports_end_among(ascending[:, -WALK_LENGTH:], entmax):
        ascending = ascending[:, -WALK_LENGTH:]  # the steps need no more than each row's top entries
    ordered = ascending[:, ::-1]  # NaN sorts last, so first here: it becomes the peak
    peak = ordered[:, :1]
    operands = _OPERANDS[rows.dtype.char]
    shifted = ordered - peak
    np.maximum(shifted, operands.floor, out=shifted)  # entries below the floor are outside the support
    width = ordered.shape[-1]
    count = _counts(width, rows.dtype.str)
    if entmax:
        shifted *= operands.half
        total = np.add.accumulate(shifted, axis=-1)
        tau = total / count  # τ_k: the smaller root of Σ_{j≤k} (x_j − τ)² = 1, from the prefix sums
        spread = tau * total
        spread -= np.add.accumulate(shifted * shifted, axis=-1)
        spread += operands.one
        spread /= count
        np.sqrt(np.maximum(spread, operands.zero, out=spread), out=spread)
        tau -= spread
    else:
        tau = np.add.accumulate(shifted, axis=-1)  # τ_k = (Σ_{j≤k} x_j − 1) / k
        tau -= operands.one
        tau /= count
    # (add.accumulate, add.reduce and a flat take: NumPy's quickest forms for a few short rows)
    support = np.add.reduce(tau <= shifted, axis=-1)  # 0 for a NaN row: a τ of another entry, unused
    threshold = tau.ravel().take(np.arange(0, width * len(support), width) + (support - 1) % width)[:, None]
    y = _mapped(rows, peak, threshold, entmax)
    # peak − peak is 0 for a finite peak and NaN for NaN or ±inf: added to the result, it turns
    # exactly the rows softmax makes NaN into NaN and leaves the others unchanged.
    y += peak - peak
    return y


def _supports_end_among(tops: np.ndarray, entmax: bool) -> bool:
    """Whether the support of every row ends among its top entries ``tops`` (rows in ascending order).

    The rule of `_walk` for the lowest of each row's top entries: it fails in every row (not for
    a row holding NaN or ``-inf`` among them). The first row is asked alone first: rows of one
    batch mostly answer alike, and where its support goes on the others need not be asked. Its
    rule is at most ``(n − 1) d²`` or ``(n − 1) d`` for ``n`` entries within ``d`` of its maximum,
    which answers for a flat row without the rule.
    """
    first = tops[0]
    gap = first.item(-1) - first.item(0)  # d of its lowest top entry
    bound = (len(first) - 1) * (gap * gap if entmax else gap)
    if (bound <= 4.0) if entmax else (bound < 1.0):
        return False
    if _support_reaches(first, entmax):
        return False
    distance = tops - tops[:, :1]
    if entmax:
        distance *= distance
        return bool(np.add.reduce(distance, axis=-1).min() > 4.0)  # (a NaN minimum compares false)
    return bool(np.add.reduce(distance, axis=-1).min() >= 1.0)


@functools.lru_cache(maxsize=16)
def _counts(size: int, dtype: str) -> np.ndarray:
    """``[1, 2, …, size]`` (read-only; kept per size and dtype)."""
    counts = np.arange(1, size + 1, dtype=dtype)
    counts.flags.writeable = False
    return counts


def backward_factors(y: np.ndarray, entmax: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """``(√y, 1/Σ√y)`` (1.5-entmax) or ``(1 on the support, 1/|S|)`` (sparsemax) of the rows ``y`` ``(…, N)``.

    ``√y`` as the torch backward computes it (the square root of a square is exact). None where a
    row is not finite (a NaN row): the torch backward handles those.

    Parameters
    ----------
    y : numpy.ndarray
        The map's output, rows along the last axis.
    entmax : bool
        1.5-entmax when True, sparsemax when False.

    Returns
    -------
    tuple of numpy.ndarray, or None
    """
    with np.errstate(invalid="ignore"):
        factor = np.sqrt(y) if entmax else (y > 0).astype(y.dtype)
        total = np.add.reduce(factor, axis=-1, keepdims=True)
    if not (total > 0).all():  # (NaN compares false)
        return None
    return factor, np.reciprocal(total, out=total)


def factored_backward(grad: np.ndarray, factors: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """``w ⊙ (g − Σ w g / Σ w)`` from [`backward_factors`][mumoe_tn.gates.simplex_numpy.backward_factors].

    Parameters
    ----------
    grad : numpy.ndarray
        The incoming gradient, rows along the last axis, shaped as the factors.
    factors : tuple of numpy.ndarray
        ``(w, 1/Σ w)``.

    Returns
    -------
    numpy.ndarray
        A new array (``grad`` is not written to).
    """
    factor, scale = factors
    scaled = grad * factor
    shift = np.add.reduce(scaled, axis=-1, keepdims=True)
    shift *= scale
    scaled -= shift * factor  # sparsemax's (g − mean_S g)·1_S is the same form, its factor 1_S
    return scaled
