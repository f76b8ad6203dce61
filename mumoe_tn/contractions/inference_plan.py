"""Planning for constant cores: inference's plans, which compute core-only steps once.

Without gradients the cores are constants: a plan's steps that read only cores (the parameter-only
sub-contractions) are computed once and reused by every call. Inference planning therefore
minimises what a call costs — its FMAs plus a fixed charge per step it runs, a kernel launch
([`LAUNCH_FMA`][mumoe_tn.contractions.inference_plan.LAUNCH_FMA]) — with the cached intermediates
bounded, among the candidates the forward planner's finders give at the call's batch and at a
much larger one.
"""

from __future__ import annotations

from dataclasses import replace

from mumoe_tn.contractions.plan import (
    ContractionPlan,
    _check_batch,
    _layout,
    _left_out,
    _size,
    choose_plan,
    plan_forward,
)
from mumoe_tn.contractions.plan_inputs import limit_elements
from mumoe_tn.contractions.search import bounded_candidates
from mumoe_tn.network import BATCH_LABEL, ExpertNetwork

__all__ = [
    "INFERENCE_CACHE_ELEMENTS",
    "INFERENCE_SCALES",
    "LAUNCH_FMA",
    "constant_elements",
    "constant_steps",
    "per_call_cost",
    "per_call_fma",
    "per_call_peak",
    "plan_inference",
]


def constant_steps(plan: ContractionPlan, n_constant: int) -> frozenset[int]:
    """Indices of the steps whose inputs descend only from the first ``n_constant`` operands.

    With the cores first (as in [`plan_forward`][mumoe_tn.contractions.plan.plan_forward]), these are the parameter-only
    sub-contractions that inference can compute once and reuse.

    Parameters
    ----------
    plan : ContractionPlan
        The plan.
    n_constant : int
        How many leading operands are constant.

    Returns
    -------
    frozenset of int
    """
    constant = [k < n_constant for k in range(len(plan.inputs))]
    found = set()
    for number, step in enumerate(plan.steps):
        flags = [constant.pop(k) for k in step.positions]
        constant.append(all(flags))
        if all(flags):
            found.add(number)
    return frozenset(found)


def constant_elements(plan: ContractionPlan, steps: frozenset[int]) -> int:
    """Elements held by the cached results of ``steps``."""
    return sum(_size(plan.steps[number].output, plan.sizes) for number in steps)


def per_call_fma(plan: ContractionPlan, steps: frozenset[int]) -> int:
    """FMAs of a call that reuses the results of ``steps``."""
    return sum(step.fma for number, step in enumerate(plan.steps) if number not in steps)


INFERENCE_SCALES = (1, 1 << 16)
"""Batch multipliers at which inference planning also searches.

At a larger batch the finders favour contracting the cores among themselves, which inference pays
only once.
"""
INFERENCE_CACHE_ELEMENTS = 1 << 20
"""Cached core-only intermediates may always hold this many elements (4 MiB in float32)."""
LAUNCH_FMA = 1 << 16
"""What inference planning charges for each step a call runs, in FMAs.

A step is one kernel launch, whose fixed cost (a few µs of dispatch on a CPU, a launch on an
accelerator) is what a core spends on about this many FMAs in the small products of a small
batch. At small batch it makes the planner take fewer, larger per-call products (see
``docs/maths.md``); at large batch FMAs rule.
"""


def per_call_cost(plan: ContractionPlan, steps: frozenset[int], launch_fma: int = LAUNCH_FMA) -> int:
    """What inference planning minimises: FMAs per call plus ``launch_fma`` per step a call runs.

    Parameters
    ----------
    plan : ContractionPlan
        The plan.
    steps : frozenset of int
        Its core-only steps, computed once and reused.
    launch_fma : int, optional
        The fixed cost of one step, in FMAs (default
        [`LAUNCH_FMA`][mumoe_tn.contractions.inference_plan.LAUNCH_FMA]; 0 counts FMAs alone).

    Returns
    -------
    int
    """
    return per_call_fma(plan, steps) + launch_fma * (len(plan.steps) - len(steps))


