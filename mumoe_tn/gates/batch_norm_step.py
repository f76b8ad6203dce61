"""``nn.BatchNorm1d``'s forward pass on a matrix of gate logits, in fewer Python steps.

A gate's batch norm runs on every training call of a layer; ``nn.BatchNorm1d.forward`` and
``F.batch_norm`` read each buffer and parameter through ``nn.Module.__getattr__`` and check
their arguments again on every call, which costs several microseconds beside one small kernel.
[`batch_norm_matrix`][mumoe_tn.gates.batch_norm_step.batch_norm_matrix] computes the same
result and makes the same updates (``num_batches_tracked += 1`` and the running averages in
training mode, with ``momentum=None`` for a cumulative average), reading the module's own
dictionaries once; where a call is anything but the common case it hands back None and the
module's own forward runs instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import has_torch_function_variadic

__all__ = ["batch_norm_matrix"]


def batch_norm_matrix(norm: nn.BatchNorm1d, logits: torch.Tensor) -> torch.Tensor | None:
    """``nn.BatchNorm1d.forward(norm, logits)`` for ``(rows, C)`` logits, or None where it does not apply.

    Parameters
    ----------
    norm : nn.BatchNorm1d
        The module, whose state (running statistics, ``num_batches_tracked``) is updated as its
        own forward pass would update it.
    logits : torch.Tensor
        ``(rows, C)``.

    Returns
    -------
    torch.Tensor or None
        The normalised logits; None (nothing computed or updated) for input that is not a plain
        matrix, a tensor subclass among the arguments, a training batch of fewer than 2 rows or
        a non-positive ``eps``: the module's forward then runs and gives torch's own result or error.
    """
    buffers = norm._buffers
    parameters = norm._parameters
    running_mean, running_var = buffers["running_mean"], buffers["running_var"]
    weight, bias = parameters["weight"], parameters["bias"]
    training, eps = norm.training, norm.eps
    if logits.ndim != 2 or has_torch_function_variadic(logits, running_mean, running_var, weight, bias):
        return None
    if (training and (logits.shape[0] < 2 or eps <= 0.0)) or eps < 0.0:
        return None
    momentum = norm.momentum
    factor = 0.0 if momentum is None else momentum
    if training and norm.track_running_stats:
        tracked = buffers["num_batches_tracked"]
        if tracked is not None:
            tracked.add_(1)
            factor = 1.0 / float(tracked) if momentum is None else momentum
    elif training:
        running_mean = running_var = None  # untracked: the batch statistics are not kept
    use_batch = training or (running_mean is None and running_var is None)
    cudnn = torch.backends.cudnn.enabled
    return torch.batch_norm(logits, weight, bias, running_mean, running_var, use_batch, factor, eps, cudnn)
