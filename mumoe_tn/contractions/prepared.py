"""A plan specialised to constant cores: straight-line matrix products over prepared operands.

Inference runs the same plan many times with cores that do not change between calls. Each step of
[`run_plan`][mumoe_tn.contractions.execute.run_plan] works out, on every call, how to view its
operands as matrices; a core stored in another axis order is then copied into that order on every
call, and the folded-bias step narrows and slices its core each time. A
[`PreparedPlan`][mumoe_tn.contractions.prepared.PreparedPlan] does all of that once, when it is
built from the cores:

- every core a step reads as a matrix is stored as that matrix (made contiguous once);
- the folded-bias step becomes one ``addmm`` of ``z`` with the core's first ``I`` rows and its
  last row as the bias;
- the results of core-only steps that the caller provides (pre-contracted sub-networks) are
  operands like the cores;
- what remains per call is one ``mm``/``addmm``/multiply per step and a view of its result.

Batched products and products that sum no label run as one ``bmm`` or one broadcasting
multiplication laid out when the plan is built; other steps run as in ``run_plan`` (``torch.einsum``). The result is
the plan's contraction, equal to ``run_plan``'s up to rounding. Nothing here records gradients:
a prepared plan is for calls whose cores need none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mumoe_tn.contractions.pairwise import (
    align_axes,
    batched_product,
    broadcast_product,
    contract_pair,
    matrix_product,
    run_batched,
)
from mumoe_tn.contractions.plan import BATCH_LABEL, ContractionPlan, ContractionStep

__all__ = ["InputProjection", "PreparedPlan"]

Labels = tuple[str, ...]


@dataclass(frozen=True)
class _Side:
    """One factor of a step's matrix product: a prepared matrix, or a value viewed as one at call time."""

    slot: int  # register holding the value (unused when ``matrix`` is given)
    matrix: torch.Tensor | None  # the factor, prepared once
    order: tuple[int, ...] | None  # axis permutation before viewing as a matrix
    split: int  # leading axes that form the matrix's rows


@dataclass(frozen=True)
class _Instruction:
    """One step of a prepared plan.

    ``kind`` is ``"mm"``, ``"addmm"``, ``"mul"``, ``"broadcast"`` (a product of the operands with
    their axes aligned as ``form`` says), ``"bmm"`` (a batched product laid out as ``form`` says),
    ``"einsum"`` or ``"ones"`` (einsum after appending the folded bias's 1 to the operand at
    position ``shape[0]``).
    """

    kind: str
    out: int
    left: _Side | None = None
    right: _Side | None = None
    bias: torch.Tensor | None = None
    shape: tuple[int, ...] | None = None  # the result's shape (-1 for the batch), or None: keep the matrix
    step: ContractionStep | None = None
    operands: tuple[Any, ...] = ()  # einsum / mul / broadcast / bmm: (slot or constant tensor) per operand
    form: Any = None  # broadcast: each operand's (order, missing axes); bmm: its BatchedProduct


