"""Exact sparse simplex projections (sparsemax, 1.5-entmax) that ``torch.compile`` can trace.

The ``entmax`` package computes the same maps, but its autograd Functions define ``forward``
as a classmethod, which dynamo cannot trace when gradients are required (torch 2.13:
"Argument mismatch when attempting to trace function forward"). These versions use the same
closed-form, sort-based thresholds (Martins & Astudillo 2016; Peters, Niculae & Martins 2019)
and their known Jacobian-vector products, as static-method Functions; the test suite checks
them against ``entmax``.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

__all__ = ["entmax15", "sparsemax"]


def _sorted_cumulative(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ordered, _ = torch.sort(x, dim=dim, descending=True)
    shape = [1] * x.ndim
    shape[dim] = -1
    rho = torch.arange(1, x.shape[dim] + 1, device=x.device, dtype=x.dtype).view(shape)
    return ordered, ordered.cumsum(dim), rho


class _Sparsemax(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x - x.amax(dim=dim, keepdim=True)
        ordered, cumulative, rho = _sorted_cumulative(x, dim)
        support = (rho * ordered > cumulative - 1).sum(dim=dim, keepdim=True)
        tau = (cumulative.gather(dim, support - 1) - 1) / support.to(x.dtype)
        y = torch.clamp(x - tau, min=0)
        ctx.dim = dim
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        inside = (y > 0).to(grad.dtype)
        mean = (grad * inside).sum(ctx.dim, keepdim=True) / inside.sum(ctx.dim, keepdim=True)
        return (grad - mean) * inside, None


class _Entmax15(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = (x - x.amax(dim=dim, keepdim=True)) / 2
        ordered, cumulative, rho = _sorted_cumulative(x, dim)
        mean = cumulative / rho
        mean_sq = (ordered * ordered).cumsum(dim) / rho
        spread = rho * (mean_sq - mean * mean)
        tau = mean - torch.sqrt(torch.clamp((1 - spread) / rho, min=0))
        support = (tau <= ordered).sum(dim=dim, keepdim=True)
        y = torch.clamp(x - tau.gather(dim, support - 1), min=0) ** 2
        ctx.dim = dim
        ctx.save_for_backward(y)
        return y

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
