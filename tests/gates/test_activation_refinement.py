"""The eager thresholds: Newton steps settle most rows; the rest are sorted, partially first."""

from __future__ import annotations

import entmax
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch_calls import TorchCalls

from mumoe_tn.gates.activation_maps import entmax15, sparsemax
from mumoe_tn.gates.simplex_torch import FIRST_K

PAIRS = [(entmax15, entmax.entmax15), (sparsemax, entmax.sparsemax)]


@given(
    flat_rows=st.lists(st.booleans(), min_size=1, max_size=12),
    width=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize(("ours", "reference"), PAIRS)
def test_rows_with_wide_and_narrow_supports_mixed(ours, reference, flat_rows, width, seed):
    generator = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.01 if flat else 30.0 for flat in flat_rows], dtype=torch.float64)
    x = torch.randn(len(flat_rows), width, generator=generator, dtype=torch.float64) * scale[:, None]
    torch.testing.assert_close(ours(x), reference(x, dim=-1))


@pytest.mark.parametrize(("ours", "reference"), PAIRS)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_refinement_along_any_dim(ours, reference, dim):
    generator = torch.Generator().manual_seed(dim)
    rows = torch.randn(35, 3 * FIRST_K, generator=generator, dtype=torch.float64)
    rows = rows * torch.logspace(-2, 1.5, 35, dtype=torch.float64)[:, None]  # flat rows to peaky ones
    x = rows.reshape(5, 7, 3 * FIRST_K).movedim(2, dim)
    supports = (ours(x, dim) > 0).sum(dim)
    assert (supports > FIRST_K).any() and (supports <= FIRST_K).any()  # both paths are taken
    torch.testing.assert_close(ours(x, dim), reference(x, dim=dim))


@pytest.mark.parametrize(("ours", "reference"), PAIRS)
@pytest.mark.parametrize("width", [64, 256])
def test_newton_steps_settle_peaky_rows_without_sorting(ours, reference, width):
    x = torch.randn(512, width, generator=torch.Generator().manual_seed(width), dtype=torch.float64) * 3
    with TorchCalls() as calls:
        y = ours(x)
    assert not {"topk", "sort"} & calls.names
    torch.testing.assert_close(y, reference(x, dim=-1))


@pytest.mark.parametrize(("ours", "reference"), PAIRS)
def test_rows_newton_does_not_settle_are_sorted(ours, reference):
    # Flat logits, large partial supports: four steps from τ = −1 leave some supports unsettled.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.2
    with TorchCalls() as calls:
        y = ours(x)
    assert {"topk", "sort"} & calls.names
    assert ((y > 0).sum(-1) > FIRST_K).any()
    torch.testing.assert_close(y, reference(x, dim=-1))


class _SquareRootInputs(TorchDispatchMode):
    """Collects the input of every ``aten.sqrt`` run inside the block (the backward pass included)."""

    def __init__(self):
        super().__init__()
        self.inputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.sqrt.default:
            self.inputs.append(args[0].detach().clone())
        return func(*args, **(kwargs or {}))


def test_cpu_backward_takes_no_square_root_of_zeros():
    # CPU kernels take the square root of zeros several times slower than of positive numbers.
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 64, generator=generator, dtype=torch.float64) * 3).requires_grad_(True)
    weights = torch.randn(256, 64, generator=generator, dtype=torch.float64)
    y = entmax15(x)
    assert (y == 0).any() and (y > 0).any()
    with _SquareRootInputs() as spy:
        (grad,) = torch.autograd.grad((y * weights).sum(), x)
    assert spy.inputs and all(bool((tensor != 0).all()) for tensor in spy.inputs)
    reference = x.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad((entmax.entmax15(reference, dim=-1) * weights).sum(), reference)
    torch.testing.assert_close(grad, expected)
    assert bool((grad[y == 0] == 0).all())  # exactly zero off the support


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("ours", "reference"), PAIRS)
def test_wide_half_precision_rows_keep_their_support(ours, reference, dtype):
    # Half-precision sums cannot count 5000 entries (bfloat16: 4992) and once put τ on the maximum.
    x = torch.zeros(2, 5000, dtype=dtype)
    y = ours(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), reference(x.float(), dim=-1), rtol=2e-2, atol=0)  # uniform 1/5000
    # Random wide rows: finite and on the simplex up to the rounding of x − τ in half precision.
    y = ours(torch.randn(3, 3000, generator=torch.Generator().manual_seed(1)).to(dtype))
    assert bool(y.isfinite().all()) and bool((y >= 0).all())
    torch.testing.assert_close(y.float().sum(-1), torch.ones(3), rtol=0, atol=0.05)


def test_second_derivatives_are_finite_and_match_finite_differences():
    generator = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 7, generator=generator, dtype=torch.float64) * 2).requires_grad_(True)
    assert bool((entmax15(x) == 0).any())  # off-support entries, where d√y/dy is infinite
    assert torch.autograd.gradgradcheck(entmax15, (x,))
    weights = torch.randn(3, 7, generator=generator, dtype=torch.float64)

    def loss(t):
        return (entmax15(t) * weights).sum()

    hessian = torch.func.jacrev(torch.func.grad(loss))(x.detach())
    assert bool(hessian.isfinite().all())
    eager = torch.autograd.functional.hessian(loss, x.detach())
    torch.testing.assert_close(hessian, eager)
