"""Matching bond by bond: every shipped format with bonds lands within the tolerance, per-bond ranks
are reported, and no match leaves an expert mode collapsed. (A format without bonds, MxD, is
matched by its number of experts: tests/layers/test_hadamard.py.)"""

import math
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import ranked_formats

from mumoe_tn import ExpertNetwork
from mumoe_tn.costs import collapsed_expert_modes, compare, layer_parameters, linear, match_layer
from mumoe_tn.costs.matching import TOLERANCE, MatchingWarning, solve_bonds
from mumoe_tn.decompositions import Format, get_format, normalise_ranks, unregister
from mumoe_tn.layers import MuMoE


@pytest.mark.parametrize("modes", range(1, 6))
@pytest.mark.parametrize("name", ranked_formats())
def test_every_format_lands_within_the_tolerance_bond_by_bond(name, modes):
    # Tucker with one rank for every bond missed by +9.5 % (16^3), -21 % (16^4) and -7 % (16^5).
    target = linear(768, 3072).params
    network = get_format(name).build((16,) * modes, 769, 3072, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MatchingWarning)
        matched = match_layer(network, target)
    (result,) = matched.networks
    assert abs(layer_parameters(result).total - target) <= TOLERANCE * target
    assert set(matched.ranks) == set(matched.bonds)
    assert all(result.sizes[bond] == size for bond, size in matched.ranks.items())
    assert not collapsed_expert_modes(result)


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=4),
    st.integers(0, 3),
    st.integers(100, 100_000),
    st.integers(1, 3),
)
def test_solve_bonds_is_within_half_its_resolution(weights, product_weight, target, multiple):
    bonds = [f"b{k}" for k in range(len(weights))]

    def count(sizes):
        return sum(w * sizes[b] for w, b in zip(weights, bonds, strict=True)) + product_weight * math.prod(
            sizes.values()
        )

    if target < count(dict.fromkeys(bonds, multiple)):
        with pytest.raises(ValueError, match="below the smallest possible count"):
            solve_bonds(count, bonds, target, multiple=multiple)
        return
    sizes, step = solve_bonds(count, bonds, target, multiple=multiple)
    assert all(size % multiple == 0 for size in sizes.values())
    assert abs(count(sizes) - target) <= step / 2
    # one rank, some bonds one step up (and, where that misses the tolerance, one a step down)
    assert max(sizes.values()) - min(sizes.values()) <= 2 * multiple


def test_solve_bonds_by_hand():
    # 10 a + 3 b: uniform ranks give 13, 26, 39 — 30 is 4 from 26 and 9 from 39; a = 2, b = 3 gives 29.
    sizes, step = solve_bonds(lambda s: 10 * s["a"] + 3 * s["b"], ["a", "b"], 30)
    assert sizes == {"a": 2, "b": 3} and step == 10  # chain 26, 29 (b first: it adds less), 39
    first, _ = solve_bonds(lambda s: 10 * s["a"] + 3 * s["b"], ["a", "b"], 36, first=["a"])
    assert first == {"a": 3, "b": 2}  # chain 26, 36 (a first), 39


def test_a_bond_steps_down_only_where_the_chain_misses_the_tolerance():
    # a·b·c from 8: the chain gives 512 (-5.7 %) and 576 (+6.1 %) around 543; (9, 9, 7) = 567 is +4.4 %.
    def count(sizes):
        return sizes["a"] * sizes["b"] * sizes["c"]

    sizes, _ = solve_bonds(count, ["a", "b", "c"], 543, first=["a"])
    assert sizes == {"a": 9, "b": 9, "c": 7}
    # The bonds in `first` bound the experts' rank: they are never lowered.
    sizes, _ = solve_bonds(count, ["a", "b", "c"], 543, first=["a", "b", "c"])
    assert sizes == {"a": 8, "b": 8, "c": 8}
    # Within the tolerance the chain's answer stands.
    sizes, _ = solve_bonds(count, ["a", "b", "c"], 570, first=["a"])
    assert sizes == {"a": 9, "b": 8, "c": 8}


#: The scale grid's uneven splits with at most five modes that the matcher does not refuse.
UNEVEN = [(64, 64), (16, 16, 16, 16, 16), (32, 32, 32, 32, 16), (16, 8, 8, 8, 8), (128, 128, 64), (8, 8, 4, 4, 4)]


@pytest.mark.parametrize("dims", UNEVEN)
@pytest.mark.parametrize("name", ranked_formats())
def test_uneven_expert_modes_land_within_the_tolerance(name, dims):
    # Tucker over 32×32×32×32×16 missed by -5.2 % with one step per bond (the core grows by 9/8).
    target = linear(768, 3072).params
    network = get_format(name).build(dims, 769, 3072, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MatchingWarning)
        try:
            matched = match_layer(network, target)
        except ValueError as error:  # refused with its reason: the smallest layer exceeds the budget
            assert "below the smallest possible count" in str(error)
            return
    assert abs(layer_parameters(matched.networks[0]).total - target) <= TOLERANCE * target


@pytest.fixture
def readme_htucker():
    """The README's hierarchical Tucker format, matched on c, d and e only (registered while the test runs)."""

    class ReadmeHierarchicalTucker(Format, name="readme_htucker"):
        def network(self, expert_dims, in_features, out_features, rank, **options):
            ranks = dict(zip("abcde", normalise_ranks(self.name, rank, 5), strict=True))
            spec = "U1: n1 a, U2: n2 b, Ui: i c, Uo: o d, L: a b e, R: c d e"
            return ExpertNetwork.from_spec(
                spec, expert_dims=expert_dims, in_features=in_features, out_features=out_features, ranks=ranks
            )

        def matched_bonds(self, network):
            return ("c", "d", "e")

    yield "readme_htucker"
    unregister("readme_htucker")


def test_the_readme_hierarchical_tucker_compares_without_collapsing(readme_htucker):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MatchingWarning)
        table = compare(768, 3072, expert_dims=(16, 16), decompositions=["cp", readme_htucker])
    (network,) = table.rows[1].networks
    assert not collapsed_expert_modes(network)
    assert (network.sizes["a"], network.sizes["b"]) == (4, 4)  # raised from the rank-1 build
    assert abs(table.rows[1].params_total - linear(768, 3072).params) <= TOLERANCE * linear(768, 3072).params


def test_a_match_that_skips_a_collapsing_rank_says_so():
    with pytest.warns(UserWarning, match=r"r=1 gives 16 parameters but collapses expert mode\(s\) \['n1'\]"):
        layer = MuMoE(2, 8, 2, "cp", match="linear", bias=False)
    assert layer.experts.network.sizes["r"] == 2  # rank 1 makes both experts multiples of one matrix
