"""Sparsemax and 1.5-entmax as torch operations: the full sort, the Newton search, the backward.

These are the torch forms of the two maps; [`mumoe_tn.gates.activation_maps`][mumoe_tn.gates.activation_maps]
chooses among them, the NumPy form ([`mumoe_tn.gates.simplex_numpy`][mumoe_tn.gates.simplex_numpy])
and the Triton kernels. Every form computes the exact closed-form threshold of the sorted-prefix
rule (Martins & Astudillo 2016; Peters, Niculae & Martins 2019); the tests check each against the
``entmax`` package.

- [`sorted_map`][mumoe_tn.gates.simplex_torch.sorted_map]: one full sort per row and a fixed run of
  whole-tensor calls, with no value read back to the host. It is the form ``torch.compile`` and
  ``torch.func`` trace (data-dependent control flow cannot be traced) and the one devices without
  the Triton kernels take (a host read there makes the host wait for the device at every call).
- [`searched_map`][mumoe_tn.gates.simplex_torch.searched_map]: for large batches on the CPU in
  eager mode, where sorting a ``(2048, 64)`` batch costs more than elementwise passes. A few Newton
  steps on the threshold equation ``Σ (x − τ)₊^(1/(α−1)) = 1``, from a ``τ`` below the root (the
  left side is convex and decreasing in ``τ``, so the steps approach the root from the left and
  never pass it), settle the support of most rows; the closed-form threshold of that support is
  checked against it and kept only where the support it implies is the same, which makes it exact.
  The other rows take the sorted rule on their ``k`` largest logits (``torch.topk``), redone with a
  larger ``k`` while the support could extend past it. The steps use floating-point arithmetic
  only: supports are counted as ``Σ sign((x − τ)₊)`` and the closed form is taken from the sums of
  the excess ``(x − τ)₊``, because on the CPU (torch 2.13) a comparison and a sum of booleans,
  ``masked_fill`` or ``torch.where`` over a ``(2048, 64)`` batch each take 5–10 times a float
  ``sub`` or ``sum``.
- [`closed_form_backward`][mumoe_tn.gates.simplex_torch.closed_form_backward]: the Jacobian-vector
  product, differentiable again. It takes ``√y`` as ``√(y + z) − z`` with ``z = 1`` off the
  support: ``sqrt`` of zeros runs about 8 times slower on the CPU than of positive numbers, and the
  form keeps second derivatives finite.

Half-precision rows are searched in float32 (their sums cannot count the support of a wide row;
bfloat16 rounds 5000 to 4992) and the result rounded back. Non-finite logits behave as in
``torch.softmax``: a row holding NaN or ``+inf`` (or only ``-inf``) gives NaN in that row only, and
``-inf`` entries of other rows get probability 0. Huge finite logits (``3e38``) do not overflow:
after subtracting the row maximum, entries below [`FLOOR`][mumoe_tn.gates.simplex_torch] are
clamped to it, which is exact because every entry of the support lies within 1 (sparsemax) or 2
(1.5-entmax) of the maximum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FIRST_K", "FLOOR", "NEWTON_STEPS", "closed_form_backward", "searched_map", "sorted_map"]

#: Size of the first partial sort of a row the Newton steps leave unsettled: supports of trained
#: gates are small, and a partial sort of 16 costs about half a full sort of 64 on the CPU.
FIRST_K = 16

#: Newton steps on the threshold before the support they imply is checked. With BatchNorm-scaled
#: logits four steps settle all but about one row in a thousand (64 or 256 experts).
NEWTON_STEPS = 4

#: Floor of the max-shifted logits; the supports of both maps lie within 2 of the maximum. An int:
#: ``torch.compile`` with ``dynamic=True`` makes a float read from a module a graph input, and one
#: read inside the map's autograd ``Function`` that a graph applies twice (a gate with two expert
#: modes) fails to trace; an int global it keeps as a constant.
FLOOR = -4

_HALF = (torch.float16, torch.bfloat16)


def _counts(ordered: torch.Tensor) -> torch.Tensor:
    """``[1, 2, …, N]`` as a row, for the sorted rows ``ordered`` ``(…, N)``."""
    return torch.arange(1, ordered.shape[-1] + 1, device=ordered.device, dtype=ordered.dtype)


def _sparsemax_rule(ordered: torch.Tensor) -> torch.Tensor:
    """``τ_k = (Σ_{j≤k} x_j − 1) / k`` for every prefix of the descending rows ``ordered``."""
    return ordered.cumsum(-1).sub_(1).div_(_counts(ordered))


def _entmax15_rule(ordered: torch.Tensor) -> torch.Tensor:
    """``τ_k``, the smaller root of ``Σ_{j≤k} (x_j − τ)² = 1``, for every prefix of the descending (halved) rows."""
    count = _counts(ordered)
    total = ordered.cumsum(-1)
    mean = total / count
    spread = torch.addcmul((ordered * ordered).cumsum(-1), mean, total, value=-1)
    return mean.sub_(spread.neg_().add_(1).div_(count).clamp(min=0).sqrt_())


def _rule(entmax: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    return _entmax15_rule if entmax else _sparsemax_rule


def _prefix_threshold(ordered: torch.Tensor, entmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``τ`` of every row of the descending, max-shifted ``ordered`` ``(rows, k)``, and the support size.

    The sorted-prefix rule ``τ_k ≤ x_k`` holds exactly on the support (a prefix); a NaN row counts
    no entry and takes the first ``τ`` (its result is NaN all the same).
    """
    tau = _rule(entmax)(ordered)
    support = (tau <= ordered).sum(dim=-1, keepdim=True).clamp(min=1)
    return tau.gather(-1, support - 1), support


