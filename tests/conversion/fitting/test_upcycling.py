"""Upcycling says what it delivers: exact ranks for any network, optimal truncation, warnings, bounded fits."""

import copy
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn import ExpertNetwork
from mumoe_tn.conversion.convert import convert
from mumoe_tn.conversion.fitting.upcycling import UpcycleWarning, upcycle_experts, upcycle_linear, upcycle_threshold
from mumoe_tn.costs import match_exact
from mumoe_tn.decompositions import get_format
from mumoe_tn.layers import FactorizedExperts, MuMoE

CLOSED_FORMS = ("cp", "tr", "tt", "tucker")


def _matrix(rows, cols, decay, generator):
    """A random ``rows × cols`` matrix with singular values ``decay**j`` and its singular values."""
    left, _ = torch.linalg.qr(torch.randn(rows, rows, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(cols, cols, generator=generator, dtype=torch.float64))
    k = min(rows, cols)
    singular = decay ** torch.arange(k, dtype=torch.float64)
    return (left[:, :k] * singular) @ right[:, :k].T, singular


def _experts(network):
    return FactorizedExperts(network, dtype=torch.float64)


@given(
    name=st.sampled_from(CLOSED_FORMS),
    dims=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
    rows=st.integers(2, 9),
    cols=st.integers(2, 9),
    kept=st.integers(1, 9),
    decay=st.floats(0.3, 0.95),
    seed=st.integers(0, 2**16),
)
def test_closed_form_upcycling_attains_the_eckart_young_error(name, dims, rows, cols, kept, decay, seed):
    generator = torch.Generator().manual_seed(seed)
    matrix, singular = _matrix(rows, cols, decay, generator)
    kept = min(kept, singular.numel())
    network = get_format(name).build(dims, rows, cols, 1)
    (network,) = match_exact([network])[1]
    scaled = get_format(name).matched_bonds(network)
    network = network.with_sizes(**{bond: min(network.sizes[bond], kept) for bond in scaled})
    capacity = network.format.upcycle_capacity(network)
    held = min(capacity, singular.numel())
    error = upcycle_experts(_experts(network), matrix)
    optimal = float(singular[held:].square().sum().sqrt() / singular.square().sum().sqrt())
    assert abs(error - optimal) < 1e-5, (network, error, optimal)


def _custom(dims, rows, cols, ranks):
    spec = "A: n1 a b, B: a i c, C: b c o" if len(dims) == 1 else "A: n1 a, B: n2 b, C: a b i c, D: c o"
    return ExpertNetwork.from_spec(spec, expert_dims=dims, in_features=rows, out_features=cols, ranks=ranks)


@pytest.mark.parametrize("kind", [*CLOSED_FORMS, "custom1", "custom2"])
@pytest.mark.parametrize(("rows", "cols"), [(7, 5), (4, 11)])
def test_exact_rank_is_the_smallest_that_holds_a_generic_matrix(kind, rows, cols):
    """At rank='exact' a generic full-rank matrix is held to rounding; one rank lower it is not."""
    generator = torch.Generator().manual_seed(rows * cols)
    matrix, _ = _matrix(rows, cols, 0.8, generator)
    dims = (3,) if kind != "custom2" else (2, 3)
    network = _custom(dims, rows, cols, 1) if kind.startswith("custom") else get_format(kind).build(dims, rows, cols, 1)
    rank, (exact,) = match_exact([network])
    # The generic fit solves normal equations, whose rounding is about eps·cond(M)² (M's condition
    # number is below 2.5 here) times the growth from the cores' gauge (measured below 3e3): ~1e-12.
    assert upcycle_experts(_experts(exact), matrix, max_iter=500) < 1e-10
    if rank > 1:
        bonds = network.bonds if network.format is None else network.format.matched_bonds(network)
        smaller = exact.with_sizes(**{bond: min(exact.sizes[bond], rank - 1) for bond in bonds})
        assert upcycle_experts(_experts(smaller), matrix, max_iter=500) > 1e-3


@pytest.mark.parametrize("seed", range(4))
def test_generic_fit_is_exact_to_rounding_when_a_core_is_underdetermined(seed):
    """Core B of ``A: a b, B: a i c, C: b c o`` has 9 unknowns per row of the 7 × 5 target but 5
    equations: its Gram matrix is singular. The fit takes the minimum-norm solution, so an exact
    rank is exact to rounding (a regularised solve would stop at its bias, ~1e-8)."""
    generator = torch.Generator().manual_seed(seed)
    matrix, singular = _matrix(7, 5, 0.8, generator)
    _, (exact,) = match_exact([_custom((3,), 7, 5, 1)])
    assert exact.sizes["a"] * exact.sizes["c"] > 5  # the underdetermined case
    rounding = torch.finfo(torch.float64).eps * float(singular[0] / singular[-1]) ** 2
    assert upcycle_experts(_experts(exact), matrix, max_iter=500) < 1e3 * rounding


def _linear(rows=24, cols=16, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(rows, cols).double()


@pytest.mark.parametrize("decomposition", [*CLOSED_FORMS, "A: n1 a b, B: a i c, C: b c o"])
def test_upcycle_linear_is_exact_by_default_and_warns_when_it_is_not(decomposition):
    linear = _linear()
    x = torch.randn(5, 24, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UpcycleWarning)
        layer, error = upcycle_linear(linear, 4, decomposition)
        assert error < 1e-8
        for module in (layer.gate.projections.n1,):
            module.weight.data.normal_(0, 3)
        torch.testing.assert_close(layer(x), linear(x))
        assert upcycle_linear(linear, 4, decomposition, rank=None)[0].network == layer.network
    with pytest.warns(UpcycleWarning, match=r"relative error of [0-9.e-]+ \(above 1e-03\).*rank='exact' \("):
        _, error = upcycle_linear(linear, 4, decomposition, rank=2)
    assert error > 1e-3


def test_rank_means_the_same_in_convert_and_upcycle_linear():
    linear = _linear()
    for rank in (3, "exact", None):
        model = nn.Sequential(copy.deepcopy(linear))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UpcycleWarning)
            convert(model, expert_dims=4, linears=r"^0$", rank=rank, upcycle=True)
            layer, _ = upcycle_linear(linear, 4, "cp", rank=rank)
        assert model[0].network == layer.network


def test_convert_warns_per_module_with_the_error_and_the_exact_rank():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).double()
    with pytest.warns(UpcycleWarning) as caught:
        report = convert(nn.Sequential(model), expert_dims=4, mlps=r"^0$", upcycle=True)  # matched: lossy
    (message,) = [str(w.message) for w in caught]
    assert "upcycling '0' at r=" in message and f"{report.replacements[0].upcycle_error:.3g}" in message
    assert "rank='exact' (r=17;" in message  # min(16 + 1, 32) and min(32 + 1, 16): 17 holds both
    with warnings.catch_warnings():
        warnings.simplefilter("error", UpcycleWarning)
        report = convert(nn.Sequential(model), expert_dims=4, mlps=r"^0$", upcycle=True, rank="exact")
    assert report.replacements[0].upcycle_error < 1e-10


