"""Gate activations and the expert gate."""

import math
import pickle
from unittest import mock

import entmax
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mumoe_tn.gates import activation_maps
from mumoe_tn.gates.entmax import entmax15, sparsemax
from mumoe_tn.gates.modules import ACTIVATIONS, GATE_NORMS, ExpertGate, resolve_activation


def search(host_checks: bool):
    """The threshold search of the CPU (Newton steps, host-checked fallbacks) or of other devices (full sort)."""
    form = "search" if host_checks else "sort"
    return mock.patch.object(activation_maps, "_forward_form", lambda x, dim, with_grad: form)


@given(st.integers(1, 8), st.integers(1, 40), st.floats(0.1, 20), st.integers(0, 2**16), st.booleans())
@pytest.mark.parametrize(("ours", "reference"), [(entmax15, entmax.entmax15), (sparsemax, entmax.sparsemax)])
def test_activations_equal_entmax_package(ours, reference, rows, width, scale, seed, host_checks):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    x.requires_grad_(True)
    with search(host_checks):
        y = ours(x)
    y_ref = reference(x, dim=-1)
    torch.testing.assert_close(y, y_ref)
    weights = torch.randn_like(y)
    (grad,) = torch.autograd.grad((y * weights).sum(), x)
    (grad_ref,) = torch.autograd.grad((y_ref * weights).sum(), x)
    torch.testing.assert_close(grad, grad_ref)


@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_partial_sort_falls_back_exactly_on_wide_supports(scale):
    # Near-uniform logits over 300 columns have supports far beyond the first top-k.
    x = torch.randn(16, 300, dtype=torch.float64) * scale
    for ours, reference in ((entmax15, entmax.entmax15), (sparsemax, entmax.sparsemax)):
        torch.testing.assert_close(ours(x), reference(x, dim=-1))
    if scale == 0.01:
        assert ((entmax15(x) > 0).sum(-1) > 64).all()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_activation_dim_and_gradcheck(dim):
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    for fn in (entmax15, sparsemax):
        assert torch.allclose(fn(x, dim).sum(dim), torch.ones(()).double())
        assert torch.autograd.gradcheck(lambda t, fn=fn: fn(t, dim), (x,))


def test_resolve_activation():
    x = torch.randn(5, 9, dtype=torch.float64)
    torch.testing.assert_close(resolve_activation(1.5)(x), entmax15(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(resolve_activation("softmax")(x), torch.softmax(x, -1))
    with pytest.raises(ValueError, match=r"alpha must be a finite number > 1.*got 1.0"):
        resolve_activation(1.0)
    with pytest.raises(ValueError, match=r"unknown activation 'relu'"):
        resolve_activation("relu")
    with pytest.raises(TypeError, match=r"got True"):
        resolve_activation(True)


@pytest.mark.parametrize("norm", ["batch", "layer", "none"])
@pytest.mark.parametrize("activation", ["entmax15", "sparsemax", "softmax", 1.3])
def test_gate_rows_on_simplex(norm, activation):
    gate = ExpertGate(6, (5, 3), activation, norm)
    coefficients = gate(torch.randn(2, 7, 6))
    assert [tuple(a.shape) for a in coefficients] == [(2, 7, 5), (2, 7, 3)]
    for a in coefficients:
        assert (a >= 0).all()
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 7), atol=1e-5, rtol=0)


def test_entmax_gate_is_sparse_and_state_dict_keys():
    gate = ExpertGate(16, 64, "entmax15", "batch")
    a = gate(torch.randn(256, 16))[0]
    assert (a == 0).float().mean() > 0.3
    assert set(gate.state_dict()) >= {"projections.n1.weight", "norms.n1.running_mean"}


def test_gate_is_float32_under_autocast():
    gate = ExpertGate(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (a,) = gate(torch.randn(10, 8).bfloat16())
    assert a.dtype == torch.float32
    torch.testing.assert_close(a.sum(-1), torch.ones(10), atol=1e-6, rtol=0)


def test_gate_errors():
    with pytest.raises(ValueError, match=r"unknown gate norm 'group'"):
        ExpertGate(4, 3, norm="group")


@st.composite
def logits_with_non_finite_entries(draw):
    """A (rows, width) float64 batch with NaN / ±inf / huge finite entries in some rows."""
    rows, width = draw(st.integers(2, 6)), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    for _ in range(draw(st.integers(1, 4))):
        row, col = draw(st.integers(0, rows - 1)), draw(st.integers(0, width - 1))
        x[row, col] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 3e38, -3e38]))
    return x


def _softmax_would_be_nan(x):
    return torch.softmax(x, dim=-1).isnan().any(-1)


@given(logits_with_non_finite_entries(), st.booleans())
@pytest.mark.parametrize(("ours", "reference"), [(entmax15, entmax.entmax15), (sparsemax, entmax.sparsemax)])
def test_non_finite_logits_poison_their_rows_only(ours, reference, x, host_checks):
    with search(host_checks):
        y = ours(x.requires_grad_(True)).detach()
    x = x.detach()
    bad = x.isnan().any(-1) | (x == math.inf).any(-1) | (x == -math.inf).all(-1)
    assert torch.equal(bad, _softmax_would_be_nan(x))  # the rule is softmax's
    assert y[bad].isnan().all()
    for row in (~bad).nonzero().flatten().tolist():
        # shift invariance, and entries more than 2 below the maximum lie outside the support
        shifted = (x[row] - x[row].max()).clamp(min=-10)
        torch.testing.assert_close(y[row], reference(shifted, dim=-1), rtol=1e-12, atol=1e-12)


