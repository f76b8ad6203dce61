"""Autotuning: time a few candidate plans on the operands' device and keep the fastest."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from mumoe_tn.contractions.execute import run_plan
from mumoe_tn.contractions.plan import ContractionPlan

__all__ = ["AUTOTUNE_CANDIDATES", "fastest_plan"]

#: How many of the cheapest candidate plans (by FMA count) autotuning times.
AUTOTUNE_CANDIDATES = 3
#: Candidates costing more than this multiple of the cheapest plan's FMAs are not timed.
AUTOTUNE_FMA_SLACK = 4.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest_plan(
    plans: Sequence[ContractionPlan],
    operands: Sequence[torch.Tensor],
    *,
    ones_appended: str | None = None,
    repeats: int = 3,
) -> ContractionPlan:
    """The plan among ``plans`` whose forward pass runs fastest on ``operands`` (median time).

    Only the :data:`AUTOTUNE_CANDIDATES` cheapest plans within :data:`AUTOTUNE_FMA_SLACK` of the
    cheapest are timed, each once to warm up and then ``repeats`` times, without gradients.

    Parameters
    ----------
    plans : Sequence of ContractionPlan
        Candidate plans for the same contraction, cheapest first (as
        :func:`mumoe_tn.contractions.forward_candidates` returns them).
    operands : Sequence of torch.Tensor
        The operands the plans contract (timed as given, on their device).
    ones_appended : str, optional
        As for :func:`mumoe_tn.contractions.run_plan`.
    repeats : int, optional
        Timed runs per plan (default 3).

    Returns
    -------
    ContractionPlan
        One of ``plans``.
    """
    if not plans:
        raise ValueError("autotuning needs at least one candidate plan")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    cheapest = plans[0].fma
    timed = [plan for plan in plans if plan.fma <= AUTOTUNE_FMA_SLACK * cheapest][:AUTOTUNE_CANDIDATES]
    if len(timed) == 1:
        return timed[0]
    device = operands[0].device
    tensors = [tensor.detach() for tensor in operands]
    medians = []
    with torch.no_grad():
        for number, plan in enumerate(timed):
            run_plan(plan, tensors, ones_appended=ones_appended)
            times = []
            for _ in range(repeats):
                _synchronize(device)
                start = time.perf_counter()
                run_plan(plan, tensors, ones_appended=ones_appended)
                _synchronize(device)
                times.append(time.perf_counter() - start)
            medians.append((statistics.median(times), number))
    return timed[min(medians)[1]]
