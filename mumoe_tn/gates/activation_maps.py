"""The gate activation maps, each with one dispatch point that picks its form by device and context.

[`entmax15`][mumoe_tn.gates.activation_maps.entmax15], [`sparsemax`][mumoe_tn.gates.activation_maps.sparsemax],
[`softmax_top_k`][mumoe_tn.gates.activation_maps.softmax_top_k] and
[`relu_top_k`][mumoe_tn.gates.activation_maps.relu_top_k] compute the same values in every form; a
call takes the quickest form its context allows ([`map_form`][mumoe_tn.gates.activation_maps.map_form]
says which):

- ``"triton"``: one kernel per direction, on CUDA tensors when Triton imports (or wherever the
  mode of [`mumoe_tn.gates.kernels`][mumoe_tn.gates.kernels] forces it), with its own backward and
  no host read ([`mumoe_tn.gates.triton_kernels`][mumoe_tn.gates.triton_kernels]);
- ``"numpy"``: CPU tensors in eager mode, where a call costs its dispatch more than its arithmetic:
  for the sparse maps, up to [`SORTED_ROWS`][mumoe_tn.gates.activation_maps] rows sorted in NumPy
  ([`mumoe_tn.gates.simplex_numpy`][mumoe_tn.gates.simplex_numpy]; with gradients, up to
  [`SORTED_ELEMENTS`][mumoe_tn.gates.activation_maps] entries, and the backward in NumPy too); for
  the top-k maps, NumPy's partition finds each row's ``k``-th largest value
  ([`mumoe_tn.gates.selection`][mumoe_tn.gates.selection]), and without gradients up to
  `SORTED_ROWS` rows are mapped wholly in NumPy
  ([`top_k_rows`][mumoe_tn.gates.selection.top_k_rows]; a tie at a row's ``k``-th value or a
  non-finite logit sends the call to the torch form, whose ``torch.topk`` settles ties);
- ``"search"``: the sparse maps of larger batches on the CPU in eager mode, by Newton steps on the
  threshold ([`searched_map`][mumoe_tn.gates.simplex_torch.searched_map]);
- ``"sort"``: torch operations with no value read back to the host, under ``torch.compile``
  (``torch.compiler.is_compiling()``), under ``torch.func`` transforms and on devices without the
  kernels: one full sort per row for the sparse maps
  ([`sorted_map`][mumoe_tn.gates.simplex_torch.sorted_map]), ``torch.topk`` for the top-k maps.

Where the sparse maps need gradients (an input that requires them with grad mode on, or a
``torch.func`` transform: ``grad``, ``vmap``, ``jacrev``, …) the form runs inside one autograd
``Function`` whose backward is the closed-form vector-Jacobian product (in NumPy after a NumPy
forward, else in torch, differentiable again for higher-order derivatives); its vmap rule is
generated. The top-k maps are products of the logits and a selection, differentiable as they stand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.autograd import Function

from mumoe_tn.gates import kernels, simplex_numpy, simplex_torch
from mumoe_tn.gates.selection import keep_top_k, partition_applies, top_k_logits, top_k_rows

__all__ = [
    "FORMS",
    "SORTED_ELEMENTS",
    "SORTED_ROWS",
    "MapForm",
    "entmax15",
    "inference_map",
    "map_form",
    "relu_top_k",
    "softmax_top_k",
    "sparsemax",
]

#: The forms a map can take (see the module notes).
FORMS = ("triton", "numpy", "search", "sort")

#: Rows up to which a CPU call in eager mode sorts in NumPy instead of searching (decoding, small
#: training batches): fewer, cheaper calls than the Newton search.
SORTED_ROWS = 64

#: Entries up to which a CPU call with gradients sorts in NumPy (and at most `SORTED_ROWS` rows):
#: measured fwd+bwd, sorting took 0.3–0.7× the Newton search's time up to 64 rows of 128 and about
#: 1.3× at 64 rows of 256 (1.5-entmax).
SORTED_ELEMENTS = 8192

#: The map names [`map_form`][mumoe_tn.gates.activation_maps.map_form] knows.
_MAPS = ("entmax15", "sparsemax", "softmax_top_k", "relu_top_k")


class MapForm(NamedTuple):
    """The form a call of a map takes (one of [`FORMS`][mumoe_tn.gates.activation_maps]) and if autograd wraps it."""

    form: str
    autograd: bool


def _traced() -> bool:
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


#: Input dtypes the NumPy form takes (half precision is mapped in float32).
_NUMPY_INPUTS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _forward_form(x: torch.Tensor, dim: int, with_grad: bool) -> str:
    """The form of a sparse map's forward pass for ``x`` (not the kernels): ``"numpy"``, ``"search"`` or ``"sort"``."""
    if not x.is_cpu or x.dtype not in _NUMPY_INPUTS or _traced():
        return "sort"
    size = x.shape[dim]
    numel = x.numel()
    if size == 0 or (numel // size <= SORTED_ROWS and (not with_grad or numel <= SORTED_ELEMENTS)):
        return "numpy"
    return "search"


def _check(x: torch.Tensor, dim: int, name: str) -> int:
    """``dim`` as a non-negative index of ``x``'s dims (TypeError/ValueError naming the rule otherwise)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} maps a floating-point tensor of logits, got {kind}")
    ndim = x.ndim
    if ndim == 0:
        raise ValueError(f"{name} maps logits along a dim, got a 0-d tensor")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(
            f"{name}: dim must be an int in [{-ndim}, {ndim - 1}] for logits of shape {tuple(x.shape)}, got {dim!r}"
        )
    return dim + ndim if dim < 0 else dim


def _sparse_form(x: torch.Tensor, dim: int) -> tuple[str, bool]:
    """The form of a sparse map's call on ``x`` and whether autograd wraps it (see `MapForm`)."""
    if kernels.gate_kernels_apply(x):
        return "triton", False
    autograd = (x.requires_grad and torch.is_grad_enabled()) or torch._C._are_functorch_transforms_active()
    return _forward_form(x, dim, autograd), autograd


def _along_last(
    form: Callable[[torch.Tensor, bool], torch.Tensor], x: torch.Tensor, dim: int, entmax: bool
) -> torch.Tensor:
    """``form`` (a map along the last dim) applied along ``dim``."""
    if dim == x.ndim - 1:
        return form(x, entmax)
    return form(x.movedim(dim, -1), entmax).movedim(-1, dim)


def _forward(x: torch.Tensor, dim: int, entmax: bool, form: str) -> torch.Tensor:
    """A sparse map's forward pass in the form named (no autograd)."""
    if form == "numpy":
        return _along_last(simplex_numpy.forward, x, dim, entmax)
    if form == "search":
        return simplex_torch.searched_map(x, dim, entmax)
    return _along_last(simplex_torch.sorted_map, x, dim, entmax)


class _SparseMap(Function):
    """A sparse map's form with its closed-form backward (``inputs``: logits, dim, entmax, form, scratch).

    ``scratch`` is None, or a list the forward pass leaves its NumPy backward factors in for
    ``setup_context`` to keep (a NumPy forward only).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dim: int, entmax: bool, form: str, scratch: list | None) -> torch.Tensor:
        if form == "numpy" and scratch is not None:
            last = dim == x.ndim - 1
            y, factors = simplex_numpy.forward_keeping_factors(x if last else x.movedim(dim, -1), entmax)
            scratch.append(factors)
            return y if last else y.movedim(-1, dim)
        return _forward(x, dim, entmax, form)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.dim, ctx.entmax, _, scratch = inputs
        ctx.factors = scratch.pop() if scratch else None
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (y,) = ctx.saved_tensors
        factors, dim = ctx.factors, ctx.dim
        if factors is None or torch.is_grad_enabled() or grad.device.type != "cpu" or grad.dtype != y.dtype:
            return simplex_torch.closed_form_backward(y, grad, dim, ctx.entmax), None, None, None, None
        last = dim == grad.ndim - 1
        rows = (grad if last else grad.movedim(dim, -1)).numpy()
        result = torch.from_numpy(simplex_numpy.factored_backward(rows, factors))
        return (result if last else result.movedim(-1, dim)), None, None, None, None


#: ``Function.apply`` without its argument binding: a Function that defines ``setup_context`` has
#: ``apply`` bind its arguments through ``inspect.signature`` on every call (about 13 µs, more than
#: a one-row map); outside ``torch.compile`` and ``torch.func`` the C entry point it ends in is the same.
_apply_unbound = super(Function, _SparseMap).apply


def _sparse_map(x: torch.Tensor, dim: int, entmax: bool) -> torch.Tensor:
    """The one dispatch point of sparsemax and 1.5-entmax (see the module notes)."""
    name = "entmax15" if entmax else "sparsemax"
    dim = _check(x, dim, name)
    form, autograd = _sparse_form(x, dim)
    if form == "triton":
        if dim == x.ndim - 1:
            return kernels.sparse_map(x, entmax)
        return kernels.sparse_map(x.movedim(dim, -1), entmax).movedim(-1, dim)
    if not autograd:
        return _forward(x, dim, entmax, form)
    if _traced() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return _SparseMap.apply(x, dim, entmax, form, None)
    return _apply_unbound(x, dim, entmax, form, [] if form == "numpy" else None)


def sparsemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax: the Euclidean projection of ``x`` onto the probability simplex along ``dim``.

    Parameters
    ----------
    x : torch.Tensor
        Floating-point logits.
    dim : int, optional
        Dimension to normalise (default last).

    Returns
    -------
    torch.Tensor
        Non-negative, summing to one along ``dim``; exactly zero below the threshold.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    ValueError
        If ``dim`` is not one of its dims.
    """
    return _sparse_map(x, dim, False)


def entmax15(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """1.5-entmax: ``argmax_p <x, p> + H_1.5(p)`` over the simplex, in closed form (exact).

    Parameters
    ----------
    x : torch.Tensor
        Floating-point logits.
    dim : int, optional
        Dimension to normalise (default last).

    Returns
    -------
    torch.Tensor
        ``[(x/2 − τ)_+]²``, summing to one along ``dim``.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    ValueError
        If ``dim`` is not one of its dims.
    """
    return _sparse_map(x, dim, True)


def _top_k_form(x: torch.Tensor, k: int) -> MapForm:
    if kernels.gate_kernels_apply(x):
        return MapForm("triton", False)
    return MapForm("numpy" if _top_k_in_numpy(x) or partition_applies(x, k) else "sort", False)


def _top_k_in_numpy(x: torch.Tensor) -> bool:
    """Whether a top-k map of ``x`` runs wholly in NumPy: few CPU float rows, no gradient, not traced."""
    if x.device.type != "cpu" or x.dtype not in simplex_numpy.NUMPY_DTYPES or not x.ndim or not x.shape[-1]:
        return False
    if (x.requires_grad and torch.is_grad_enabled()) or _traced():
        return False
    return x.numel() // x.shape[-1] <= SORTED_ROWS


def softmax_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """The softmax of each row's ``k`` largest logits (as ``torch.topk`` selects them), 0 elsewhere.

    A row holding a non-finite logit gives NaN in that row only.

    Parameters
    ----------
    x : torch.Tensor
        Logits ``(…, N)``.
    k : int
        Entries kept per row, ``1 ≤ k ≤ N``.

    Returns
    -------
    torch.Tensor
        Shaped as ``x``; exactly ``k`` non-zeros per finite row.
    """
    if kernels.gate_kernels_apply(x):
        return kernels.top_k_softmax(x, k)
    if _top_k_in_numpy(x):
        y = top_k_rows(x.detach(), k, softmax=True)
        if y is not None:
            return y
    return torch.softmax(top_k_logits(x, k, mark_non_finite=True), dim=-1)


def relu_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest logits through a ReLU, kept in place, 0 elsewhere (not renormalised).

    A row holding a non-finite logit gives NaN in that row only.

    Parameters
    ----------
    x : torch.Tensor
        Logits ``(…, N)``.
    k : int
        Entries kept per row, ``1 ≤ k ≤ N``.

    Returns
    -------
    torch.Tensor
        Shaped as ``x``.
    """
    if kernels.gate_kernels_apply(x):
        return kernels.relu_top_k(x, k)
    if _top_k_in_numpy(x):
        y = top_k_rows(x.detach(), k, softmax=False)
        if y is not None:
            return y
    return keep_top_k(x, k, relu=True, mark_non_finite=True)  # ReLU after the top k: the same kept values


def map_form(name: str, x: torch.Tensor, dim: int = -1, k: int = 1) -> MapForm:
    """The form a call of the map ``name`` on ``x`` takes here and now (device, dtype, grad mode, tracing).

    Parameters
    ----------
    name : {"entmax15", "sparsemax", "softmax_top_k", "relu_top_k"}
        The map.
    x : torch.Tensor
        The logits of the call.
    dim : int, optional
        The sparse maps' ``dim``.
    k : int, optional
        The top-k maps' ``k``.

    Returns
    -------
    MapForm
        The form (one of [`FORMS`][mumoe_tn.gates.activation_maps]) and whether autograd wraps it.
    """
    if name not in _MAPS:
        raise ValueError(f"unknown map {name!r}; choose one of {list(_MAPS)}")
    if name in ("softmax_top_k", "relu_top_k"):
        return _top_k_form(x, k)
    return MapForm(*_sparse_form(x, _check(x, dim, name)))


def inference_map(activation: Callable[..., torch.Tensor], x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``activation`` along the last dim for logits like ``x`` without gradients, its form chosen once.

    For [`entmax15`][mumoe_tn.gates.activation_maps.entmax15] and
    [`sparsemax`][mumoe_tn.gates.activation_maps.sparsemax], the choice each call of theirs makes
    is made here for calls like ``x`` (same shape, dtype and device, no gradient): where it is the
    NumPy form, the map returned goes straight to it. Any other activation or input: ``activation``.

    Parameters
    ----------
    activation : Callable
        The gate's φ.
    x : torch.Tensor
        Logits ``(…, N)`` like those of the calls the map will serve.

    Returns
    -------
    Callable
        Maps logits like ``x`` to coefficients, equal to ``activation(logits)``.
    """
    if (activation is entmax15 or activation is sparsemax) and x.ndim and x.is_floating_point():
        if _sparse_form(x.detach(), x.ndim - 1) == ("numpy", False):
            return functools.partial(simplex_numpy.forward, entmax=activation is entmax15)
    return activation
