"""One pairwise step of a plan, as a single 2-D matrix product where no label is batched.

``torch.einsum`` runs every pairwise contraction as a batched product (``bmm``), with a batch of
one when no label is shared by both operands and the result. On CPU (MKL, torch 2.13) ``bmm`` with
a batch of one is markedly slower than ``mm`` on the same matrices (e.g. ``(2048, 65) @ (65, 38)``
forward and backward: 1.6 ms against 1.2 ms), and its reshapes add autograd nodes that cost
per-call time when the matrices are small. A step whose labels split into rows (left operand
and result), an inner part (both operands, summed) and columns (right operand and result) is
therefore run here as one ``torch.mm`` of the operands viewed as matrices; every other step
with labels shared by both operands and kept in the result (a batch) is one ``torch.bmm`` of
the operands viewed as stacks of matrices, the layout ``torch.einsum`` gives them itself, worked out
once per step instead of on every call (``einsum`` parses and plans its equation each time: about
10 µs of host time per call at small sizes); every other step (labels summed within one operand,
repeated labels) goes to ``torch.einsum`` unchanged. A step that sums no label (an elementwise or outer product, batched
or not) is one broadcasting multiplication: ``einsum`` runs it as a ``bmm`` whose inner dimension
is 1, which on CPU (2 threads) took 2.0 ms where the multiplication takes 0.7 ms (``(1024, 512, 1)
@ (1024, 1, 8)``, in a Tucker layer's backward pass).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import torch

from mumoe_tn.contractions.plan import einsum_equation

__all__ = [
    "BatchedProduct",
    "MatrixProduct",
    "align_axes",
    "batched_layout",
    "batched_product",
    "broadcast_product",
    "contract_pair",
    "matrix_product",
    "pair_form",
    "run_batched",
]

Labels = tuple[str, ...]


@dataclass(frozen=True)
class MatrixProduct:
    """How a pairwise step runs as ``left @ right``.

    Attributes
    ----------
    swap : bool
        The second operand is the left factor (its free labels lead the result).
    left_order : tuple of int or None
        Permutation of the left factor's axes into ``(rows…, inner…)``; None when already so.
    right_order : tuple of int or None
        Permutation of the right factor's axes into ``(inner…, columns…)``; None when already so.
    n_rows : int
        Number of row axes (leading axes of the permuted left factor and of the result).
    n_inner : int
        Number of contracted axes.
    """

    swap: bool
    left_order: tuple[int, ...] | None
    right_order: tuple[int, ...] | None
    n_rows: int
    n_inner: int


def matrix_product(first: Labels, second: Labels, output: Labels) -> MatrixProduct | None:
    """The matrix-product form of ``einsum(first, second -> output)``, or None where it has none.

    It has one when every label appears once per operand, at least one label is shared by the
    two operands and summed (in neither result), every other label of an operand is in the
    result, and the result lists the free labels of one operand before those of the other.

    Parameters
    ----------
    first, second : tuple of str
        Labels of the two operands.
    output : tuple of str
        Labels of the result.

    Returns
    -------
    MatrixProduct or None
    """
    if any(len(set(labels)) != len(labels) for labels in (first, second, output)):
        return None
    inner = tuple(x for x in first if x in second)
    free_first = [x for x in first if x not in second]
    free_second = [x for x in second if x not in first]
    # The result holds exactly the free labels: no shared label is kept (batched), none summed alone.
    if not inner or sorted(output) != sorted(free_first + free_second):
        return None
    if set(output[: len(free_first)]) == set(free_first):
        swap, left, right, n_rows = False, first, second, len(free_first)
    elif set(output[: len(free_second)]) == set(free_second):
        swap, left, right, n_rows = True, second, first, len(free_second)
    else:
        return None  # the free labels interleave in the result
    rows, columns = output[:n_rows], output[n_rows:]
    left_order = tuple(left.index(x) for x in (*rows, *inner))
    right_order = tuple(right.index(x) for x in (*inner, *columns))
    return MatrixProduct(
        swap,
        None if left_order == tuple(range(len(left))) else left_order,
        None if right_order == tuple(range(len(right))) else right_order,
        n_rows,
        len(inner),
    )


@dataclass(frozen=True)
class BatchedProduct:
    """How a pairwise step runs as one ``torch.bmm``: ``left (B, M, K) @ right (B, K, N)``.

    Attributes
    ----------
    left_order, right_order : tuple of int or None
        Permutations of the first operand's axes into ``(batch…, rows…, inner…)`` and of the
        second's into ``(batch…, inner…, columns…)``; None when already so.
    n_batch, n_rows, n_inner : int
        Number of batch axes (shared and kept), row axes (the first operand's free labels) and
        contracted axes.
    output_order : tuple of int or None
        Permutation of ``(batch…, rows…, columns…)`` into the result's order; None when already so.
    """

    left_order: tuple[int, ...] | None
    right_order: tuple[int, ...] | None
    n_batch: int
    n_rows: int
    n_inner: int
    output_order: tuple[int, ...] | None


def batched_product(first: Labels, second: Labels, output: Labels) -> BatchedProduct | None:
    """The batched-matrix-product form of ``einsum(first, second -> output)``, or None where it has none.

    It has one when every label appears once per operand, some labels are shared by the two
    operands and kept in the result (the batch), some are shared and summed (the inner part),
    and every other label of an operand is in the result.

    Parameters
    ----------
    first, second : tuple of str
        Labels of the two operands.
    output : tuple of str
        Labels of the result.

    Returns
    -------
    BatchedProduct or None
    """
    if any(len(set(labels)) != len(labels) for labels in (first, second, output)):
        return None
    batch = tuple(x for x in first if x in second and x in output)
    inner = tuple(x for x in first if x in second and x not in output)
    rows = tuple(x for x in first if x not in second)
    columns = tuple(x for x in second if x not in first)
    if not batch or not inner or sorted(output) != sorted(batch + rows + columns):
        return None
    left_order = tuple(first.index(x) for x in (*batch, *rows, *inner))
    right_order = tuple(second.index(x) for x in (*batch, *inner, *columns))
    produced = (*batch, *rows, *columns)
    output_order = tuple(produced.index(x) for x in output)

    def identity(order: tuple[int, ...]) -> tuple[int, ...] | None:
        return None if order == tuple(range(len(order))) else order

    return BatchedProduct(
        identity(left_order), identity(right_order), len(batch), len(rows), len(inner), identity(output_order)
    )


def run_batched(product: BatchedProduct, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``first`` and ``second`` contracted as ``product`` says, by one ``torch.bmm``.

    Raises
    ------
    ValueError
        If a shared label has two sizes: checked because a reshape into stacks of matrices would not notice.
    """
    left = first if product.left_order is None else first.permute(product.left_order)
    right = second if product.right_order is None else second.permute(product.right_order)
    find = batched_layout if torch.compiler.is_compiling() else _cached_batched_layout
    left_shape, right_shape = left.shape, right.shape  # (each read of a shape builds a new object)
    left_stack, right_stack, shape = find(product.n_batch, product.n_rows, product.n_inner, left_shape, right_shape)
    # (no reshape where an operand already is the stack: each is one more autograd node per call)
    if left_shape != left_stack:
        left = left.reshape(*left_stack)  # (separate sizes parse faster than one tuple)
    if right_shape != right_stack:
        right = right.reshape(*right_stack)
    result = torch.bmm(left, right)
    if (left_stack[0], left_stack[1], right_stack[2]) != shape:
        result = result.view(*shape)  # (never empty: a batched product has a batch axis)
    return result if product.output_order is None else result.permute(product.output_order)


def batched_layout(
    nb: int, nr: int, ni: int, left: torch.Size, right: torch.Size
) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, ...]]:
    """The stacks of matrices a batched product multiplies for operands shaped ``left`` and ``right``.

    ``left`` is ``(batch…, rows…, inner…)`` and ``right`` ``(batch…, inner…, columns…)``, with
    ``nb`` batch, ``nr`` row and ``ni`` inner axes (as a
    [`BatchedProduct`][mumoe_tn.contractions.pairwise.BatchedProduct] counts them). Returns the
    two stacks' shapes and the result's.

    Raises
    ------
    ValueError
        If a shared label has two sizes.
    """
    batch, rows = left[:nb], left[nb : nb + nr]
    columns = right[nb + ni :]
    if right[:nb] != batch or left[nb + nr :] != right[nb : nb + ni]:
        raise ValueError(
            f"shared labels have sizes {(*batch, *left[nb + nr :])} in one operand and "
            f"{tuple(right[: nb + ni])} in the other"
        )
    size, inner = math.prod(batch), math.prod(left[nb + nr :])
    return (size, math.prod(rows), inner), (size, inner, math.prod(columns)), (*batch, *rows, *columns)


