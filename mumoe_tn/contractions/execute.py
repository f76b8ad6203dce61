"""Execution of a `ContractionPlan` on torch tensors, one pairwise einsum per step."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from mumoe_tn.contractions.backward import PlanFunction, affine_einsum, affine_is_plain, use_plan_function
from mumoe_tn.contractions.pairwise import contract_pair
from mumoe_tn.contractions.plan import ContractionPlan, ContractionStep

__all__ = ["constant_intermediates", "run_plan"]


def run_plan(
    plan: ContractionPlan,
    operands: Sequence[torch.Tensor],
    *,
    ones_appended: str | None = None,
    constants: Mapping[int, torch.Tensor] | None = None,
    memory_saving: bool = True,
) -> torch.Tensor:
    """Contract ``operands`` following ``plan``.

    Each step is one ``torch.einsum`` over at most two operands (one ``torch.mm`` where the
    step is a plain matrix product, see [`mumoe_tn.contractions.pairwise`][mumoe_tn.contractions.pairwise]),
    so torch never searches a path at call time, ``torch.compile(fullgraph=True)`` traces it, and autocast applies per
    step. Operands are used as given unless ``constants`` supplies precomputed results of
    some steps (see [`constant_intermediates`][mumoe_tn.contractions.execute.constant_intermediates]).

    Parameters
    ----------
    plan : ContractionPlan
        The planned steps; ``len(operands)`` must equal ``len(plan.inputs)``.
    operands : Sequence of torch.Tensor
        Tensors whose dimensions follow ``plan.inputs``.
    ones_appended : str, optional
        A label of the *last* operand whose final entry is omitted and taken to be 1 (the
        folded bias: the input ``z`` lacks the trailing 1 of leg ``i``). The step that
        contracts it computes ``einsum(z, T[:I]) + T[I]`` instead of concatenating a column
        of ones onto ``z``.
    constants : Mapping[int, torch.Tensor], optional
        Step index -> that step's result, computed earlier from operands that have not
        changed since; those steps are skipped.
    memory_saving : bool, optional
        When gradients are needed, run the steps as one autograd node whose backward holds
        less memory (default True; see [`mumoe_tn.contractions.backward`][mumoe_tn.contractions.backward]).
        False records every step with autograd.

    Returns
    -------
    torch.Tensor
        The result, with dimensions ordered as ``plan.output``.
    """
    if memory_saving and constants is None:
        program = use_plan_function(plan, operands, ones_appended)
        if program is not None:
            return PlanFunction.apply(program, ones_appended, *operands)
    current = list(operands)
    short = len(current) - 1 if ones_appended is not None else -1
    for number, step in enumerate(plan.steps):
        if constants is not None and number in constants:
            short -= sum(1 for k in step.positions if k < short)  # z is never part of a constant step
            for k in step.positions:
                current.pop(k)
            current.append(constants[number])
            continue
        if short in step.positions:
            picked = [current.pop(k) for k in step.positions]
            current.append(_affine_step(step, picked, step.positions.index(short), ones_appended))
            short = -1
            continue
        short -= sum(1 for k in step.positions if k < short)  # later pops shift it down
        picked = [current.pop(k) for k in step.positions]
        current.append(contract_pair(step.operands, step.output, picked, step.equation))
    return current[0]


def constant_intermediates(
    plan: ContractionPlan, operands: Sequence[torch.Tensor], steps: Collection[int]
) -> dict[int, torch.Tensor]:
    """Compute the results of ``steps``, which must depend only on ``operands``.

    Parameters
    ----------
    plan : ContractionPlan
        The plan.
    operands : Sequence of torch.Tensor
        The first ``len(operands)`` operands of the plan (e.g. the cores).
    steps : Collection of int
        Step indices whose inputs descend from ``operands`` only, as given by
        [`mumoe_tn.contractions.inference_plan.constant_steps`][mumoe_tn.contractions.inference_plan.constant_steps].

    Returns
    -------
    dict of int to torch.Tensor
        Step index -> result, for [`run_plan`][mumoe_tn.contractions.execute.run_plan]'s ``constants``.
    """
    current: list[torch.Tensor | None] = [*operands, *([None] * (len(plan.inputs) - len(operands)))]
    results = {}
    for number, step in enumerate(plan.steps):
        picked = [current.pop(k) for k in step.positions]
        if number in steps:
            if any(tensor is None for tensor in picked):
                raise ValueError(f"step {number} of the plan depends on operands beyond the {len(operands)} given")
            results[number] = contract_pair(step.operands, step.output, picked, step.equation)
        current.append(results.get(number))
    return results


def _affine_step(step: ContractionStep, picked: list[torch.Tensor], which: int, label: str) -> torch.Tensor:
    """One step in which operand ``which`` lacks the final entry (a 1) of leg ``label``."""
    if not affine_is_plain(step, which, label):
        # Not a plain contraction of z's leg with one tensor: append the ones explicitly.
        z = picked[which]
        picked[which] = torch.cat([z, z.new_ones(*z.shape[:-1], 1)], dim=-1)
        return torch.einsum(step.equation, *picked)
    return affine_einsum(step, picked, which, label)
