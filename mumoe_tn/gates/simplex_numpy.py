"""Sparsemax and 1.5-entmax of CPU rows in NumPy: the form of few rows, where calls cost more than arithmetic.

A decoding step gates one to a few dozen rows of a few hundred logits. There the cost of a map is
the number of calls, not their arithmetic, and a NumPy call on a few hundred numbers costs a
fraction of a torch call's dispatch. [`sorted_rows`][mumoe_tn.gates.simplex_numpy.sorted_rows]
sorts each row once and takes the exact closed-form threshold of the sorted prefixes (the rule
the torch forms of [`mumoe_tn.gates.simplex_torch`][mumoe_tn.gates.simplex_torch] take), so the
result equals the ``entmax`` package's. Up to [`SCALAR_ROWS`][mumoe_tn.gates.simplex_numpy] rows
(a token's few expert modes) walk their sorted entries one by one while the rule holds, which for
a trained gate's support of a few entries costs less than the vectorised steps' fixed run of
calls; longer supports, more rows and non-finite rows take the vectorised steps.
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
import math

import numpy as np
import torch

from mumoe_tn.gates.simplex_torch import FLOOR

__all__ = [
    "NUMPY_DTYPES",
    "SCALAR_ROWS",
    "SCALAR_SUPPORT",
    "backward_factors",
    "factored_backward",
    "forward",
    "forward_keeping_factors",
    "sorted_rows",
]

#: Longest support the one-row walk follows entry by entry before it takes the vectorised steps on
#: the row it sorted: a step of the walk costs a few Python operations, the vectorised steps about
#: as much as forty of them.
SCALAR_SUPPORT = 24

#: Most rows that take the one-row walk each before the vectorised steps do.
SCALAR_ROWS = 4

#: The largest finite value of each NumPy float dtype the one-row walk takes.
_LARGEST = {
    np.dtype(np.float32): float(np.finfo(np.float32).max),
    np.dtype(np.float64): float(np.finfo(np.float64).max),
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
    """One row, its threshold found by walking the sorted entries (None where a value is not finite).

    The sorted-prefix rule holds for the entries of the support and fails at the first one after
    it, so the walk stops there; the sums are in float64 (Python floats). A support longer than
    `SCALAR_SUPPORT` takes the vectorised steps on the sorted row instead.
    """
    ordered = np.sort(row)[::-1]  # NaN sorts last, so first here; -inf last
    head = ordered[:SCALAR_SUPPORT].tolist()
    peak, lowest = head[0], float(ordered[-1])
    if not (math.isfinite(peak) and math.isfinite(lowest)) or peak - lowest > _LARGEST[row.dtype]:
        return None  # NaN or ±inf, or x − peak would overflow: the rows' steps handle those
    scale = 0.5 if entmax else 1.0
    total = total_sq = 0.0
    tau = 0.0
    for k, value in enumerate(head, 1):
        shifted = (value - peak) * scale
        total += shifted
        if entmax:  # the smaller root of Σ_{j≤k} (x_j − τ)² = 1
            total_sq += shifted * shifted
            mean = total / k
            candidate = mean - math.sqrt(max((1.0 - (total_sq - mean * total)) / k, 0.0))
            if candidate > shifted:
                break
        else:  # (Σ_{j≤k} x_j − 1) / k, below x_k on the support
            candidate = (total - 1.0) / k
            if candidate >= shifted:
                break
        tau = candidate
    else:
        if len(head) < len(ordered):  # the support may go on: the vectorised steps decide
            tau = _sorted_row_threshold(ordered, peak, entmax)
    return _mapped(row, peak, tau, entmax)


def _sorted_row_threshold(ordered: np.ndarray, peak: float, entmax: bool) -> float:
    """``τ`` of one finite row from its entries in descending order (the vectorised steps of one row)."""
    shifted = ordered - peak
    np.maximum(shifted, FLOOR, out=shifted)  # entries below the floor are outside the support
    count = _counts(len(ordered), ordered.dtype.str)
    if entmax:
        shifted *= 0.5
        total = np.add.accumulate(shifted)
        tau = total / count  # as in `_vectorised_rows`
        spread = tau * total
        spread -= np.add.accumulate(shifted * shifted)
        spread += 1
        spread /= count
        np.sqrt(np.maximum(spread, 0, out=spread), out=spread)
        tau -= spread
    else:
        tau = np.add.accumulate(shifted)
        tau -= 1
        tau /= count
    return float(tau[np.count_nonzero(tau <= shifted) - 1])


def _mapped(x: np.ndarray, peak: np.ndarray | float, tau: np.ndarray | float, entmax: bool) -> np.ndarray:
    """``(x − peak − τ)₊`` (sparsemax) or ``((x − peak)/2 − τ)₊²`` (1.5-entmax), as a new array."""
    y = x - peak  # shifted first: x − peak is exact where it matters (entries near the peak)
    if entmax:
        y *= 0.5
    y -= tau
    np.maximum(y, 0, out=y)
    if entmax:
        y *= y
    return y


def _vectorised_rows(rows: np.ndarray, entmax: bool) -> np.ndarray:
    ordered = np.sort(rows, axis=-1)[:, ::-1]  # NaN sorts last, so first here: it becomes the peak
    peak = ordered[:, :1]
    shifted = ordered - peak
    np.maximum(shifted, FLOOR, out=shifted)  # entries below the floor are outside the support
    count = _counts(rows.shape[-1], rows.dtype.str)
    if entmax:
        shifted *= 0.5
        total = np.add.accumulate(shifted, axis=-1)
        tau = total / count  # τ_k: the smaller root of Σ_{j≤k} (x_j − τ)² = 1, from the prefix sums
        spread = tau * total
        spread -= np.add.accumulate(shifted * shifted, axis=-1)
        spread += 1
        spread /= count
        np.sqrt(np.maximum(spread, 0, out=spread), out=spread)
        tau -= spread
    else:
        tau = np.add.accumulate(shifted, axis=-1)  # τ_k = (Σ_{j≤k} x_j − 1) / k
        tau -= 1
        tau /= count
    # (add.accumulate, add.reduce and a flat take: NumPy's quickest forms for a few short rows)
    support = np.add.reduce(tau <= shifted, axis=-1)  # 0 for a NaN row: a τ of another entry, unused
    width = rows.shape[-1]
    threshold = tau.ravel().take(np.arange(0, width * len(support), width) + (support - 1) % width)[:, None]
    y = _mapped(rows, peak, threshold, entmax)
    # peak − peak is 0 for a finite peak and NaN for NaN or ±inf: added to the result, it turns
    # exactly the rows softmax makes NaN into NaN and leaves the others unchanged.
    y += peak - peak
    return y


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
