"""One executor for a plan's steps: instructions over registers, run by one loop.

A [`ContractionPlan`][mumoe_tn.contractions.plan.ContractionPlan] names each step's operands by
their positions in a list that the steps pop from and append to. A
[`PlanExecutor`][mumoe_tn.contractions.executor.PlanExecutor] turns that into registers once per
plan: the plan's inputs first, then one register per step's result, and each step an instruction
that reads its operands' registers and writes its own. Every way of running a plan is that one
loop, [`PlanExecutor.run`][mumoe_tn.contractions.executor.PlanExecutor.run], with other
parameters (as opt_einsum's ``ContractExpression`` evaluates its constants with the loop that
runs a call):

- which intermediates it *records*: a plain call lets each intermediate go after the one step
  that reads it; the one-node autograd function of [`mumoe_tn.contractions.backward`][mumoe_tn.contractions.backward]
  keeps them for its backward pass;
- which steps it *skips*: a step whose register is already filled is not run. The results of
  core-only steps computed once (see [`constant_intermediates`][mumoe_tn.contractions.execute.constant_intermediates])
  and a step's product that the caller computed itself (the input's first product, fused with
  the gate's projection) are filled in before the loop;
- which steps it *runs*: only the core-only ones, when the constants are computed;
- which instructions: the plain ones made here, or those a
  [`PreparedPlan`][mumoe_tn.contractions.prepared.PreparedPlan] lays out over constant cores.

The folded bias (the input ``z`` omits the trailing 1 of leg ``i``) is one instruction,
[`FoldedBias`][mumoe_tn.contractions.executor.FoldedBias], whichever route runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mumoe_tn.contractions.inference_plan import constant_steps
from mumoe_tn.contractions.pairwise import contract_pair, pair_form
from mumoe_tn.contractions.plan import ContractionPlan, ContractionStep

__all__ = [
    "FoldedBias",
    "Instruction",
    "PlanExecutor",
    "PlanExecutors",
    "PlanStep",
    "affine_einsum",
    "affine_is_plain",
    "kept_by_plan",
    "plan_executor",
]

Labels = tuple[str, ...]
Registers = list[torch.Tensor | None]


class Instruction(Protocol):
    """One step over registers: reads ``registers``, returns what goes into register ``out``.

    ``frees`` lists the intermediates it is the only reader of, let go after it unless recorded.
    """

    out: int
    frees: tuple[int, ...]

    def __call__(self, registers: Registers) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class PlanStep:
    """A step of a plan over registers: ``contract_pair`` of the registers ``values``.

    Attributes
    ----------
    step : ContractionStep
        The step.
    values : tuple of int
        The register of each operand, in equation order.
    out : int
        The register of the result.
    frees : tuple of int
        The intermediates among ``values`` (each is read by this step alone).
    """

    step: ContractionStep
    values: tuple[int, ...]
    out: int
    frees: tuple[int, ...]

    def __post_init__(self) -> None:
        # How the step's pair of operands multiplies, worked out once (it depends on the labels alone).
        operands = self.step.operands
        form = pair_form(*operands, self.step.output) if len(operands) == 2 else None
        object.__setattr__(self, "_form", form)

    def __call__(self, registers: Registers) -> torch.Tensor:
        step = self.step
        return contract_pair(step.operands, step.output, [registers[v] for v in self.values], step.equation, self._form)


@dataclass(frozen=True, eq=False)
class FoldedBias(PlanStep):
    """The step that reads ``z`` without the trailing 1 of leg ``label``: ``einsum(z, T[:I]) + T[I]``.

    Three forms, chosen when the instruction is made: with ``weight`` (``T[:I]`` as a prepared
    ``(I, K)`` matrix, ``bias`` its last row) one ``addmm`` of ``z``'s rows; where
    [`affine_is_plain`][mumoe_tn.contractions.executor.affine_is_plain] holds,
    [`affine_einsum`][mumoe_tn.contractions.executor.affine_einsum] on ``T`` as it is; otherwise a
    column of ones is appended to ``z`` and the step contracted as planned.

    Attributes
    ----------
    which : int
        ``z``'s place among the step's operands.
    label : str
        The leg whose last entry ``z`` omits.
    plain : bool
        ``affine_is_plain`` for this step.
    weight, bias : torch.Tensor or None
        The prepared ``T[:I]`` (``(I, K)``) and ``T[I]`` (``(1, K)``), or None.
    n_rows : int
        Leading axes of ``z`` that form the rows of the ``addmm``.
    shape : tuple of int or None
        How the ``addmm``'s result is viewed (None: as the matrix).
    """

    which: int = 0
    label: str = ""
    plain: bool = False
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    n_rows: int = 1
    shape: tuple[int, ...] | None = None

    def __call__(self, registers: Registers) -> torch.Tensor:
        if self.weight is not None:
            z = registers[self.values[self.which]]
            if z.ndim != 2 or self.n_rows != 1:
                z = z.reshape(math.prod(z.shape[: self.n_rows]), -1)
            result = torch.addmm(self.bias, z, self.weight)
            shape = self.shape  # (a view by separate sizes parses faster than by one tuple)
            return result if shape is None else result.view(*shape) if shape else result.view(shape)
        tensors = [registers[v] for v in self.values]
        if self.plain:
            return affine_einsum(self.step, tensors, self.which, self.label, self._form)
        z = tensors[self.which]
        tensors[self.which] = torch.cat([z, z.new_ones(*z.shape[:-1], 1)], dim=-1)
        step = self.step
        return contract_pair(step.operands, step.output, tensors, step.equation, self._form)


@dataclass(frozen=True, eq=False)
class PlanExecutor:
    """A plan as instructions over registers, and the one loop that runs them.

    Attributes
    ----------
    instructions : tuple of Instruction
        In the plan's order; at most one per step.
    n_inputs : int
        The plan's inputs: registers ``0 … n_inputs - 1``.
    result : int
        The register of the result.
    registers : tuple
        The registers as a call starts: None, or a constant (a prepared core, a cached core-only result).
    """

    instructions: tuple[Instruction, ...]
    n_inputs: int
    result: int
    registers: tuple[torch.Tensor | None, ...]

    def __post_init__(self) -> None:
        # What the loop reads of each instruction, the call bound once (a call through the
        # instance's type costs more, on every step of every call).
        program = tuple((instruction.out, instruction.__call__, instruction.frees) for instruction in self.instructions)
        object.__setattr__(self, "_program", program)

    @classmethod
    def of_steps(
        cls, inputs: Sequence[Labels], steps: Sequence[ContractionStep], ones_appended: str | None = None
    ) -> PlanExecutor:
        """The plain executor of a plan's ``steps`` over ``inputs``.

        See [`plan_executor`][mumoe_tn.contractions.executor.plan_executor], which keeps one per plan.
        """
        n_inputs = len(inputs)
        current = list(range(n_inputs))
        short = n_inputs - 1 if ones_appended is not None else None
        instructions: list[Instruction] = []
        for number, step in enumerate(steps):
            values = tuple(current.pop(k) for k in step.positions)
            out = n_inputs + number
            frees = tuple(v for v in values if v >= n_inputs)
            if short in values:
                which = values.index(short)
                plain = affine_is_plain(step, which, ones_appended)
                instructions.append(FoldedBias(step, values, out, frees, which, ones_appended, plain))
            else:
                instructions.append(PlanStep(step, values, out, frees))
            current.append(out)
        return cls(tuple(instructions), n_inputs, current[0], (None,) * (n_inputs + len(steps)))

    def start(self, operands: Sequence[torch.Tensor | None], first: int = 0) -> Registers:
        """The registers as a call starts: the constants, and ``operands`` from register ``first`` on."""
        registers = list(self.registers)
        registers[first : first + len(operands)] = operands
        return registers

    def run(
        self, registers: Registers, *, record: bool = False, only: Sequence[Instruction] | None = None
    ) -> Registers:
        """Run, in order, each instruction whose register is still empty; the registers are filled in place.

        A register the caller filled (a cached constant, a product computed elsewhere) skips the
        instruction that writes it.

        Parameters
        ----------
        registers : list
            As from [`start`][mumoe_tn.contractions.executor.PlanExecutor.start], with any results
            computed elsewhere filled in.
        record : bool, optional
            Keep every intermediate in the registers (default False: each is let go after the
            one step that reads it).
        only : Collection of int, optional
            Run only the instructions at these places.

        Returns
        -------
        list
            ``registers``; ``result`` holds the plan's result once every instruction has run.
        """
        program = self._program if only is None else [self._program[k] for k in sorted(only)]
        for out, instruction, frees in program:
            if registers[out] is None:
                registers[out] = instruction(registers)
                if frees and not record:
                    for value in frees:
                        registers[value] = None
        return registers

    def __call__(self, operands: Sequence[torch.Tensor]) -> torch.Tensor:
        """The plan's result on ``operands`` (one per input)."""
        return self.run(self.start(operands))[self.result]

    def constants(self, plan: ContractionPlan, operands: Sequence[torch.Tensor], steps: Collection[int]) -> Registers:
        """Registers after running only ``steps``, which must read nothing but ``operands`` (the leading inputs).

        Raises
        ------
        ValueError
            If one of ``steps`` depends on an input beyond ``operands``.
        """
        outside = sorted(set(steps) - constant_steps(plan, len(operands)))
        if outside:
            raise ValueError(f"step {outside[0]} of the plan depends on operands beyond the {len(operands)} given")
        return self.run(self.start(operands), record=True, only=steps)


