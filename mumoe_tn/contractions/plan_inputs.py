"""What planning takes in, checked: labels and sizes, explicit paths, memory limits; and a step's einsum equation.

The checks run before any path search, so bad input gets the library's own ``ValueError``
quoting it (see [`plan_contraction`][mumoe_tn.contractions.plan.plan_contraction], which re-exports
``einsum_equation`` and ``check_memory_limit``). This module does not import torch.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "EINSUM_SYMBOLS",
    "check_labels",
    "check_memory_limit",
    "check_path",
    "einsum_equation",
    "limit_elements",
]

#: torch.einsum accepts only these subscripts: symbols are assigned per pairwise step.
EINSUM_SYMBOLS = string.ascii_letters

Labels = tuple[str, ...]


def check_path(path: Sequence[Any], n_operands: int) -> tuple[tuple[int, ...], ...]:
    """Check an explicit path against the operand count; return it as tuples of ints."""
    remaining = n_operands
    checked = []
    for number, step in enumerate(path):
        if (
            not isinstance(step, tuple)
            or not step
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in step)
            or len(set(step)) != len(step)
        ):
            raise ValueError(
                f"explicit path step {number} must be a non-empty tuple of distinct int positions, got {step!r}"
            )
        if not all(0 <= k < remaining for k in step):
            raise ValueError(
                f"explicit path step {number} {step!r} refers to a position outside 0..{remaining - 1} "
                f"(the operand list has {remaining} entries at that step)"
            )
        remaining -= len(step) - 1
        checked.append(step)
    if remaining != 1 or not checked:
        raise ValueError(
            f"explicit path {tuple(path)!r} leaves {remaining} operand(s) of {n_operands}; "
            "a path must contract every operand into one result"
        )
    return tuple(checked)


def einsum_equation(operands: Sequence[Labels], result: Labels) -> str:
    """A ``torch.einsum`` equation for labelled operands, with symbols assigned per call (a-z, A-Z).

    Parameters
    ----------
    operands : Sequence of tuple of str
        Labels of each operand.
    result : tuple of str
        Labels of the result.

    Returns
    -------
    str
        E.g. ``"ab,bc->ac"``; a ``ValueError`` when more than 52 distinct labels meet.
    """
    labels = list(dict.fromkeys((*(x for labels in operands for x in labels), *result)))
    if len(labels) > len(EINSUM_SYMBOLS):
        raise ValueError(
            f"a contraction step joins {len(labels)} distinct labels but torch.einsum accepts at most "
            f"{len(EINSUM_SYMBOLS)} per call: {labels}"
        )
    symbol = dict(zip(labels, EINSUM_SYMBOLS, strict=False))
    equation = ",".join("".join(symbol[x] for x in labels) for labels in operands)
    return equation + "->" + "".join(symbol[x] for x in result)


def check_memory_limit(memory_limit: object) -> int | str | None:
    """``memory_limit`` checked: None, a positive int (elements) or ``"max_input"`` (the largest operand).

    Raises
    ------
    ValueError
        For anything else, quoting it.
    """
    if memory_limit is None or memory_limit == "max_input":
        return memory_limit  # type: ignore[return-value]
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit < 1:
        raise ValueError(
            "memory_limit must be None, a positive int (elements of the largest intermediate) or 'max_input', "
            f"got {memory_limit!r}"
        )
    return memory_limit


def limit_elements(memory_limit: object, inputs: Sequence[Labels], sizes: Mapping[str, int]) -> int | None:
    """``memory_limit`` as an element count (None: no limit)."""
    if check_memory_limit(memory_limit) == "max_input":
        return max(_size(labels, sizes) for labels in inputs)
    return memory_limit  # type: ignore[return-value]


def check_labels(inputs: tuple[Labels, ...], output: Labels, sizes: Mapping[str, int]) -> None:
    """Every label sized, at least one operand, every output label carried by an operand."""
    if not inputs:
        raise ValueError("a contraction needs at least one operand")
    for labels in (*inputs, output):
        for label in labels:
            if label not in sizes:
                raise ValueError(f"label {label!r} has no size; sizes are given for {sorted(sizes)}")
    missing = set(output) - {x for labels in inputs for x in labels}
    if missing:
        raise ValueError(f"output labels {sorted(missing)} appear in no operand")


def _size(labels: Sequence[str], sizes: Mapping[str, int]) -> int:
    total = 1
    for label in labels:
        total *= sizes[label]
    return total
