"""Exact sparse simplex projections (sparsemax, 1.5-entmax) that ``torch.compile`` can trace.

The ``entmax`` package computes the same maps, but its autograd Functions define ``forward``
as a classmethod, which dynamo cannot trace when gradients are required (torch 2.13:
"Argument mismatch when attempting to trace function forward"). These versions use the same
closed-form, sort-based thresholds (Martins & Astudillo 2016; Peters, Niculae & Martins 2019)
and their known Jacobian-vector products, as static-method Functions; the test suite checks
them against ``entmax``.

Speed: on CPU in eager mode, a batch of up to [`SORTED_ROWS`][mumoe_tn.gates.entmax] rows (decoding,
small training batches; with gradients, up to [`SORTED_ELEMENTS`][mumoe_tn.gates.entmax] entries) is
sorted row by row in NumPy ([`sorted_forward`][mumoe_tn.gates.entmax.sorted_forward]): a fixed run
of cheap calls and no aten call in the forward. In larger batches no row is sorted at first. A few
Newton steps on the threshold equation ``Σ (x − τ)₊^(1/(α−1)) = 1``, from a ``τ`` below the root
(the equation's left side is convex and decreasing in ``τ``, so the steps approach the root from the
left and never pass it), settle the support of most rows; the closed-form threshold of that support
is then checked against it and kept only where the support it implies is the same, which makes it
the exact threshold. The other rows fall back to the sorted thresholds of their ``k`` largest logits
(``torch.topk``, cheaper than a full sort), recomputed with a larger ``k`` while the support could
extend past it. Sorting a ``(2048, 64)`` batch of rows costs more on CPU than the elementwise Newton
steps. The eager steps use floating-point arithmetic only: supports are counted as
``Σ sign((x − τ)₊)`` and the closed form is taken from the sums of the excess ``(x − τ)₊`` (shifted by ``τ``),
because on CPU (torch 2.13) a comparison and a sum of booleans, ``masked_fill`` or ``torch.where``
over a ``(2048, 64)`` batch each take 5–10 times a float ``sub`` or ``sum``. For the same reason the
backward of 1.5-entmax takes ``√y`` as ``√(y + z) − z`` with ``z = 1`` off the support: ``sqrt`` of
zeros runs about 8 times slower on CPU than of positive numbers, and the form keeps second
derivatives finite. Under ``torch.compile`` and ``torch.func`` transforms, and on every device but
the CPU, the full sort is used: the fallbacks are data-dependent control flow, which cannot be
traced, and which on an accelerator makes the host wait for the device at every call. Either search
runs in float32 for half-precision inputs, whose sums cannot count the support of a wide row. The
Functions define ``setup_context`` and generate their vmap rule, so ``torch.func`` (``vmap``,
``grad``, ``jacrev``, …) works through them.

On CUDA tensors, when Triton is importable, ``entmax15`` and ``sparsemax`` run instead as one
kernel per direction, with the same exact thresholds found without a sort or a host read
([`mumoe_tn.gates.triton_kernels`][mumoe_tn.gates.triton_kernels]; switched by
[`mumoe_tn.gates.kernels`][mumoe_tn.gates.kernels]).

Non-finite logits behave as in ``torch.softmax``: a row holding NaN or ``+inf`` (or only
``-inf``) gives NaN in that row only, and ``-inf`` entries of other rows get probability 0.
Huge finite logits (``3e38``) do not overflow: after subtracting the row maximum, entries
below [`FLOOR`][mumoe_tn.gates.entmax] are clamped to it. That is exact, because every entry of the support lies
within 1 (sparsemax) or 2 (1.5-entmax) of the maximum, so a clamped entry stays outside the
support and leaves the threshold unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch.autograd import Function

from mumoe_tn.gates import kernels

__all__ = ["entmax15", "inference_map", "sorted_forward", "sparsemax"]


#: Size of the first partial sort in eager mode: supports of trained gates are small, and a
#: partial sort of 16 costs about half a full sort of 64 on CPU.
FIRST_K = 16

#: Newton steps on the threshold before the support they imply is checked (eager mode). With
#: BatchNorm-scaled logits four steps settle all but about one row in a thousand (64 or 256 experts).
NEWTON_STEPS = 4

#: Floor of the max-shifted logits; the supports of both maps lie within 2 of the maximum.
FLOOR = -4.0

#: Rows up to which a CPU forward pass in eager mode sorts every row in one pass (see
#: [`sorted_forward`][mumoe_tn.gates.entmax.sorted_forward]): fewer, cheaper calls than the Newton search.
#: With gradients the autograd Functions take it too (up to `SORTED_ELEMENTS` entries) and keep
#: their closed-form backward.
SORTED_ROWS = 64

#: Entries up to which the autograd Functions' CPU forward sorts (and at most `SORTED_ROWS` rows):
#: measured fwd+bwd, sorting took 0.3–0.7× the Newton search's time up to 64 rows of 128 and
#: about 1.3× at 64 rows of 256 (1.5-entmax).
SORTED_ELEMENTS = 8192


class _Map(NamedTuple):
    """How one sparse map finds its threshold: sorted-prefix rule, Newton step, closed form."""

    rule: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    newton_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    closed_form: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest entries of every row of the 2-D ``x``, in descending order."""
    if k >= x.shape[-1]:
        return torch.sort(x, dim=-1, descending=True)[0]
    return torch.topk(x, k, dim=-1, sorted=True)[0]