class PreparedPlan:
    """A plan bound to constant cores (and cached core-only results), run as straight-line steps.

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
        slots = list(range(n_inputs))  # the value index of each position of the plan's operand list
        short = n_inputs - 1 if ones_appended is not None else None
        self._instructions: list[_Instruction] = []
        for number, step in enumerate(plan.steps):
            picked = [slots.pop(k) for k in step.positions]
            out = n_inputs + number
            if number in constants:
                values.append((constants[number], ("constant", id(constants[number]))))
            else:
                values.append((None, None))
                self._instructions.append(self._compile(step, picked, values, out, short, ones_appended))
            slots.append(out)
        self._result = slots[0]
        # The registers as a call starts: constants in place, the rest filled as the steps run.
        self._registers: list[Any] = [tensor for tensor, _ in values]
        self._rows_start = len(plan.inputs) - self.n_rows_operands

    # ------------------------------------------------------------------ building
    def _matrix(self, key: tuple, tensor: torch.Tensor, order: tuple[int, ...] | None, split: int) -> torch.Tensor:
        """``tensor`` permuted by ``order`` and stored as a contiguous matrix of its first ``split`` axes."""
        full = (*key, order, split)
        found = self._derived.get(full)
        if found is None:
            permuted = tensor if order is None else tensor.permute(order)
            shape = (math.prod(permuted.shape[:split]), math.prod(permuted.shape[split:]))
            found = permuted.reshape(shape).contiguous()
            self._derived[full] = found
        return found

    def _side(self, value: tuple, slot: int, order: tuple[int, ...] | None, split: int) -> _Side:
        tensor, key = value
        if tensor is None:
            return _Side(slot, None, order, split)
        return _Side(slot, self._matrix(key, tensor, order, split), None, split)

    def _compile(
        self,
        step: ContractionStep,
        picked: list[int],
        values: list[tuple[torch.Tensor | None, tuple | None]],
        out: int,
        short: int | None,
        label: str | None,
    ) -> _Instruction:
        shape = tuple(-1 if x == BATCH_LABEL else self._sizes[x] for x in step.output)
        if short in picked:
            prepared = self._affine(step, picked, values, out, short, label, shape) if len(picked) == 2 else None
            if prepared is not None:
                return prepared
            # z lacks the trailing 1 of its leg: append it, then contract as the step says.
            operands = tuple(self._operand(values, k) for k in picked)
            return _Instruction("ones", out, step=step, operands=operands, shape=(picked.index(short),))
        if len(picked) == 2:
            first, second = step.operands
            if first == second == step.output:
                return _Instruction("mul", out, operands=tuple(self._operand(values, k) for k in picked))
            product = matrix_product(first, second, step.output)
            if product is not None:
                left, right = (picked[1], picked[0]) if product.swap else (picked[0], picked[1])
                n_rows, n_inner = product.n_rows, product.n_inner
                keep = None if len(step.output) == 2 and n_rows == 1 else shape
                return _Instruction(
                    "mm",
                    out,
                    left=self._side(values[left], left, product.left_order, n_rows),
                    right=self._side(values[right], right, product.right_order, n_inner),
                    shape=keep,
                )
            operands = tuple(self._operand(values, k) for k in picked)
            aligned = broadcast_product(first, second, step.output)
            if aligned is not None:
                return _Instruction("broadcast", out, operands=operands, form=aligned)
            batched = batched_product(first, second, step.output)
            if batched is not None:
                return _Instruction("bmm", out, operands=operands, form=batched)
        return _Instruction("einsum", out, step=step, operands=tuple(self._operand(values, k) for k in picked))

    def _affine(
        self,
        step: ContractionStep,
        picked: list[int],
        values: list[tuple[torch.Tensor | None, tuple | None]],
        out: int,
        short: int,
        label: str | None,
        shape: tuple[int, ...],
    ) -> _Instruction | None:
        """``z @ T[:I] + T[I]`` as one ``addmm``, where ``z`` is the rows and the other factor a constant."""
        which = picked.index(short)
        other = 1 - which
        tensor, key = values[picked[other]]
        z_labels, t_labels = step.operands[which], step.operands[other]
        product = matrix_product(z_labels, t_labels, step.output)
        if tensor is None or product is None or product.swap or product.n_inner != 1 or label not in t_labels:
            return None
        if product.left_order is not None or z_labels[-1] != label:
            return None
        axis = t_labels.index(label)
        size = tensor.shape[axis]
        weight = self._matrix((*key, "head"), tensor.narrow(axis, 0, size - 1), product.right_order, 1)
        bias = self._matrix((*key, "last"), tensor.narrow(axis, size - 1, 1), product.right_order, 1)
        keep = None if len(step.output) == 2 and product.n_rows == 1 else shape
        return _Instruction(
            "addmm", out, left=_Side(short, None, None, product.n_rows), right=_Side(0, weight, None, 1), bias=bias,
            shape=keep,
        )  # fmt: skip

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
        for position, instruction in enumerate(self._instructions):
            left, right = instruction.left, instruction.right
            if instruction.kind not in ("mm", "addmm") or left is None or right is None:
                continue
            if left.matrix is None and left.slot == z_slot and left.order is None and left.split == 1:
                if right.matrix is None:
                    return None
                bias = None if instruction.bias is None else instruction.bias.reshape(-1)
                return InputProjection(position, right.matrix, bias, instruction.shape)
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
        registers = self._registers.copy()
        registers[self._rows_start : self._rows_start + len(rows)] = rows
        if projected is None:
            for instruction in self._instructions:
                registers[instruction.out] = _run(instruction, registers)
        else:
            skipped, result = projected
            for position, instruction in enumerate(self._instructions):
                if position == skipped:
                    registers[instruction.out] = result if instruction.shape is None else result.view(instruction.shape)
                else:
                    registers[instruction.out] = _run(instruction, registers)
        return registers[self._result]


@dataclass(frozen=True)
class InputProjection:
    """A prepared plan's step ``input @ matrix (+ bias)``: where it is, and its constant factors.

    Attributes
    ----------
    position : int
        The step's place among the plan's instructions.
    matrix : torch.Tensor
        ``(I, K)``, contiguous.
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


def _run(instruction: _Instruction, registers: list[Any]) -> torch.Tensor:
    kind = instruction.kind
    if kind == "mm" or kind == "addmm":
        left, right = _as_matrix(instruction.left, registers), _as_matrix(instruction.right, registers)
        result = torch.mm(left, right) if kind == "mm" else torch.addmm(instruction.bias, left, right)
        return result if instruction.shape is None else result.view(instruction.shape)
    operands = [registers[x] if isinstance(x, int) else x for x in instruction.operands]
    if kind == "ones":
        (which,) = instruction.shape
        z = operands[which]
        operands[which] = torch.cat([z, z.new_ones(*z.shape[:-1], 1)], dim=-1)
    if kind == "mul":
        return operands[0] * operands[1]
    if kind == "bmm":
        return run_batched(instruction.form, operands[0], operands[1])
    if kind == "broadcast":
        return align_axes(operands[0], *instruction.form[0]) * align_axes(operands[1], *instruction.form[1])
    step = instruction.step
    return contract_pair(step.operands, step.output, operands, step.equation)
