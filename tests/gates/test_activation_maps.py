"""Every form of the gate activation maps against the ``entmax`` package, and which form each context takes."""

from __future__ import annotations

import math
from unittest import mock

import entmax
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mumoe_tn.gates import activation_maps, kernels, simplex_numpy, simplex_torch
from mumoe_tn.gates.activation_maps import (
    SORTED_ELEMENTS,
    SORTED_ROWS,
    MapForm,
    entmax15,
    inference_map,
    map_form,
    relu_top_k,
    softmax_top_k,
    sparsemax,
)

OURS = {"entmax15": entmax15, "sparsemax": sparsemax}
REFERENCES = {"entmax15": entmax.entmax15, "sparsemax": entmax.sparsemax}
SPARSE_FORMS = ("numpy", "search", "sort")


def forced(form: str):
    """The sparse maps' forward pass in ``form`` whatever the context (the kernels aside)."""
    return mock.patch.object(activation_maps, "_forward_form", lambda x, dim, with_grad: form)


@st.composite
def logits(draw):
    """Logits of 1-3 dims, float32 or float64, with ties and ``-inf`` entries drawn (each row keeps a finite one)."""
    ndim = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    sizes[dim] = draw(st.integers(1, 40))  # past the search's first partial sort of 16
    shape = tuple(sizes)
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * draw(st.sampled_from([0.01, 0.5, 2.0, 30.0]))
    if draw(st.booleans()):  # ties: values on a grid of 1/2
        x = (x * 2).round() / 2
    if draw(st.booleans()):  # -inf entries, never a whole row along dim
        holes = torch.rand(shape, generator=generator) < 0.3
        peak = x.argmax(dim=dim, keepdim=True)
        holes.scatter_(dim, peak, False)
        x = x.masked_fill(holes, -math.inf)
    return x.to(dtype), dim


@settings(deadline=None, max_examples=60)
@given(case=logits(), name=st.sampled_from(sorted(OURS)), form=st.sampled_from(SPARSE_FORMS))
def test_every_form_equals_the_entmax_package_with_and_without_gradients(case, name, form):
    x, dim = case
    expected = REFERENCES[name](x.double(), dim=dim)
    with forced(form):
        y = OURS[name](x, dim)  # no gradient: the form itself
        leaf = x.clone().requires_grad_(True)
        y_grad = OURS[name](leaf, dim)  # the autograd Function around the form
    assert y.dtype == x.dtype and y.shape == x.shape and y_grad.grad_fn is not None
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if x.dtype == torch.float32 else {}
    torch.testing.assert_close(y.double(), expected, **tolerance)
    torch.testing.assert_close(y_grad.detach(), y)
    weights = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).reshape(x.shape)
    (grad,) = torch.autograd.grad((y_grad * weights).sum(), leaf)
    reference = x.double().requires_grad_(True)
    (expected_grad,) = torch.autograd.grad((REFERENCES[name](reference, dim=dim) * weights.double()).sum(), reference)
    torch.testing.assert_close(grad.double(), expected_grad, **tolerance)