def plan_executor(plan: ContractionPlan, ones_appended: str | None = None) -> PlanExecutor:
    """The plain executor of ``plan`` (made once per plan and folded-bias label, and kept by the plan).

    Parameters
    ----------
    plan : ContractionPlan
        The plan.
    ones_appended : str, optional
        A label of the *last* input whose final entry (a 1, the folded bias) the calls omit.

    Returns
    -------
    PlanExecutor
        One [`PlanStep`][mumoe_tn.contractions.executor.PlanStep] per step, the step that reads the
        last input a [`FoldedBias`][mumoe_tn.contractions.executor.FoldedBias] where ``ones_appended`` is given.
        The plan keeps it (at most one per label, freed with the plan, never pickled or copied with it).
    """
    return kept_by_plan(plan, ones_appended, lambda: PlanExecutor.of_steps(plan.inputs, plan.steps, ones_appended))


def kept_by_plan(plan: ContractionPlan, key: Any, make: Callable[[], Any]) -> Any:
    """A value derived from ``plan`` alone (its executors, its backward program): made once, kept by the plan.

    The plan holds them in a [`PlanExecutors`][mumoe_tn.contractions.executor.PlanExecutors] by
    ``key``, freed with the plan and never pickled or copied with it; while ``torch.compile``
    traces, the value is made afresh and nothing is kept (nothing Python-side changes in a
    compiled region).
    """
    if torch.compiler.is_compiling():
        return make()
    kept = plan.__dict__.get(_EXECUTORS)
    if kept is None:
        kept = plan.__dict__.setdefault(_EXECUTORS, PlanExecutors())
    found = kept.get(key, _NOT_KEPT)
    return kept.setdefault(key, make()) if found is _NOT_KEPT else found


