"""Saved plans: a layer's contraction plans as a JSON-able dict, checked when read back.

A layer plans once per batch-size bucket. Writing its plans down lets them travel with a
checkpoint, or be computed on one process of a distributed job and broadcast to the others, so
that every process runs the same steps (same rounding, same memory) without searching again.
This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mumoe_tn.contractions.plan import ContractionPlan, constant_steps
from mumoe_tn.network import BATCH_LABEL, ExpertNetwork

__all__ = ["PLAN_KINDS", "SAVED_PLANS_FORMAT", "read_plans", "write_plans"]

#: The kinds of plan a layer keeps: the forward pass, and inference with core-only steps reused.
PLAN_KINDS = ("train", "inference")
#: Version of the dictionaries written by `write_plans`.
SAVED_PLANS_FORMAT = 1

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


def read_plans(network: ExpertNetwork, saved: Mapping[str, Any]) -> list[Entry]:
    """Check saved plans against ``network`` and return them as ``(kind, batch, plan, constant)``.

    Every plan must contract ``network``'s forward equation at its batch size with the network's
    sizes; inference plans may reuse only core-only steps.

    Parameters
    ----------
    network : ExpertNetwork
        The layer's network.
    saved : Mapping[str, Any]
        A dict from `write_plans` (e.g. read back from JSON).

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
        found.append((kind, batch, plan, constant))
    return found


def _keys(saved: object) -> str:
    return str(sorted(map(str, saved))) if isinstance(saved, Mapping) else ""
