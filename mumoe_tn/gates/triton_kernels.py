"""Gate activations as Triton kernels: one launch per direction for entmax15, sparsemax and the top-k gates.

Why hand-written kernels: on a GPU a gate's activation is a few hundred numbers per token, so its
cost is the number of launches, not their arithmetic. Counted as aten calls that compute (views left
out) on a ``(64, 64)`` batch, the ``entmax`` package's 1.5-entmax is 25 forward and 7 backward (its
sparsemax 15 and 9); the torch form of
[`mumoe_tn.gates.simplex_torch`][mumoe_tn.gates.simplex_torch] off the CPU (one full sort) is 28 and 11
(sparsemax 17 and 7); a top-k router's ``topk``, ``softmax``, ``scatter``,
``isfinite``, ``where`` … are 11 and 6. Each is a kernel launch the host must queue. Here each
direction of each map is one kernel: one program per row reads the row, finds the threshold and
writes the coefficients; the backward reads the coefficients and the incoming gradient and writes
the closed-form vector-Jacobian product.

**Exact thresholds without a sort.** A row is walked in tiles of at most ``MAX_BLOCK`` columns, so
any row length works, and every step is a pass of sums over the row in float32 (bfloat16 and
float16 inputs are read in float32 and the result rounded back). On the max-shifted row (scaled by
1/2 for 1.5-entmax) the threshold ``τ`` solves ``Σ (x − τ)₊^(1/(α−1)) = 1``; its left side is convex
and decreasing in ``τ``, and ``τ = −1`` lies below the root. Each step takes the support
``S = {x > τ}`` and the closed-form threshold of ``S`` (sparsemax: ``(Σ_S x − 1)/|S|``; 1.5-entmax:
the smaller root of ``Σ_S (x − t)² = 1``). When that threshold is at most every entry of ``S``,
``S`` is the support (the sorted-prefix rule holds exactly on a prefix of the sorted row) and the
threshold is exact — the same closed form the sorting algorithms take. Otherwise ``τ`` takes a
Newton step, which from below the root of a convex decreasing function never passes it. For
sparsemax the Newton step is the closed form itself (Michelot's algorithm): the support shrinks at
every step, so a row of ``N`` entries takes at most ``N`` steps. For 1.5-entmax the Newton steps
converge quadratically onto the last piece of the piecewise-quadratic equation. On Gaussian rows of
16–1,024 logits (scales 0.3–10) either map took 1–9 steps, fewer the peakier the row.
A step that makes no progress (a rounding-level stall) ends the search with the closed form of the
current support. The loops run on the device with no host read, so the launch is asynchronous and
capturable in a CUDA graph. An in-register sort would bound the row length by the register file
and cost ``O(N log² N)`` compare-exchanges where the steps cost a few passes of sums.

**Top-k without a sort.** The ``k``-th largest logit is found by walking the row's distinct values
downwards from its maximum (one pass each, counting ties), at most ``k`` passes for a router's small
``k``; ties at the ``k``-th value are kept lowest index first, so every row keeps exactly ``k``
entries. The softmax router renormalises the kept logits; the ReLU router keeps their positive
parts.

Non-finite logits follow the torch paths: a row holding NaN or ``+inf`` (or only ``-inf``) maps to
NaN for entmax15 and sparsemax, and ``-inf`` entries of other rows get 0; the top-k gates give NaN
in a row holding any non-finite logit, with a zero gradient there, as their torch forms do.

The kernels are registered as ``torch.library`` custom operators with fake (meta) implementations
and autograd formulas, so ``torch.compile`` traces through them without graph breaks. Triton is an
optional dependency: this module imports without it (``AVAILABLE`` is then False) and
[`mumoe_tn.gates.kernels`][mumoe_tn.gates.kernels] decides when the kernels run.
"""

from __future__ import annotations

import torch

from mumoe_tn.gates.selection import check_top_k

try:
    import triton
    import triton.language as tl
except ImportError:  # an optional dependency: the torch paths serve every device without it
    triton = None

__all__ = ["AVAILABLE", "MAX_BLOCK", "MAX_STEPS", "relu_top_k", "sparse_map", "top_k_softmax"]

#: Whether Triton is importable (the operators below exist either way; they need it to run).
AVAILABLE = triton is not None

#: Columns one program reads at a time; longer rows are walked in tiles of this many.
MAX_BLOCK = 1024

#: Bound on the threshold steps of one row, a guard only: rows settle in a handful of steps.
MAX_STEPS = 64


