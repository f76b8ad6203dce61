"""Saved plans: a layer's contraction plans as a JSON-able dict, checked when read back.

A layer plans once per batch-size bucket. Writing its plans down lets them travel with a
checkpoint, or be computed on one process of a distributed job and broadcast to the others, so
that every process runs the same steps (same rounding, same memory) without searching again.

A saved plan is data, and its order of steps decides how much memory a call allocates: every plan
read back is checked against a memory bound before it is kept. With the layer's ``memory_limit``
the bound is that limit (or the result's size, if larger), as for planning. Without it, the bound
is the larger of `PEAK_FACTOR` × the largest operand or result and `LOADED_PEAK_FACTOR` × the
largest intermediate of the greedy path: every plan ``"auto"`` makes keeps within
``max(PEAK_FACTOR × held, PEAK_SLACK × that)``, so the layer's own plans always load. An inference
plan is checked on the intermediates a call computes, and the core-only results it caches on the
bound of ``plan_inference`` (the larger of 4 × the parameters and ``INFERENCE_CACHE_ELEMENTS``).
A plan beyond its bound is refused with a ``ValueError`` naming the plan, the step and the sizes,
and nothing is loaded: a plan that slipped past would allocate the excess at the first call.
This module does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from mumoe_tn.contractions.inference_plan import INFERENCE_CACHE_ELEMENTS, constant_elements, constant_steps
from mumoe_tn.contractions.plan import ContractionPlan, memory_bound, plan_contraction
from mumoe_tn.contractions.search import PEAK_FACTOR
from mumoe_tn.network import BATCH_LABEL, ExpertNetwork

__all__ = ["LOADED_PEAK_FACTOR", "PLAN_KINDS", "SAVED_PLANS_FORMAT", "loaded_plan_bound", "read_plans", "write_plans"]

#: The kinds of plan a layer keeps: the forward pass, and inference with core-only steps reused.
PLAN_KINDS = ("train", "inference")
#: Version of the dictionaries written by `write_plans`.
SAVED_PLANS_FORMAT = 1
#: Without a ``memory_limit``, a loaded plan's intermediates may reach this multiple of the greedy path's largest.
LOADED_PEAK_FACTOR = 8

Entry = tuple[str, int, ContractionPlan, frozenset[int] | None]


def write_plans(network: ExpertNetwork, entries: Iterable[Entry]) -> dict[str, Any]:
    """The plans of a layer over ``network`` as a JSON-able dict.

    Parameters
    ----------
    network : ExpertNetwork
        The layer's network.
    entries : Iterable of (kind, batch, plan, constant)
        ``kind`` one of `PLAN_KINDS`, the batch-size bucket, the plan and, for inference, the
        core-only steps it reuses (None for ``"train"``).

    Returns
    -------
    dict
    """
    plans = []
    for kind, batch, plan, constant in entries:
        entry: dict[str, Any] = {"kind": kind, "batch": int(batch), "plan": plan.to_dict()}
        if constant is not None:
            entry["constant"] = sorted(constant)
        plans.append(entry)
    return {"format": SAVED_PLANS_FORMAT, "network": network.to_spec(), "plans": plans}


def read_plans(
    network: ExpertNetwork, saved: Mapping[str, Any], *, memory_limit: int | str | None = None
) -> list[Entry]:
    """Check saved plans against ``network`` and return them as ``(kind, batch, plan, constant)``.

    Every plan must contract ``network``'s forward equation at its batch size with the network's
    sizes; inference plans may reuse only core-only steps; every plan must keep within the memory
    bound of `loaded_plan_bound` (see the module's text).

    Parameters
    ----------
    network : ExpertNetwork
        The layer's network.
    saved : Mapping[str, Any]
        A dict from `write_plans` (e.g. read back from JSON).
    memory_limit : int or "max_input", optional
        The layer's ``memory_limit`` (default None: the bound relative to the greedy path).

    Returns
    -------
    list of tuple
    """
    if not isinstance(saved, Mapping) or saved.get("format") != SAVED_PLANS_FORMAT or "plans" not in saved:
        raise ValueError(
            f"saved plans are a dict written by export_plans() (format {SAVED_PLANS_FORMAT}), got "
            f"{type(saved).__name__} {_keys(saved)}"
        )
    inputs, output = network.forward_equation()
    inputs = tuple(tuple(labels) for labels in inputs)
    found: list[Entry] = []
    for number, entry in enumerate(saved["plans"]):
        kind, batch = entry.get("kind"), entry.get("batch")
        if kind not in PLAN_KINDS:
            raise ValueError(f"saved plan {number} has kind {kind!r}; expected one of {list(PLAN_KINDS)}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or batch & (batch - 1):
            raise ValueError(f"saved plan {number} is for batch {batch!r}; plans are kept per power-of-two batch")
        plan = ContractionPlan.from_dict(entry.get("plan"))
        sizes = {**network.sizes, BATCH_LABEL: batch}
        if plan.inputs != inputs or plan.output != tuple(output) or dict(plan.sizes) != sizes:
            raise ValueError(
                f"saved plan {number} contracts another network or batch than this layer's "
                f"({network.to_spec()!r} at batch {batch}); plans only load into the layer they were made for"
            )
        constant = None
        if kind == "inference":
            constant = frozenset(int(k) for k in entry.get("constant", ()))
            if not constant <= constant_steps(plan, len(network.cores)):
                raise ValueError(
                    f"saved inference plan {number} reuses steps {sorted(constant)} that involve the input"
                )
        _check_memory(network, number, kind, batch, plan, constant or frozenset(), memory_limit)
        found.append((kind, batch, plan, constant))
    return found


def loaded_plan_bound(network: ExpertNetwork, batch: int, memory_limit: int | str | None = None) -> int:
    """The most elements an intermediate of a loaded plan of ``network`` at ``batch`` may hold.

    Parameters
    ----------
    network : ExpertNetwork
        The layer's network.
    batch : int
        The plan's batch-size bucket.
    memory_limit : int or "max_input", optional
        The layer's ``memory_limit``: the bound is that limit, or the result's size if larger.
        Default: the larger of `PEAK_FACTOR` × the largest operand or result and
        `LOADED_PEAK_FACTOR` × the greedy path's largest intermediate.

    Returns
    -------
    int
        Elements.
    """
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch}
    greedy = plan_contraction(inputs, output, sizes, "greedy", lead=BATCH_LABEL)
    if memory_limit is not None:
        return memory_bound([greedy], memory_limit)
    held = max(math.prod(sizes[x] for x in labels) for labels in (*inputs, output))
    return max(PEAK_FACTOR * held, LOADED_PEAK_FACTOR * greedy.largest_intermediate)


def _check_memory(
    network: ExpertNetwork,
    number: int,
    kind: str,
    batch: int,
    plan: ContractionPlan,
    constant: frozenset[int],
    memory_limit: int | str | None,
) -> None:
    """Refuse a saved plan whose per-call intermediates or cached results exceed their bounds."""
    cache = max(4 * network.n_params, INFERENCE_CACHE_ELEMENTS)
    if constant and constant_elements(plan, constant) > cache:
        raise ValueError(
            f"saved inference plan {number} (batch {batch}) caches {constant_elements(plan, constant):,} elements "
            f"of core-only results, above the bound of {cache:,} (4x the parameters, at least "
            f"{INFERENCE_CACHE_ELEMENTS:,}); plan this layer afresh rather than load it"
        )
    bound = loaded_plan_bound(network, batch, memory_limit)
    for step_number, step in enumerate(plan.steps):
        if step_number in constant:
            continue
        elements = math.prod(plan.sizes[x] for x in step.output)
        if elements > bound:
            rule = (
                f"memory_limit={memory_limit!r}"
                if memory_limit is not None
                else f"{PEAK_FACTOR}x the largest operand or result, or {LOADED_PEAK_FACTOR}x the largest "
                "intermediate of the greedy path"
            )
            raise ValueError(
                f"saved {kind} plan {number} (batch {batch}) step {step_number} {step.describe()} makes an "
                f"intermediate of {elements:,} elements, above the bound of {bound:,} ({rule}); "
                "plan this layer afresh rather than load it"
            )


def _keys(saved: object) -> str:
    return str(sorted(map(str, saved))) if isinstance(saved, Mapping) else ""
