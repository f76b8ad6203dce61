"""Checks of the gate activations' Triton kernels on CPU tensors, under Triton's interpreter.

Not collected by the suite: ``tests/gates/test_triton_kernels.py`` runs this file in a process of
its own with ``TRITON_INTERPRET=1``, which must be set before Triton is first imported (Triton's own
reductions are jitted then) and which other test modules, importing Triton, would not see. Run it
alone as ``TRITON_INTERPRET=1 python -m pytest tests/gates/triton_interpreted.py``. References: the
``entmax`` package, the library's own torch maps, torch's softmax of the top-k logits, and central
differences of the kernels' own forward pass.
"""

import contextlib
import os

import entmax
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch_calls import AtenCalls

from mumoe_tn.gates import kernels
from mumoe_tn.gates.modules import ExpertGate, ReLUTopKRouter, TopKRouter

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start of the process", allow_module_level=True)
pytest.importorskip("triton")

from mumoe_tn.gates import triton_kernels as K

SPARSE_MAPS = [(True, entmax.entmax15), (False, entmax.sparsemax)]
WIDTHS = [1, 2, 3, 7, 16, 33, 64, 100]
HALF_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


@contextlib.contextmanager
def tiles(block):
    """Rows walked in tiles of ``block`` columns (several tiles, the last one ragged, for wider rows)."""
    previous, K.MAX_BLOCK = K.MAX_BLOCK, block
    try:
        yield
    finally:
        K.MAX_BLOCK = previous


def _rows(seed, n_rows, width, scale, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n_rows, width, generator=generator, dtype=torch.float64) * scale).to(dtype)


def _top_k_reference(x, k, relu):
    """Torch's top-k of the logits (ReLU'd first for the ReLU gate), kept in place; softmax'd unless ``relu``."""
    values, indices = (torch.relu(x) if relu else x).topk(k, dim=-1)
    return torch.zeros_like(x).scatter(-1, indices, values if relu else torch.softmax(values, dim=-1))