def sorted_map(x: torch.Tensor, entmax: bool) -> torch.Tensor:
    """Sparsemax or 1.5-entmax (``entmax``) along the last dim by one full sort per row, traceable.

    (``clamp`` and ``square`` out of place: ``torch.func.vmap`` has no batching rule for their
    in-place forms.)

    Parameters
    ----------
    x : torch.Tensor
        Logits ``(…, N)``, any floating dtype and device.
    entmax : bool
        1.5-entmax when True, sparsemax when False.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x`` (no autograd graph of its own: callers wrap it).
    """
    dtype = x.dtype
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.detach().reshape(-1, x.shape[-1])
    if dtype in _HALF:
        rows = rows.float()
    ordered = torch.sort(rows, dim=-1, descending=True)[0]  # NaN sorts first: it becomes the peak
    peak = ordered[:, :1]
    bad = peak - peak  # 0, or NaN for the rows softmax makes NaN: added to the result at the end
    shifted = (ordered - peak).clamp(min=FLOOR)
    if entmax:
        shifted = shifted.mul_(0.5)
    threshold, _ = _prefix_threshold(shifted, entmax)
    y = rows - peak  # shifted first: x − peak is exact where it matters (entries near the peak)
    if entmax:
        y = y.mul_(0.5).sub_(threshold).clamp(min=0).square()
    else:
        y = y.sub_(threshold).clamp(min=0)
    return y.add_(bad).to(dtype).reshape(x.shape)


def _partial_threshold(rows: torch.Tensor, k: int, entmax: bool) -> torch.Tensor:
    """``τ`` of every row of the 2-D max-shifted ``rows`` from its ``k`` largest entries, ``k`` doubled while needed.

    When the whole partial sort of a row is inside the support, the true support may be longer:
    only those rows are redone, with twice the ``k``.
    """
    size = rows.shape[-1]

    def largest(part: torch.Tensor, k: int) -> torch.Tensor:
        if k >= size:
            return torch.sort(part, dim=-1, descending=True)[0]
        return torch.topk(part, k, dim=-1, sorted=True)[0]

    tau, support = _prefix_threshold(largest(rows, k), entmax)
    while k < size:
        redo = (support == k).squeeze(-1).nonzero().squeeze(-1)
        if redo.numel() == 0:
            break
        k = min(2 * k, size)
        tau_redone, support_redone = _prefix_threshold(largest(rows.index_select(0, redo), k), entmax)
        tau = tau.index_copy(0, redo, tau_redone)
        support = support.index_copy(0, redo, support_redone)
    return tau


def _newton_step(rows: torch.Tensor, tau: torch.Tensor, entmax: bool) -> torch.Tensor:
    excess = (rows - tau).clamp_(min=0)
    if entmax:  # f(τ) = Σ (x − τ)₊² − 1, f'(τ) = −2 Σ (x − τ)₊
        return tau.addcdiv((excess * excess).sum(-1, keepdim=True) - 1, excess.sum(-1, keepdim=True), value=0.5)
    # f(τ) = Σ (x − τ)₊ − 1, f'(τ) = −#{x > τ}
    return tau.addcdiv(excess.sum(dim=-1, keepdim=True) - 1, excess.sign_().sum(dim=-1, keepdim=True))


def _closed_form(tau: torch.Tensor, excess: torch.Tensor, count: torch.Tensor, entmax: bool) -> torch.Tensor:
    """Threshold of the support ``S`` of ``excess = (x − τ)₊`` (``count = |S|``), shifted back by ``τ``."""
    total = excess.sum(dim=-1, keepdim=True)
    if not entmax:  # (Σ_S x − 1) / |S|
        return tau + (total - 1) / count
    mean = total / count  # the smaller root of Σ_S (x − t)² = 1 in x − τ
    spread = (excess * excess).sum(dim=-1, keepdim=True) - count * mean * mean
    return tau + mean - torch.sqrt(torch.clamp((1 - spread) / count, min=0))


