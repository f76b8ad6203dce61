"""Gate activations and the expert gate."""

import entmax
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mumoe_tn.activations import entmax15, sparsemax
from mumoe_tn.gating import ExpertGate, resolve_activation


@given(st.integers(1, 8), st.integers(1, 40), st.floats(0.1, 20), st.integers(0, 2**16))
@pytest.mark.parametrize(("ours", "reference"), [(entmax15, entmax.entmax15), (sparsemax, entmax.sparsemax)])
def test_activations_equal_entmax_package(ours, reference, rows, width, scale, seed):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    x.requires_grad_(True)
    y, y_ref = ours(x), reference(x, dim=-1)
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