# ----------------------------------------------------------------------------- forward values
@given(
    seed=st.integers(0, 2**16),
    n_rows=st.integers(1, 2),
    width=st.sampled_from(WIDTHS),
    scale=st.sampled_from([0.01, 1.0, 30.0]),
    block=st.sampled_from([16, 128]),
)
@pytest.mark.parametrize(("entmax_flag", "reference"), SPARSE_MAPS)
def test_sparse_maps_equal_the_entmax_package(entmax_flag, reference, seed, n_rows, width, scale, block):
    x = _rows(seed, n_rows, width, scale)
    expected = reference(x.double(), dim=-1).float()
    with tiles(block):
        torch.testing.assert_close(K.sparse_map(x, entmax_flag), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's NumPy on 3e38 - (-3e38)
@pytest.mark.parametrize(("entmax_flag", "reference"), SPARSE_MAPS)
@pytest.mark.parametrize(
    "row",
    [
        [0.0] * 37,  # all tied: uniform, full support
        [2.0, 2.0, 2.0, -5.0, 2.0, 2.0],  # ties on the support
        [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # sparsemax's threshold falls on the tied zeros
        [3.0e38, -3.0e38, 1.0e30, 3.0e38, 0.0],  # huge finite values: no overflow
        [float("-inf"), 0.5, float("-inf"), -0.5] + [-1.0] * 20,  # -inf entries get 0
        [1e-30, -1e-30, 0.0, 5e-31],  # tiny differences: near-uniform
    ],
)
def test_sparse_maps_on_ties_and_extremes(entmax_flag, reference, row):
    x = torch.tensor([row], dtype=torch.float32)
    expected = reference(x.double().clamp(min=-1e300), dim=-1).float()
    torch.testing.assert_close(K.sparse_map(x, entmax_flag), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entmax_flag", [True, False])
def test_bad_rows_are_nan_and_leave_the_others_alone(entmax_flag):
    x = _rows(0, 5, 9, 3.0)
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    x[3] = float("-inf")
    y = K.sparse_map(x, entmax_flag)
    assert torch.isnan(y[1:4]).all()
    ours = torch.cat([y[:1], y[4:]])
    expected = (entmax.entmax15 if entmax_flag else entmax.sparsemax)(torch.cat([x[:1], x[4:]]), dim=-1)
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("entmax_flag", "reference"), SPARSE_MAPS)
def test_half_precision_inputs_are_computed_in_float32(dtype, entmax_flag, reference):
    x = _rows(1, 4, 100, 2.0, dtype)
    y = K.sparse_map(x, entmax_flag)
    assert y.dtype == dtype
    expected = reference(x.double(), dim=-1)  # the same rounded logits, mapped exactly
    tolerance = HALF_TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance / 10)


def test_wide_rows_in_many_tiles_match_the_library_maps():
    from mumoe_tn.gates.entmax import entmax15, sparsemax

    x = _rows(2, 2, 3000, 0.05)  # a wide support over 12 tiles
    with kernels.gate_kernels("never"), tiles(256):
        for flag, ours in ((True, entmax15), (False, sparsemax)):
            torch.testing.assert_close(K.sparse_map(x, flag), ours(x), rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------- backward
def _directional_check(f, x, seed):
    """``⟨g, J v⟩`` from the kernels' backward against central differences of their forward, in float32."""
    generator = torch.Generator().manual_seed(seed)
    g = torch.randn(x.shape, generator=generator)
    v = torch.randn(x.shape, generator=generator)
    leaf = x.clone().requires_grad_(True)
    (vjp,) = torch.autograd.grad((f(leaf) * g).sum(), leaf)
    step = 1e-3
    difference = (f(x + step * v) - f(x - step * v)) / (2 * step)
    return (vjp * v).sum(), (difference * g).sum(), vjp


@given(seed=st.integers(0, 2**16), width=st.sampled_from([1, 3, 7, 33, 100]), scale=st.sampled_from([0.3, 3.0]))
@pytest.mark.parametrize(("entmax_flag", "reference"), SPARSE_MAPS)
def test_sparse_map_backward_equals_the_package_and_finite_differences(entmax_flag, reference, seed, width, scale):
    x = _rows(seed, 2, width, scale)
    analytic, numeric, vjp = _directional_check(lambda t: K.sparse_map(t, entmax_flag), x, seed)
    torch.testing.assert_close(analytic, numeric, rtol=2e-2, atol=2e-3)
    leaf = x.double().requires_grad_(True)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).double()
    (expected,) = torch.autograd.grad((reference(leaf, dim=-1) * g).sum(), leaf)
    torch.testing.assert_close(vjp.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("entmax_flag", "reference"), SPARSE_MAPS)
def test_half_precision_backward(dtype, entmax_flag, reference):
    x = _rows(3, 3, 40, 2.0, dtype).requires_grad_(True)
    g = _rows(4, 3, 40, 1.0, dtype)
    (grad,) = torch.autograd.grad((K.sparse_map(x, entmax_flag) * g).sum(), x)
    assert grad.dtype == dtype
    leaf = x.detach().double().requires_grad_(True)
    (expected,) = torch.autograd.grad((reference(leaf, dim=-1) * g.double()).sum(), leaf)
    tolerance = HALF_TOLERANCE[dtype]
    torch.testing.assert_close(grad.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("entmax_flag", [True, False])
def test_double_backward_goes_through_the_torch_formula(entmax_flag):
    x = _rows(5, 2, 12, 1.0).double()
    leaf = x.float().requires_grad_(True)
    reference = x.clone().requires_grad_(True)
    from mumoe_tn.gates.entmax import entmax15, sparsemax

    ours_map, torch_map = (lambda t: K.sparse_map(t, entmax_flag)), (entmax15 if entmax_flag else sparsemax)
    (first,) = torch.autograd.grad((ours_map(leaf) ** 3).sum(), leaf, create_graph=True)
    (second,) = torch.autograd.grad(first.square().sum(), leaf)
    with kernels.gate_kernels("never"):
        (first_ref,) = torch.autograd.grad((torch_map(reference) ** 3).sum(), reference, create_graph=True)
        (second_ref,) = torch.autograd.grad(first_ref.square().sum(), reference)
    assert torch.isfinite(second).all()
    torch.testing.assert_close(second.double(), second_ref, rtol=1e-3, atol=1e-4)


# ----------------------------------------------------------------------------- top-k gates
@given(
    seed=st.integers(0, 2**16),
    width=st.sampled_from([1, 3, 7, 16, 40]),
    k=st.integers(1, 5),
    relu=st.booleans(),
    block=st.sampled_from([8, 64]),
)
def test_top_k_gates_equal_torch_top_k(seed, width, k, relu, block):
    k = min(k, width)
    x = _rows(seed, 2, width, 2.0)  # continuous values: no ties, so the kept set is unique

    def f(t, k):
        with tiles(block):
            return (K.relu_top_k if relu else K.top_k_softmax)(t, k)

    leaf = x.clone().requires_grad_(True)
    y = f(leaf, k)
    torch.testing.assert_close(y, _top_k_reference(x, k, relu), rtol=1e-5, atol=1e-7)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    (vjp,) = torch.autograd.grad((y * g).sum(), leaf)
    reference = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad((_top_k_reference(reference, k, relu) * g).sum(), reference)
    torch.testing.assert_close(vjp, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("relu", [False, True])
def test_top_k_keeps_exactly_k_of_tied_logits_lowest_index_first(relu):
    x = torch.tensor([[1.0] * 6, [0.5, 2.0, 0.5, 0.5, 3.0, 0.5], [-1.0, -2.0, -1.0, -1.0, -3.0, 0.0]])
    y = (K.relu_top_k if relu else K.top_k_softmax)(x, 3)
    kept = y != 0
    if relu:
        assert kept.sum(-1).tolist() == [3, 3, 0]
        torch.testing.assert_close(y[1], torch.tensor([0.5, 2.0, 0.0, 0.0, 3.0, 0.0]))
    else:
        assert kept.sum(-1).tolist() == [3, 3, 3]
        assert kept[0].tolist() == [True] * 3 + [False] * 3
        assert kept[1].tolist() == [True, True, False, False, True, False]
        assert kept[2].tolist() == [True, False, True, False, False, True]
        torch.testing.assert_close(y.sum(-1), torch.ones(3))


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_top_k_half_precision_and_bad_rows(relu, dtype):
    x = _rows(6, 4, 50, 1e3, dtype)  # large logits: the softmax is one-hot-like but finite
    x[2, 7] = float("-inf")
    f = K.relu_top_k if relu else K.top_k_softmax
    y = f(x, 4)
    assert y.dtype == dtype and torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3]]).any()
    expected = _top_k_reference(x[[0, 1, 3]].float(), 4, relu)
    torch.testing.assert_close(y[[0, 1, 3]].float(), expected, rtol=HALF_TOLERANCE[dtype], atol=1e-3)
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(f(leaf, 4).nansum(), leaf)
    assert grad.dtype == dtype and (grad[2] == 0).all()  # as the torch gate: no gradient from a NaN row


