"""Parameter matching restricted to ranks that are multiples of ``rank_multiple``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mumoe_tn as mt
from mumoe_tn.cli import main
from mumoe_tn.costs import compare
from mumoe_tn.costs.matching import solve_rank
from mumoe_tn.decompositions import build


def brute_force_rank(count, target: int, multiple: int, limit: int) -> int:
    """The multiple of ``multiple`` up to ``limit`` whose count is closest to ``target`` (ties: smaller)."""
    candidates = range(multiple, limit + 1, multiple)
    return min(candidates, key=lambda r: (abs(count(r) - target), r))


@given(
    fixed=st.integers(0, 500),
    linear_term=st.integers(1, 60),
    square_term=st.integers(0, 3),
    multiple=st.integers(1, 24),
    target_rank=st.integers(1, 300),
    offset=st.integers(-40, 40),
)
def test_solve_rank_is_the_closest_multiple(fixed, linear_term, square_term, multiple, target_rank, offset):
    def count(r: int) -> int:
        return fixed + linear_term * r + square_term * r * r

    target = max(count(multiple), count(target_rank) + offset)
    found = solve_rank(count, target, multiple=multiple)
    assert found % multiple == 0
    assert found == brute_force_rank(count, target, multiple, limit=4 * (target_rank + multiple))


def test_layer_rank_is_the_closest_multiple_by_counted_parameters():
    target = 768 * 3072 + 3072  # nn.Linear(768, 3072)
    layer = mt.MuMoE(768, 3072, 256, "cp", match="linear", rank_multiple=16)
    rank = layer.network.sizes["r"]
    assert rank % 16 == 0

    def counted(r: int) -> int:
        return sum(p.numel() for p in mt.MuMoE(768, 3072, 256, "cp", r, device="meta").parameters())

    distances = {r: abs(counted(r) - target) for r in (rank - 16, rank, rank + 16)}
    assert min(distances, key=distances.get) == rank
    assert rank == 528  # by hand: R·(256 + 769 + 3072) + 768·256 closest to 2,362,368 at R = 528


def test_blocks_and_tables_round_to_the_multiple():
    block = mt.MuMoEMLP(256, 1024, 256, 16, "tr", match="mlp", rank_multiple=4, device="meta")
    assert block.experts1.network.sizes["r3"] % 4 == 0
    assert block.experts2.network.sizes["r3"] == block.experts1.network.sizes["r3"]
    gated = mt.MuMoEGatedMLP(256, 512, 256, 16, "cp", match="mlp", rank_multiple=8, device="meta")
    assert {layer.network.sizes["r"] % 8 for layer in gated.expert_layers.values()} == {0}
    table = compare(768, 3072, 256, ("cp", "tr", "tt"), rank_multiple=16)
    for row in table.rows:
        for network in row.networks:
            assert all(network.sizes[b] % 16 == 0 for b in mt.costs.matching.scaled_bonds(network))


def test_match_step_is_one_multiple():
    network = build("cp", 256, 769, 3072, 1)
    found = mt.costs.match_layer(network, 2_362_368, rank_multiple=16)
    assert found.rank == 528
    assert found.step == 16 * (256 + 769 + 3072)  # 16 rank units of the CP core rows


def test_cli_rank_multiple(capsys):
    assert main(["compare", "--json", "--rank-multiple", "16"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["config"]["rank_multiple"] == 16
    ranks = {row["name"]: row["ranks"] for row in table["rows"] if "μMoE" in row["name"]}
    assert ranks == {"cp μMoE": {"r": 528}, "tr μMoE": {"r1": 4, "r2": 4, "r3": 144}}  # numbers, not text
    with pytest.raises(SystemExit) as stopped:
        main(["compare", "--rank-multiple", "0"])
    assert stopped.value.code == 2
    assert "--rank-multiple: expected a positive integer, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rank": 64, "rank_multiple": 16}, ValueError, "rank_multiple=16 rounds the ranks match= chooses"),
        ({"match": "linear", "rank_multiple": 0}, ValueError, "rank_multiple must be a positive int, got 0"),
        ({"match": "linear", "rank_multiple": "16"}, TypeError, "rank_multiple must be a positive int, got '16'"),
        ({"match": "linear", "rank_multiple": True}, TypeError, "rank_multiple must be a positive int, got True"),
    ],
)
def test_rank_multiple_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        mt.MuMoE(768, 3072, 256, "cp", device="meta", **kwargs)
    with pytest.raises(error, match=message):
        block_kwargs = {**kwargs, "match": "mlp"} if "match" in kwargs else kwargs
        mt.MuMoEMLP(64, 256, 64, 16, "cp", device="meta", **block_kwargs)


def test_target_below_the_first_multiple_names_it():
    with pytest.raises(ValueError, match="at rank 32"):
        solve_rank(lambda r: 10 * r, 100, multiple=32)
