"""Planning time bounded by the network's size: searches above their effort bound are left out or
replaced by the greedy path (and the plan says so), and saved plans are held to a memory bound."""

import json
import subprocess
import sys
import time
from pathlib import Path

import opt_einsum
import pytest
import torch

from mumoe_tn import ExpertNetwork
from mumoe_tn.contractions import plan_contraction, plan_forward
from mumoe_tn.contractions.effort import (
    BRANCH_TWO_MAX_OPERANDS,
    DP_EFFORT_BOUND,
    EXHAUSTIVE_MAX_OPERANDS,
    GREEDY_EFFORT_BOUND,
    dp_effort,
    exhaustive_orders,
    search_refusal,
)
from mumoe_tn.contractions.inference_plan import constant_elements, constant_steps
from mumoe_tn.contractions.plan import ContractionPlan
from mumoe_tn.contractions.saved import LOADED_PEAK_FACTOR, loaded_plan_bound
from mumoe_tn.contractions.search import bounded_candidates, bounded_path, find_path
from mumoe_tn.conversion.persistence.record import execution_from_data
from mumoe_tn.decompositions import build
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.network import BATCH_LABEL

DTYPE = torch.float64
#: Hang guards, not benchmarks: on an idle core each of these plans in well under a second.
QUICK = 10.0
#: The whole clique family, 6 to 16 cores, planned in one subprocess.
FAMILY_SECONDS = 60
REPOSITORY = Path(__file__).resolve().parents[2]


def clique(cores, modes=1, bond=1, leg=4):
    """Every pair of cores joined by a bond of size ``bond``; the physical legs spread over the first cores."""
    labels = {f"c{k}": [] for k in range(cores)}
    sizes = {}
    for a in range(cores):
        for b in range(a + 1, cores):
            labels[f"c{a}"].append(f"b{a}_{b}")
            labels[f"c{b}"].append(f"b{a}_{b}")
            sizes[f"b{a}_{b}"] = bond
    for k, physical in enumerate([*(f"n{m + 1}" for m in range(modes)), "i", "o"]):
        labels[f"c{k % cores}"].append(physical)
        sizes[physical] = leg
    return ExpertNetwork(labels, sizes, name="clique")


def forward(network, batch):
    inputs, output = network.forward_equation()
    return [tuple(x) for x in inputs], tuple(output), {**network.sizes, BATCH_LABEL: batch}


# ---------------------------------------------------------------- the attacker's clique
def test_a_twelve_core_clique_plans_in_seconds_and_says_which_searches_it_left_out():
    network = clique(12)
    start = time.perf_counter()
    plan = plan_forward(network, 64)
    assert time.perf_counter() - start < QUICK
    assert len(plan.inputs) == 14
    assert "left out dynamic programming (without outer products, fewest FMAs) over 14 operands" in plan.note
    assert "note: left out dynamic programming" in repr(plan)


def test_a_twelve_core_clique_layer_builds_and_calibrates_in_seconds():
    start = time.perf_counter()
    layer = FactorizedExperts(clique(12), dtype=DTYPE)  # calibration plans forward passes and the squared norm
    y = layer(torch.randn(4, 4, dtype=DTYPE), [torch.rand(4, 4, dtype=DTYPE)])
    assert time.perf_counter() - start < 2 * QUICK
    assert y.shape == (4, 4) and torch.isfinite(y).all()


FAMILY = range(6, 17)

FAMILY_SCRIPT = """
import json, sys, time
sys.path.insert(0, {tests!r})
from test_planning_effort import clique
from mumoe_tn.contractions.plan import plan_forward
for cores in {sizes!r}:
    start = time.perf_counter()
    try:
        plan_forward(clique(cores), 64)
        outcome = "planned"
    except ValueError as error:  # the library's own refusal (a step beyond torch.einsum's 52 labels)
        outcome = str(error)
    print(json.dumps({{"cores": cores, "seconds": time.perf_counter() - start, "outcome": outcome}}), flush=True)
"""