# ----------------------------------------------------------------------------- dispatch and tracing
def test_gates_take_the_kernels_when_forced_and_agree_with_their_torch_paths():
    torch.manual_seed(0)
    z = torch.randn(6, 10)
    gates = [
        ExpertGate(10, (12, 12), "entmax15", "layer"),
        ExpertGate(10, 20, "sparsemax", "none"),
        TopKRouter(10, (9, 5), k=2),
        ReLUTopKRouter(10, 16, k=3),
    ]
    for gate in gates:
        with kernels.gate_kernels("never"):
            expected = gate(z)
        with kernels.gate_kernels("always"), torch.profiler.profile() as profile:
            ours = gate(z)
        names = {event.name for event in profile.events()}
        assert any(name.startswith("mumoe_tn::") for name in names), names
        for a, b in zip(ours, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_gate_has_no_graph_break(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setitem(kernels._state, "module", None)  # the first call, traced, finds the kernels
    gate = ExpertGate(8, 12, "entmax15", "layer")
    z = torch.randn(5, 8, requires_grad=True)

    def step(z):
        (a,) = gate(z)
        return (a * torch.arange(12.0)).sum()

    with kernels.gate_kernels("always"):
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        value = compiled(z)
        (grad,) = torch.autograd.grad(value, z)
    with kernels.gate_kernels("never"):
        expected_value = step(z)
        (expected_grad,) = torch.autograd.grad(expected_value, z)
    torch.testing.assert_close(value, expected_value)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("k", [0, 6, 2.0, True])
def test_top_k_refuses_a_k_outside_the_row(k):
    with pytest.raises(ValueError, match=rf"k must be an int in \[1, 5\].*k={k!r}"):
        K.top_k_softmax(torch.zeros(2, 5), k)


@pytest.mark.parametrize(
    "activation",
    [
        lambda t: kernels.sparse_map(t, True),
        lambda t: kernels.sparse_map(t, False),
        lambda t: kernels.top_k_softmax(t, 3),
        lambda t: kernels.relu_top_k(t, 3),
    ],
)
def test_one_kernel_per_direction(activation):
    x = _rows(7, 4, 24, 2.0).requires_grad_(True)
    with kernels.gate_kernels("always"), AtenCalls() as forward:
        y = activation(x)
    seed = torch.ones_like(y)
    with AtenCalls() as backward:
        y.backward(seed)
    assert len(forward.kernels) == 1 and sum(forward.kernels.values()) == 1, forward.kernels
    (name,) = forward.kernels
    assert dict(backward.kernels) == {name + "_backward": 1}
    assert not forward.host_reads and not backward.host_reads


def test_public_maps_take_the_kernels_along_any_dim():
    from mumoe_tn.gates.activation_maps import MapForm, entmax15, map_form, sparsemax

    x = _rows(8, 6, 5, 2.0)
    with kernels.gate_kernels("always"), torch.profiler.profile() as profile:
        assert map_form("entmax15", x, 0) == MapForm("triton", False)
        got = {True: entmax15(x, 0), False: sparsemax(x, 0)}
    assert sum(event.name == "mumoe_tn::sparse_map" for event in profile.events()) == 2
    for flag, reference in SPARSE_MAPS:
        torch.testing.assert_close(got[flag], reference(x.double(), dim=0).float(), rtol=1e-5, atol=1e-6)
