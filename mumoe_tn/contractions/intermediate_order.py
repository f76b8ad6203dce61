"""The label order of a plan's intermediates: each one laid out as the step that reads it takes it.

A pairwise step runs as one matrix product where it can (see
[`mumoe_tn.contractions.pairwise`][mumoe_tn.contractions.pairwise]): its operands are viewed as
matrices ``(rows…, inner…) @ (inner…, columns…)``, or as stacks of them with the batch leading.
An operand whose labels are not in that order is permuted first, and where the permuted strides
do not allow the view, copied — forward, and again for its gradient in the backward pass. A copy
of a core costs the core's size, whatever the batch; a copy of an intermediate that carries the
batch costs the batch's. The order of an intermediate's labels is free (it only says how the step
that makes it lays its result out), so here it is chosen backwards from the output: each step asks
for its intermediate operands in the order its matrix product reads them, and the step that makes
an intermediate lays it out so. A tensor ring's batched product of its two batch-sized
intermediates, for example, then reads both as they are made, without a copy, and only the cores
are permuted.

The labels each intermediate holds, and so every FMA count and peak, are those of the path; only
their order changes, and every step computes the same sums.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["consumer_orders"]

Labels = tuple[str, ...]
#: A wish for an operand's label order: blocks in order, each block's labels in any order.
Wish = tuple[tuple[str, ...], ...]


def consumer_orders(
    inputs: Sequence[Labels], output: Labels, path: Sequence[tuple[int, ...]], results: Sequence[Labels], lead: str
) -> list[Labels]:
    """The label order of each step's result, chosen for the step that reads it.

    Parameters
    ----------
    inputs : Sequence of tuple of str
        Labels of the plan's operands.
    output : tuple of str
        Labels of the result (the last step's, kept as given).
    path : Sequence of tuple of int
        The path: positions in the current operand list, per step (taken in descending order).
    results : Sequence of tuple of str
        Each step's result in a default order: the labels it holds, and the order of any label
        no reader constrains.
    lead : str
        A label that leads every intermediate holding it (the batch).

    Returns
    -------
    list of tuple of str
        Per step, ``results``' labels in their new order; the last is ``output``.
    """
    operands: list[list[int]] = []  # per step: its operands, inputs as k, step results as len(inputs) + n
    current = list(range(len(inputs)))
    for number, positions in enumerate(path):
        operands.append([current.pop(k) for k in sorted(positions, reverse=True)])
        current.append(len(inputs) + number)

    def labels_of(ref: int) -> Labels:
        return tuple(inputs[ref]) if ref < len(inputs) else tuple(results[ref - len(inputs)])

    wishes: dict[int, Wish] = {}
    orders: list[Labels] = list(results)
    for number in reversed(range(len(path))):
        refs = operands[number]
        if number == len(path) - 1:
            order = tuple(output)
        else:
            made = _natural([labels_of(ref) for ref in refs], tuple(results[number]), lead)
            order = _resolve(wishes.get(number), made, lead)
        orders[number] = order
        if len(refs) != 2:
            continue
        first, second = refs
        fixed = (first < len(inputs), second < len(inputs))
        asked = _operand_wishes(labels_of(first), labels_of(second), order, fixed, lead)
        for ref, wish in zip(refs, asked, strict=True):
            if ref >= len(inputs) and wish is not None:
                wishes[ref - len(inputs)] = wish
    return orders


def _natural(operands: Sequence[Labels], default: Labels, lead: str) -> Labels:
    """The order a pairwise step lays its result out in without a permutation (``default`` otherwise).

    A batched product makes ``(batch, rows, columns)``, a matrix product the free labels of its
    left factor (the one holding ``lead``, else the first) and then the other's; each group's
    labels in ``default``'s order.
    """
    if len(operands) != 2:
        return default
    first, second = (set(labels) for labels in operands)
    inner = (first & second) - set(default)
    if not inner:
        return default
    batch = [x for x in default if x in first and x in second]
    if not batch and lead in second:
        first, second = second, first
    return (*batch, *(x for x in default if x not in second), *(x for x in default if x not in first))


def _resolve(wish: Wish | None, default: Labels, lead: str) -> Labels:
    """``default``'s labels as ``wish`` orders them (within a block, as in ``default``); the ``lead`` first."""
    order = default
    if wish is not None and sorted(x for block in wish for x in block) == sorted(default):
        order = tuple(x for block in wish for x in sorted(block, key=default.index))
    if lead in order and order[0] != lead:
        order = (lead, *(x for x in order if x != lead))
    return order


def _operand_wishes(
    first: Labels, second: Labels, output: Labels, fixed: tuple[bool, bool], lead: str
) -> tuple[Wish | None, Wish | None]:
    """How a pairwise step ``first · second -> output`` reads its operands without permuting them.

    A fixed operand (a plan input) keeps its order; the other one's contracted labels then
    follow it where the product reads them in its order (the first operand's), or where it holds
    ``lead`` (a copy of it would cost the batch's size). None where the step is no matrix or
    broadcast product.
    """
    if any(len(set(labels)) != len(labels) for labels in (first, second, output)):
        return None, None
    shared = [x for x in first if x in second]
    inner = [x for x in shared if x not in output]
    kept = set(output)
    if any(x not in kept and x not in inner for x in (*first, *second)) or len(kept) != len(output):
        return None, None  # a label summed within one operand: an einsum
    if not inner:  # a broadcast product: each operand in the result's order
        return tuple((x,) for x in output if x in first), tuple((x,) for x in output if x in second)
    batch = [x for x in output if x in first and x in second]
    if batch:  # a batched product: (batch, rows, inner) @ (batch, inner, columns)
        rows = [x for x in output if x in first and x not in batch]
        columns = [x for x in output if x in second and x not in batch]
        if output != (*batch, *rows, *columns):
            return None, None
        contracted = _inner_blocks(first, second, inner, fixed, lead)
        return (*_singles(batch), *_singles(rows), *contracted), (*_singles(batch), *contracted, *_singles(columns))
    free_first = [x for x in first if x not in second]
    free_second = [x for x in second if x not in first]
    if set(output[: len(free_first)]) == set(free_first):
        rows_in_first = True
    elif set(output[: len(free_second)]) == set(free_second):
        rows_in_first = False
    else:
        return None, None  # the free labels interleave in the result
    n_rows = len(free_first) if rows_in_first else len(free_second)
    rows, columns = _singles(output[:n_rows]), _singles(output[n_rows:])
    contracted = _inner_blocks(first, second, inner, fixed, lead)
    if rows_in_first:
        return (*rows, *contracted), (*contracted, *columns)
    return (*contracted, *columns), (*rows, *contracted)


def _inner_blocks(first: Labels, second: Labels, inner: list[str], fixed: tuple[bool, bool], lead: str) -> Wish:
    """The contracted labels' order in the operands.

    The first operand's where it is an input (the product reads them in its order); the second's
    where that is an input holding ``lead``; one block in any order where the second is a core (the
    intermediate's maker picks it, the core is permuted to match); the first's where both are
    intermediates (one order for both).
    """
    if fixed[0]:
        return _singles(inner)
    if fixed[1] and lead in second:
        return _singles([x for x in second if x in inner])
    if fixed[1]:
        return (tuple(inner),)
    return _singles(inner)


def _singles(labels: Sequence[str]) -> Wish:
    """``labels`` in this order: one block per label."""
    return tuple((x,) for x in labels)
