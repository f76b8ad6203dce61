"""Cost model: FMA unit, planned vs closed-form FLOPs, parameters, rank bounds, matching."""

import math
import sys

import opt_einsum
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import any_network, custom_networks, named_networks

from mumoe_tn import ExpertNetwork, MuMoE
from mumoe_tn.contractions import plan_contraction, plan_forward
from mumoe_tn.costs import (
    compare,
    dense_forward_fma,
    dense_moe,
    layer_flops,
    layer_parameters,
    linear,
    match_block,
    match_layer,
    materialize_fma,
    matmul_fma,
    min_cut,
    rank_bound,
    solve_rank,
    sparse_moe,
)
from mumoe_tn.decompositions import cp, tr, tt, tucker
from mumoe_tn.measure import expert_ranks
from mumoe_tn.network import BATCH_LABEL


def test_fma_unit_on_a_matrix_product():
    # A (2×3)·(3×4) product is 24 multiply-adds; opt_einsum reports 48, cotengra's
    # contraction_cost 24.
    assert matmul_fma(2, 3, 4) == 24
    plan = plan_contraction([("i", "j"), ("j", "k")], ("i", "k"), {"i": 2, "j": 3, "k": 4})
    assert plan.fma == 24
    info = opt_einsum.contract_path("ij,jk->ik", (2, 3), (3, 4), shapes=True)[1]
    assert int(info.opt_cost) == 48


def test_fma_unit_with_a_hyperedge_step():
    # 'bn,nr,bi,ir,or->bo': 192 + 160 + 32 (an elementwise step, nothing summed) + 224 FMAs.
    sizes = {"b": 8, "n": 5, "r": 4, "i": 6, "o": 7}
    inputs = [("b", "n"), ("n", "r"), ("b", "i"), ("i", "r"), ("o", "r")]
    plan = plan_contraction(inputs, ("b", "o"), sizes)
    assert plan.fma == 608
    cotengra = pytest.importorskip("cotengra")
    tree = cotengra.ContractionTree.from_path(
        inputs, ("b", "o"), sizes, path=[tuple(s.positions[::-1]) for s in plan.steps]
    )
    assert tree.contraction_cost() == 608


@given(any_network(), st.integers(1, 5))
def test_planned_fma_cross_checks_opt_einsum(network, batch):
    """opt_einsum counts 2 per FMA on steps that sum an index and 1 on steps that do not."""
    plan = plan_forward(network, batch)
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch}
    symbol = {label: opt_einsum.get_symbol(k) for k, label in enumerate(sizes)}
    eq = ",".join("".join(symbol[x] for x in labels) for labels in inputs) + "->" + "".join(symbol[x] for x in output)
    shapes = [tuple(sizes[x] for x in labels) for labels in inputs]
    info = opt_einsum.contract_path(eq, *shapes, shapes=True, optimize=list(plan.path))[1]
    expected = 0
    for step in plan.steps:
        summed = {x for labels in step.operands for x in labels} - set(step.output)
        expected += (2 if summed else 1) * step.fma
    assert int(info.opt_cost) == expected
    assert plan.largest_intermediate <= int(info.largest_intermediate) or len(plan.steps) == 1


@pytest.mark.parametrize("n_modes", [1, 2, 3, 4])
def test_cp_planned_equals_closed_form_at_batch_one(n_modes):
    network = cp(tuple(range(3, 3 + n_modes)), 11, 13, 7)
    fmt = network.format
    r = network.sizes["r"]
    # The paper's R(ΣN + I + O) omits exactly the E elementwise products of length R.
    assert fmt.hand_fma(network) - fmt.closed_form_fma(network) == n_modes * r
    assert plan_forward(network, 1).fma == fmt.hand_fma(network)


@given(st.integers(1, 4), st.sampled_from([2, 4]), st.integers(8, 32), st.data())
def test_tr_planned_equals_closed_form_at_batch_one(n_modes, expert_rank, io_rank, data):
    # In the paper's regime (N_e ≥ 8 experts per mode, equal ranks between expert cores,
    # I, O above the input–output rank) the planner finds exactly the paper's order. Outside
    # it (a single expert, R1 = R2 = 1) cheaper orders exist; planned <= hand order always.
    dims = tuple(data.draw(st.integers(8, 64)) for _ in range(n_modes))
    sizes = data.draw(st.tuples(st.integers(io_rank, 96), st.integers(io_rank, 96)))
    network = tr(dims, *sizes, io_rank, expert_rank=expert_rank)
    fmt = network.format
    assert fmt.hand_fma(network) == fmt.closed_form_fma(network)
    assert plan_forward(network, 1).fma == fmt.closed_form_fma(network)