def _prefix_threshold(rows: torch.Tensor, k: int, rule) -> tuple[torch.Tensor, torch.Tensor]:
    """``τ`` of every row from its ``k`` largest entries, and the support size found."""
    candidates, inside = rule(_largest(rows, k), -1)
    support = inside.sum(dim=-1, keepdim=True)
    return candidates.gather(-1, support - 1), support


def _sorted_threshold(rows: torch.Tensor, k: int, rule) -> torch.Tensor:
    """``τ`` of every row of the 2-D ``rows`` from sorted prefixes, starting with the ``k`` largest.

    When the whole partial sort of a row is inside the support, the true support may be longer:
    only those rows are redone, with twice the ``k``.
    """
    size = rows.shape[-1]
    tau, support = _prefix_threshold(rows, k, rule)
    while k < size:
        redo = (support == k).squeeze(-1).nonzero().squeeze(-1)
        if redo.numel() == 0:
            break
        k = min(2 * k, size)
        tau_redone, support_redone = _prefix_threshold(rows.index_select(0, redo), k, rule)
        tau = tau.index_copy(0, redo, tau_redone)
        support = support.index_copy(0, redo, support_redone)
    return tau


def _newton_threshold(rows: torch.Tensor, sparse_map: _Map) -> tuple[torch.Tensor, torch.Tensor]:
    """``τ`` of every row of the 2-D, max-shifted ``rows``, and which rows it is exact for.

    Starts at ``τ = −1`` (the maximum, 0, alone gives mass ≥ 1 there), takes
    [`NEWTON_STEPS`][mumoe_tn.gates.entmax] steps, then computes the closed-form threshold of the
    support ``{x > τ}``. A row's threshold is exact when that support is the one it implies.
    """
    tau = rows.new_full((rows.shape[0], 1), -1.0)
    for _ in range(NEWTON_STEPS):
        tau = sparse_map.newton_step(rows, tau)
    excess = (rows - tau).clamp_(min=0)
    count = excess.sign().sum(dim=-1, keepdim=True)  # ≥ 1 in exact arithmetic: τ stays below the maximum 0
    exact = sparse_map.closed_form(tau, excess, count)
    # {x > τ} and {x > exact} are both upper sets of the row, so they agree when their sizes do.
    # A NaN τ counts no entry on either side (sign(NaN) is 0): such a row is not settled.
    count = count.squeeze(-1)
    settled = ((rows - exact).clamp_(min=0).sign_().sum(dim=-1) == count) & (count > 0)
    return exact, settled