# Eager calls look the form up per step; torch.compile traces the function itself (it warns that it
# ignores an lru_cache wrapper) and bakes the answer into the graph.
_cached_batched_layout = lru_cache(maxsize=4096)(batched_layout)


def broadcast_product(
    first: Labels, second: Labels, output: Labels
) -> tuple[tuple[tuple[int, ...] | None, tuple[int, ...]], tuple[tuple[int, ...] | None, tuple[int, ...]]] | None:
    """How ``einsum(first, second -> output)`` runs as one broadcasting product, or None where it does not.

    It does when no label is summed: every label appears once per operand and every label of
    either operand is in the result (an elementwise product, an outer product, or a mix of both).

    Parameters
    ----------
    first, second : tuple of str
        Labels of the two operands.
    output : tuple of str
        Labels of the result.

    Returns
    -------
    tuple or None
        For each operand, the permutation of its axes into the result's order (None when already
        so) and the positions of the result's axes it lacks (a dimension of size 1 is inserted at
        each).
    """
    if any(len(set(labels)) != len(labels) for labels in (first, second, output)):
        return None
    if set(output) != set(first) | set(second) or len(output) != len(set(first) | set(second)):
        return None
    forms = []
    for labels in (first, second):
        order = tuple(sorted(range(len(labels)), key=lambda k: output.index(labels[k])))
        missing = tuple(k for k, label in enumerate(output) if label not in labels)
        forms.append((None if order == tuple(range(len(labels))) else order, missing))
    return forms[0], forms[1]


