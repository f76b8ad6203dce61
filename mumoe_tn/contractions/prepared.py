"""A plan specialised to constant cores: straight-line matrix products over prepared operands.

Inference runs the same plan many times with cores that do not change between calls. Each step of
[`run_plan`][mumoe_tn.contractions.execute.run_plan] works out, on every call, how to view its
operands as matrices; a core stored in another axis order is then copied into that order on every
call, and the folded-bias step narrows and slices its core each time. A
[`PreparedPlan`][mumoe_tn.contractions.prepared.PreparedPlan] does all of that once, when it is
built from the cores:

- every core a step reads as a matrix is stored as that matrix (made contiguous once), a wide
  right factor of per-call rows column-major where the plan's batch has
  [`COLUMN_MAJOR_ROWS`][mumoe_tn.contractions.prepared.COLUMN_MAJOR_ROWS] rows or more;
- the folded-bias step becomes one ``addmm`` of ``z`` with the core's first ``I`` rows and its
  last row as the bias;
- the results of core-only steps that the caller provides (pre-contracted sub-networks) are
  operands like the cores;
- what remains per call is one ``mm``/``addmm``/multiply per step and a view of its result.

Batched products and products that sum no label run as one ``bmm`` or one broadcasting
multiplication laid out when the plan is built; other steps, and a folded-bias step whose other
factor is computed per call, keep the plan's own instruction (as ``run_plan`` runs it). The
instructions run through the plan's [`PlanExecutor`][mumoe_tn.contractions.executor.PlanExecutor],
whose registers start with the cores and cached results in place. The result is the plan's
contraction, equal to ``run_plan``'s up to rounding. Nothing here records gradients: a prepared
plan is for calls whose cores need none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mumoe_tn.contractions.executor import FoldedBias, Instruction, PlanExecutor, PlanStep, plan_executor
from mumoe_tn.contractions.pairwise import (
    align_axes,
    batched_product,
    broadcast_product,
    matrix_product,
    run_batched,
)
from mumoe_tn.contractions.plan import BATCH_LABEL, ContractionPlan

__all__ = ["COLUMN_MAJOR_ROWS", "InputProjection", "PreparedPlan"]

Labels = tuple[str, ...]

COLUMN_MAJOR_ROWS = 4
"""Batch (a plan's bucket) from which a prepared wide right factor of per-call rows is stored column-major.

BLAS's small-row products read a right factor with more columns than rows faster by columns (as
``nn.Linear`` stores its weight): for a CP layer's ``(B, 529) @ (529, 3072)`` on one CPU thread,
0.55× the row-major time at B = 4, 0.86× at B = 8, 0.98× at B = 64, but 1.3× at B = 1 and 2,
which keep rows. A tall factor (``(3072, 552)``) is read 5–10 % slower by columns: it keeps rows.
"""


@dataclass(frozen=True)
class _Side:
    """One factor of a step's matrix product: a prepared matrix, or a value viewed as one at call time."""

    slot: int  # register holding the value (unused when ``matrix`` is given)
    matrix: torch.Tensor | None  # the factor, prepared once
    order: tuple[int, ...] | None  # axis permutation before viewing as a matrix
    split: int  # leading axes that form the matrix's rows


@dataclass(frozen=True, eq=False)
class _Instruction:
    """One product of a prepared plan over registers.

    ``kind`` is ``"mm"`` (``left @ right``, each a prepared matrix or a register viewed as one),
    ``"mul"``, ``"broadcast"`` (a product of the operands with their axes aligned as ``form``
    says) or ``"bmm"`` (a batched product laid out as ``form`` says).
    """

    kind: str
    out: int
    frees: tuple[int, ...]
    left: _Side | None = None
    right: _Side | None = None
    shape: tuple[int, ...] | None = None  # the result's shape (-1 for the batch), or None: keep the matrix
    operands: tuple[Any, ...] = ()  # mul / broadcast / bmm: (register or constant tensor) per operand
    form: Any = None  # broadcast: each operand's (order, missing axes); bmm: its BatchedProduct

    def __call__(self, registers: list[Any]) -> torch.Tensor:
        kind = self.kind
        if kind == "mm":
            result = torch.mm(_as_matrix(self.left, registers), _as_matrix(self.right, registers))
            shape = self.shape  # (a view by separate sizes parses faster than by one tuple)
            return result if shape is None else result.view(*shape) if shape else result.view(shape)
        first, second = self.operands  # (a register's number, or a constant tensor)
        if type(first) is int:
            first = registers[first]
        if type(second) is int:
            second = registers[second]
        if kind == "mul":
            return first * second
        if kind == "bmm":
            return run_batched(self.form, first, second)
        return align_axes(first, *self.form[0]) * align_axes(second, *self.form[1])


