"""A planned contraction as one autograd node, with a backward pass that holds less memory.

Recording every pairwise einsum of a plan with autograd keeps each step's operands until that
step's backward has run, keeps the output of every elementwise step (e.g. CP's Hadamard product
of the input and coefficient projections) although it costs one multiply per element to redo,
and allocates a fresh gradient for every operand. [`PlanFunction`][mumoe_tn.contractions.backward.PlanFunction]
runs the same steps, but

- drops the outputs of elementwise steps after the forward pass and recomputes them in the
  backward pass where they are needed,
- frees every intermediate and every intermediate gradient right after its last use (a second
  backward pass through a retained graph recomputes the intermediates from the saved operands),
  and
- computes the gradient of an elementwise product into the incoming gradient's buffer when that
  buffer is its own (``dA = dC · B`` in place, after ``dB = dC · A``).

The gradients are those of the einsum steps (the test suite compares them with autograd
through [`run_plan`][mumoe_tn.contractions.execute.run_plan]'s plain path on random networks);
with ``create_graph=True`` the backward pass is itself recorded (no in-place writes), so
gradient penalties and double backward work. The plain path is used under ``torch.compile``,
``torch.func`` transforms, autocast and activation checkpointing (see
[`use_plan_function`][mumoe_tn.contractions.backward.use_plan_function]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mumoe_tn.contractions.executor import FoldedBias, PlanExecutor, PlanStep, kept_by_plan, plan_executor
from mumoe_tn.contractions.pairwise import contract_pair
from mumoe_tn.contractions.plan import ContractionPlan, ContractionStep

__all__ = ["MIN_ELEMENTS", "PlanFunction", "plan_program", "use_plan_function"]

Labels = tuple[str, ...]

#: Plans whose largest intermediate holds fewer elements run as plain einsum steps: there the
#: one-node backward saves little memory and its bookkeeping costs more time than it saves.
MIN_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class _StepProgram:
    """What the backward pass knows of one step, besides its instruction (which also recomputes it)."""

    instruction: PlanStep
    elementwise: bool  # every label of every operand is kept: one multiply per output element
    short: int | None  # which operand is z without its trailing 1 (the folded bias), if any
    terminal: tuple[bool, ...]  # per operand: an input of the plan (no earlier step reads its gradient)

    @property
    def step(self) -> ContractionStep:
        return self.instruction.step

    @property
    def values(self) -> tuple[int, ...]:
        return self.instruction.values

    @property
    def output(self) -> int:
        return self.instruction.out


@dataclass(frozen=True)
class _Program:
    executor: PlanExecutor  # runs the forward pass (and recomputes a dropped intermediate)
    steps: tuple[_StepProgram, ...]
    dropped: frozenset[int]  # intermediates recomputed in backward instead of kept


def _is_elementwise(step: ContractionStep) -> bool:
    if len(step.operands) < 2 or len(set(step.output)) != len(step.output):
        return False
    return all(sorted(labels) == sorted(step.output) for labels in step.operands)


def plan_program(plan: ContractionPlan, ones_appended: str | None = None) -> _Program | None:
    """The value-flow program [`PlanFunction`][mumoe_tn.contractions.backward.PlanFunction] runs for ``plan``.

    Parameters
    ----------
    plan : ContractionPlan
        The plan.
    ones_appended : str, optional
        As for [`run_plan`][mumoe_tn.contractions.execute.run_plan].

    Returns
    -------
    object or None
        None where the plan has a step the program does not express (a repeated label within one
        operand, a label summed within one operand alone, a folded bias that needs its column of
        ones appended); then the plain einsum steps run.
    """
    return kept_by_plan(plan, ("program", ones_appended), lambda: _program_of(plan, ones_appended))


def _program_of(plan: ContractionPlan, ones_appended: str | None) -> _Program | None:
    n_inputs = len(plan.inputs)
    if any(len(set(x)) != len(x) for x in plan.inputs):
        return None  # a repeated label within one operand (a diagonal): autograd handles it
    executor = plan_executor(plan, ones_appended)
    steps = []
    for instruction in executor.instructions:
        step = instruction.step
        for k, operand in enumerate(step.operands):
            others = {x for j, labels in enumerate(step.operands) if j != k for x in labels}
            if not set(operand) <= others | set(step.output):
                return None  # a label summed within one operand alone: autograd handles it
        which = instruction.which if isinstance(instruction, FoldedBias) else None
        if which is not None and not instruction.plain:
            return None
        terminal = tuple(v < n_inputs for v in instruction.values)
        steps.append(_StepProgram(instruction, _is_elementwise(step), which, terminal))
    dropped = set()
    for program in steps[:-1]:
        if program.elementwise and all(v < n_inputs or v not in dropped for v in program.values):
            dropped.add(program.output)
    return _Program(executor, tuple(steps), frozenset(dropped))


def use_plan_function(
    plan: ContractionPlan, operands: Sequence[torch.Tensor], ones_appended: str | None
) -> _Program | None:
    """The program to run through [`PlanFunction`][mumoe_tn.contractions.backward.PlanFunction], or None.

    None (run the plain einsum steps) when no gradient is needed, while ``torch.compile``
    traces, under ``torch.func`` transforms, autocast or saved-tensor hooks (activation
    checkpointing), for small plans (largest intermediate below
    [`MIN_ELEMENTS`][mumoe_tn.contractions.backward]), for plans without an elementwise step (no
    product to recompute: autograd's per-step nodes free as early and reuse the permuted core
    copies the forward einsums made), or when the plan has a step the program does not express.
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return None
    if len(plan.steps) < 2 or plan.largest_intermediate < MIN_ELEMENTS:
        return None  # (the plan's own property, read before the operands)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in operands):
        return None
    if torch.is_autocast_enabled(operands[0].device.type):
        return None
    if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        return None  # checkpoint-style hooks must see every saved tensor
    program = plan_program(plan, ones_appended)
    # Without an elementwise step to recompute, autograd's per-step nodes free as early and
    # reuse the permuted copies of the cores that the forward einsums made.
    return program if program is not None and program.dropped else None