def _newton_threshold(rows: torch.Tensor, entmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``τ`` of every row of the 2-D, max-shifted ``rows``, and which rows it is exact for.

    Starts at ``τ = −1`` (the maximum, 0, alone gives mass ≥ 1 there), takes
    [`NEWTON_STEPS`][mumoe_tn.gates.simplex_torch] steps, then computes the closed-form threshold of
    the support ``{x > τ}``. A row's threshold is exact when that support is the one it implies.
    """
    tau = rows.new_full((rows.shape[0], 1), -1.0)
    for _ in range(NEWTON_STEPS):
        tau = _newton_step(rows, tau, entmax)
    excess = (rows - tau).clamp_(min=0)
    count = excess.sign().sum(dim=-1, keepdim=True)  # ≥ 1 in exact arithmetic: τ stays below the maximum 0
    exact = _closed_form(tau, excess, count, entmax)
    # {x > τ} and {x > exact} are both upper sets of the row, so they agree when their sizes do.
    # A NaN τ counts no entry on either side (sign(NaN) is 0): such a row is not settled.
    count = count.squeeze(-1)
    settled = ((rows - exact).clamp_(min=0).sign_().sum(dim=-1) == count) & (count > 0)
    return exact, settled


def searched_map(x: torch.Tensor, dim: int, entmax: bool) -> torch.Tensor:
    """Sparsemax or 1.5-entmax along ``dim`` by the Newton search (CPU, eager: it reads values on the host).

    Parameters
    ----------
    x : torch.Tensor
        Logits, any floating dtype.
    dim : int
        Dimension to normalise.
    entmax : bool
        1.5-entmax when True, sparsemax when False.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x`` (no autograd graph of its own).
    """
    x = x.detach()
    peak = x.amax(dim=dim, keepdim=True)  # NaN if the row holds one, ±inf if inf or only -inf
    shifted = (x - peak).clamp_(min=FLOOR)
    bad = ~peak.isfinite()
    any_bad = bool(bad.any())
    if any_bad:
        shifted = torch.where(bad, 0.0, shifted)  # keeps the search in bounds; the row is NaN at the end
    if entmax:
        shifted = shifted / 2
    size = x.shape[dim]
    rows = shifted.movedim(dim, -1).reshape(-1, size)
    search = rows.float() if rows.dtype in _HALF else rows
    tau, settled = _newton_threshold(search, entmax)
    redo = (~settled).nonzero().squeeze(-1)
    if redo.numel():
        redone = _partial_threshold(search.index_select(0, redo), min(FIRST_K, size), entmax)
        tau = tau.index_copy(0, redo, redone)
    shape = list(shifted.movedim(dim, -1).shape)
    shape[-1] = 1
    tau = tau.to(rows.dtype).reshape(shape).movedim(-1, dim)
    y = torch.clamp(shifted - tau, min=0)
    if entmax:
        y = y**2
    return torch.where(bad, torch.nan, y) if any_bad else y


def _square_root(y: torch.Tensor) -> torch.Tensor:
    """``√y`` of the non-negative ``y``, exactly, as ``√(y + z) − z`` with ``z = 1`` where ``y = 0``.

    ``y + 0`` and ``√1 − 1`` are exact, so the value equals ``y.sqrt()``. The form avoids the square
    root of zeros, which CPU kernels take about 8 times slower, and its derivative is finite off the
    support (``1/2`` where ``√y`` has ``inf``), so double backward through the 1.5-entmax backward
    gives finite second derivatives instead of ``inf · 0 = NaN``.
    """
    off_support = 1 - y.sign()
    return (y + off_support).sqrt() - off_support


def closed_form_backward(y: torch.Tensor, grad: torch.Tensor, dim: int, entmax: bool) -> torch.Tensor:
    """The vector-Jacobian product of the map at its output ``y``, in torch (differentiable again).

    Parameters
    ----------
    y : torch.Tensor
        The map's output.
    grad : torch.Tensor
        The incoming gradient, shaped as ``y``.
    dim : int
        The normalised dimension.
    entmax : bool
        1.5-entmax when True, sparsemax when False.

    Returns
    -------
    torch.Tensor
        ``w ⊙ (g − Σ w g / Σ w)`` with ``w = √y`` (1.5-entmax) or the support's indicator (sparsemax).
    """
    weight = _square_root(y) if entmax else y.sign()  # y ≥ 0: sign is 1 on the support, 0 off it
    scaled = grad * weight
    shift = scaled.sum(dim, keepdim=True) / weight.sum(dim, keepdim=True)
    return scaled - shift * weight