def test_huge_finite_and_infinite_logits_examples():
    x = torch.tensor([[3e38, -3e38, 1.0], [3e38, 3e38, -3e38], [0.0, -math.inf, 1.0], [math.nan, 0.0, 1.0]])
    for fn in (entmax15, sparsemax):
        y = fn(x)
        torch.testing.assert_close(y[0], torch.tensor([1.0, 0.0, 0.0]))
        torch.testing.assert_close(y[1], torch.tensor([0.5, 0.5, 0.0]))
        assert y[2, 1] == 0 and torch.isclose(y[2].sum(), torch.tensor(1.0))
        assert y[3].isnan().all()


def test_gradients_of_good_rows_unaffected_by_a_bad_row():
    x = torch.randn(3, 5, dtype=torch.float64)
    x[1, 2] = math.nan
    for fn in (entmax15, sparsemax):
        leaf = x.clone().requires_grad_(True)
        y = fn(leaf)
        weights = torch.randn_like(y)
        (y[[0, 2]] * weights[[0, 2]]).sum().backward()
        clean = x[[0, 2]].clone().requires_grad_(True)
        (fn(clean) * weights[[0, 2]]).sum().backward()
        torch.testing.assert_close(leaf.grad[[0, 2]], clean.grad)


@pytest.mark.parametrize("activation", ["entmax15", "sparsemax", "softmax"])
def test_gate_with_overflowing_logits_keeps_other_rows(activation):
    gate = ExpertGate(4, 6, activation, "none")
    z = torch.randn(5, 4)
    clean = gate(z)[0]
    z[2] = 3e38  # the logits of row 2 overflow float32 to ±inf (or NaN)
    a = gate(z)[0]
    assert a[2].isnan().all() or torch.isclose(a[2].sum(), torch.tensor(1.0))
    torch.testing.assert_close(a[[0, 1, 3, 4]], clean[[0, 1, 3, 4]], rtol=0, atol=0)


def test_entmax_and_sparsemax_at_zero_logits_are_uniform_with_full_support():
    x = torch.zeros(2, 7)
    for fn in (entmax15, sparsemax):
        torch.testing.assert_close(fn(x), torch.full((2, 7), 1 / 7))


def test_registries_are_mappings_of_picklable_functions():
    assert set(GATE_NORMS) == {"batch", "layer", "none"}
    for name, phi in ACTIVATIONS.items():
        assert pickle.loads(pickle.dumps(phi)) is phi, name
    alpha = pickle.loads(pickle.dumps(resolve_activation(1.3)))
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(alpha(x), entmax.entmax_bisect(x, alpha=1.3, dim=-1))


@pytest.mark.parametrize(("ours", "reference"), [(sparsemax, entmax.sparsemax), (entmax15, entmax.entmax15)])
def test_long_rows_along_any_dim_and_under_vmap(ours, reference):
    # rows longer than the first partial sort (64): the eager top-k path, and the full sort under torch.func
    torch.manual_seed(0)
    x = torch.randn(100, 3, dtype=torch.float64) * 3
    x[:70, 0] = 5.0  # a support of 70 > 64 entries in column 0: the partial sort must grow
    expected = reference(x, dim=0)
    torch.testing.assert_close(ours(x, dim=0), expected)
    torch.testing.assert_close(torch.func.vmap(ours)(x.T), expected.T)


@pytest.mark.parametrize("fn", [entmax15, sparsemax])
def test_training_forward_off_the_cpu_reads_no_value_on_the_host(fn):
    # A meta tensor has no values: a step that reads one on the host (nonzero, any) raises here,
    # as it would make the host wait for the device on CUDA.
    x = torch.randn(64, 256, device="meta", requires_grad=True)
    y = fn(x)
    assert y.shape == x.shape and y.device.type == "meta"
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_full_sort_search_of_wide_half_precision_rows_matches_entmax(dtype):
    # 5,000 near-equal logits: a support wider than half precision counts exactly.
    x = (torch.randn(3, 5000, dtype=torch.float64) * 1e-3).to(dtype)
    reference = entmax.entmax15(x.double(), dim=-1)
    with search(False):
        y = entmax15(x.requires_grad_(True))
    torch.testing.assert_close(y.double(), reference, rtol=2e-2, atol=2e-6)
    assert (y > 0).sum(-1).min() > 4000


@pytest.mark.parametrize("requires_grad", [False, True])
def test_one_mode_activation_map_takes_either_layout(requires_grad):
    gate = ExpertGate(6, 5)
    logits = torch.randn(4, 5, dtype=torch.float64, requires_grad=requires_grad)
    activate = gate.activation_map(logits)
    expected = entmax.entmax15(logits.detach(), dim=-1)
    for layout in (logits, [logits], (logits,)):
        (coefficients,) = activate(layout)
        torch.testing.assert_close(coefficients.detach(), expected)
    with pytest.raises(ValueError, match="zip"):
        activate([logits, logits])
