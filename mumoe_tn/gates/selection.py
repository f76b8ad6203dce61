"""Keeping each row's top ``k`` entries, fast on the CPU; and the rows holding a non-finite entry.

A top-k gate or a TopK activation keeps the entries ``torch.topk(x, k, dim=-1)`` selects and
zeroes the rest. [`keep_top_k`][mumoe_tn.gates.selection.keep_top_k] (``x`` there, 0 elsewhere,
optionally through a ReLU), [`top_k_logits`][mumoe_tn.gates.selection.top_k_logits] (``x``
there, ``-inf`` elsewhere: a softmax over them is the softmax over the top ``k``) and
[`top_k_mask`][mumoe_tn.gates.selection.top_k_mask] (booleans) give the same values and
gradients as ``topk`` → ``scatter`` (up to the sign of a zero, and the rounding of a softmax's
sum), as one elementwise product where ``scatter`` gathers and scatters the kept entries forward
and back.

On the CPU, torch's ``topk`` selects with ``std::nth_element`` over ``(value, index)`` pairs
(once ``64·k > N``, otherwise a heap): about 5 µs per row of 512 floats, 2 µs per row of 256 —
the largest part of a small replacement's distillation step. NumPy's ``partition`` (a
vectorised quickselect) finds every row's ``k``-th largest value ``t`` in about a fifth of that
time; ``x ≥ t`` then marks the row's top ``k``, read from the sign of ``x − t`` (exact for finite
floats: ``x − t`` is 0 only where ``x = t``) and applied as a 0/1 factor or a 0/−inf term —
elementwise arithmetic, several times faster than torch's boolean ``where`` on the CPU. That is
torch's selection whenever the selection is unique. In a row whose ``k``-th and ``k+1``-th
largest values tie, ``topk`` picks among the tied entries: such a tensor, one with a non-finite
entry, other dtypes and devices, and short rows take ``torch.topk`` and ``scatter``.

[`nan_rows`][mumoe_tn.gates.selection.nan_rows] marks the rows with a non-finite entry by a
row minimum and maximum, instead of ``isfinite(x).all(-1)``'s four passes.
"""

from __future__ import annotations

import math

import numpy
import torch

__all__ = ["check_top_k", "keep_top_k", "nan_rows", "partition_applies", "top_k_logits", "top_k_mask", "top_k_rows"]

#: The dtypes NumPy partitions as torch orders them.
_PARTITIONED = (torch.float32, torch.float64)

#: The integer type of each float width, and back.
_INTEGERS = {4: numpy.int32, 8: numpy.int64}
_FLOATS = {4: numpy.float32, 8: numpy.float64}

#: Rows shorter than this take ``torch.topk`` (NumPy's call costs more than it saves).
_MIN_ROW = 128


def partition_applies(x: torch.Tensor, k: int) -> bool:
    """Whether NumPy's partition may select ``x``'s top ``k`` (faster than ``torch.topk``).

    On CPU float32/float64 rows of at least 128 entries in eager mode (not under ``torch.compile``
    or ``torch.func``); a tie at the ``k``-th value or a non-finite entry still sends a call to
    ``torch.topk`` once the values are read.

    Parameters
    ----------
    x : torch.Tensor
        ``(…, N)``.
    k : int
        Entries per row.

    Returns
    -------
    bool
    """
    n = x.shape[-1]
    return (
        x.dtype in _PARTITIONED
        and x.device.type == "cpu"
        and x.numel() > 0
        and n >= _MIN_ROW
        and k < n
        and not torch._C._are_functorch_transforms_active()
        and not torch.compiler.is_compiling()
    )


def _order_keys(values: numpy.ndarray) -> numpy.ndarray:
    """The floats' bits as integers that order as the floats do, or back (the map is its own inverse).

    IEEE 754 floats of one sign order as their bits read as integers; flipping the magnitude bits
    of the negatives puts those in order too. NumPy partitions the integers in half the time.
    """
    if values.dtype.kind == "i":
        integers, back = values, _FLOATS[values.dtype.itemsize]
    else:
        integers, back = values.view(_INTEGERS[values.dtype.itemsize]), None
    magnitude = numpy.iinfo(integers.dtype).max
    flipped = integers ^ ((integers >> (8 * integers.dtype.itemsize - 1)) & magnitude)
    return flipped if back is None else flipped.view(back)