class PreparedPlan:
    """A plan bound to constant cores (and cached core-only results), run as straight-line steps.

    Built on the plan's [`plan_executor`][mumoe_tn.contractions.executor.plan_executor]: each of its
    instructions is replaced by a product over prepared matrices where one serves, and the steps
    whose results are given are dropped.

    Parameters
    ----------
    plan : ContractionPlan
        The plan; its first ``len(cores)`` inputs are the cores, the rest are supplied per call.
    cores : Sequence of torch.Tensor
        The cores, as the plan reads them.
    constants : Mapping of int to torch.Tensor, optional
        Results of core-only steps (step index → tensor), as from
        [`constant_intermediates`][mumoe_tn.contractions.execute.constant_intermediates].
    ones_appended : str, optional
        A label of the *last* operand whose final entry (a 1, the folded bias) the calls omit.
    derived : MutableMapping, optional
        A store of the prepared matrices, shared by the plans of one set of cores, so that plans
        reading a core the same way keep one copy of it.
    """

    def __init__(
        self,
        plan: ContractionPlan,
        cores: Sequence[torch.Tensor],
        constants: Mapping[int, torch.Tensor] | None = None,
        *,
        ones_appended: str | None = None,
        derived: MutableMapping[tuple, torch.Tensor] | None = None,
    ) -> None:
        self.plan = plan
        self.n_rows_operands = len(plan.inputs) - len(cores)
        self._derived = {} if derived is None else derived
        constants = constants or {}
        n_inputs = len(plan.inputs)
        # Each value is a constant tensor (with the key it is stored under) or a register filled per call.
        values: list[tuple[torch.Tensor | None, tuple | None]] = [(core, ("core", k)) for k, core in enumerate(cores)]
        values += [(None, None)] * self.n_rows_operands
        # Sizes as the cores have them (padded bonds included); the batch is whatever a call brings.
        self._sizes = dict(plan.sizes)
        for labels, core in zip(plan.inputs, cores, strict=False):  # the cores lead the plan's inputs
            self._sizes.update(zip(labels, core.shape, strict=True))
        plain = plan_executor(plan, ones_appended)
        instructions: list[Instruction] = []
        for number, instruction in enumerate(plain.instructions):
            if number in constants:
                values.append((constants[number], ("constant", id(constants[number]))))
            else:
                values.append((None, None))
                instructions.append(self._compile(instruction, values))
        # The registers as a call starts: constants in place, the rest filled as the steps run.
        registers = tuple(tensor for tensor, _ in values)
        self._executor = PlanExecutor(tuple(instructions), n_inputs, plain.result, registers)
        # Where each instruction's result goes, and how a product computed elsewhere is viewed there.
        self._results = [(instruction.out, getattr(instruction, "shape", None)) for instruction in instructions]
        self._rows_start = len(plan.inputs) - self.n_rows_operands

    # ------------------------------------------------------------------ building
    def _matrix(
        self, key: tuple, tensor: torch.Tensor, order: tuple[int, ...] | None, split: int, columns: bool = False
    ) -> torch.Tensor:
        """``tensor`` permuted by ``order`` as a matrix of its first ``split`` axes, stored by rows.

        With ``columns``, a matrix with at least as many columns as rows is stored by columns,
        a view of ``tensor`` where its memory already holds it so.
        """
        permuted = tensor.detach() if order is None else tensor.detach().permute(order)
        shape = (math.prod(permuted.shape[:split]), math.prod(permuted.shape[split:]))
        columns = columns and shape[1] >= shape[0]
        full = (*key, order, split, "columns") if columns else (*key, order, split)
        found = self._derived.get(full)
        if found is None:
            found = permuted.reshape(shape)
            found = found.t().contiguous().t() if columns else found.contiguous()
            self._derived[full] = found
        return found

    def _side(self, value: tuple, slot: int, order: tuple[int, ...] | None, split: int, columns: bool = False) -> _Side:
        tensor, key = value
        if tensor is None:
            return _Side(slot, None, order, split)
        return _Side(slot, self._matrix(key, tensor, order, split, columns), None, split)

    def _compile(self, instruction: PlanStep, values: list[tuple[torch.Tensor | None, tuple | None]]) -> Instruction:
        """The step ``instruction`` over prepared matrices where it is a product they serve, else as it is."""
        step, picked, out, frees = instruction.step, instruction.values, instruction.out, instruction.frees
        shape = tuple(-1 if x == BATCH_LABEL else self._sizes[x] for x in step.output)
        if isinstance(instruction, FoldedBias):
            return self._folded(instruction, values, shape) if len(picked) == 2 else instruction
        if len(picked) == 2:
            first, second = step.operands
            if first == second == step.output:
                return _Instruction("mul", out, frees, operands=tuple(self._operand(values, k) for k in picked))
            product = matrix_product(first, second, step.output)
            if product is not None:
                left, right = (picked[1], picked[0]) if product.swap else (picked[0], picked[1])
                n_rows, n_inner = product.n_rows, product.n_inner
                keep = None if len(step.output) == 2 and n_rows == 1 else shape
                columns = values[left][0] is None and self.plan.sizes.get(BATCH_LABEL, 0) >= COLUMN_MAJOR_ROWS
                return _Instruction(
                    "mm",
                    out,
                    frees,
                    left=self._side(values[left], left, product.left_order, n_rows),
                    right=self._side(values[right], right, product.right_order, n_inner, columns),
                    shape=keep,
                )
            operands = tuple(self._operand(values, k) for k in picked)
            aligned = broadcast_product(first, second, step.output)
            if aligned is not None:
                return _Instruction("broadcast", out, frees, operands=operands, form=aligned)
            batched = batched_product(first, second, step.output)
            if batched is not None:
                return _Instruction("bmm", out, frees, operands=operands, form=batched)
        return instruction  # contract_pair over the registers, the cores among them

    def _folded(
        self,
        instruction: FoldedBias,
        values: list[tuple[torch.Tensor | None, tuple | None]],
        shape: tuple[int, ...],
    ) -> FoldedBias:
        """The folded-bias step as one ``addmm`` of ``z``'s rows where the other factor is a constant."""
        step, label, which = instruction.step, instruction.label, instruction.which
        other = 1 - which
        tensor, key = values[instruction.values[other]]
        z_labels, t_labels = step.operands[which], step.operands[other]
        product = matrix_product(z_labels, t_labels, step.output)
        if tensor is None or product is None or product.swap or product.n_inner != 1 or label not in t_labels:
            return instruction
        if product.left_order is not None or z_labels[-1] != label:
            return instruction
        axis = t_labels.index(label)
        size = tensor.shape[axis]
        weight = self._matrix((*key, "head"), tensor.narrow(axis, 0, size - 1), product.right_order, 1)
        bias = self._matrix((*key, "last"), tensor.narrow(axis, size - 1, 1), product.right_order, 1)
        keep = None if len(step.output) == 2 and product.n_rows == 1 else shape
        return replace(instruction, weight=weight, bias=bias, n_rows=product.n_rows, shape=keep)

    @staticmethod
    def _operand(values: list[tuple[torch.Tensor | None, tuple | None]], k: int) -> Any:
        return values[k][0] if values[k][0] is not None else k

    @functools.cached_property
    def input_projection(self) -> InputProjection | None:
        """The step that multiplies the input rows (the last operand) by a prepared matrix, if the plan has one.

        That step reads nothing but the input and constants, so a caller that multiplies the same
        input by another matrix (a gate's projection) can do both in one matrix product and hand
        this step's result to the call as
        ``projected``. None where the plan's first use of the input is no such product (it meets a
        per-call intermediate, or needs its column of ones appended).
        """
        z_slot = len(self.plan.inputs) - 1
        for position, instruction in enumerate(self._executor.instructions):
            if isinstance(instruction, FoldedBias):
                if instruction.weight is not None and instruction.n_rows == 1:
                    bias = instruction.bias.reshape(-1)
                    return InputProjection(position, instruction.weight, bias, instruction.shape)
                continue
            if not isinstance(instruction, _Instruction) or instruction.kind != "mm":
                continue
            left, right = instruction.left, instruction.right
            if left.matrix is None and left.slot == z_slot and left.order is None and left.split == 1:
                if right.matrix is None:
                    return None
                return InputProjection(position, right.matrix, None, instruction.shape)
        return None

    # ------------------------------------------------------------------ running
    def __call__(self, rows: Sequence[torch.Tensor], projected: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Contract the prepared cores with the per-call operands ``rows`` (coefficients, then input).

        ``projected``: ``(position, result)`` of the step `input_projection`
        names, computed by the caller as ``rows[-1] @ matrix + bias`` (any ``(rows, K)`` view);
        that step is then skipped.
        """
        if len(rows) != self.n_rows_operands:
            raise ValueError(f"the prepared plan takes {self.n_rows_operands} operands per call, got {len(rows)}")
        executor = self._executor
        registers = executor.start(rows, self._rows_start)
        if projected is not None:  # the step's product, computed by the caller: the step is skipped
            position, result = projected
            out, shape = self._results[position]
            registers[out] = result if shape is None else result.view(*shape) if shape else result.view(shape)
        return executor.run(registers)[executor.result]


@dataclass(frozen=True)
class InputProjection:
    """A prepared plan's step ``input @ matrix (+ bias)``: where it is, and its constant factors.

    Attributes
    ----------
    position : int
        The step's place among the plan's instructions.
    matrix : torch.Tensor
        ``(I, K)``, stored by rows or by columns (see
        [`COLUMN_MAJOR_ROWS`][mumoe_tn.contractions.prepared.COLUMN_MAJOR_ROWS]).
    bias : torch.Tensor or None
        ``(K,)``: the folded bias's row (the input omits its trailing 1), or None.
    shape : tuple of int or None
        How the step views its ``(rows, K)`` result (None: as the matrix).
    """

    position: int
    matrix: torch.Tensor
    bias: torch.Tensor | None
    shape: tuple[int, ...] | None


def _as_matrix(side: _Side, registers: list[Any]) -> torch.Tensor:
    if side.matrix is not None:
        return side.matrix
    value = registers[side.slot]
    if side.order is not None:
        value = value.permute(side.order)
    if value.ndim == 2 and side.split == 1:
        return value
    return value.reshape(math.prod(value.shape[: side.split]), -1)