if AVAILABLE:

    @triton.jit
    def _row_peak(x_row, n_cols, BLOCK: tl.constexpr):
        """The row's maximum and whether it is bad (NaN, ``+inf`` or only ``-inf``)."""
        cols = tl.arange(0, BLOCK)
        peak = tl.full([], float("-inf"), tl.float32)
        nans = tl.full([], 0, tl.int32)
        for start in range(0, n_cols, BLOCK):
            index = start + cols
            x = tl.load(x_row + index, mask=index < n_cols, other=float("-inf")).to(tl.float32)
            peak = tl.maximum(peak, tl.max(x, axis=0))
            nans += tl.sum((x != x).to(tl.int32), axis=0)
        bad = (nans > 0) | (peak == float("inf")) | (peak == float("-inf"))
        return tl.where(bad, 0.0, peak), bad

    @triton.jit
    def _sparse_map_forward_kernel(
        x_ptr, y_ptr, n_cols, x_stride, y_stride, max_steps, ENTMAX: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        y_row = y_ptr + row * y_stride
        cols = tl.arange(0, BLOCK)
        peak, bad = _row_peak(x_row, n_cols, BLOCK)
        scale = 0.5 if ENTMAX else 1.0
        tau = tl.full([], -1.0, tl.float32)
        steps = tl.full([], 0, tl.int32)
        searching = bad == 0
        while searching:
            count = tl.full([], 0.0, tl.float32)
            total = tl.full([], 0.0, tl.float32)
            total_sq = tl.full([], 0.0, tl.float32)
            lowest = tl.full([], float("inf"), tl.float32)
            for start in range(0, n_cols, BLOCK):
                index = start + cols
                x = tl.load(x_row + index, mask=index < n_cols, other=float("-inf")).to(tl.float32)
                excess = (x - peak) * scale - tau
                inside = excess > 0
                kept = tl.where(inside, excess, 0.0)
                count += tl.sum(inside.to(tl.float32), axis=0)
                total += tl.sum(kept, axis=0)
                total_sq += tl.sum(kept * kept, axis=0)
                lowest = tl.minimum(lowest, tl.min(tl.where(inside, excess, float("inf")), axis=0))
            if ENTMAX:
                mean = total / count
                closed = mean - tl.sqrt(tl.maximum((1.0 - (total_sq - total * mean)) / count, 0.0))
                newton = (total_sq - 1.0) / (2.0 * total)
            else:
                closed = (total - 1.0) / count
                newton = closed
            steps += 1
            searching = (closed > lowest) & (newton > 0.0) & (steps < max_steps)
            tau += tl.where(searching, newton, closed)
        for start in range(0, n_cols, BLOCK):
            index = start + cols
            inside_row = index < n_cols
            x = tl.load(x_row + index, mask=inside_row, other=0.0).to(tl.float32)
            y = tl.maximum((x - peak) * scale - tau, 0.0)
            if ENTMAX:
                y = y * y
            y = tl.where(bad, float("nan"), y)
            tl.store(y_row + index, y.to(y_ptr.dtype.element_ty), mask=inside_row)

    @triton.jit
    def _sparse_map_backward_kernel(
        y_ptr, g_ptr, out_ptr, n_cols, y_stride, g_stride, out_stride, ENTMAX: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        y_row = y_ptr + row * y_stride
        g_row = g_ptr + row * g_stride
        out_row = out_ptr + row * out_stride
        cols = tl.arange(0, BLOCK)
        weighted = tl.full([], 0.0, tl.float32)
        weights = tl.full([], 0.0, tl.float32)
        for start in range(0, n_cols, BLOCK):
            index = start + cols
            inside_row = index < n_cols
            y = tl.load(y_row + index, mask=inside_row, other=0.0).to(tl.float32)
            g = tl.load(g_row + index, mask=inside_row, other=0.0).to(tl.float32)
            w = tl.sqrt(y) if ENTMAX else (y > 0).to(tl.float32)
            weighted += tl.sum(g * w, axis=0)
            weights += tl.sum(w, axis=0)
        shift = weighted / weights
        for start in range(0, n_cols, BLOCK):
            index = start + cols
            inside_row = index < n_cols
            y = tl.load(y_row + index, mask=inside_row, other=0.0).to(tl.float32)
            g = tl.load(g_row + index, mask=inside_row, other=0.0).to(tl.float32)
            w = tl.sqrt(y) if ENTMAX else (y > 0).to(tl.float32)
            tl.store(out_row + index, (w * (g - shift)).to(out_ptr.dtype.element_ty), mask=inside_row)

    @triton.jit
    def _top_k_forward_kernel(x_ptr, y_ptr, n_cols, x_stride, y_stride, k, RELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        y_row = y_ptr + row * y_stride
        cols = tl.arange(0, BLOCK)
        nonfinite = tl.full([], 0, tl.int32)
        for start in range(0, n_cols, BLOCK):
            index = start + cols
            inside_row = index < n_cols
            x = tl.load(x_row + index, mask=inside_row, other=0.0).to(tl.float32)
            nonfinite += tl.sum(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0)
        bad = nonfinite > 0
        # Walk the distinct values down from the maximum until k entries lie at or above `level`.
        level = tl.full([], float("inf"), tl.float32)
        peak = tl.full([], 0.0, tl.float32)
        above = tl.full([], 0, tl.int32)  # entries at or above `level`
        ties = tl.full([], 0, tl.int32)  # entries equal to `level`
        walking = bad == 0
        while walking:
            top = tl.full([], float("-inf"), tl.float32)
            count = tl.full([], 0, tl.int32)
            for start in range(0, n_cols, BLOCK):
                index = start + cols
                x = tl.load(x_row + index, mask=index < n_cols, other=float("-inf")).to(tl.float32)
                below = tl.where(x < level, x, float("-inf"))
                tile_top = tl.max(below, axis=0)
                tile_count = tl.sum((below == tile_top).to(tl.int32), axis=0)
                count = tl.where(tile_top > top, tile_count, tl.where(tile_top == top, count + tile_count, count))
                top = tl.maximum(top, tile_top)
            peak = tl.where(level == float("inf"), top, peak)
            level = top
            ties = count
            above += count
            walking = (above < k) & (top > float("-inf"))  # the second only guards a k beyond the row
            if RELU:
                walking = walking & (level > 0.0)  # below 0 every entry maps to 0 anyway
        wanted = tl.where(bad, 0, k - (above - ties))  # how many of the entries equal to `level` are kept
        total = tl.full([], 1.0, tl.float32)
        if not RELU:
            total = tl.full([], 0.0, tl.float32)
            seen = tl.full([], 0, tl.int32)
            for start in range(0, n_cols, BLOCK):
                index = start + cols
                x = tl.load(x_row + index, mask=index < n_cols, other=float("-inf")).to(tl.float32)
                tie = x == level
                rank = seen + tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)
                keep = (x > level) | (tie & (rank < wanted))
                total += tl.sum(tl.exp(tl.where(keep, x - peak, float("-inf"))), axis=0)
                seen += tl.sum(tie.to(tl.int32), axis=0)
            total = tl.where(bad, 1.0, total)  # a bad row keeps nothing and is written as NaN
        seen = tl.full([], 0, tl.int32)
        for start in range(0, n_cols, BLOCK):
            index = start + cols
            inside_row = index < n_cols
            x = tl.load(x_row + index, mask=inside_row, other=float("-inf")).to(tl.float32)
            tie = x == level
            rank = seen + tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)
            keep = (x > level) | (tie & (rank < wanted))
            seen += tl.sum(tie.to(tl.int32), axis=0)
            if RELU:
                y = tl.where(keep, tl.maximum(x, 0.0), 0.0)
            else:
                y = tl.exp(tl.where(keep, x - peak, float("-inf"))) / total
            y = tl.where(bad, float("nan"), y)
            tl.store(y_row + index, y.to(y_ptr.dtype.element_ty), mask=inside_row)

    @triton.jit
    def _top_k_backward_kernel(
        y_ptr, g_ptr, out_ptr, n_cols, y_stride, g_stride, out_stride, RELU: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        y_row = y_ptr + row * y_stride
        g_row = g_ptr + row * g_stride
        out_row = out_ptr + row * out_stride
        cols = tl.arange(0, BLOCK)
        weighted = tl.full([], 0.0, tl.float32)
        nans = tl.full([], 0, tl.int32)
        if not RELU:
            for start in range(0, n_cols, BLOCK):
                index = start + cols
                inside_row = index < n_cols
                y = tl.load(y_row + index, mask=inside_row, other=0.0).to(tl.float32)
                g = tl.load(g_row + index, mask=inside_row, other=0.0).to(tl.float32)
                weighted += tl.sum(tl.where(y > 0, g * y, 0.0), axis=0)
                nans += tl.sum((y != y).to(tl.int32), axis=0)
        for start in range(0, n_cols, BLOCK):
            index = start + cols
            inside_row = index < n_cols
            y = tl.load(y_row + index, mask=inside_row, other=0.0).to(tl.float32)
            g = tl.load(g_row + index, mask=inside_row, other=0.0).to(tl.float32)
            if RELU:
                out = tl.where(y > 0, g, 0.0)
            else:
                out = tl.where((y > 0) & (nans == 0), y * (g - weighted), 0.0)
            tl.store(out_row + index, out.to(out_ptr.dtype.element_ty), mask=inside_row)


def _block(n_cols: int) -> int:
    return min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK)


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``(rows, N)`` tensor whose rows are contiguous (a view where it can be)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _row_kernel(kernel, x: torch.Tensor, *tensors: torch.Tensor, **constants) -> torch.Tensor:
    """Launch ``kernel`` with one program per row of ``x``'s last dim; returns a new tensor shaped like ``x``."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    if out.numel() == 0:
        return out
    operands = [_rows(t) for t in (x, *tensors)]
    flat = out.view(-1, n_cols)
    block = _block(n_cols)
    strides = [operand.stride(0) for operand in (*operands, flat)]
    scalars = constants.pop("scalars", ())
    kernel[(flat.shape[0],)](
        *operands, flat, n_cols, *strides, *scalars, **constants, BLOCK=block, num_warps=_warps(block)
    )
    return out


@torch.library.custom_op("mumoe_tn::sparse_map", mutates_args=())
def _sparse_map_op(x: torch.Tensor, entmax: bool) -> torch.Tensor:
    return _row_kernel(_sparse_map_forward_kernel, x, scalars=(MAX_STEPS,), ENTMAX=entmax)


@torch.library.custom_op("mumoe_tn::sparse_map_backward", mutates_args=())
def _sparse_map_backward_op(y: torch.Tensor, grad: torch.Tensor, entmax: bool) -> torch.Tensor:
    return _row_kernel(_sparse_map_backward_kernel, y, grad, ENTMAX=entmax)


@torch.library.custom_op("mumoe_tn::top_k", mutates_args=())
def _top_k_op(x: torch.Tensor, k: int, relu: bool) -> torch.Tensor:
    return _row_kernel(_top_k_forward_kernel, x, scalars=(k,), RELU=relu)


@torch.library.custom_op("mumoe_tn::top_k_backward", mutates_args=())
def _top_k_backward_op(y: torch.Tensor, grad: torch.Tensor, relu: bool) -> torch.Tensor:
    return _row_kernel(_top_k_backward_kernel, y, grad, RELU=relu)


@_sparse_map_op.register_fake
@_top_k_op.register_fake
def _fake_forward(x: torch.Tensor, *options: object) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@_sparse_map_backward_op.register_fake
@_top_k_backward_op.register_fake
def _fake_backward(y: torch.Tensor, grad: torch.Tensor, *options: object) -> torch.Tensor:
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


def _save_output(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.flag = inputs[-1]  # entmax (sparse maps) or relu (top-k)
    ctx.save_for_backward(output)


def _sparse_map_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
    (y,) = ctx.saved_tensors
    if torch.is_grad_enabled():  # a backward that is itself differentiated: the same formula in torch
        if ctx.flag:  # √y as √(y + z) − z, z = 1 off the support: finite derivatives there (as in entmax.py)
            off_support = 1 - y.sign()
            weight = (y + off_support).sqrt() - off_support
        else:
            weight = y.sign()
        shift = (grad * weight).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True)
        return weight * (grad - shift), None
    return _sparse_map_backward_op(y, grad, ctx.flag), None


def _top_k_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
    (y,) = ctx.saved_tensors
    if torch.is_grad_enabled():
        kept = torch.nan_to_num(y, nan=0.0)
        if ctx.flag:
            return grad * kept.sign(), None, None
        return kept * (grad - (grad * kept).sum(-1, keepdim=True)), None, None
    return _top_k_backward_op(y, grad, ctx.flag), None, None


_sparse_map_op.register_autograd(_sparse_map_backward, setup_context=_save_output)
_top_k_op.register_autograd(_top_k_backward, setup_context=_save_output)


def sparse_map(x: torch.Tensor, entmax: bool) -> torch.Tensor:
    """1.5-entmax (``entmax=True``) or sparsemax of ``x`` along its last dim, one kernel each way.

    Parameters
    ----------
    x : torch.Tensor
        Logits ``(…, N)`` in float32, float64 (computed in float32), bfloat16 or float16.
    entmax : bool
        1.5-entmax when True, sparsemax when False.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x``, contiguous.
    """
    return _sparse_map_op(x, entmax)


def top_k_softmax(x: torch.Tensor, k: int) -> torch.Tensor:
    """The softmax of each row's ``k`` largest logits, 0 elsewhere (exactly ``k`` kept; ties by lowest index).

    Parameters
    ----------
    x : torch.Tensor
        Logits ``(…, N)``.
    k : int
        Entries kept per row, ``1 ≤ k ≤ N``.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x``.
    """
    check_top_k(x, k)
    return _top_k_op(x, k, False)


def relu_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest logits' positive parts kept in place, 0 elsewhere (not renormalised).

    Parameters
    ----------
    x : torch.Tensor
        Logits ``(…, N)``.
    k : int
        Entries kept per row, ``1 ≤ k ≤ N``.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x``.
    """
    check_top_k(x, k)
    return _top_k_op(x, k, True)