def _partition_sign(x: torch.Tensor, k: int, positive: bool) -> torch.Tensor | None:
    """``sign(x − t)`` in ``x``'s dtype, ``t`` each row's ``k``-th largest value: ≥ 0 exactly at the row's top ``k``.

    With ``positive``, ``t`` is at least the least positive float (the top ``k`` that are > 0).
    None when ``x`` holds a non-finite value or a row's ``k``-th and ``k+1``-th largest tie.
    """
    if not _finite_sum(x):
        return None
    n = x.shape[-1]
    keys = _order_keys(x.reshape(-1, n).contiguous().numpy())
    ordered = numpy.partition(keys, n - k, axis=-1)  # ordered[:, n - k]: the k-th largest of each row
    kth, below = _order_keys(ordered[:, n - k]), _order_keys(ordered[:, : n - k].max(axis=-1))
    if (below == kth).any():  # the k+1-th largest ties with the k-th (compared as floats: -0.0 == 0.0)
        return None
    if positive:  # x ≥ the least positive float: x > 0, in the same comparison
        kth = numpy.maximum(kth, numpy.nextafter(kth.dtype.type(0), kth.dtype.type(1)))
    return (x - torch.from_numpy(kth).reshape(*x.shape[:-1], 1)).sign_()


def check_top_k(x: torch.Tensor, k: int) -> None:
    """Require ``k`` to be an int in ``[1, N]`` for the rows ``(…, N)`` of ``x`` (ValueError otherwise)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= max(x.shape[-1], 1):
        raise ValueError(f"k must be an int in [1, {x.shape[-1]}] (the last dim of x), got k={k!r}")


def top_k_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """Booleans shaped as ``x``: True at the ``k`` entries of each row that ``torch.topk(x, k, dim=-1)`` selects.

    Parameters
    ----------
    x : torch.Tensor
        ``(…, N)``.
    k : int
        Entries per row, ``1 ≤ k ≤ N``.

    Returns
    -------
    torch.Tensor
        ``(…, N)`` booleans.
    """
    check_top_k(x, k)
    x = x.detach()
    sign = _partition_sign(x, k, False) if partition_applies(x, k) else None
    if sign is not None:
        return sign >= 0
    indices = torch.topk(x, k, dim=-1, sorted=False).indices
    return torch.zeros_like(x, dtype=torch.bool).scatter_(-1, indices, True)


def keep_top_k(x: torch.Tensor, k: int, *, relu: bool = False, mark_non_finite: bool = False) -> torch.Tensor:
    """``x`` at each row's top ``k`` entries (as ``torch.topk`` selects them), 0 elsewhere; differentiable.

    Parameters
    ----------
    x : torch.Tensor
        ``(…, N)``.
    k : int
        Entries per row, ``1 ≤ k ≤ N``.
    relu : bool, optional
        Pass the kept entries through a ReLU (a negative kept entry becomes 0).
    mark_non_finite : bool, optional
        A row of ``x`` holding a NaN or an infinity comes out all NaN (a gate's rule).

    Returns
    -------
    torch.Tensor
        Shaped as ``x``.
    """
    check_top_k(x, k)
    detached = x.detach()
    sign = _partition_sign(detached, k, relu) if partition_applies(detached, k) else None
    if sign is not None:  # sign + 1 clamped to 1: 1 at the top k, 0 elsewhere (x is finite)
        return x * sign.add_(1).clamp_max_(1)
    values, indices = torch.topk(x, k, dim=-1, sorted=False)
    kept = torch.zeros_like(x).scatter_(-1, indices, torch.relu(values) if relu else values)
    return kept + nan_rows(detached) if mark_non_finite and _may_hold_non_finite(detached) else kept


def top_k_logits(x: torch.Tensor, k: int, *, mark_non_finite: bool = False) -> torch.Tensor:
    """``x`` at each row's top ``k`` entries, ``-inf`` elsewhere: a softmax of it is the softmax over the top ``k``.

    Parameters
    ----------
    x : torch.Tensor
        ``(…, N)`` logits.
    k : int
        Entries per row, ``1 ≤ k ≤ N``.
    mark_non_finite : bool, optional
        A row of ``x`` holding a NaN or an infinity comes out all NaN (so does its softmax).

    Returns
    -------
    torch.Tensor
        Shaped as ``x``; gradients reach the kept entries.
    """
    check_top_k(x, k)
    detached = x.detach()
    sign = _partition_sign(detached, k, False) if partition_applies(detached, k) else None
    if sign is not None:  # min(sign, 0)·max·2: 0 at the top k, -inf elsewhere (never 0·inf; x is finite)
        return x + sign.clamp_max_(0).mul_(torch.finfo(x.dtype).max).mul_(2)
    values, indices = torch.topk(x, k, dim=-1, sorted=False)
    kept = torch.full_like(x, -math.inf).scatter_(-1, indices, values)
    return kept + nan_rows(detached) if mark_non_finite and _may_hold_non_finite(detached) else kept


def top_k_rows(x: torch.Tensor, k: int, *, softmax: bool) -> torch.Tensor | None:
    """The top-k maps of CPU float32/float64 logits without autograd, all in NumPy; None where torch decides.

    ``softmax``: the softmax of each row's top ``k`` logits, 0 elsewhere; else the top ``k``
    through a ReLU, 0 elsewhere. The selection is ``torch.topk``'s wherever it is unique; a row
    whose ``k``-th and ``k+1``-th largest tie (``topk`` picks among the tied entries) or a
    non-finite entry gives None, and the caller takes the torch form.

    Parameters
    ----------
    x : torch.Tensor
        ``(…, N)`` CPU float32 or float64 logits that do not require gradients.
    k : int
        Entries per row, ``1 ≤ k ≤ N``.
    softmax : bool
        The softmax top-k map when True, the ReLU top-k map when False.

    Returns
    -------
    torch.Tensor or None
        A new tensor shaped as ``x``, or None.
    """
    check_top_k(x, k)
    values = x.numpy()
    n = values.shape[-1]
    rows = values.reshape(-1, n)
    if rows.size == 0 or not math.isfinite(numpy.add.reduce(rows, axis=None)):
        return None  # (a sum that overflows only sends the call to torch)
    if k < n:
        ordered = numpy.partition(rows, n - k, axis=-1)  # ordered[:, n - k]: the k-th largest of each row
        kth = ordered[:, n - k : n - k + 1]
        if (ordered[:, : n - k].max(axis=-1, keepdims=True) == kth).any():
            return None
        kept = rows >= kth
    else:
        kept = True
    if softmax:
        y = rows - rows.max(axis=-1, keepdims=True)
        numpy.exp(y, out=y)
        y *= kept
        y /= numpy.add.reduce(y, axis=-1, keepdims=True)
    else:
        y = numpy.maximum(rows, 0)
        y *= kept
    return torch.from_numpy(y.reshape(values.shape))


def _finite_sum(x: torch.Tensor) -> bool:
    """Whether the sum of ``x`` is finite: then every entry is (a NaN or an infinity makes it NaN or infinite).

    One reduction, where ``isfinite(x).all()`` takes five passes; a sum that overflows only sends
    the caller down its general path.
    """
    return math.isfinite(x.sum().item())


def _may_hold_non_finite(x: torch.Tensor) -> bool:
    """False where ``x`` is on the CPU and finite (elsewhere reading it would wait for the device)."""
    if x.device.type != "cpu" or x.numel() == 0 or torch.compiler.is_compiling():
        return True
    return not _finite_sum(x)


def nan_rows(x: torch.Tensor) -> torch.Tensor:
    """``(…, 1)``: 0 where the row of ``x`` is finite, NaN where it holds a NaN or an infinity (no gradient)."""
    x = x.detach()
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)  # two passes beat aminmax's one
    return (low - low) + (high - high)  # x - x: 0 for a finite x, NaN for ±inf and NaN
