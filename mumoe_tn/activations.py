"""Exact sparse simplex projections (sparsemax, 1.5-entmax) that ``torch.compile`` can trace.

The ``entmax`` package computes the same maps, but its autograd Functions define ``forward``
as a classmethod, which dynamo cannot trace when gradients are required (torch 2.13:
"Argument mismatch when attempting to trace function forward"). These versions use the same
closed-form, sort-based thresholds (Martins & Astudillo 2016; Peters, Niculae & Martins 2019)
and their known Jacobian-vector products, as static-method Functions; the test suite checks
them against ``entmax``.

Speed: in eager mode the thresholds are first computed from the ``k`` largest logits
(``torch.topk``, much cheaper than a full sort); the rows whose support could extend past ``k``
are recomputed, alone, with a larger ``k``, so the result is always exact. Under ``torch.compile`` and
``torch.func`` transforms the full sort is used, because the fallback is data-dependent control
flow. The Functions define ``setup_context`` and generate their vmap rule, so ``torch.func``
(``vmap``, ``grad``, ``jacrev``, …) works through them.

Non-finite logits behave as in ``torch.softmax``: a row holding NaN or ``+inf`` (or only
``-inf``) gives NaN in that row only, and ``-inf`` entries of other rows get probability 0.
Huge finite logits (``3e38``) do not overflow: after subtracting the row maximum, entries
below [`FLOOR`][mumoe_tn.activations] are clamped to it. That is exact, because every entry of the support lies
within 1 (sparsemax) or 2 (1.5-entmax) of the maximum, so a clamped entry stays outside the
support and leaves the threshold unchanged.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

__all__ = ["entmax15", "sparsemax"]


#: Size of the first partial sort in eager mode: supports of trained gates are small, and a
#: partial sort of 16 costs about half a full sort of 64 on CPU.
FIRST_K = 16

#: Floor of the max-shifted logits; the supports of both maps lie within 2 of the maximum.
FLOOR = -4.0


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


def _threshold(x: torch.Tensor, dim: int, rule) -> torch.Tensor:
    """The exact threshold ``τ`` along ``dim`` from the sorted-prefix ``rule``.

    ``rule(ordered, dim)`` returns the candidate thresholds for every prefix length and
    whether each prefix is inside the support (true for a leading run only). When the whole
    partial sort of a row is inside the support, the true support may be longer: only those
    rows are redone, with twice the ``k``.
    """
    size = x.shape[dim]
    traced = torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
    rows = x.movedim(dim, -1).reshape(-1, size)
    k = size if traced else min(FIRST_K, size)
    tau, support = _prefix_threshold(rows, k, rule)
    while k < size:
        redo = (support == k).squeeze(-1).nonzero().squeeze(-1)
        if redo.numel() == 0:
            break
        k = min(2 * k, size)
        tau_redone, support_redone = _prefix_threshold(rows.index_select(0, redo), k, rule)
        tau = tau.index_copy(0, redo, tau_redone)
        support = support.index_copy(0, redo, support_redone)
    shape = list(x.movedim(dim, -1).shape)
    shape[-1] = 1
    return tau.reshape(shape).movedim(-1, dim)


def _shifted(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` minus its row maximum, floored at [`FLOOR`][mumoe_tn.activations], and the rows softmax makes NaN.

    A row is bad when the shift yields NaN: a NaN entry, ``+inf`` (``inf - inf``) or only
    ``-inf``. Bad rows are replaced by zeros so the threshold search stays in bounds.
    """
    shifted = (x - x.amax(dim=dim, keepdim=True)).clamp(min=FLOOR)
    bad = shifted.isnan().any(dim=dim, keepdim=True)
    return torch.where(bad, 0.0, shifted), bad


def _prefix(ordered: torch.Tensor, dim: int) -> torch.Tensor:
    shape = [1] * ordered.ndim
    shape[dim] = -1
    return torch.arange(1, ordered.shape[dim] + 1, device=ordered.device, dtype=ordered.dtype).view(shape)


def _sparsemax_rule(ordered: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rho = _prefix(ordered, dim)
    cumulative = ordered.cumsum(dim) - 1
    return cumulative / rho, rho * ordered > cumulative


def _entmax15_rule(ordered: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rho = _prefix(ordered, dim)
    mean = ordered.cumsum(dim) / rho
    mean_sq = (ordered * ordered).cumsum(dim) / rho
    spread = rho * (mean_sq - mean * mean)
    tau = mean - torch.sqrt(torch.clamp((1 - spread) / rho, min=0))
    return tau, tau <= ordered


class _Sparsemax(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dim: int) -> torch.Tensor:
        x, bad = _shifted(x, dim)
        y = torch.clamp(x - _threshold(x, dim, _sparsemax_rule), min=0)
        return torch.where(bad, torch.nan, y)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        inside = (y > 0).to(grad.dtype)
        mean = (grad * inside).sum(ctx.dim, keepdim=True) / inside.sum(ctx.dim, keepdim=True)
        return (grad - mean) * inside, None


class _Entmax15(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dim: int) -> torch.Tensor:
        x, bad = _shifted(x, dim)
        x = x / 2
        y = torch.clamp(x - _threshold(x, dim, _entmax15_rule), min=0) ** 2
        return torch.where(bad, torch.nan, y)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        root = y.sqrt()
        scaled = grad * root
        shift = scaled.sum(ctx.dim, keepdim=True) / root.sum(ctx.dim, keepdim=True)
        return scaled - shift * root, None


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
    return _Sparsemax.apply(x, dim % x.ndim)


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
    return _Entmax15.apply(x, dim % x.ndim)