def pair_form(first: Labels, second: Labels, output: Labels) -> tuple[str, Any]:
    """How ``einsum(first, second -> output)`` runs: ``(kind, form)``, the first of these forms that serves.

    ``("mul", None)`` (the same labels throughout), ``("broadcast", …)`` (see `broadcast_product`),
    ``("mm", MatrixProduct)``, ``("bmm", BatchedProduct)``, or ``("einsum", None)``.
    """
    return _first_form(_finders(), first, second, output)


def _first_form(finders: tuple, first: Labels, second: Labels, output: Labels) -> tuple[str, Any]:
    if first == second == output:
        return "mul", None
    for kind, find in finders:
        form = find(first, second, output)
        if form is not None:
            return kind, form
    return "einsum", None


def _finders() -> tuple:
    """The forms `pair_form` tries, in order, each with the function that finds it (as the module holds it now)."""
    return (("broadcast", broadcast_product), ("mm", matrix_product), ("bmm", batched_product))


# (the eager cache binds the finders once, at import; a traced call looks them up as it runs)
_cached_pair_form = lru_cache(maxsize=4096)(partial(_first_form, _finders()))


def align_axes(tensor: torch.Tensor, order: tuple[int, ...] | None, missing: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` with its axes in the result's order and a size-1 axis at every position in ``missing``."""
    if order is not None:
        tensor = tensor.permute(order)
    for axis in missing:
        tensor = tensor.unsqueeze(axis)
    return tensor


def _as_matrix(tensor: torch.Tensor, split: int) -> torch.Tensor:
    """``tensor`` viewed (or copied, where its strides do not allow a view) as a matrix of its first ``split`` axes."""
    if tensor.ndim == 2 and split == 1:
        return tensor
    return tensor.reshape(math.prod(tensor.shape[:split]), math.prod(tensor.shape[split:]))


def _size_mismatch(operands: Sequence[Labels], product: MatrixProduct, left: torch.Size, right: torch.Size) -> str:
    left_labels = operands[1] if product.swap else operands[0]
    order = product.left_order or range(len(left_labels))
    inner = tuple(left_labels[k] for k in order[product.n_rows :])
    return (
        f"contracted labels {inner} have sizes {tuple(left[product.n_rows :])} in one operand and "
        f"{tuple(right[: product.n_inner])} in the other"
    )


def contract_pair(
    operands: Sequence[Labels],
    output: Labels,
    tensors: Sequence[torch.Tensor],
    equation: str | None = None,
    form: tuple[str, Any] | None = None,
) -> torch.Tensor:
    """The einsum of ``tensors`` (labelled ``operands``) into ``output``: one ``mm`` or product where possible.

    Parameters
    ----------
    operands : Sequence of tuple of str
        Labels of each tensor.
    output : tuple of str
        Labels of the result.
    tensors : Sequence of torch.Tensor
        The operands.
    equation : str, optional
        The step's ``torch.einsum`` equation, if known (made from the labels where needed).
    form : tuple, optional
        ``pair_form(*operands, output)`` of two operands, if known (looked up where needed).

    Returns
    -------
    torch.Tensor
        The result, its axes ordered as ``output`` (equal to the einsum's up to rounding).

    Raises
    ------
    ValueError
        If a tensor's number of dimensions differs from its labels', or a contracted label has two
        sizes: checked because a reshape into a matrix would not notice.
    """
    if len(operands) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors for {len(operands)} labelled operands {tuple(operands)}")
    if len(tensors) != 2 or tensors[0].ndim != len(operands[0]) or tensors[1].ndim != len(operands[1]):
        for k, (labels, tensor) in enumerate(zip(operands, tensors, strict=True)):
            if tensor.ndim != len(labels):
                raise ValueError(f"operand {k} has shape {tuple(tensor.shape)} but {len(labels)} labels {labels}")
    if len(tensors) == 2:
        first, second = operands
        if form is None:
            form = (pair_form if torch.compiler.is_compiling() else _cached_pair_form)(first, second, output)
        kind, form = form
        if kind == "mul":
            return tensors[0] * tensors[1]
        if kind == "broadcast":
            return align_axes(tensors[0], *form[0]) * align_axes(tensors[1], *form[1])
        if kind == "mm":
            left, right = (tensors[1], tensors[0]) if form.swap else (tensors[0], tensors[1])
            if form.left_order is not None:
                left = left.permute(form.left_order)
            if form.right_order is not None:
                right = right.permute(form.right_order)
            if left.ndim == 2 == right.ndim and form.n_rows == 1:  # (a plain matrix product)
                if left.shape[1] != right.shape[0]:
                    raise ValueError(_size_mismatch(operands, form, left.shape, right.shape))
                return torch.mm(left, right)
            if left.shape[form.n_rows :] != right.shape[: form.n_inner]:
                raise ValueError(_size_mismatch(operands, form, left.shape, right.shape))
            rows, columns = left.shape[: form.n_rows], right.shape[form.n_inner :]
            result = torch.mm(_as_matrix(left, form.n_rows), _as_matrix(right, form.n_inner))
            if len(rows) == 1 and len(columns) == 1:
                return result
            return result.view(*rows, *columns) if rows or columns else result.view(())  # (sizes: faster)
        if kind == "bmm":
            shared = tuple(x for x in first if x in second)
            left = tuple(tensors[0].shape[first.index(x)] for x in shared)
            right = tuple(tensors[1].shape[second.index(x)] for x in shared)
            if left != right:
                raise ValueError(f"shared labels {shared} have sizes {left} in one operand and {right} in the other")
            return run_batched(form, tensors[0], tensors[1])
    return torch.einsum(einsum_equation(operands, output) if equation is None else equation, *tensors)
