"""The top-k keeps of mumoe_tn.gates.selection against torch.topk → scatter, ties and non-finite rows included."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mumoe_tn.gates.selection import keep_top_k, nan_rows, top_k_logits, top_k_mask


def _reference_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x, k, dim=-1, sorted=False).indices


def _reference_keep(x: torch.Tensor, k: int, relu: bool) -> torch.Tensor:
    values, indices = torch.topk(x, k, dim=-1)
    return torch.zeros_like(x).scatter(-1, indices, torch.relu(values) if relu else values)


@st.composite
def rows_and_k(draw, ties: bool = False):
    """A float32 or float64 matrix whose rows take the NumPy path or torch's (short rows), and a k."""
    rows = draw(st.integers(1, 6))
    n = draw(st.sampled_from([3, 16, 127, 128, 200, 256, 512]))
    k = draw(st.integers(1, n))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if ties:  # few distinct values: a row's k-th and k+1-th largest often tie
        x = torch.randint(-3, 4, (rows, n), generator=generator).to(dtype)
    else:
        x = torch.randn(rows, n, generator=generator, dtype=dtype)
    return x, k


@settings(deadline=None)
@given(rows_and_k(), st.booleans())
def test_keep_top_k_is_topk_then_scatter(case, relu):
    x, k = case
    x = x.requires_grad_()
    kept = keep_top_k(x, k, relu=relu)
    expected = _reference_keep(x, k, relu)
    torch.testing.assert_close(kept, expected, rtol=0, atol=0)
    grad = torch.randn_like(x)
    (mine,) = torch.autograd.grad(kept, x, grad)
    (theirs,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@settings(deadline=None)
@given(rows_and_k(ties=True))
def test_ties_select_what_topk_selects(case):
    x, k = case
    expected = torch.zeros_like(x, dtype=torch.bool).scatter(-1, _reference_indices(x, k), True)
    assert torch.equal(top_k_mask(x, k), expected)
    assert torch.equal(keep_top_k(x, k), _reference_keep(x, k, relu=False))


@settings(deadline=None)
@given(rows_and_k())
def test_top_k_logits_softmax_is_the_softmax_over_the_top_k(case):
    x, k = case
    x = x.requires_grad_()
    mine = torch.softmax(top_k_logits(x, k), dim=-1)
    values, indices = torch.topk(x, k, dim=-1)
    theirs = torch.zeros_like(x).scatter(-1, indices, torch.softmax(values, dim=-1))
    torch.testing.assert_close(mine, theirs)
    grad = torch.randn_like(x)
    torch.testing.assert_close(torch.autograd.grad(mine, x, grad)[0], torch.autograd.grad(theirs, x, grad)[0])
    assert torch.equal(top_k_logits(x, k) == -math.inf, mine == 0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_entries_keep_torch_semantics(bad):
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    x[1, 7] = bad
    for relu in (False, True):
        torch.testing.assert_close(keep_top_k(x, 32, relu=relu), _reference_keep(x, 32, relu), equal_nan=True)
    expected = torch.zeros_like(x, dtype=torch.bool).scatter(-1, _reference_indices(x, 32), True)
    assert torch.equal(top_k_mask(x, 32), expected)


def test_nan_rows_marks_the_rows_with_a_non_finite_entry():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    x[1, 3], x[2, 299], x[3, 0] = math.nan, math.inf, -math.inf
    marks = nan_rows(x)
    assert marks.shape == (5, 1)
    assert torch.equal(marks.isnan().squeeze(-1), ~torch.isfinite(x).all(dim=-1))
    assert torch.equal(marks[[0, 4]], torch.zeros(2, 1))


@pytest.mark.parametrize("k", [0, 257, 2.0, True])
def test_a_k_outside_the_row_is_refused(k):
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 256\]"):
        keep_top_k(torch.zeros(2, 256), k)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("n", [16, 256])
def test_marked_rows_with_a_non_finite_entry_come_out_nan(bad, n):
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(2))
    x[1, 5] = bad
    for out in (keep_top_k(x, 4, relu=True, mark_non_finite=True), top_k_logits(x, 4, mark_non_finite=True)):
        assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    finite = torch.randn(3, n, generator=torch.Generator().manual_seed(3))
    assert torch.equal(keep_top_k(finite, 4, mark_non_finite=True), keep_top_k(finite, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_signed_zeros_tie_as_torch_ties_them(dtype):
    row = [3.0, 2.0, -0.0, 0.0] + [-1.0 - i for i in range(200)]
    for order in (row, [*row[:2], 0.0, -0.0, *row[4:]]):
        x = torch.tensor([order, [-v for v in order]], dtype=dtype)
        expected = torch.zeros_like(x, dtype=torch.bool).scatter(-1, _reference_indices(x, 3), True)
        assert torch.equal(top_k_mask(x, 3), expected)
        assert torch.equal(keep_top_k(x, 3).signbit(), _reference_keep(x, 3, relu=False).signbit())
