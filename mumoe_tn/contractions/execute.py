"""Execution of a `ContractionPlan` on torch tensors, one pairwise einsum per step."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from mumoe_tn.contractions.backward import PlanFunction, use_plan_function
from mumoe_tn.contractions.executor import plan_executor
from mumoe_tn.contractions.plan import ContractionPlan

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
    The steps run through the plan's [`PlanExecutor`][mumoe_tn.contractions.executor.PlanExecutor].

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
        of ones onto ``z`` (see [`FoldedBias`][mumoe_tn.contractions.executor.FoldedBias]).
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
    executor = plan_executor(plan, ones_appended)
    if constants is None:
        return executor(operands)
    registers = executor.start(operands)
    for number, tensor in constants.items():  # their steps are skipped
        registers[executor.n_inputs + number] = tensor
    return executor.run(registers)[executor.result]


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

    Raises
    ------
    ValueError
        If one of ``steps`` reads an operand beyond the ``len(operands)`` given.
    """
    registers = plan_executor(plan).constants(plan, operands, steps)
    n_inputs = len(plan.inputs)
    return {number: registers[n_inputs + number] for number in range(len(plan.steps)) if number in steps}