def test_tr_planner_can_beat_the_papers_chain_order():
    network = tr((5, 5), 7, 9, (4, 4, 4, 3))
    assert plan_forward(network, 1).fma < network.format.closed_form_fma(network)


@given(named_networks(max_rank=4), st.sampled_from([1, 2, 7, 64, 4096]))
def test_planned_never_above_hand_order(network, batch):
    flops = layer_flops(network, batch=batch, bias=False)
    assert flops.planned <= flops.hand_order
    assert flops.hand_order == batch * network.format.hand_fma(network)


def test_dense_costs():
    network = cp((4, 3), 6, 5, 2)
    assert dense_forward_fma(network) == 12 * 6 * 5 + 12 * 5 + 3 * 5
    assert materialize_fma(network) > 0
    assert layer_flops(network, batch=3, bias=False).gate == 3 * 6 * 7


@given(any_network(max_modes=3), st.booleans(), st.booleans())
def test_parameter_count_equals_built_layer(network, bias, input_norm):
    if bias:
        network = network.with_sizes(i=network.in_features + 1)
    in_features = network.in_features - int(bias)
    layer = MuMoE(in_features, network.out_features, decomposition=network, bias=bias, input_norm=input_norm)
    count = layer_parameters(network, bias=bias, gate=True, input_norm=input_norm)
    assert count.total == sum(p.numel() for p in layer.parameters())
    assert count.experts == sum(p.numel() for p in layer.experts.parameters())
    assert count.gate == sum(p.numel() for p in layer.gate.parameters())
    assert layer_parameters(network, bias=bias, gate=False).total == count.experts


@pytest.mark.parametrize(
    ("network", "expected"),
    [
        (cp(5, 9, 11, 4), 4),
        (cp(5, 9, 11, 40), 9),
        (tr(5, 30, 40, (2, 3, 5)), 10),  # R3·min(R1, R2)
        (tr(5, 7, 40, (2, 3, 5)), 7),
        (tucker(5, 30, 40, (2, 6, 5)), 5),  # min(I, R_I, R_O, O)
        (tt((5, 4), 30, 40, (3, 2, 6)), 6),
    ],
)
def test_min_cut_reproduces_paper_bounds(network, expected):
    assert rank_bound(network) == expected == network.format.closed_form_rank_bound(network)


@given(named_networks(max_rank=5))
def test_min_cut_equals_closed_form_bound(network):
    assert rank_bound(network) == network.format.closed_form_rank_bound(network)


def _experts(network, seed):
    from mumoe_tn import FactorizedExperts

    experts = FactorizedExperts(network, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64))
    return experts


@given(named_networks(max_size=5, max_rank=3), st.integers(0, 1000))
def test_measured_rank_equals_bound_for_generic_named_cores(network, seed):
    ranks = expert_ranks(
        _experts(network, seed), [(0,) * network.n_expert_modes, tuple(n - 1 for n in network.expert_dims)]
    )
    assert set(ranks.values()) == {rank_bound(network)}


@given(custom_networks(), st.integers(0, 1000))
def test_measured_rank_never_above_min_cut(network, seed):
    labels, bound = min_cut(network)
    assert bound == math.prod(network.sizes[x] for x in labels)
    assert max(expert_ranks(_experts(network, seed)).values()) <= bound


def test_expert_ranks_of_initialised_layer():
    layer = MuMoE(12, 10, 3, "cp", 4)
    assert set(expert_ranks(layer.experts).values()) == {4}
    with pytest.raises(TypeError, match="needs a FactorizedExperts"):
        expert_ranks(layer)


