"""Sparsemax and 1.5-entmax of a few rows (decoding, small training batches) against the ``entmax`` package."""

import warnings

import entmax
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_calls import AtenCalls

from mumoe_tn.gates import activation_maps as ours
from mumoe_tn.gates import simplex_numpy, simplex_torch
from mumoe_tn.gates.activation_maps import SORTED_ELEMENTS, SORTED_ROWS, inference_map
from mumoe_tn.gates.simplex_numpy import FIRST_STEPS, WALK_LENGTH

REFERENCES = {"entmax15": entmax.entmax15, "sparsemax": entmax.sparsemax}
PUBLIC = {"entmax15": ours.entmax15, "sparsemax": ours.sparsemax}


def sorted_forward(x, name):
    """The NumPy form (what a CPU call of few rows without gradients takes)."""
    return simplex_numpy.forward(x, name == "entmax15")


@settings(deadline=None, max_examples=60)
@given(
    name=st.sampled_from(sorted(REFERENCES)),
    rows=st.integers(1, SORTED_ROWS),
    width=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 0.3, 1.0, 10.0, 1e3]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_sorted_forward_equals_the_entmax_package(name, rows, width, scale, dtype, seed):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale
    expected = REFERENCES[name](x, dim=-1)
    got = sorted_forward(x, name)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, expected)
    # The same steps in torch (what other devices run).
    torch.testing.assert_close(simplex_torch.sorted_map(x, name == "entmax15"), expected)


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows_are_projected_in_float32(name, dtype):
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * 4
    got = sorted_forward(x.to(dtype), name)
    assert got.dtype == dtype
    expected = REFERENCES[name](x.to(dtype).float(), dim=-1)
    torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(got.float().sum(-1), torch.ones(3), atol=2e-2, rtol=0)


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("torch_steps", [False, True])
def test_non_finite_rows_are_nan_in_that_row_only(name, torch_steps):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, nan, 0.0], [inf, 1.0, 2.0], [-inf, -inf, -inf], [0.0, 1.0, -inf], [3e38, -3e38, 0.0]])
    got = simplex_torch.sorted_map(x, name == "entmax15") if torch_steps else sorted_forward(x, name)
    assert torch.isnan(got[:3]).all()
    torch.testing.assert_close(got[3:], REFERENCES[name](x[3:], dim=-1))
    assert not torch.isnan(got[3:]).any()


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_public_maps_take_the_sorted_path_along_any_dim(name, monkeypatch):
    calls = []
    for function in ("forward", "forward_keeping_factors"):
        real = getattr(simplex_numpy, function)

        def spy(x, which, real=real):
            calls.append(tuple(x.shape))
            return real(x, which)

        monkeypatch.setattr(simplex_numpy, function, spy)
    x = torch.randn(4, 7, 3)
    with torch.no_grad():
        got = PUBLIC[name](x, dim=1)
    torch.testing.assert_close(got, REFERENCES[name](x, dim=1))
    assert calls == [(4, 3, 7)]
    y = PUBLIC[name](x.requires_grad_(), dim=1)  # gradients: the autograd Function, which sorts the same way
    assert y.grad_fn is not None and calls == [(4, 3, 7)] * 2
    with torch.no_grad():
        PUBLIC[name](torch.randn(SORTED_ROWS + 1, 5))  # more rows: the batched search
    assert len(calls) == 2


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_no_rows_map_to_no_rows(name):
    for x in (torch.randn(0, 5), torch.randn(0, 3, 5)):
        assert sorted_forward(x, name).shape == x.shape
        assert inference_map(PUBLIC[name], x)(x).shape == x.shape


