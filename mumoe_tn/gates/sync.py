"""BatchNorm gates whose statistics are those of the whole data-parallel batch.

[`sync_gate_norms`][mumoe_tn.gates.sync.sync_gate_norms] replaces every
[`LogitBatchNorm`][mumoe_tn.gates.modules.LogitBatchNorm] of a model by a
[`SyncLogitBatchNorm`][mumoe_tn.gates.sync.SyncLogitBatchNorm]: in training mode under a process
group of several ranks it computes the mean and variance of the logits over the real tokens of
every rank (two all-reduces per gate mode, differentiable), so data-parallel training equals one
process on the concatenated batch, and every rank's running statistics stay equal. Unlike
``torch.nn.SyncBatchNorm`` it runs on CPU (gloo) as well as CUDA (NCCL), keeps its statistics in
float32 under half-precision casts, and honours the gates' token mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mumoe_tn.gates.modules import LogitBatchNorm

__all__ = ["SyncLogitBatchNorm", "sync_gate_norms"]


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose gradient is the all-reduced gradient: every rank's loss sees every token."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None


class SyncLogitBatchNorm(LogitBatchNorm):
    """A [`LogitBatchNorm`][mumoe_tn.gates.modules.LogitBatchNorm] with statistics over every rank's tokens.

    Without an initialised process group, with one rank, or in eval mode it is a
    ``LogitBatchNorm``. In training mode under ``process_group`` (the default group when None)
    of two or more ranks, the batch mean and biased variance come from the real tokens of all
    ranks; the running statistics are updated with the unbiased variance, as BatchNorm does.
    Every rank must call it in the same order (it communicates).

    Parameters
    ----------
    num_features : int
        Number of experts ``N_e`` of the gate mode.
    process_group : torch.distributed.ProcessGroup, optional
        The ranks whose tokens make up the batch; the default process group when None.
    **options
        As for ``LogitBatchNorm`` (``eps``, ``momentum``, ``affine``, ``track_running_stats``,
        ``device``, ``dtype``).
    """

    def __init__(self, num_features: int, process_group: Any = None, **options: Any) -> None:
        super().__init__(num_features, **options)
        self.process_group = process_group

    def _ranks(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise ``(rows, N)`` logits with the statistics of every rank's real rows.

        Parameters
        ----------
        input : torch.Tensor
            Logits ``(rows, N)``.
        mask : torch.Tensor, optional
            ``(rows,)`` booleans, True = real token; padding rows come out as zeros.

        Returns
        -------
        torch.Tensor
            The normalised logits, shaped as ``input``.
        """
        if not self.training or self._ranks() < 2:
            return super().forward(input, mask)
        real = input if mask is None else input[mask]
        normed = self._normalise(real)
        if mask is None:
            return normed
        return torch.zeros_like(input).masked_scatter(mask[:, None].expand_as(input), normed)

    def _normalise(self, rows: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD if self.process_group is None else self.process_group
        wide = torch.promote_types(rows.dtype, torch.float64)  # token counts beyond 2**24 stay exact
        count = torch.full((1,), rows.shape[0], dtype=wide, device=rows.device)
        totals = _SumOverRanks.apply(torch.cat([rows.sum(0, dtype=wide), count]), group)
        tokens = int(totals[-1].item())
        if tokens < 2:
            raise ValueError(
                f"gate_norm='batch' needs at least 2 real tokens per batch over all ranks in training mode, "
                f"got {tokens}: use gate_norm='layer' (or 'none')"
            )
        mean = (totals[:-1] / tokens).to(rows.dtype)
        centred = rows - mean
        variance = _SumOverRanks.apply(centred.square().sum(0), group) / tokens
        out = centred * torch.rsqrt(variance + self.eps)
        if self.affine:
            out = out * self.weight + self.bias
        if self.track_running_stats:
            self._update_running(mean.detach(), variance.detach() * tokens / (tokens - 1))
        return out

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, unbiased: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)


def _synchronised(norm: LogitBatchNorm, process_group: Any) -> SyncLogitBatchNorm:
    """A ``SyncLogitBatchNorm`` with ``norm``'s options, statistics, parameters and mode."""
    buffer = norm.running_mean if norm.running_mean is not None else norm.weight
    factory = {} if buffer is None else {"device": buffer.device, "dtype": buffer.dtype}
    options = {"eps": norm.eps, "momentum": norm.momentum, "affine": norm.affine}
    synced = SyncLogitBatchNorm(
        norm.num_features, process_group, track_running_stats=norm.track_running_stats, **options, **factory
    )
    for name, value in norm._buffers.items():
        synced._buffers[name] = value
    for name, value in norm._parameters.items():
        synced._parameters[name] = value  # the same Parameter objects: an optimizer keeps them
    return synced.train(norm.training)


def sync_gate_norms(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every BatchNorm gate norm in ``module`` by one synchronised across ranks.

    Call it before wrapping the model in ``DistributedDataParallel`` or ``fully_shard``. The
    running statistics (float32), parameters and train/eval mode carry over; norms that are
    already synchronised are left as they are. Gates with ``gate_norm="layer"`` or ``"none"``
    normalise each token on its own and need nothing.

    Parameters
    ----------
    module : nn.Module
        A μMoE layer or any model holding some.
    process_group : torch.distributed.ProcessGroup, optional
        The data-parallel ranks; the default process group when None.

    Returns
    -------
    nn.Module
        ``module``, changed in place (or the new norm when ``module`` is itself a ``LogitBatchNorm``).

    Examples
    --------
    >>> model = sync_gate_norms(model)  # doctest: +SKIP
    >>> model = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, LogitBatchNorm) and not isinstance(module, SyncLogitBatchNorm):
        return _synchronised(module, process_group)
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, LogitBatchNorm) and not isinstance(child, SyncLogitBatchNorm)
    ]
    for parent, name, child in targets:
        parent._modules[name] = _synchronised(child, process_group)
    return module