def plan_inference(
    network: ExpertNetwork,
    batch_size: int,
    *,
    max_cached: int | None = None,
    memory_limit: int | str | None = None,
    launch_fma: int = LAUNCH_FMA,
) -> tuple[ContractionPlan, frozenset[int]]:
    """Plan the forward pass for constant cores: cheapest call, core-only steps free.

    A call costs its FMAs plus [`LAUNCH_FMA`][mumoe_tn.contractions.inference_plan.LAUNCH_FMA] per step it runs
    ([`per_call_cost`][mumoe_tn.contractions.inference_plan.per_call_cost]): at a small batch a plan that
    reuses a larger core-only intermediate and runs one step fewer wins, at a large batch the
    fewest FMAs.

    Parameters
    ----------
    network : ExpertNetwork
        The decomposition.
    batch_size : int
        Rows of the flattened batch.
    max_cached : int, optional
        Most elements the cached core-only intermediates may hold (default: the larger of
        4 × the network's parameter count and
        [`INFERENCE_CACHE_ELEMENTS`][mumoe_tn.contractions.inference_plan.INFERENCE_CACHE_ELEMENTS]). Plans
        that would cache more are counted without caching.
    memory_limit : int or "max_input", optional
        Most elements an intermediate computed per call may hold (see
        [`choose_plan`][mumoe_tn.contractions.plan.choose_plan]; the cached core-only results are bounded by
        ``max_cached``).
    launch_fma : int, optional
        What a step a call runs costs, in FMAs (default [`LAUNCH_FMA`][mumoe_tn.contractions.inference_plan.LAUNCH_FMA];
        0: the fewest FMAs per call).

    Returns
    -------
    plan : ContractionPlan
        The plan (its ``fma`` counts every step).
    constant : frozenset of int
        The core-only steps to compute once (see
        [`constant_steps`][mumoe_tn.contractions.inference_plan.constant_steps]); a call then costs
        [`per_call_fma`][mumoe_tn.contractions.inference_plan.per_call_fma] FMAs.
    """
    batch_size = _check_batch(batch_size)
    limit = max(4 * network.n_params, INFERENCE_CACHE_ELEMENTS) if max_cached is None else max_cached
    inputs, output = network.forward_equation()
    inputs = tuple(tuple(labels) for labels in inputs)
    output = tuple(output)
    sizes = {**network.sizes, BATCH_LABEL: batch_size}
    found: list[tuple[ContractionPlan, frozenset[int]]] = []
    for scale in INFERENCE_SCALES:
        scaled = {**sizes, BATCH_LABEL: batch_size * scale}
        bound = limit_elements(memory_limit, inputs, sizes) if scale == 1 else None
        paths, notes = bounded_candidates(inputs, output, scaled, memory_limit=bound)
        for path in paths:
            try:
                plan = replace(_layout(inputs, output, sizes, path, BATCH_LABEL), note=_left_out(notes))
            except ValueError:
                continue
            steps = constant_steps(plan, len(network.cores))
            if constant_elements(plan, steps) > limit:
                steps = frozenset()
            found.append((plan, steps))
    if not found:
        return plan_forward(network, batch_size, memory_limit=memory_limit), frozenset()
    cached = {id(plan): steps for plan, steps in found}
    chosen = choose_plan(
        [plan for plan, _ in found],
        memory_limit,
        peak=lambda plan: per_call_peak(plan, cached[id(plan)]),
        fma=lambda plan: (
            per_call_cost(plan, cached[id(plan)], launch_fma),
            constant_elements(plan, cached[id(plan)]),
        ),
    )
    return chosen, cached[id(chosen)]


def per_call_peak(plan: ContractionPlan, steps: frozenset[int]) -> int:
    """Elements of the largest intermediate a call computes when the results of ``steps`` are reused."""
    return max((_size(step.output, plan.sizes) for k, step in enumerate(plan.steps) if k not in steps), default=0)