def _threshold(x: torch.Tensor, dim: int, sparse_map: _Map) -> torch.Tensor:
    """The exact threshold ``τ`` along ``dim`` of the max-shifted ``x``."""
    size = x.shape[dim]
    rows = x.movedim(dim, -1).reshape(-1, size)
    # Half-precision sums of a wide row lose its support counts (bfloat16 rounds 5000 to 4992)
    # and can push τ onto the maximum; the search runs in float32 and τ is rounded back.
    search = rows.float() if rows.dtype in (torch.float16, torch.bfloat16) else rows
    if _without_host_checks(rows):
        tau = _sorted_threshold(search, size, sparse_map.rule)
    else:
        tau, settled = _newton_threshold(search, sparse_map)
        redo = (~settled).nonzero().squeeze(-1)
        if redo.numel():
            redone = _sorted_threshold(search.index_select(0, redo), min(FIRST_K, size), sparse_map.rule)
            tau = tau.index_copy(0, redo, redone)
    tau = tau.to(rows.dtype)
    shape = list(x.movedim(dim, -1).shape)
    shape[-1] = 1
    return tau.reshape(shape).movedim(-1, dim)


def _shifted(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` minus its row maximum, floored at [`FLOOR`][mumoe_tn.gates.entmax], and the rows softmax makes NaN.

    A row is bad when the shift yields NaN: a NaN entry, ``+inf`` (``inf - inf``) or only
    ``-inf``. Bad rows are replaced by zeros so the threshold search stays in bounds.
    """
    peak = x.amax(dim=dim, keepdim=True)  # NaN if the row holds one, ±inf if inf or only -inf
    shifted = (x - peak).clamp(min=FLOOR)
    bad = ~peak.isfinite()
    return _where_bad(bad, 0.0, shifted), bad


def _square_root(y: torch.Tensor) -> torch.Tensor:
    """``√y`` of the non-negative ``y``, exactly, as ``√(y + z) − z`` with ``z = 1`` where ``y = 0``.

    ``y + 0`` and ``√1 − 1`` are exact, so the value equals ``y.sqrt()``. The form avoids the square
    root of zeros, which CPU kernels take about 8 times slower (see the module notes), and its
    derivative is finite off the support (``1/2`` where ``√y`` has ``inf``), so double backward
    through the 1.5-entmax backward gives finite second derivatives instead of ``inf · 0 = NaN``.
    """
    off_support = 1 - y.sign()
    return (y + off_support).sqrt() - off_support


def _traced() -> bool:
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def _without_host_checks(x: torch.Tensor) -> bool:
    """Whether to take the full sort, with no step whose control flow reads values of ``x``.

    Under ``torch.compile`` and ``torch.func`` such steps cannot be traced. Off the CPU, reading a
    value on the host (``nonzero``, ``any``) waits for every kernel queued before it, so the host
    stops queueing ahead of the device: a sort per row costs less there than the stall.
    """
    return _traced() or x.device.type != "cpu"


def _where_bad(bad: torch.Tensor, value: float, y: torch.Tensor) -> torch.Tensor:
    """``value`` in the bad rows of ``y``; on CPU in eager mode ``y`` itself when no row is bad."""
    if not _without_host_checks(bad) and not bad.any():
        return y
    return torch.where(bad, value, y)


def _prefix(ordered: torch.Tensor, dim: int) -> torch.Tensor:
    shape = [1] * ordered.ndim
    shape[dim] = -1
    return torch.arange(1, ordered.shape[dim] + 1, device=ordered.device, dtype=ordered.dtype).view(shape)


def _sparsemax_rule(ordered: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rho = _prefix(ordered, dim)
    cumulative = ordered.cumsum(dim) - 1
    return cumulative / rho, rho * ordered > cumulative


def _entmax15_root(total: torch.Tensor, total_sq: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The smaller root ``τ`` of ``Σ_S (x − τ)² = 1`` from ``Σ_S x``, ``Σ_S x²`` and ``|S|``."""
    mean = total / count
    spread = total_sq - count * mean * mean
    return mean - torch.sqrt(torch.clamp((1 - spread) / count, min=0))


def _entmax15_rule(ordered: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    tau = _entmax15_root(ordered.cumsum(dim), (ordered * ordered).cumsum(dim), _prefix(ordered, dim))
    return tau, tau <= ordered


def _sparsemax_newton_step(rows: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    # f(τ) = Σ (x − τ)₊ − 1, f'(τ) = −#{x > τ}
    excess = (rows - tau).clamp_(min=0)
    return tau.addcdiv(excess.sum(dim=-1, keepdim=True) - 1, excess.sign_().sum(dim=-1, keepdim=True))


def _sparsemax_closed_form(tau: torch.Tensor, excess: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Threshold of the support ``S`` of ``excess = (x − τ)₊`` (``count = |S|``): ``(Σ_S x − 1) / |S|``."""
    return tau + (excess.sum(dim=-1, keepdim=True) - 1) / count


def _entmax15_newton_step(rows: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    # f(τ) = Σ (x − τ)₊² − 1, f'(τ) = −2 Σ (x − τ)₊
    excess = (rows - tau).clamp_(min=0)
    return tau.addcdiv((excess * excess).sum(dim=-1, keepdim=True) - 1, excess.sum(dim=-1, keepdim=True), value=0.5)


def _entmax15_closed_form(tau: torch.Tensor, excess: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Threshold of the support ``S`` of ``excess = (x − τ)₊``: the root in ``x − τ``, shifted back by ``τ``."""
    total = excess.sum(dim=-1, keepdim=True)
    return tau + _entmax15_root(total, (excess * excess).sum(dim=-1, keepdim=True), count)


_SPARSEMAX = _Map(_sparsemax_rule, _sparsemax_newton_step, _sparsemax_closed_form)
_ENTMAX15 = _Map(_entmax15_rule, _entmax15_newton_step, _entmax15_closed_form)


class _Sparsemax(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dim: int) -> torch.Tensor:
        x, bad = _shifted(x, dim)
        y = torch.clamp(x - _threshold(x, dim, _SPARSEMAX), min=0)
        return _where_bad(bad, torch.nan, y)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        inside = y.sign()  # y ≥ 0: 1 on the support, 0 off it (a float op, see the module notes)
        mean = (grad * inside).sum(ctx.dim, keepdim=True) / inside.sum(ctx.dim, keepdim=True)
        return (grad - mean) * inside, None


class _Entmax15(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dim: int) -> torch.Tensor:
        x, bad = _shifted(x, dim)
        x = x / 2
        y = torch.clamp(x - _threshold(x, dim, _ENTMAX15), min=0) ** 2
        return _where_bad(bad, torch.nan, y)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        root = _square_root(y)
        scaled = grad * root
        shift = scaled.sum(ctx.dim, keepdim=True) / root.sum(ctx.dim, keepdim=True)
        return scaled - shift * root, None


def sorted_forward(x: torch.Tensor, sparse_map: str) -> torch.Tensor:
    """Sparsemax or 1.5-entmax along the last dim of ``x`` by one full sort per row, without autograd.

    The path of a few rows (a batch of one to a few dozen tokens; the autograd Functions call it
    for their forward on CPU), where the cost is the number of calls, not their arithmetic. It is a fixed,
    short run of whole-array calls (one sort, two cumulative sums, the sorted-prefix threshold,
    one gather, the map) and no autograd Function. On CPU the rows are float32 or float64 arrays
    shared with NumPy, whose calls on a few hundred numbers cost about half of torch's dispatch
    (measured on a 256-wide row: about 50 µs against 140 µs for the same steps in torch, and
    180 µs for the ``entmax`` package); other devices run the same steps in torch. The threshold
    is the exact closed form of the sorted prefixes (as under ``torch.compile``), so the result
    equals the ``entmax`` package's (the tests compare them); rows with NaN or ``+inf`` (or only
    ``-inf``) give NaN in that row only, as in ``torch.softmax``.

    Parameters
    ----------
    x : torch.Tensor
        Logits ``(…, N)``.
    sparse_map : {"sparsemax", "entmax15"}
        Which map.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x``.
    """
    rows = x.detach().reshape(-1, x.shape[-1])
    dtype = rows.dtype
    if dtype is torch.float16 or dtype is torch.bfloat16:
        rows = rows.float()  # sums of a wide half-precision row cannot count its support
    entmax = sparse_map == "entmax15"
    if rows.device.type == "cpu" and (rows.dtype is torch.float32 or rows.dtype is torch.float64):
        y = torch.from_numpy(_numpy_sorted_map(rows.numpy(), entmax))
    else:
        y = _torch_sorted_map(rows, entmax)
    if y.dtype is not dtype:
        y = y.to(dtype)
    return y if x.ndim == 2 else y.reshape(x.shape)


#: Longest support the one-row path walks element by element before it takes the vectorised steps.
SCALAR_SUPPORT = 64

#: The largest finite value of each NumPy float dtype the one-row path takes.
_LARGEST = {
    np.dtype(np.float32): float(np.finfo(np.float32).max),
    np.dtype(np.float64): float(np.finfo(np.float64).max),
}

#: Most rows that take the one-row path each (a token's few expert modes) before the vectorised steps do.
SCALAR_ROWS = 4


def inference_map(activation: Callable[..., torch.Tensor], x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``activation`` along the last dim for logits like ``x`` without gradients, in its quickest form.

    For [`entmax15`][mumoe_tn.gates.entmax.entmax15] and [`sparsemax`][mumoe_tn.gates.entmax.sparsemax]
    on up to [`SORTED_ROWS`][mumoe_tn.gates.entmax] float32 or float64 rows on the CPU, where no
    Triton kernel serves them, the decision that every call of those functions makes (kernels,
    sorted path, NumPy, dtype) is taken here once: the map returned goes straight to the NumPy
    steps of [`sorted_forward`][mumoe_tn.gates.entmax.sorted_forward] (a few microseconds less a
    call, which is most of a one-token call's gate). Any other activation or input: ``activation``.

    Parameters
    ----------
    activation : Callable
        The gate's φ.
    x : torch.Tensor
        Logits ``(…, N)`` like those of the calls the map will serve (same shape, dtype and device).

    Returns
    -------
    Callable
        Maps logits like ``x`` to coefficients, equal to ``activation(logits)``.
    """
    if activation is entmax15 or activation is sparsemax:
        rows = x.numel() // x.shape[-1] if x.ndim and x.shape[-1] else 0
        quick = 0 < rows <= SORTED_ROWS and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
        if quick and not kernels.gate_kernels_apply(x):
            return functools.partial(_cpu_rows_map, entmax=activation is entmax15)
    return activation


def _cpu_rows_map(x: torch.Tensor, entmax: bool) -> torch.Tensor:
    """[`sorted_forward`][mumoe_tn.gates.entmax.sorted_forward] of CPU float logits ``(…, N)`` (no gradient)."""
    rows = x.numpy()
    y = _numpy_sorted_map(rows.reshape(-1, rows.shape[-1]), entmax)  # (NumPy copies a strided view if it must)
    return torch.from_numpy(y.reshape(rows.shape))


def _numpy_sorted_map(rows: np.ndarray, entmax: bool) -> np.ndarray:
    """[`sorted_forward`][mumoe_tn.gates.entmax.sorted_forward] on a 2-D float array (a new array)."""
    if 0 < rows.shape[0] <= SCALAR_ROWS:
        singles = [_single_row(row, entmax) for row in rows]  # None for a non-finite row too: the rows' steps
        if all(single is not None for single in singles):
            return singles[0][None] if len(singles) == 1 else np.stack(singles)
    # NaN rows are meant, and x − peak of a finite row may overflow to −inf (below the floor all
    # the same): NumPy need not warn
    with np.errstate(invalid="ignore", over="ignore"):
        return _numpy_sorted_rows(rows, entmax)


def _single_row(row: np.ndarray, entmax: bool) -> np.ndarray | None:
    """One row, its threshold found by walking the sorted entries (None past `SCALAR_SUPPORT` or not finite).

    The sorted-prefix rule holds for the entries of the support and fails at the first one after
    it, so the walk stops there: a trained gate's support is a few entries, which costs less than
    the vectorised steps' fixed run of calls. The sums are in float64 (Python floats).
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
        if len(head) < len(ordered):
            return None  # the support may go on: the vectorised steps decide
    return _numpy_map(row, peak, tau, entmax)


def _numpy_map(x: np.ndarray, peak: np.ndarray | float, tau: np.ndarray | float, entmax: bool) -> np.ndarray:
    """``(x − peak − τ)₊`` (sparsemax) or ``((x − peak)/2 − τ)₊²`` (1.5-entmax), as a new array."""
    y = x - peak  # shifted first: x − peak is exact where it matters (entries near the peak)
    if entmax:
        y *= 0.5
    y -= tau
    np.maximum(y, 0, out=y)
    if entmax:
        y *= y
    return y


def _numpy_sorted_rows(rows: np.ndarray, entmax: bool) -> np.ndarray:
    ordered = np.sort(rows, axis=-1)[:, ::-1]  # NaN sorts last, so first here: it becomes the peak
    peak = ordered[:, :1]
    shifted = ordered - peak
    np.maximum(shifted, FLOOR, out=shifted)  # entries below the floor are outside the support
    count = _numpy_counts(rows.shape[-1], rows.dtype.str)
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
    y = _numpy_map(rows, peak, threshold, entmax)
    # peak − peak is 0 for a finite peak and NaN for NaN or ±inf: added to the result, it turns
    # exactly the rows softmax makes NaN into NaN and leaves the others unchanged.
    y += peak - peak
    return y


def _torch_sorted_map(rows: torch.Tensor, entmax: bool) -> torch.Tensor:
    """[`sorted_forward`][mumoe_tn.gates.entmax.sorted_forward]'s steps in torch (any device)."""
    ordered = torch.sort(rows, dim=-1, descending=True)[0]  # NaN sorts first: it becomes the peak
    peak = ordered[:, :1]
    bad = peak - peak  # 0, or NaN for the rows softmax makes NaN (see _numpy_sorted_map)
    shifted = (ordered - peak).clamp_(min=FLOOR)
    if entmax:
        shifted = shifted.mul_(0.5)
    count = _counts(rows.shape[-1], rows.device, rows.dtype)
    total = shifted.cumsum(-1)
    if entmax:
        mean = total / count
        spread = torch.addcmul((shifted * shifted).cumsum(-1), mean, total, value=-1)
        tau = mean.sub_(spread.neg_().add_(1).div_(count).clamp_(min=0).sqrt_())
    else:
        tau = total.sub_(1).div_(count)
    support = (tau <= shifted).sum(dim=-1, keepdim=True).clamp_(min=1)  # a NaN row counts none
    threshold = tau.gather(-1, support.sub_(1))
    y = rows - peak  # shifted first: x − peak is exact where it matters (entries near the peak)
    if entmax:
        y = y.mul_(0.5).sub_(threshold).clamp_(min=0).square_()
    else:
        y = y.sub_(threshold).clamp_(min=0)
    return y.add_(bad)


@functools.lru_cache(maxsize=16)
def _numpy_counts(size: int, dtype: str) -> np.ndarray:
    """``[1, 2, …, size]`` (read-only; kept per size and dtype)."""
    counts = np.arange(1, size + 1, dtype=dtype)
    counts.flags.writeable = False
    return counts


@functools.lru_cache(maxsize=64)
def _counts(size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 2, …, size]`` as a row (small, kept per size, device and dtype)."""
    return torch.arange(1, size + 1, device=device, dtype=dtype)


def _sorted_applies(x: torch.Tensor, dim: int) -> bool:
    """Whether [`sorted_forward`][mumoe_tn.gates.entmax.sorted_forward] serves this call (see `SORTED_ROWS`)."""
    if x.requires_grad and torch.is_grad_enabled():
        return False
    if x.ndim == 0 or x.shape[dim] == 0 or x.numel() // x.shape[dim] > SORTED_ROWS:
        return False
    return x.is_floating_point() and not _traced()


def _eager_twin(rule: type[Function], name: str) -> type[Function]:
    """``rule`` with ``forward(ctx, …)``, for eager mode.

    ``Function.apply`` binds the arguments to ``forward``'s signature (``inspect.signature``, about
    0.1 ms a call) for every Function that defines ``setup_context``; this form skips that. It
    cannot run under ``torch.func`` transforms, where ``rule`` itself is used. On CPU, up to
    [`SORTED_ROWS`][mumoe_tn.gates.entmax] rows and [`SORTED_ELEMENTS`][mumoe_tn.gates.entmax] entries
    take [`sorted_forward`][mumoe_tn.gates.entmax.sorted_forward] (no aten call; the Newton search
    is 60–90 of them); float32 and float64 rows there also keep, as NumPy arrays, the factors of
    the closed-form backward (``√y`` and ``1/Σ√y`` for 1.5-entmax, the support and ``1/|S|`` for
    sparsemax), so a backward that builds no graph is four NumPy calls on those rows instead of
    the rule's eight torch calls (which the autograd engine runs at several times their
    standalone cost at these sizes). A backward that builds a graph (double backward) takes the
    rule's differentiable formula from ``y``.
    """
    entmax = name == "entmax15"

    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        size = x.shape[dim]
        ctx.factors = None
        if x.device.type == "cpu" and size and x.numel() // size <= SORTED_ROWS and x.numel() <= SORTED_ELEMENTS:
            last = dim == x.ndim - 1
            y = sorted_forward(x if last else x.movedim(dim, -1), name)
            if y.dtype is torch.float32 or y.dtype is torch.float64:
                ctx.factors = _backward_factors(y.numpy(), entmax)
            y = y if last else y.movedim(-1, dim)
        else:
            y = rule.forward(x, dim)
        rule.setup_context(ctx, (x, dim), y)
        return y

    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        factors = ctx.factors
        quick = factors is not None and not torch.is_grad_enabled() and grad.device.type == "cpu"
        if not quick or grad.dtype != ctx.saved_tensors[0].dtype:
            return rule.backward(ctx, grad)
        dim = ctx.dim
        last = dim == grad.ndim - 1
        rows = (grad if last else grad.movedim(dim, -1)).numpy()
        factor, scale = factors
        scaled = rows * factor  # a new array: grad itself is never written to
        shift = np.add.reduce(scaled, axis=-1, keepdims=True)
        shift *= scale
        scaled -= shift * factor  # sparsemax's (g − mean_S g)·1_S is the same form, its factor 1_S
        result = torch.from_numpy(scaled)
        return (result if last else result.movedim(-1, dim)), None

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(f"{rule.__name__}Eager", (Function,), namespace)


def _backward_factors(y: np.ndarray, entmax: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """``(√y, 1/Σ√y)`` (1.5-entmax) or ``(1 on the support, 1/|S|)`` (sparsemax) of the rows ``y``, in NumPy.

    ``√y`` as the rule's backward computes it (the square root of a square is exact). None where a
    row is not finite (a NaN row): the rule's backward handles those.
    """
    with np.errstate(invalid="ignore"):
        factor = np.sqrt(y) if entmax else (y > 0).astype(y.dtype)
        total = np.add.reduce(factor, axis=-1, keepdims=True)
    if not (total > 0).all():  # (NaN compares false)
        return None
    return factor, np.reciprocal(total, out=total)


_SparsemaxEager = _eager_twin(_Sparsemax, "sparsemax")
_Entmax15Eager = _eager_twin(_Entmax15, "entmax15")


def _kernel_map(x: torch.Tensor, dim: int, entmax: bool) -> torch.Tensor:
    """The map as Triton kernels (see [`mumoe_tn.gates.kernels`][mumoe_tn.gates.kernels]), along any ``dim``."""
    if dim in (-1, x.ndim - 1):
        return kernels.sparse_map(x, entmax)
    return kernels.sparse_map(x.movedim(dim, -1), entmax).movedim(-1, dim)


def sparsemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax: the Euclidean projection of ``x`` onto the probability simplex along ``dim``.

    Parameters
    ----------
    x : torch.Tensor
        Logits.
    dim : int, optional
        Dimension to normalise (default last).

    Returns
    -------
    torch.Tensor
        Non-negative, summing to one along ``dim``; exactly zero below the threshold.
    """
    if kernels.gate_kernels_apply(x):
        return _kernel_map(x, dim, entmax=False)
    if _sorted_applies(x, dim):
        if dim in (-1, x.ndim - 1):
            return sorted_forward(x, "sparsemax")
        return sorted_forward(x.movedim(dim, -1), "sparsemax").movedim(-1, dim)
    return (_Sparsemax if _traced() else _SparsemaxEager).apply(x, dim % x.ndim)


def entmax15(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """1.5-entmax: ``argmax_p <x, p> + H_1.5(p)`` over the simplex, in closed form (exact).

    Parameters
    ----------
    x : torch.Tensor
        Logits.
    dim : int, optional
        Dimension to normalise (default last).

    Returns
    -------
    torch.Tensor
        ``[(x/2 − τ)_+]²``, summing to one along ``dim``.
    """
    if kernels.gate_kernels_apply(x):
        return _kernel_map(x, dim, entmax=True)
    if _sorted_applies(x, dim):
        if dim in (-1, x.ndim - 1):
            return sorted_forward(x, "entmax15")
        return sorted_forward(x.movedim(dim, -1), "entmax15").movedim(-1, dim)
    return (_Entmax15 if _traced() else _Entmax15Eager).apply(x, dim % x.ndim)