def test_the_threshold_allows_for_half_precision_rounding():
    assert upcycle_threshold(torch.float64) == upcycle_threshold(torch.float32) == 1e-3
    assert upcycle_threshold(torch.bfloat16) == 8 * torch.finfo(torch.bfloat16).eps
    linear = _linear().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UpcycleWarning)
        _, error = upcycle_linear(linear, 4, "cp")
    assert 0 < error < upcycle_threshold(torch.bfloat16)


def test_the_generic_fit_is_bounded_and_shows_progress(capsys):
    network = _custom((3,), 9, 7, {"a": 2, "b": 2, "c": 2})  # holds rank 4 of 7: a real fit
    matrix, _ = _matrix(9, 7, 0.9, torch.Generator().manual_seed(1))
    one_sweep = upcycle_experts(_experts(network), matrix, max_iter=1, progress=True)
    assert "ALS fit" in capsys.readouterr().err
    converged = upcycle_experts(_experts(network), matrix, max_iter=300, tol=1e-12)
    assert converged < one_sweep
    upcycle_experts(_experts(network), matrix, max_iter=2, progress=False)
    assert capsys.readouterr().err == ""
    for bad in ({"max_iter": 0}, {"max_iter": 2.5}, {"tol": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            upcycle_experts(_experts(network), matrix, **bad)


def test_layers_accept_rank_exact_and_refuse_it_with_match():
    layer = MuMoE(24, 16, 4, "tr", rank="exact")
    assert layer.network.sizes["r3"] == 16 and layer.network.sizes["r1"] == 4
    with pytest.raises(ValueError, match="rank='exact' chooses the ranks; give it without match="):
        MuMoE(24, 16, 4, "cp", rank="exact", match="linear")


@pytest.mark.parametrize(
    ("decomposition", "rank", "clipped"),
    [("cp", 60, "r 60 → 12"), ("tucker", 50, "s_n1 50 → 3, s_i 50 → 4, s_o 50 → 5"), ("tt", (9, 9), "r1 9 → 3")],
)
def test_decompose_dense_clips_ranks_a_tensor_cannot_use(decomposition, rank, clipped):
    from mumoe_tn.conversion import decompose_dense

    weight = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.warns(UserWarning, match=rf"tensor of shape \(3, 4, 5\) can use were clipped: {clipped}"):
        experts, error = decompose_dense(weight, decomposition, rank)
    assert type(error) is float and error < 1e-4  # clipped ranks still hold the whole tensor
    assert sum(p.numel() for p in experts.parameters()) < weight.numel() * 4


def test_a_ready_network_keeps_its_ranks_when_upcycled():
    from mumoe_tn.decompositions import build

    torch.manual_seed(0)
    linear = nn.Linear(8, 10)
    ready = build("cp", (4,), 9, 10, 6)  # rank 6 < 8: inexact, but the user's choice
    with pytest.warns(UpcycleWarning):
        layer, error = upcycle_linear(linear, 4, decomposition=ready)
    assert layer.network == ready
    assert error > 0