@settings(deadline=None, max_examples=40)
@given(
    name=st.sampled_from(sorted(REFERENCES)),
    shape=st.sampled_from([(1, 16), (3, 7), (2, 4, 4), (64, 5), (65, 5), (1, 2, 300)]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_the_inference_map_equals_the_entmax_package(name, shape, dtype, seed):
    # decided once for logits like x (the NumPy steps up to SORTED_ROWS rows, the map itself beyond),
    # then applied to other logits of that shape, strided ones (a column slice) included
    gen = torch.Generator().manual_seed(seed)
    like = torch.empty(shape, dtype=dtype)
    mapped = inference_map(PUBLIC[name], like)
    wide = torch.randn(*shape[:-1], shape[-1] + 3, generator=gen, dtype=dtype) * 3
    x = wide[..., : shape[-1]]
    got = mapped(x)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, REFERENCES[name](x, dim=-1))


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("width", [1, 2, 40, 64, 65, 256])
@pytest.mark.parametrize("scale", [1e-3, 0.3, 1.0, 30.0])
def test_one_row_walks_its_support_or_takes_the_vectorised_steps(name, width, scale):
    # One row (a decoding step): the support is walked entry by entry, or where it reaches past the
    # row's top WALK_LENGTH entries the vectorised steps run on the sorted row.
    gen = torch.Generator().manual_seed(width)
    for dtype in (torch.float32, torch.float64):
        x = (torch.randn(1, width, generator=gen, dtype=torch.float64) * scale).to(dtype)
        torch.testing.assert_close(sorted_forward(x, name), REFERENCES[name](x, dim=-1))
    tied = torch.zeros(1, width)  # a zero-initialised gate: every entry in the support
    torch.testing.assert_close(sorted_forward(tied, name), torch.full((1, width), 1 / width))


@settings(deadline=None, max_examples=120)
@given(
    name=st.sampled_from(sorted(REFERENCES)),
    width=st.integers(1, 512),
    scale=st.sampled_from([1e-3, 0.1, 0.3, 0.6, 1.0, 3.0, 30.0, 1e4]),
    offset=st.sampled_from([0.0, -7.5, 1e3]),
    tied=st.integers(0, 512),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_one_row_equals_the_entmax_package_whatever_its_support(name, width, scale, offset, tied, dtype, seed):
    # Supports of every length: ended within the walk's first steps, after them, or past the top
    # entries the walk reads (the vectorised steps); ``tied`` entries share the row's maximum.
    x = torch.randn(1, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale + offset
    top = x.argsort(dim=-1, descending=True)[:, : min(tied, width)]
    x = x.scatter(-1, top, x.max().item()).to(dtype)
    expected = REFERENCES[name](x, dim=-1)
    for mapped in (sorted_forward(x, name), inference_map(PUBLIC[name], x)(x), PUBLIC[name](x)):
        assert mapped.dtype == dtype and mapped.shape == x.shape
        torch.testing.assert_close(mapped, expected)


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize(
    "support", [1, 2, FIRST_STEPS - 1, FIRST_STEPS, FIRST_STEPS + 1, WALK_LENGTH - 1, WALK_LENGTH, WALK_LENGTH + 1, 300]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_row_finds_a_support_of_any_length(name, support, dtype):
    # `support` entries at 0 and the rest far below: a support of exactly that many, 1/support each
    x = torch.full((1, 400), -50.0, dtype=dtype)
    x[0, torch.randperm(400, generator=torch.Generator().manual_seed(support))[:support]] = 0.0
    got = sorted_forward(x, name)
    expected = torch.where(x == 0, 1 / support, 0.0).to(dtype)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, REFERENCES[name](x, dim=-1))


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_row_support_ends_where_the_entmax_package_ends_it(name, dtype):
    # rows spread over ever wider ranges: supports ending among the walk's first steps, after them,
    # and past the top entries it reads, each at an entry of its own (no ties)
    supports = set()
    for spread in torch.logspace(-1.5, 2.5, 60, dtype=torch.float64).tolist():
        x = torch.rand(1, 400, generator=torch.Generator().manual_seed(int(spread * 1e3)), dtype=dtype) * -spread
        got = sorted_forward(x, name)
        torch.testing.assert_close(got, REFERENCES[name](x, dim=-1))
        supports.add(int((got > 0).sum()))
    bands = (range(2, FIRST_STEPS), range(FIRST_STEPS, WALK_LENGTH), range(WALK_LENGTH, 400))
    assert all(any(k in band for k in supports) for band in bands), sorted(supports)


@settings(deadline=None, max_examples=80)
@given(
    name=st.sampled_from(sorted(REFERENCES)),
    rows=st.integers(2, SORTED_ROWS),
    width=st.integers(WALK_LENGTH - 1, 512),
    scales=st.lists(st.sampled_from([1e-3, 0.1, 0.3, 1.0, 10.0]), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_rows_whose_supports_end_early_or_late_equal_the_entmax_package(name, rows, width, scales, dtype, seed):
    # several rows, each scaled by one of `scales`: the steps of all rows run on each row's top
    # WALK_LENGTH entries only where every row's support ends among them
    generator = torch.Generator().manual_seed(seed)
    scale = torch.tensor(scales, dtype=torch.float64)[torch.randint(len(scales), (rows, 1), generator=generator)]
    x = (torch.randn(rows, width, generator=generator, dtype=torch.float64) * scale).to(dtype)
    got = sorted_forward(x, name)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, REFERENCES[name](x, dim=-1))


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_one_non_finite_or_huge_row(name, dtype):
    inf, nan = float("inf"), float("nan")
    for bad in ([1.0, nan, 0.0], [inf, 1.0, 2.0], [-inf, -inf, -inf], [nan] * 3):
        assert torch.isnan(sorted_forward(torch.tensor([bad], dtype=dtype), name)).all()
    huge = torch.finfo(dtype).max * 0.75  # x − peak may overflow in the row's dtype
    for good in ([0.0, 1.0, -inf], [-inf, 2.0, -inf], [huge, -huge, 0.0], [huge, huge, -huge]):
        x = torch.tensor([good], dtype=dtype)
        got = sorted_forward(x, name)
        assert got.dtype == dtype and not torch.isnan(got).any()
        torch.testing.assert_close(got, REFERENCES[name](x.double(), dim=-1).to(dtype))
    # more than FIRST_STEPS entries tied at the top, the rest a huge distance below (no overflow warning)
    x = torch.full((1, 100), -huge * 0.6, dtype=dtype)
    x[0, : FIRST_STEPS + 8] = huge * 0.6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = sorted_forward(x, name)
    torch.testing.assert_close(got, torch.where(x > 0, 1 / (FIRST_STEPS + 8), 0.0).to(dtype))


@given(
    name=st.sampled_from(sorted(REFERENCES)),
    rows=st.integers(1, SORTED_ROWS),
    width=st.integers(1, SORTED_ELEMENTS // SORTED_ROWS),
    dim=st.sampled_from([0, -1]),
    seed=st.integers(0, 2**16),
)
def test_small_training_batches_sort_in_numpy_and_keep_the_closed_form_backward(name, rows, width, dim, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator, dtype=torch.float64) * 3
    x = (x if dim == -1 else x.T.contiguous()).requires_grad_(True)  # `rows` rows of `width` along `dim`
    weights = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    with AtenCalls() as forward:
        y = PUBLIC[name](x, dim)
    assert not forward.kernels  # the Newton search is 60-90 of them
    (grad,) = torch.autograd.grad((y * weights).sum(), x)
    reference = x.detach().clone().requires_grad_(True)
    expected = REFERENCES[name](reference, dim=dim)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(grad, torch.autograd.grad((expected * weights).sum(), reference)[0])


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("width", [1, 2, 3, FIRST_STEPS + 1, WALK_LENGTH + 1])
def test_one_row_of_subnormal_or_edge_tied_logits_equals_the_entmax_package_and_the_rows_steps(name, width):
    gen = torch.Generator().manual_seed(width)
    gap = 2.0 if name == "entmax15" else 1.0  # an entry this far below a lone peak sits exactly on the support's edge
    edge = torch.full((width,), -gap, dtype=torch.float64)
    edge[0] = 0.0
    rows = {
        "subnormal": torch.randn(width, generator=gen, dtype=torch.float64) * 1e-310,
        "edge tie": edge,
        "edge tie, scaled": edge * 3.0 + 7.0,
        "spread ties": torch.randint(0, 3, (width,), generator=gen).to(torch.float64) * gap / 2,
    }
    for what, row in rows.items():
        x = row[None]
        one = sorted_forward(x, name)
        torch.testing.assert_close(one, REFERENCES[name](x, dim=-1), msg=lambda m, at=what: f"{at}: {m}")
        rows_steps = x.expand(simplex_numpy.SCALAR_ROWS + 1, width).contiguous()  # the rows' vectorised steps
        several = sorted_forward(rows_steps, name)
        torch.testing.assert_close(several, one.expand_as(several), msg=lambda m, at=what: f"{at}, rows: {m}")
