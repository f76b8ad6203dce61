"""Whether a gate's batch statistics are shared between data-parallel replicas.

A BatchNorm gate normalises each expert mode's logits with the statistics of the batch it sees.
Under data parallelism (``DistributedDataParallel``, ``fully_shard``) every rank sees only its
own part of the batch, so an unsynchronised gate computes other coefficients than one process
on the whole batch would, and the ranks' running statistics drift apart. This module holds the
check that warns about it; [`mumoe_tn.gates.sync`][mumoe_tn.gates.sync] holds the cure.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

__all__ = ["UnsynchronisedNormWarning", "warn_unsynchronised"]


class UnsynchronisedNormWarning(UserWarning):
    """A BatchNorm gate trains with per-rank statistics under a multi-rank process group."""


def _world_size() -> int:
    """Ranks of the initialised default process group, 1 without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def warn_unsynchronised(norm: torch.nn.Module) -> None:
    """Warn that ``norm`` trains with its own rank's batch statistics when several ranks run.

    Called by [`LogitBatchNorm`][mumoe_tn.gates.modules.LogitBatchNorm] in training mode. Silent
    without an initialised process group, with one rank, and while ``torch.compile`` traces
    (a warning cannot be traced). Python's warning filter shows it once per process by default.

    Parameters
    ----------
    norm : torch.nn.Module
        The gate norm about to compute batch statistics.
    """
    if torch.compiler.is_compiling():
        return
    world = _world_size()
    if world > 1:
        warnings.warn(
            f"a BatchNorm gate ({type(norm).__name__}) trains under a process group of {world} ranks with "
            "the statistics of its own rank's tokens only: the coefficients differ from training on the "
            "whole batch and the running statistics drift apart between ranks. Call "
            "mumoe_tn.gates.sync_gate_norms(model) before wrapping the model (DDP, fully_shard), or build "
            "the layers with gate_norm='layer'",
            UnsynchronisedNormWarning,
            stacklevel=3,
        )