#: The attribute of a plan that holds its executors.
_EXECUTORS = "_executors"
#: What `kept_by_plan` reads for a key not kept yet (a kept value may be None).
_NOT_KEPT = object()


class PlanExecutors(dict):
    """What a plan keeps derived from itself (executors by folded-bias label, …): a pickle or copy has none."""

    def __reduce__(self) -> tuple[type, tuple]:
        return (type(self), ())


def affine_is_plain(step: ContractionStep, which: int, label: str) -> bool:
    """Whether the folded-bias step contracts ``z``'s leg ``label`` with exactly one other operand.

    Then ``einsum(z, T[:I]) + T[I]`` computes it; otherwise a column of ones is appended.

    Parameters
    ----------
    step : ContractionStep
        The step that takes ``z``.
    which : int
        ``z``'s position among the step's operands.
    label : str
        The leg whose last entry ``z`` omits.

    Returns
    -------
    bool
    """
    others = [k for k in range(len(step.operands)) if k != which]
    return len(others) == 1 and label in step.operands[others[0]] and label not in step.output


def affine_einsum(
    step: ContractionStep, tensors: Sequence[torch.Tensor], which: int, label: str, form: tuple | None = None
) -> torch.Tensor:
    """``einsum(z, T[:I]) + T[I]``: the step with operand ``which`` lacking the trailing 1 of ``label``.

    Only for steps where [`affine_is_plain`][mumoe_tn.contractions.executor.affine_is_plain] holds.
    Where ``z`` is rows ``(B, I)`` and ``T`` a matrix whose other leg is the result's columns, it
    is one ``addmm`` (one kernel and one autograd node, as ``nn.Linear``).

    Parameters
    ----------
    step : ContractionStep
        The step.
    tensors : Sequence of torch.Tensor
        Its two operands, in equation order.
    which : int
        The position of ``z``.
    label : str
        The leg whose last entry ``z`` omits.
    form : tuple, optional
        How the step's pair multiplies (``pair_form``), if known.

    Returns
    -------
    torch.Tensor
    """
    z = tensors[which]
    other = 1 - which
    labels, tensor = step.operands[other], tensors[other]
    axis = labels.index(label)
    head = tensor.narrow(axis, 0, z.shape[-1])
    rows = step.operands[which]
    if z.ndim == 2 == tensor.ndim and rows[1] == label and tuple(step.output) == (rows[0], labels[1 - axis]):
        # rows of z times a matrix, plus its last row: one addmm (T[:I] transposed where T is (K, I + 1))
        bias = tensor.select(axis, tensor.shape[axis] - 1)
        return torch.addmm(bias, z, head if axis == 0 else head.T)
    picked = list(tensors)
    picked[other] = head
    result = contract_pair(step.operands, step.output, picked, step.equation, form)
    # The ones column meets T's last slice along the leg: add it, arranged like the result. Each
    # view left out where it would change nothing is one autograd node fewer per call.
    rest = [x for x in labels if x != label]
    bias = tensor.select(axis, tensor.shape[axis] - 1)
    order = tuple(rest.index(x) for x in step.output if x in rest)
    if order != tuple(range(len(order))):
        bias = bias.permute(order)
    if step.output[len(step.output) - len(order) :] != tuple(x for x in step.output if x in rest):
        bias = bias.reshape([result.shape[k] if x in rest else 1 for k, x in enumerate(step.output)])
    # (otherwise the bias's axes are the result's last ones, in order: it broadcasts as it is)
    return result.add_(bias) if not result.requires_grad else result + bias