@pytest.fixture(scope="module")
def clique_family():
    """Plan the cliques of 6 to 16 cores in a subprocess, within `FAMILY_SECONDS` in all."""
    script = FAMILY_SCRIPT.format(tests=str(Path(__file__).parent), sizes=list(FAMILY))
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=FAMILY_SECONDS,
            cwd=REPOSITORY,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"planning the clique family took over {FAMILY_SECONDS} s; it got through: {expired.stdout}")
    assert done.returncode == 0, done.stderr
    return {entry["cores"]: entry for entry in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize("cores", FAMILY)
def test_every_clique_of_the_family_plans_in_bounded_time(clique_family, cores):
    entry = clique_family[cores]
    assert entry["seconds"] < QUICK / 2, entry
    assert entry["outcome"] == "planned" or "torch.einsum accepts at most 52" in entry["outcome"], entry


# ---------------------------------------------------------------- named optimizers beyond their bound
def test_a_recorded_optimal_over_ten_expert_modes_plans_quickly_and_says_it_fell_back():
    network = build("cp", (2,) * 10, 4, 3, 2)
    layer = FactorizedExperts(network, dtype=DTYPE)
    for option, value in execution_from_data({"optimize": "optimal"}).items():  # as a replayed record sets it
        setattr(layer, option, value)
    start = time.perf_counter()
    y = layer(torch.randn(4, 4, dtype=DTYPE), [torch.rand(4, 2, dtype=DTYPE) for _ in range(10)])
    assert time.perf_counter() - start < QUICK
    plan = layer.plan(4)
    assert "'optimal' is an exhaustive search over 23 operands" in plan.note
    assert plan.note.endswith("planned with 'greedy'")
    assert plan.path == find_path(*forward(network, 4), "greedy")
    assert y.shape == (4, 3)


@pytest.mark.parametrize(
    ("optimizer", "operands", "refused"),
    [
        ("optimal", EXHAUSTIVE_MAX_OPERANDS, False),
        ("optimal", EXHAUSTIVE_MAX_OPERANDS + 1, True),
        ("branch-all", EXHAUSTIVE_MAX_OPERANDS + 1, True),
        ("branch-2", BRANCH_TWO_MAX_OPERANDS, False),
        ("branch-2", BRANCH_TWO_MAX_OPERANDS + 1, True),
        ("greedy", 200, False),
    ],
)
def test_named_searches_follow_their_operand_bounds(optimizer, operands, refused):
    # A chain of matrices: the bounds on these searches count operands alone.
    inputs = [(f"x{k}", f"x{k + 1}") for k in range(operands)]
    sizes = {f"x{k}": 2 for k in range(operands + 1)}
    refusal = search_refusal(optimizer, inputs, ("x0",), sizes, most_cost=1)
    assert (refusal is not None) == refused
    if refused:
        assert f"over {operands} operands" in refusal


def test_the_exhaustive_bound_counts_pairwise_orders():
    # n operands: C(n,2) · C(n-1,2) · … · C(2,2) orders, counted here by brute force for small n.
    def orders(n):
        return 1 if n == 1 else sum(orders(n - 1) for _ in range(n * (n - 1) // 2))

    assert [exhaustive_orders(n) for n in range(1, 7)] == [orders(n) for n in range(1, 7)]


def test_dynamic_programming_effort_counts_connected_sub_networks():
    # A chain of 6 matrices has 21 connected sub-networks (its intervals) against 63 subsets: the
    # pairs one sweep compares are sums of products of those counts (by hand: sizes 1..6 keep
    # 6, 5, 4, 3, 2, 1 intervals). Sizes of 1: every sub-network is within the first cost cap.
    inputs = [(f"x{k}", f"x{k + 1}") for k in range(6)]
    sizes = {f"x{k}": 1 for k in range(7)}
    counts = [0, 6, 5, 4, 3, 2, 1]
    pairs = sum(counts[m] * counts[n - m] for n in range(2, 7) for m in range(1, n // 2 + 1))
    assert dp_effort(inputs, ("x0", "x6"), sizes, outer=False, most_cost=1) == pairs
    every = [1, 6, 15, 20, 15, 6, 1]
    pairs = sum(every[m] * every[n - m] for n in range(2, 7) for m in range(1, n // 2 + 1))
    assert dp_effort(inputs, ("x0", "x6"), sizes, outer=True, most_cost=1) == pairs
    # Sizes of 2 and a cap at the result's size (4): only the intervals' results (two legs) fit.
    sizes = {f"x{k}": 2 for k in range(7)}
    assert dp_effort(inputs, ("x0", "x6"), sizes, outer=True, most_cost=4) == 196


def test_a_memory_limit_prunes_the_counted_sub_networks():
    network = clique(8, bond=2)
    inputs, output, sizes = forward(network, 64)
    free = dp_effort(inputs, output, sizes, outer=False, most_cost=10**12)
    bounded = dp_effort(inputs, output, sizes, outer=False, most_cost=10**12, memory_limit=64 * 4)
    assert bounded < free


def test_a_randomised_search_over_a_large_clique_falls_back_to_greedy():
    network = clique(40)
    inputs, output, sizes = forward(network, 4)
    start = time.perf_counter()
    path, note = bounded_path(inputs, output, sizes, "random-greedy-128")
    assert time.perf_counter() - start < QUICK
    assert path == find_path(inputs, output, sizes, "greedy")
    assert f"above the bound {GREEDY_EFFORT_BOUND:.1e}" in note and note.endswith("planned with 'greedy'")


def test_a_hyper_optimiser_is_counted_by_its_trials():
    # What optimize="cotengra" builds (cotengra.HyperOptimizer), stood in for by an object of that name.
    hyper_optimizer = type("HyperOptimizer", (), {})
    inputs, output, sizes = forward(clique(40), 4)
    few, many = hyper_optimizer(), hyper_optimizer()
    few.max_repeats, many.max_repeats = 1, 128
    assert search_refusal(few, inputs, output, sizes, most_cost=1) is None
    refusal = search_refusal(many, inputs, output, sizes, most_cost=1)
    assert "a randomised search of 128 trials over 42 operands" in refusal


def test_dynamic_programming_on_the_clique_is_refused_and_on_a_chain_is_run():
    inputs, output, sizes = forward(clique(12), 64)
    path, note = bounded_path(inputs, output, sizes, "dp")
    assert f"above the bound {DP_EFFORT_BOUND:.1e}" in note
    assert path == find_path(inputs, output, sizes, "greedy")
    chain = build("tt", (2,) * 7, 3, 4, 2)  # 17 operands, but few connected sub-networks
    inputs, output, sizes = forward(chain, 64)
    path, note = bounded_path(inputs, output, sizes, "dp")
    assert note == ""
    assert path == find_path(inputs, output, sizes, opt_einsum.paths.DynamicProgramming())


def test_the_same_network_gets_the_same_answer_every_time():
    inputs, output, sizes = forward(clique(10), 64)
    first = bounded_candidates(inputs, output, sizes)
    assert first[1], "the clique of 10 leaves some search out"
    assert bounded_candidates(inputs, output, sizes) == first


def test_a_note_travels_with_a_saved_plan_and_does_not_change_its_identity():
    plan = plan_forward(build("cp", (2,) * 10, 4, 3, 2), 4, "optimal")
    assert plan.note
    again = ContractionPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.note == plan.note
    assert again == plan_forward(build("cp", (2,) * 10, 4, 3, 2), 4, "greedy")
    data = plan.to_dict()
    data["note"] = ["not", "text"]
    with pytest.raises(ValueError, match="a saved plan's note must be a string"):
        ContractionPlan.from_dict(data)


# ---------------------------------------------------------------- saved plans held to a memory bound
def cores_first_path(n_cores, n_operands):
    """Contract every core into the dense W first, then the rows: the worst order for a batch."""
    path, length = [(0, 1)], n_operands - 1
    while length > 1:
        path.append((0, length - 1))
        length -= 1
    assert len(path) == n_operands - 1 and n_cores >= 2
    return tuple(path)


def worst_order_plans(network, batch, kind="train"):
    """Saved plans (as ``export_plans`` writes them) holding one plan in the cores-first order."""
    inputs, output, sizes = forward(network, batch)
    path = cores_first_path(len(network.cores), len(inputs))
    plan = plan_contraction(inputs, output, sizes, path, lead=BATCH_LABEL)
    entry = {"kind": kind, "batch": batch, "plan": plan.to_dict()}
    if kind == "inference":
        entry["constant"] = sorted(constant_steps(plan, len(network.cores)))
    return {"format": 1, "network": network.to_spec(), "plans": [entry]}


def test_a_saved_plan_in_the_worst_order_is_refused_and_the_layer_plans_within_the_bound():
    network = build("tucker", (16, 16), 128, 128, 4)
    layer = FactorizedExperts(network, dtype=DTYPE)
    saved = worst_order_plans(network, 4)
    crafted = ContractionPlan.from_dict(saved["plans"][0]["plan"])
    dense = 16 * 16 * 128 * 128  # W itself: every core contracted before any row
    assert crafted.largest_intermediate >= dense
    bound = loaded_plan_bound(network, 4)
    greedy = plan_forward(network, 4, "greedy")
    assert bound == max(4 * 4 * 128, 4 * 128 * 4, LOADED_PEAK_FACTOR * greedy.largest_intermediate)
    assert crafted.largest_intermediate > bound
    with pytest.raises(ValueError, match=r"saved train plan 0 \(batch 4\) step \d+ .* makes an intermediate of "):
        layer.load_plans(saved)
    assert layer.export_plans()["plans"] == []  # nothing was loaded
    assert layer.plan(4).largest_intermediate <= bound


def test_a_saved_plan_is_held_to_the_layers_memory_limit():
    network = build("tucker", (16, 16), 128, 128, 4)
    first = FactorizedExperts(network, dtype=DTYPE)
    first.plan(64)
    saved = first.export_plans()
    assert first.plan(64).largest_intermediate == 64 * 128  # the output: every path allocates it
    FactorizedExperts(network, dtype=DTYPE, memory_limit=64 * 128).load_plans(saved)  # fits: loads
    # At batch 4: the core meets both expert factors first, (n1 n2 s_i s_o) = 16·16·4·4 elements,
    # above the output (4·128) but within the default bound.
    inputs, output, sizes = forward(network, 4)
    path = ((0, 1), (0, 6), (2, 5), (2, 4), (0, 2), (1, 2), (0, 1))
    plan = plan_contraction(inputs, output, sizes, path, lead=BATCH_LABEL)
    assert plan.largest_intermediate == 16 * 16 * 4 * 4
    data = {**saved, "plans": [{"kind": "train", "batch": 4, "plan": plan.to_dict()}]}
    assert plan.largest_intermediate <= loaded_plan_bound(network, 4)
    FactorizedExperts(network, dtype=DTYPE).load_plans(data)
    with pytest.raises(ValueError, match=r"step 1 .* 4,096 elements, above the bound of 2,048 \(memory_limit=2048\)"):
        FactorizedExperts(network, dtype=DTYPE, memory_limit=2048).load_plans(data)


def test_an_inference_plan_caching_the_dense_weight_is_refused():
    network = build("tucker", (16, 16), 128, 128, 4)
    saved = worst_order_plans(network, 1, kind="inference")
    plan = ContractionPlan.from_dict(saved["plans"][0]["plan"])
    assert saved["plans"][0]["constant"] == [0, 1, 2, 3]  # every core, into W (16·16·128·128 elements)
    assert constant_elements(plan, frozenset(range(4))) > max(4 * network.n_params, 1 << 20)
    with pytest.raises(ValueError, match=r"saved inference plan 0 \(batch 1\) caches [\d,]+ elements of core-only"):
        FactorizedExperts(network, dtype=DTYPE).load_plans(saved)


def test_the_layers_own_plans_always_load_back():
    for name, dims in [("tucker", (16, 16)), ("cp", (8, 8, 8)), ("tt", (4,) * 6), ("tr", (16,))]:
        network = build(name, dims, 128, 128, 4)
        first = FactorizedExperts(network, dtype=DTYPE).eval()
        for batch in (1, 8, 256):
            first.plan(batch)
            with torch.no_grad():
                first(torch.randn(batch, 128, dtype=DTYPE), [torch.rand(batch, n, dtype=DTYPE) for n in dims])
        FactorizedExperts(network, dtype=DTYPE).load_plans(json.loads(json.dumps(first.export_plans())))


def _timed(make, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        made = make()
        best = min(best, time.perf_counter() - start)
    return best, made


if __name__ == "__main__":  # python tests/contractions/test_planning_effort.py: the planning-time figures of the docs
    torch.set_num_threads(1)
    print("search (what runs)                                   seconds  note")
    for cores in range(6, 17, 2):
        start = time.perf_counter()
        try:
            note = repr(plan_forward(clique(cores), 64).note[:60])
        except ValueError as refused:  # a step beyond einsum's 52 labels: refused, in bounded time too
            note = f"refused: {str(refused)[:50]}"
        seconds = time.perf_counter() - start
        print(f"clique of {cores:2d} cores, 'auto'                           {seconds:7.3f}  {note}")
    for label, network, optimizer in [
        ("'optimal' at its bound (8 operands)", clique(5, modes=2), "optimal"),
        ("'branch-2' at its bound (16 operands)", clique(13, modes=2), "branch-2"),
        ("'dp' on a TT layer of 8 expert modes (19 operands)", build("tt", (2,) * 8, 3, 4, 2), "dp"),
        ("'greedy' on a 256-core chain (511 operands)", build("tt", (2,) * 254, 3, 4, 2), "greedy"),
    ]:
        inputs, output, sizes = forward(network, 64)
        seconds, (_, note) = _timed(lambda i=inputs, o=output, s=sizes, opt=optimizer: bounded_path(i, o, s, opt), 1)
        print(f"{label:52s} {seconds:7.3f}  {note[:60]!r} ({len(inputs)} operands)")
