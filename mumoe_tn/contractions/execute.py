"""Execution of a :class:`ContractionPlan` on torch tensors, one pairwise einsum per step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mumoe_tn.contractions.plan import ContractionPlan

__all__ = ["run_plan"]


def run_plan(plan: ContractionPlan, operands: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract ``operands`` following ``plan``.

    Each step is one ``torch.einsum`` over at most two operands, so torch never searches a
    path at call time, ``torch.compile(fullgraph=True)`` traces it, and autocast applies per
    step. Operands are used as given (no caching of parameter-only intermediates), so
    gradients and in-place parameter updates are always seen.

    Parameters
    ----------
    plan : ContractionPlan
        The planned steps; ``len(operands)`` must equal ``len(plan.inputs)``.
    operands : Sequence of torch.Tensor
        Tensors whose dimensions follow ``plan.inputs``.

    Returns
    -------
    torch.Tensor
        The result, with dimensions ordered as ``plan.output``.
    """
    current = list(operands)
    for step in plan.steps:
        picked = [current.pop(k) for k in step.positions]
        current.append(torch.einsum(step.equation, *picked))
    return current[0]