@pytest.mark.parametrize("name", sorted(OURS))
@pytest.mark.parametrize("form", SPARSE_FORMS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck_of_the_autograd_form(name, form, dim):
    generator = torch.Generator().manual_seed(dim + 7)
    x = (torch.randn(3, 5, 4, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    with forced(form):
        assert torch.autograd.gradcheck(lambda t: OURS[name](t, dim), (x,))
        if form != "search":  # (double backward: the torch formula, whatever the forward)
            assert torch.autograd.gradgradcheck(lambda t: OURS[name](t, dim), (x,))


@pytest.mark.parametrize("name", sorted(OURS))
@pytest.mark.parametrize("form", SPARSE_FORMS)
def test_rows_softmax_makes_nan_are_nan_in_every_form(name, form):
    inf, nan = math.inf, math.nan
    x = torch.tensor([[1.0, nan, 0.0], [inf, 1.0, 2.0], [-inf, -inf, -inf], [0.0, 1.0, -inf], [3e38, -3e38, 0.0]])
    with forced(form):
        y = OURS[name](x)
    assert torch.isnan(y[:3]).all() and not torch.isnan(y[3:]).any()
    torch.testing.assert_close(y[3:], REFERENCES[name](x[3:].double(), dim=-1).float())


# ----------------------------------------------------------------------------- which form each context takes
class Calls:
    """Counts the calls of the forms' functions (the real functions still run)."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        functions = {
            simplex_numpy: ("forward", "forward_keeping_factors", "factored_backward"),
            simplex_torch: ("sorted_map", "searched_map", "closed_form_backward"),
            kernels: ("sparse_map", "top_k_softmax", "relu_top_k"),
        }
        for module, names in functions.items():
            for name in names:
                monkeypatch.setattr(module, name, self._spy(name, getattr(module, name)))

    def _spy(self, name, function):
        def spy(*args, **kwargs):
            self.names.append(name)
            return function(*args, **kwargs)

        return spy


@pytest.mark.parametrize("name", sorted(OURS))
def test_cpu_eager_calls_take_numpy_for_few_rows_and_the_search_for_many(name, monkeypatch):
    calls = Calls(monkeypatch)
    few, many = torch.randn(SORTED_ROWS, 8), torch.randn(SORTED_ROWS + 1, 8)
    assert map_form(name, few) == MapForm("numpy", False)
    assert map_form(name, many) == MapForm("search", False)
    OURS[name](few)
    OURS[name](many)
    assert calls.names == ["forward", "searched_map"]


@pytest.mark.parametrize("name", sorted(OURS))
def test_gradients_take_the_function_with_numpy_both_ways_then_the_torch_backward_for_higher_orders(name, monkeypatch):
    calls = Calls(monkeypatch)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert map_form(name, x) == MapForm("numpy", True)
    assert map_form(name, x.detach()) == MapForm("numpy", False)
    with torch.no_grad():
        assert map_form(name, x) == MapForm("numpy", False)
    y = OURS[name](x)
    torch.autograd.grad(y[:, 0].sum(), x)
    assert calls.names == ["forward_keeping_factors", "factored_backward"]
    calls.names.clear()
    (first,) = torch.autograd.grad(OURS[name](x)[:, 0].sum(), x, create_graph=True)
    assert first.requires_grad
    assert calls.names == ["forward_keeping_factors", "closed_form_backward"]
    wide = torch.randn(2, SORTED_ELEMENTS // 2 + 1, requires_grad=True)  # few rows, too many entries to sort
    assert map_form(name, wide) == MapForm("search", True)


@pytest.mark.parametrize("name", sorted(OURS))
def test_traced_calls_take_the_full_sort(name, monkeypatch):
    calls = Calls(monkeypatch)
    x = torch.randn(3, 7)
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        assert map_form(name, x) == MapForm("sort", False)
        assert map_form(name, x.clone().requires_grad_()) == MapForm("sort", True)
    seen = []

    def under_vmap(row):
        seen.append(map_form(name, row))
        return OURS[name](row)

    torch.testing.assert_close(torch.func.vmap(under_vmap)(x), REFERENCES[name](x, dim=-1))
    assert seen == [MapForm("sort", True)] and calls.names == ["sorted_map"]
    calls.names.clear()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: OURS[name](t) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), 2 * REFERENCES[name](x, dim=-1))
    assert calls.names == ["sorted_map"]  # at trace time: the compiled graph holds its operators
    torch._dynamo.reset()


def test_kernels_are_taken_where_their_mode_allows_and_nowhere_else(monkeypatch):
    pytest.importorskip("triton")
    calls = Calls(monkeypatch)
    monkeypatch.setattr(kernels, "_kernels", lambda: object())  # the kernels' form is found (not run here)
    x = torch.randn(2, 300)
    with kernels.gate_kernels("always"):
        for name in (*OURS, "softmax_top_k", "relu_top_k"):
            assert map_form(name, x) == MapForm("triton", False)
            assert map_form(name, x.requires_grad_(name != "relu_top_k")) == MapForm("triton", False)
            assert map_form(name, x.double()) != MapForm("triton", False)  # float64 keeps its torch or NumPy form
        x.requires_grad_(False)
        monkeypatch.setattr(kernels, "sparse_map", lambda t, flag: calls.names.append(("sparse_map", flag)) or t)
        monkeypatch.setattr(kernels, "top_k_softmax", lambda t, k: calls.names.append("top_k_softmax") or t)
        monkeypatch.setattr(kernels, "relu_top_k", lambda t, k: calls.names.append("relu_top_k") or t)
        entmax15(x, 0)
        sparsemax(x)
        softmax_top_k(x, 2)
        relu_top_k(x, 2)
    assert calls.names == [("sparse_map", True), ("sparse_map", False), "top_k_softmax", "relu_top_k"]
    with kernels.gate_kernels("auto"):
        assert map_form("entmax15", x) == MapForm("numpy", False)  # CPU tensors: never the kernels in auto mode


def test_top_k_maps_take_numpy_on_cpu_and_torch_otherwise(monkeypatch):
    long_rows, short_rows = torch.randn(2, 256), torch.randn(2, 64)
    for name in ("softmax_top_k", "relu_top_k"):
        assert map_form(name, long_rows, k=3) == MapForm("numpy", False)  # wholly NumPy
        assert map_form(name, short_rows, k=3) == MapForm("numpy", False)
        assert map_form(name, long_rows.requires_grad_(), k=3) == MapForm("numpy", False)  # NumPy's partition
        assert map_form(name, short_rows.requires_grad_(), k=3) == MapForm("sort", False)  # short: torch.topk
        long_rows.requires_grad_(False)
        short_rows.requires_grad_(False)
        with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
            assert map_form(name, long_rows, k=3) == MapForm("sort", False)
    rows = []
    real = activation_maps.top_k_rows
    monkeypatch.setattr(
        activation_maps, "top_k_rows", lambda x, k, softmax: rows.append(softmax) or real(x, k, softmax=softmax)
    )
    softmax_top_k(short_rows, 3)
    relu_top_k(short_rows, 3)
    softmax_top_k(short_rows.requires_grad_(), 3)  # gradients: the torch form
    with torch.no_grad():
        relu_top_k(short_rows, 3)
    assert rows == [True, False, False]


@settings(deadline=None, max_examples=60)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 300),
    k=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    ties=st.booleans(),
    non_finite=st.sampled_from([None, math.nan, math.inf, -math.inf]),
    seed=st.integers(0, 2**16),
)
def test_top_k_maps_in_numpy_equal_their_torch_form(rows, width, k, dtype, ties, non_finite, seed):
    k = min(k, width)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator, dtype=dtype)
    if ties:
        x = x.round()
    if non_finite is not None:
        x[0, width // 2] = non_finite
    for ours in (softmax_top_k, relu_top_k):
        with mock.patch.object(activation_maps, "_top_k_in_numpy", lambda x: False):
            expected = ours(x, k)  # the torch form (NumPy's partition, else torch.topk)
        got = ours(x, k)
        torch.testing.assert_close(got, expected, equal_nan=True)
        assert got.dtype == dtype and got.shape == x.shape


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("width", [64, 256])
def test_top_k_maps_equal_torch_top_k(relu, width):
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(width)).requires_grad_()
    values, indices = (torch.relu(x) if relu else x).topk(3, dim=-1)
    expected = torch.zeros_like(x).scatter(-1, indices, values if relu else values.softmax(-1))
    y = (relu_top_k if relu else softmax_top_k)(x, 3)
    torch.testing.assert_close(y, expected)
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad((y * weights).sum(), x)
    torch.testing.assert_close(grad, torch.autograd.grad((expected * weights).sum(), x)[0])
    bad = x.detach().clone()
    bad[1, 0] = math.nan
    out = (relu_top_k if relu else softmax_top_k)(bad, 3)
    assert out[1].isnan().all() and not out[[0, 2, 3, 4]].isnan().any()


@pytest.mark.parametrize("name", sorted(OURS))
def test_the_inference_map_is_the_numpy_form_chosen_once(name):
    few, many = torch.empty(3, 16), torch.empty(SORTED_ROWS + 1, 16)
    mapped = inference_map(OURS[name], few)
    assert mapped.func is simplex_numpy.forward
    x = torch.randn(3, 16) * 3
    torch.testing.assert_close(mapped(x), REFERENCES[name](x, dim=-1))
    assert inference_map(OURS[name], many) is OURS[name]
    assert inference_map(torch.softmax, few) is torch.softmax


@pytest.mark.parametrize("name", sorted(OURS))
def test_bad_calls_get_the_librarys_errors(name):
    with pytest.raises(TypeError, match=rf"{name} maps a floating-point tensor of logits, got torch.int64"):
        OURS[name](torch.ones(2, 3, dtype=torch.long))
    message = rf"{name}: dim must be an int in \[-2, 1\] for logits of shape \(2, 3\), got 2"
    with pytest.raises(ValueError, match=message):
        OURS[name](torch.ones(2, 3), 2)
    with pytest.raises(ValueError, match=rf"{name} maps logits along a dim, got a 0-d tensor"):
        OURS[name](torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"unknown map 'softmax'"):
        map_form("softmax", torch.ones(2, 3))