def test_baselines():
    assert linear(768, 3072).params == 769 * 3072
    assert linear(768, 3072, bias=False).fma == 768 * 3072
    dense = dense_moe(256, 768, 3072, gate=False)
    assert dense.params == dense.fma == 256 * 769 * 3072
    sparse = sparse_moe(256, 2, 768, 3072)
    assert sparse.params == 256 * 769 * 3072 + 768 * 256 and sparse.fma == 2 * 769 * 3072 + 768 * 256
    with pytest.raises(ValueError, match="top_k=9 cannot exceed the number of experts 8"):
        sparse_moe(8, 9, 4, 4)


@given(st.integers(1, 50), st.integers(0, 30), st.integers(1, 10**6))
def test_solve_rank_is_closest_with_ties_to_smaller(a, b, target):
    def count(r):
        return a * r * r + b * r + 1

    assume(target >= count(1))
    r = solve_rank(count, target)
    best = min(abs(count(k) - target) for k in range(1, r + 3))
    assert abs(count(r) - target) == best
    assert all(abs(count(k) - target) > best for k in range(1, r))  # ties go to the smaller rank


@given(named_networks(max_size=6, max_rank=3), st.integers(1, 4))
def test_match_layer_within_one_rank_step(network, factor):
    network = network.with_sizes(i=network.in_features + 1)
    bonds = None
    target = factor * linear(network.in_features - 1, network.out_features).params + 50
    try:
        matched = match_layer(network, target, bonds=bonds)
    except ValueError as error:
        assert "below the smallest possible count" in str(error)
        return
    assert abs(matched.params - matched.target) <= matched.step
    assert layer_parameters(matched.networks[0]).total == matched.params


def test_matching_errors():
    with pytest.raises(ValueError, match=r"target of 10 parameters is below the smallest possible count.*at rank 1"):
        match_layer(cp(8, 17, 16, 1), 10)
    custom = ExpertNetwork.from_spec("n1 a, a i o", expert_dims=4, in_features=5, out_features=6, ranks=2)
    # A network without a format scales every bond (here the only one, a).
    assert match_layer(custom, 1000).bonds == ("a",) == match_layer(custom, 1000, bonds=["a"]).bonds
    with pytest.raises(TypeError, match=r"needs an ExpertNetwork, got 'cp'"):
        match_layer("cp", 1000)
    with pytest.raises(ValueError, match=r"bonds to scale must be bonds of the network"):
        match_layer(tucker(8, 17, 16, 2), 10_000, bonds=["zz"])
    with pytest.raises(ValueError, match=r"must be a positive int"):
        solve_rank(lambda r: r, 0)


def test_match_block_shares_one_rank():
    first, second = cp(64, 197, 256, 1), cp(64, 257, 196, 1)
    matched = match_block(first, second, 100_804)
    assert matched.networks[0].sizes["r"] == matched.networks[1].sizes["r"] == matched.rank


def test_compare_table_and_renderers():
    table = compare(64, 128, (8, 4), ("cp", "tr", "tt", "tucker"), ranks={"tt": 8}, batch=16)
    names = [row.name for row in table.rows]
    assert names[:4] == ["cp μMoE", "tr μMoE", "tt μMoE", "tucker μMoE"]
    assert names[4:] == ["nn.Linear", "dense MoE (N=32)", "sparse top-2 MoE (N=32)"]
    tt_row = table.rows[2]
    assert tt_row.ranks == "r1=4, r2=4, r3=8"
    assert table.rows[4].params_vs_reference == 1.0
    import csv
    import io
    import json

    data = json.loads(table.to_json())
    assert data["config"]["target_params"] == 65 * 128 and len(data["rows"]) == 7
    assert len(list(csv.DictReader(io.StringIO(table.to_csv())))) == 7
    assert table.to_markdown().count("\n") == 8
    assert table.to_rich().row_count == 7


def test_compare_errors():
    with pytest.raises(ValueError, match=r"unknown decomposition 'cpx'"):
        compare(decompositions=("cpx",))
    with pytest.raises(ValueError, match=r"ranks given for \['tt'\], which name no row; the rows are \['cp'\]"):
        compare(decompositions=("cp",), ranks={"tt": 3})
    with pytest.raises(ValueError, match=r"match must be 'linear', 'mlp'"):
        compare(match="huge")
    with pytest.raises(TypeError, match=r"bias must be a bool, got 2"):
        compare(bias=2)


def test_cost_model_is_torch_free():
    import subprocess

    code = "import sys, mumoe_tn.costs, mumoe_tn.network, mumoe_tn.decompositions; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
