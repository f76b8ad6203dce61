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


def _timed_call(
    plan: ContractionPlan,
    operands: Sequence[torch.Tensor],
    ones_appended: str | None,
    backward: bool,
) -> None:
    """One contraction of ``operands`` by ``plan``, then its backward when ``backward``.

    With ``backward`` the operands that required grad are fresh leaves and the result is
    back-propagated with a gradient of ones (the cost of a backward pass does not depend on
    the values of the incoming gradient).
    """
    if not backward:
        with torch.no_grad():
            run_plan(plan, operands, ones_appended=ones_appended)
        return
    # Identity hooks keep this graph's saved tensors as they are: inside a non-reentrant activation
    # checkpoint, the checkpoint's own hooks would otherwise recompute the whole checkpointed
    # region when this backward unpacks them.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
        leaves = [tensor.detach().requires_grad_(tensor.requires_grad) for tensor in operands]
        result = run_plan(plan, leaves, ones_appended=ones_appended)
        needed = [leaf for leaf in leaves if leaf.requires_grad]
        torch.autograd.grad(result, needed, grad_outputs=torch.ones_like(result))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def fastest_plan(
    plans: Sequence[ContractionPlan],
    operands: Sequence[torch.Tensor],
    *,
    ones_appended: str | None = None,
    repeats: int = 3,
    backward: bool | None = None,
) -> ContractionPlan:
    """The plan among ``plans`` whose contraction runs fastest on ``operands`` (median time).

    Each plan runs once to warm up and then ``repeats`` times; ties go to the earlier plan.
    In training the backward pass costs about twice the forward and follows the plan's steps in
    reverse, so a plan is then timed forward and backward together.

    Parameters
    ----------
    plans : Sequence of ContractionPlan
        Candidate plans for the same contraction (e.g. from
        [`mumoe_tn.contractions.autotune_candidates`][mumoe_tn.contractions.plan.autotune_candidates]).
    operands : Sequence of torch.Tensor
        The operands the plans contract (timed as given, on their device; never modified).
    ones_appended : str, optional
        As for [`mumoe_tn.contractions.run_plan`][mumoe_tn.contractions.execute.run_plan].
    repeats : int, optional
        Timed runs per plan (default 3).
    backward : bool, optional
        Time the forward and the backward pass (gradients of the operands that require grad)
        rather than the forward alone. Default: when gradients are enabled and an operand
        requires grad, as in a training step.

    Returns
    -------
    ContractionPlan
        One of ``plans``.
    """
    if not plans:
        raise ValueError("autotuning needs at least one candidate plan")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if backward is not None and not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool or None, got {type(backward).__name__}")
    if backward is None:
        backward = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in operands)
    elif backward and not any(tensor.requires_grad for tensor in operands):
        raise ValueError("backward=True needs an operand that requires grad")
    if backward and torch.is_inference_mode_enabled():
        raise ValueError("backward=True cannot time a backward pass under torch.inference_mode()")
    if backward and any(tensor.is_inference() for tensor in operands):
        raise ValueError("backward=True cannot time a backward pass through inference tensors (made under "
                         "torch.inference_mode()); clone them outside it first")  # fmt: skip
    timed = list(plans)
    if len(timed) == 1:
        return timed[0]
    device = operands[0].device
    medians = []
    for number, plan in enumerate(timed):
        _timed_call(plan, operands, ones_appended, backward)
        times = []
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            _timed_call(plan, operands, ones_appended, backward)
            _synchronize(device)
            times.append(time.perf_counter() - start)
        medians.append((statistics.median(times), number))
    return timed[min(medians)[1]]
