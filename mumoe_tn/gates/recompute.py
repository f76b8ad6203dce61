"""Activation checkpointing of layers whose gates keep running statistics.

``torch.utils.checkpoint`` (and ``checkpoint_wrapper``) runs a checkpointed block's forward a
second time during backward. Gradients are unchanged, but a BatchNorm gate in training mode
updates its running mean and variance on both passes: the statistics that eval mode uses would
move twice per step. [`keep_statistics_on_recompute`][mumoe_tn.gates.recompute.keep_statistics_on_recompute]
gives checkpointing a ``context_fn`` under which the recomputation leaves them as the first pass
left them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

__all__ = ["keep_statistics_on_recompute"]

_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def _running_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The running-statistics buffers of every norm in ``module`` that tracks them."""
    return [
        buffer
        for norm in module.modules()
        if getattr(norm, "track_running_stats", False)
        for name in _RUNNING
        if (buffer := getattr(norm, name, None)) is not None
    ]


@contextlib.contextmanager
def _restoring(module: nn.Module) -> Iterator[None]:
    buffers = _running_buffers(module)
    saved = [buffer.detach().clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                buffer.copy_(value)


def keep_statistics_on_recompute(
    module: nn.Module,
) -> Callable[[], tuple[AbstractContextManager, AbstractContextManager]]:
    """A checkpointing ``context_fn`` under which recomputing ``module`` keeps its running statistics.

    Parameters
    ----------
    module : nn.Module
        The checkpointed block (its norms with ``track_running_stats`` are restored after the
        recomputation; gate norms and any ``nn.BatchNorm*`` alike).

    Returns
    -------
    Callable
        ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
        context_fn=...)`` or ``checkpoint_wrapper(module, context_fn=...)``: no context around
        the first forward pass, a restoring one around the recomputation.

    Examples
    --------
    >>> from torch.utils.checkpoint import checkpoint
    >>> block = MuMoEMLP(16, 32, 16, 8, "cp", 4)  # doctest: +SKIP
    >>> y = checkpoint(block, x, use_reentrant=False, context_fn=keep_statistics_on_recompute(block))  # doctest: +SKIP
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")

    def contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
        return contextlib.nullcontext(), _restoring(module)

    return contexts