def _grad_of_operand(
    grad: torch.Tensor,
    output: Labels,
    others: Sequence[tuple[torch.Tensor, Labels]],
    target: Labels,
    *,
    terminal: bool = False,
) -> torch.Tensor:
    """``∂ einsum(…) / ∂ operand`` applied to ``grad``: contract it with the other operands.

    Every label of the operand is in the output or in another operand (checked by `_program_of`).
    For a ``terminal`` operand (an input, whose gradient no later step reads) with one other
    operand whose gradient is smaller than both tensors it is made from (a weight's gradient, summed
    over the batch), the labels from the side spanning fewer entries come first: they are the rows
    of the batched matrix product, the orientation BLAS runs faster (as autograd's own ``bmm``
    backward arranges it); the result is returned as a permuted view. Other gradients keep the
    natural order, laid out contiguously: a batch-sized gradient (e.g. of the expert coefficients)
    goes on to the caller's backward, whose elementwise kernels run several times slower on a
    transposed operand.
    """
    operands = [(grad, output), *((tensor, labels) for tensor, labels in others)]
    order = target
    if terminal and len(operands) == 2 and _result_size(operands, target) < min(t.numel() for t, _ in operands):
        small = min(operands, key=lambda operand: _span(*operand, target))[1]
        order = tuple(x for x in target if x in small) + tuple(x for x in target if x not in small)
    result = contract_pair([labels for _, labels in operands], order, [tensor for tensor, _ in operands])
    return result if order == target else result.permute(*(order.index(x) for x in target))


def _result_size(operands: Sequence[tuple[torch.Tensor, Labels]], target: Labels) -> int:
    """Entries of the contraction's result, labelled ``target``."""
    sizes = {label: size for tensor, labels in operands for label, size in zip(labels, tensor.shape, strict=True)}
    return math.prod(sizes[label] for label in target)


def _span(tensor: torch.Tensor, labels: Labels, target: Labels) -> int:
    """Entries of ``tensor`` along its labels that ``target`` keeps."""
    span = 1
    for size, label in zip(tensor.shape, labels, strict=True):
        if label in target:
            span *= size
    return span


