"""Autotuning: time a few candidate plans on the operands' device and keep the fastest."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from mumoe_tn.contractions.execute import run_plan
from mumoe_tn.contractions.plan import ContractionPlan

__all__ = ["fastest_plan"]


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
    """The plan among ``plans`` whose contraction runs fastest on ``operands`` (median time).

    Each plan runs once to warm up and then ``repeats`` times, without gradients; ties go to
    the earlier plan.

    Parameters
    ----------
    plans : Sequence of ContractionPlan
        Candidate plans for the same contraction (e.g. from
        [`mumoe_tn.contractions.autotune_candidates`][mumoe_tn.contractions.plan.autotune_candidates]).
    operands : Sequence of torch.Tensor
        The operands the plans contract (timed as given, on their device).
    ones_appended : str, optional
        As for [`mumoe_tn.contractions.run_plan`][mumoe_tn.contractions.execute.run_plan].
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
    timed = list(plans)
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