class PlanFunction(torch.autograd.Function):
    """Run a plan as one autograd node (see the module notes).

    ``PlanFunction.apply(plan_program(plan, ones_appended), ones_appended, *operands)``;
    [`run_plan`][mumoe_tn.contractions.execute.run_plan] calls it where it pays off.
    """

    @staticmethod
    def forward(ctx: Any, program: _Program, label: str | None, *operands: torch.Tensor) -> torch.Tensor:
        executor = program.executor
        values = executor.run(executor.start(operands), record=True)  # the intermediates are kept for backward
        result = values[program.steps[-1].output]
        for value in program.dropped:
            values[value] = None
        values[program.steps[-1].output] = None
        ctx.program, ctx.label = program, label
        ctx.intermediates = values[len(operands) :]
        ctx.n_inputs = len(operands)
        ctx.save_for_backward(*operands)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        program: _Program = ctx.program
        n_inputs = ctx.n_inputs
        # The intermediates are let go as the backward pass uses them; a second backward through a
        # retained graph (retain_graph=True) recomputes them from the saved operands, and so does
        # a recorded one (create_graph=True), where they must depend on the operands.
        intermediates = ctx.intermediates
        ctx.intermediates = None
        if intermediates is None or torch.is_grad_enabled():
            intermediates = [None] * len(program.steps)
        values: list[torch.Tensor | None] = [*ctx.saved_tensors, *intermediates]
        del intermediates
        needs = _needs_grad(program, ctx.needs_input_grad[2:])
        grads: list[torch.Tensor | None] = [None] * len(values)
        grads[program.steps[-1].output] = grad
        for number in range(len(program.steps) - 1, -1, -1):
            program_step = program.steps[number]
            out_grad = grads[program_step.output]
            grads[program_step.output] = None
            if out_grad is not None:
                for value in program_step.values:
                    if values[value] is None:
                        _recompute(program, value, values, n_inputs)
                # Every gradient but the caller's (that of the last step) is a buffer of this pass;
                # with create_graph=True the backward pass is recorded, so nothing is overwritten.
                grad_owned = number != len(program.steps) - 1 and not torch.is_grad_enabled()
                _step_backward(program_step, ctx.label, out_grad, grad_owned, values, grads, needs)
            for value in program_step.values:  # every value is the operand of one step only
                if value >= n_inputs:
                    values[value] = None
        return (None, None, *grads[:n_inputs])


def _needs_grad(program: _Program, inputs: Sequence[bool]) -> list[bool]:
    needs = [*inputs, *([False] * len(program.steps))]
    for program_step in program.steps:
        needs[program_step.output] = any(needs[v] for v in program_step.values)
    return needs


def _recompute(program: _Program, value: int, values: list[torch.Tensor | None], n_inputs: int) -> None:
    program_step = program.steps[value - n_inputs]
    for operand in program_step.values:
        if values[operand] is None:
            _recompute(program, operand, values, n_inputs)
    values[value] = program_step.instruction(values)


def _step_backward(
    program_step: _StepProgram,
    label: str | None,
    out_grad: torch.Tensor,
    grad_owned: bool,
    values: list[torch.Tensor | None],
    grads: list[torch.Tensor | None],
    needs: list[bool],
) -> None:
    step = program_step.step
    operands = [values[v] for v in program_step.values]
    wanted = [k for k, v in enumerate(program_step.values) if needs[v]]
    results: dict[int, torch.Tensor] = {}
    if program_step.short is not None:
        results = _affine_backward(program_step, operands, out_grad, wanted, label)
    elif program_step.elementwise and len(operands) == 2 and all(labels == step.output for labels in step.operands):
        # dB = dC · A first, then dA = dC · B into dC's own buffer when it is ours.
        if 1 in wanted:
            results[1] = out_grad * operands[0]
        if 0 in wanted:
            results[0] = out_grad.mul_(operands[1]) if grad_owned else out_grad * operands[1]
    else:
        for k in wanted:
            others = [(operands[j], step.operands[j]) for j in range(len(operands)) if j != k]
            terminal = program_step.terminal[k]
            results[k] = _grad_of_operand(out_grad, step.output, others, step.operands[k], terminal=terminal)
    for k, result in results.items():
        grads[program_step.values[k]] = result  # every value is the operand of one step only


def _affine_backward(
    program_step: _StepProgram,
    operands: list[torch.Tensor],
    out_grad: torch.Tensor,
    wanted: list[int],
    label: str,
) -> dict[int, torch.Tensor]:
    """Gradients of ``einsum(z, T[:I]) + T[I]`` (``z`` lacks the trailing 1 of the leg)."""
    step = program_step.step
    which, other = program_step.short, 1 - program_step.short
    z, tensor = operands[which], operands[other]
    z_labels, other_labels = step.operands[which], step.operands[other]
    axis = other_labels.index(label)
    results = {}
    if which in wanted:
        narrowed = tensor.narrow(axis, 0, z.shape[-1])
        results[which] = _grad_of_operand(out_grad, step.output, [(narrowed, other_labels)], z_labels)
    if other in wanted:
        terminal = program_step.terminal[other]
        body = _grad_of_operand(out_grad, step.output, [(z, z_labels)], other_labels, terminal=terminal)
        rest = tuple(x for x in other_labels if x != label)
        bias = _grad_of_operand(out_grad, step.output, [], rest)
        results[other] = torch.cat([body, bias.unsqueeze(axis)], dim=axis)
    return results
