"""The planner: bounded planning time, FMA-optimality on small networks, any number of labels,
checked paths, and the module's plan cache (LRU, thread-safe, fresh optimizers, autotune)."""

import importlib.util
import itertools
import re
import string
import sys
import threading
import time
from functools import cache
from types import SimpleNamespace

import opt_einsum
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import named_networks

import mumoe_tn.contractions.search
from mumoe_tn import ExpertNetwork, MuMoE
from mumoe_tn.contractions import (
    autotune,
    autotune_candidates,
    constant_steps,
    forward_candidates,
    per_call_fma,
    plan_contraction,
    plan_dense,
    plan_forward,
    plan_inference,
    run_plan,
)
from mumoe_tn.contractions.autotune import fastest_plan
from mumoe_tn.contractions.inference_plan import constant_elements
from mumoe_tn.contractions.plan import AUTOTUNE_CANDIDATES, AUTOTUNE_FMA_SLACK, einsum_equation
from mumoe_tn.contractions.search import RANDOM_GREEDY_REPEATS, candidate_paths
from mumoe_tn.decompositions import build, get_format, tt
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.network import BATCH_LABEL

DTYPE = torch.float64
#: Hang guards, not benchmarks: planning takes well under a second on an idle core.
GENEROUS_SECONDS = 15.0


def sweep_reference(network, cores, coefficients, z):
    """y computed row by row: vectors absorbed into their cores, then cores contracted left to
    right in declaration order (einsum symbols assigned here, per call) — no path search."""
    legs = dict(zip(network.expert_legs, range(len(coefficients)), strict=True))
    rows = []
    for b in range(z.shape[0]):
        tensors = []
        for name, labels in network.cores.items():
            tensor, kept = cores[name], list(labels)
            for label in labels:
                if label in legs or label == "i":
                    vector = coefficients[legs[label]][b] if label in legs else z[b]
                    tensor = torch.tensordot(tensor, vector, dims=([kept.index(label)], [0]))
                    kept.remove(label)
            tensors.append((tensor, kept))
        running, labels = tensors[0]
        for k, (tensor, other) in enumerate(tensors[1:], start=1):
            later = {x for _, rest in tensors[k + 1 :] for x in rest} | {"o"}
            result = [x for x in dict.fromkeys(labels + other) if x in later]
            symbol = dict(zip(dict.fromkeys(labels + other), string.ascii_letters, strict=False))
            equation = "".join(symbol[x] for x in labels) + "," + "".join(symbol[x] for x in other)
            running = torch.einsum(equation + "->" + "".join(symbol[x] for x in result), running, tensor)
            labels = result
        rows.append(running)
    return torch.stack(rows)


def random_call(network, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    coefficients = [torch.rand(batch, n, generator=gen, dtype=DTYPE) for n in network.expert_dims]
    return coefficients, torch.randn(batch, network.in_features, generator=gen, dtype=DTYPE)


# ---------------------------------------------------------------- bounded planning time
@pytest.mark.parametrize("name", ["cp", "tucker"])
def test_eight_expert_modes_build_and_run_in_bounded_time(name):
    start = time.perf_counter()
    layer = MuMoE(8, 8, (2,) * 8, name, 4 if name == "cp" else 2, dtype=DTYPE)
    y = layer(torch.randn(6, 8, dtype=DTYPE))
    assert time.perf_counter() - start < GENEROUS_SECONDS
    experts = layer.experts
    z = layer.input_norm(torch.randn(3, 8, dtype=DTYPE))
    coefficients = [torch.rand(3, 2, dtype=DTYPE) for _ in range(8)]
    cores = experts.cores
    expected = sweep_reference(experts.network, cores, coefficients, torch.cat([z, torch.ones(3, 1, dtype=DTYPE)], 1))
    torch.testing.assert_close(experts(z, coefficients, append_one=True), expected)
    assert y.shape == (6, 8)


@pytest.mark.parametrize(
    ("name", "modes", "rank"),
    [("cp", 51, 3), ("tt", 58, 2), ("tt", 24, 2)],
    ids=["star-54-labels", "chain-60-cores", "chain-26-cores"],
)
def test_large_networks_build_and_run_and_match_a_sweep(name, modes, rank):
    network = build(name, (2,) * modes, 3, 4, rank)
    assert name != "cp" or len(network.sizes) == 54
    start = time.perf_counter()
    module = FactorizedExperts(network, dtype=DTYPE)  # init contracts the squared norm (2× bond labels)
    coefficients, z = random_call(network, 5)
    y = module(z, coefficients)
    assert time.perf_counter() - start < 2 * GENEROUS_SECONDS
    with torch.no_grad():
        expected = sweep_reference(network, module.cores, coefficients, z)
    torch.testing.assert_close(y, expected)


def test_a_custom_54_label_star_builds_runs_and_matches_a_sweep():
    # A centre core holding i, o and 26 bonds, each bond to a leaf core holding one expert leg.
    leaves = 26
    spec = {"centre": ("i", "o", *(f"b{k}" for k in range(leaves)))}
    spec |= {f"leaf{k}": (f"b{k}", f"n{k + 1}") for k in range(leaves)}
    sizes = {"i": 3, "o": 2, **{f"b{k}": 2 if k < 6 else 1 for k in range(leaves)}}
    sizes |= {f"n{k + 1}": 2 for k in range(leaves)}
    network = ExpertNetwork(spec, sizes, name="custom")
    assert len(network.sizes) == 54
    start = time.perf_counter()
    module = FactorizedExperts(network, dtype=DTYPE)
    coefficients, z = random_call(network, 4)
    y = module(z, coefficients)
    assert time.perf_counter() - start < 2 * GENEROUS_SECONDS
    with torch.no_grad():
        torch.testing.assert_close(y, sweep_reference(network, module.cores, coefficients, z))


def test_every_step_equation_uses_only_letters_torch_accepts():
    network = build("tt", (2,) * 58, 3, 4, 2)
    assert len(network.sizes) > 52
    plan = plan_forward(network, 8)
    for step in plan.steps:
        assert re.fullmatch(r"[a-zA-Z,]+->[a-zA-Z]*", step.equation), step.equation


def test_a_step_beyond_52_labels_is_a_clear_error():
    labels = [f"x{k}" for k in range(53)]
    sizes = dict.fromkeys(labels, 1)
    with pytest.raises(ValueError, match="at most 52"):
        plan_contraction([labels[:30], labels[20:]], labels, sizes, "greedy")


# ---------------------------------------------------------------- FMA-optimality
def _step_fma(labels_a, labels_b, sizes):
    total = 1
    for x in set(labels_a) | set(labels_b):
        total *= sizes[x]
    return total


def exact_minimum_fma(inputs, output, sizes):
    """FMA-minimal pairwise contraction over all orders (subset DP, outer products included)."""
    n = len(inputs)
    full = (1 << n) - 1

    def labels_of(subset):
        inside = {x for k in range(n) if subset >> k & 1 for x in inputs[k]}
        outside = {x for k in range(n) if not subset >> k & 1 for x in inputs[k]} | set(output)
        return frozenset(inside & outside)

    @cache
    def best(subset):
        if subset & (subset - 1) == 0:
            return 0
        found = None
        low = subset & -subset
        part = (subset - 1) & subset
        while part:
            if part & low:  # each split once
                rest = subset ^ part
                cost = best(part) + best(rest) + _step_fma(labels_of(part), labels_of(rest), sizes)
                found = cost if found is None else min(found, cost)
            part = (part - 1) & subset
        return found

    return best(full)


@settings(max_examples=120, deadline=None)
@given(
    named_networks(names=("cp", "tr", "tt"), max_modes=2, max_size=5, max_rank=4) | named_networks(("tucker",), 1),
    st.sampled_from([1, 2, 7, 64, 1024]),
)
def test_auto_is_fma_optimal_on_small_networks(network, batch):
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch}
    assert len(inputs) <= 7
    auto = plan_forward(network, batch)
    assert auto.fma == exact_minimum_fma([tuple(x) for x in inputs], tuple(output), sizes)
    assert auto.fma <= plan_forward(network, batch, "optimal").fma
    assert auto.fma <= plan_forward(network, batch, "dp").fma


def test_auto_beats_dp_where_dp_misses_outer_products():
    network = tt(6, 2, 10, (2, 7))
    auto, dp = plan_forward(network, 64), plan_forward(network, 64, "dp")
    assert auto.fma < dp.fma


@settings(max_examples=30, deadline=None)
@given(named_networks(max_modes=3), st.sampled_from([1, 16, 512]))
def test_auto_never_costs_more_than_dp(network, batch):
    assert plan_forward(network, batch).fma <= plan_forward(network, batch, "dp").fma


# ---------------------------------------------------------------- checked arguments
@pytest.mark.parametrize("batch", [0, -5, 2.5, True, "8", None])
def test_plan_forward_rejects_a_batch_that_is_not_a_positive_int(batch):
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        plan_forward(build("cp", 3, 4, 5, 2), batch)


@pytest.mark.parametrize(
    ("path", "match"),
    [
        (((0, 9), (0, 1), (0, 1), (0, 1), (0, 1), (0, 1)), "outside"),
        (((0, 1),), "leaves 6 operand"),
        (((0, 1),) * 7, "outside"),
        (((0, 0), (0, 1)), "distinct"),
        (((),), "non-empty"),
        ((("a", 1),), "int positions"),
        ((), "leaves 7 operand"),
    ],
)
def test_explicit_paths_are_checked(path, match):
    network = build("cp", (3, 2), 4, 5, 2)
    with pytest.raises(ValueError, match=match):
        plan_forward(network, 4, path)


def test_a_valid_explicit_path_is_followed_and_correct():
    network = build("cp", (3, 2), 4, 5, 2)
    path = ((0, 1), (0, 1), (0, 1), (0, 1), (0, 1), (0, 1))
    plan = plan_forward(network, 4, [list(step) for step in path])
    assert plan.path == path
    gen = torch.Generator().manual_seed(0)
    cores = {name: torch.randn(shape, generator=gen, dtype=DTYPE) for name, shape in network.core_shapes.items()}
    coefficients, z = random_call(network, 4)
    y = run_plan(plan, [*cores.values(), *coefficients, z])
    torch.testing.assert_close(y, sweep_reference(network, cores, coefficients, z))


# ---------------------------------------------------------------- the module's plan cache
def test_plan_cache_is_least_recently_used():
    module = FactorizedExperts(build("cp", (3, 2), 4, 5, 2), max_plans=2)
    first = module.plan(1)
    second = module.plan(4)
    assert module.plan(1) is first  # touched: now the most recent
    module.plan(16)  # evicts bucket 4, the least recently used
    assert module.plan(1) is first
    assert module.plan(4) is not second


def test_concurrent_forwards_with_a_one_plan_cache(monkeypatch):
    import mumoe_tn.layers.experts

    real = mumoe_tn.layers.experts.plan_forward

    def slow_plan_forward(*args, **kwargs):  # planning yields the GIL: threads interleave
        time.sleep(0.002)
        return real(*args, **kwargs)

    monkeypatch.setattr(mumoe_tn.layers.experts, "plan_forward", slow_plan_forward)
    torch.manual_seed(0)
    module = FactorizedExperts(build("tr", (3, 2), 4, 5, 2), max_plans=1, dtype=DTYPE)
    calls = [random_call(module.network, batch, seed=batch) for batch in (1, 3, 5, 9, 17, 33, 65, 129)]
    with torch.no_grad():
        expected = [sweep_reference(module.network, module.cores, a, z) for a, z in calls]
    errors, results = [], {}

    def work(k):
        try:
            for _ in range(15):
                results[k] = module(calls[k][1], calls[k][0])
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(calls))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: races show up in a short test
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for k, value in enumerate(expected):
        torch.testing.assert_close(results[k], value)


def test_named_optimizers_are_fresh_for_every_plan():
    pytest.importorskip("cotengra")
    network = tt(6, 3, 10, (2, 7))
    module = FactorizedExperts(network, optimize="cotengra")
    module.plan(3)  # a stateful shared optimizer would keep the tree found here
    stale_tree_fma = 1_130_496  # what the tree for another batch size costs at batch 8192
    assert module.plan(8192).fma < stale_tree_fma


def test_cached_plans_are_not_pickled_and_the_module_round_trips():
    import copy
    import pickle

    module = FactorizedExperts(build("cp", (3, 2), 4, 5, 2), dtype=DTYPE)
    try:
        pickle.dumps(module.network)
    except TypeError:
        pytest.skip("ExpertNetwork itself does not pickle yet")
    coefficients, z = random_call(module.network, 3)
    y = module(z, coefficients)
    for clone in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        torch.testing.assert_close(clone(z, coefficients), y)


# ---------------------------------------------------------------- autotune
def test_autotune_picks_one_of_the_cheapest_candidates_and_is_exact():
    torch.manual_seed(0)
    module = FactorizedExperts(build("tr", (4, 3), 6, 5, 3), optimize="autotune", dtype=DTYPE)
    coefficients, z = random_call(module.network, 50)
    y = module(z, coefficients)
    with torch.no_grad():
        torch.testing.assert_close(y, sweep_reference(module.network, module.cores, coefficients, z))
    chosen = module.plan(50)
    candidates = autotune_candidates(module.network, 64)
    assert any(chosen.steps == plan.steps for plan in candidates)
    assert module.plan(50) is chosen  # timed once per bucket, then cached


def test_fastest_plan_returns_a_given_plan_and_checks_its_arguments():
    network = build("cp", (3, 2), 4, 5, 2)
    plans = forward_candidates(network, 8)
    operands = [torch.randn(s) for s in network.core_shapes.values()]
    operands += [torch.rand(8, n) for n in network.expert_dims] + [torch.randn(8, 4)]
    assert fastest_plan(plans, operands, repeats=1) in plans
    with pytest.raises(ValueError, match=r"^autotuning needs at least one candidate plan$"):
        fastest_plan([], operands)
    for bad in (0, 2.5, "3", True):
        with pytest.raises(ValueError, match=rf"^repeats must be a positive int, got {re.escape(repr(bad))}$"):
            fastest_plan(plans, operands, repeats=bad)
    assert fastest_plan(plans[:1], operands) is plans[0]


def test_fastest_plan_prefers_the_fast_plan_whatever_the_order(monkeypatch):
    # A clock that advances by each run's FMA count: the choice is tested, not this machine's load.
    # One path contracts z and the input core first; the other forms the (i, o, r) outer product of
    # the two matrix cores first (more than 50 times the work).
    network = build("cp", 4, 129, 128, 32)
    sizes = {**network.sizes, BATCH_LABEL: 256}
    inputs, output = network.forward_equation()
    assert inputs == [("n1", "r"), ("i", "r"), ("o", "r"), (BATCH_LABEL, "n1"), (BATCH_LABEL, "i")]
    good = plan_contraction(inputs, output, sizes, "greedy", lead=BATCH_LABEL)
    slow = plan_contraction(inputs, output, sizes, ((1, 2), (0, 1), (1, 2), (0, 1)), lead=BATCH_LABEL)
    assert slow.fma > 50 * good.fma
    clock, runs = [0.0], []

    def counted_run(plan, tensors, *, ones_appended=None):
        runs.append(plan)
        clock[0] += plan.fma  # whole numbers: equal plans take exactly equal times
        return run_plan(plan, tensors, ones_appended=ones_appended)  # the real call checks the operands

    monkeypatch.setattr(autotune, "run_plan", counted_run)
    monkeypatch.setattr(autotune, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    gen = torch.Generator().manual_seed(0)
    operands = [torch.randn(shape, generator=gen) for shape in network.core_shapes.values()]
    operands += [torch.rand(256, n, generator=gen) for n in network.expert_dims]
    operands.append(torch.randn(256, 128, generator=gen))  # the folded bias: leg i lacks its last 1
    for plans in ([slow, good], [good, slow]):
        assert fastest_plan(plans, operands, ones_appended="i", repeats=2) is good
    assert runs == [slow] * 3 + [good] * 3 + [good] * 3 + [slow] * 3  # one warm-up, then the repeats
    twin = plan_contraction(inputs, output, sizes, slow.path, lead=BATCH_LABEL)
    assert twin == slow and twin is not slow
    assert fastest_plan([slow, twin], operands, ones_appended="i", repeats=1) is slow  # a tie: the earlier
    assert fastest_plan([twin, slow], operands, ones_appended="i", repeats=1) is twin


class _BackwardTicks(torch.autograd.Function):
    """Identity whose backward advances a fake clock by ``cost`` (a plan's backward work)."""

    @staticmethod
    def forward(ctx, tensor, clock, cost):
        ctx.clock, ctx.cost = clock, cost
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock[0] += ctx.cost
        return grad, None, None


def test_fastest_plan_times_the_backward_pass_in_training(monkeypatch):
    # Plan "forward_light" runs its forward in 1 tick and its backward in 10; "balanced" takes 3 + 3.
    # Forward alone favours the first, a training step (forward + backward) the second.
    network = build("cp", 3, 5, 4, 2)
    plans = forward_candidates(network, 8)[:2]
    assert plans[0] != plans[1]
    forward_light, balanced = plans
    ticks = {id(forward_light): (1, 10), id(balanced): (3, 3)}
    clock, seen = [0.0], []

    def ticking_run(plan, tensors, *, ones_appended=None):
        forward, backward = ticks[id(plan)]
        clock[0] += forward
        seen.append((torch.is_grad_enabled(), [t.requires_grad for t in tensors]))
        return _BackwardTicks.apply(run_plan(plan, tensors, ones_appended=ones_appended), clock, backward)

    monkeypatch.setattr(autotune, "run_plan", ticking_run)
    monkeypatch.setattr(autotune, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    cores = [torch.randn(s, requires_grad=True) for s in network.core_shapes.values()]
    rows = [torch.rand(8, n) for n in network.expert_dims] + [torch.randn(8, 5)]
    operands = cores + rows
    assert fastest_plan(plans, operands, repeats=1) is balanced  # grad enabled, cores require grad
    assert seen[0] == (True, [True] * len(cores) + [False] * len(rows))  # as the operands required it
    with torch.no_grad():
        assert fastest_plan(plans, operands, repeats=1) is forward_light
    assert fastest_plan(plans, operands, repeats=1, backward=False) is forward_light
    assert fastest_plan(plans, [t.detach() for t in operands], repeats=1) is forward_light
    with torch.no_grad():
        assert fastest_plan(plans, operands, repeats=1, backward=True) is balanced
    assert all(t.grad is None for t in cores)  # timing leaves no gradient behind


def test_fastest_plan_checks_the_backward_option():
    network = build("cp", 3, 5, 4, 2)
    plans = forward_candidates(network, 8)[:2]
    operands = [torch.randn(s) for s in network.core_shapes.values()]
    operands += [torch.rand(8, n) for n in network.expert_dims] + [torch.randn(8, 5)]
    with pytest.raises(TypeError, match=r"^backward must be a bool or None, got int$"):
        fastest_plan(plans, operands, backward=1)
    with pytest.raises(ValueError, match=r"^backward=True needs an operand that requires grad$"):
        fastest_plan(plans, operands, backward=True)
    trainable = [operands[0].clone().requires_grad_(), *operands[1:]]
    with torch.inference_mode():
        with pytest.raises(
            ValueError, match=r"^backward=True cannot time a backward pass under torch\.inference_mode\(\)$"
        ):
            fastest_plan(plans, trainable, backward=True)
        frozen = [t.clone() for t in operands]
    with pytest.raises(ValueError, match=r"^backward=True cannot time a backward pass through inference tensors"):
        fastest_plan(plans, [trainable[0], *frozen[1:]], backward=True)


def test_autotuning_inside_an_activation_checkpoint_finishes():
    # Non-reentrant checkpointing packs every tensor saved in its region; the timing's own backward
    # would unpack them, recompute the region (and its autotuning) and wait on the plan cache.
    torch.manual_seed(0)
    layer = MuMoE(8, 6, (4,), "cp", 5, optimize="autotune", dtype=DTYPE)
    plain = MuMoE(8, 6, (4,), "cp", 5, dtype=DTYPE)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(4, 8, 8, dtype=DTYPE, requires_grad=True)
    result = {}

    def work():
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        y.sum().backward()
        result["y"] = y.detach()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "autotuning under torch.utils.checkpoint did not finish"
    torch.testing.assert_close(result["y"], plain(x))


def test_autotune_candidates_are_the_cheapest_paths_in_both_layouts():
    network = build("tr", (4, 3), 6, 5, 3)
    plans = forward_candidates(network, 64)
    candidates = autotune_candidates(network, 64)
    paths = list(dict.fromkeys(plan.path for plan in candidates))
    expected = [p.path for p in plans if p.fma <= AUTOTUNE_FMA_SLACK * plans[0].fma][:AUTOTUNE_CANDIDATES]
    assert paths == expected
    assert len({plan.steps for plan in candidates}) == len(candidates) <= 2 * len(paths)
    gen = torch.Generator().manual_seed(0)
    cores = {name: torch.randn(shape, generator=gen, dtype=DTYPE) for name, shape in network.core_shapes.items()}
    coefficients, z = random_call(network, 64)
    expected_y = sweep_reference(network, cores, coefficients, z)
    for plan in candidates:  # every layout computes the same result
        torch.testing.assert_close(run_plan(plan, [*cores.values(), *coefficients, z]), expected_y)


def test_candidates_are_distinct_valid_paths_cheapest_first():
    network = build("tucker", (3, 2), 4, 5, 2)
    plans = forward_candidates(network, 16)
    assert len({plan.path for plan in plans}) == len(plans)
    assert [plan.fma for plan in plans] == sorted(plan.fma for plan in plans)
    inputs, _ = network.forward_equation()
    for plan in plans:  # every path contracts every operand exactly once
        used = list(itertools.chain.from_iterable(plan.path))
        assert len(plan.path) == len(inputs) - 1 and len(used) == 2 * (len(inputs) - 1)


def test_opt_einsum_cost_cross_check():
    # Our FMA count of opt_einsum's own path: every pairwise step of the forward network sums
    # an index or not; opt_einsum counts 2 per multiply-add where an index is summed, else 1.
    network = build("cp", (3, 2), 4, 5, 2)
    plan = plan_forward(network, 8, "optimal")
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: 8}
    symbol = {x: opt_einsum.get_symbol(k) for k, x in enumerate(sizes)}
    equation = ",".join("".join(symbol[x] for x in labels) for labels in inputs)
    equation += "->" + "".join(symbol[x] for x in output)
    shapes = [tuple(sizes[x] for x in labels) for labels in inputs]
    _, info = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=list(plan.path))
    summed = sum(step.fma for step in plan.steps if set().union(*step.operands) - set(step.output))
    assert int(info.opt_cost) == plan.fma + summed


@pytest.mark.parametrize("path", [((0, 1, 2),), ((0,), (0, 1, 2))])
def test_a_step_of_k_operands_costs_k_minus_one_fma_per_element(path):
    # "ab,bc,cd->ad" in one step: (3 - 1) multiply-adds for each of the 2·3·4·5 index combinations; a
    # one-operand step "ab->ab" costs one per element. opt_einsum counts FLOPs: (k - 1) multiplies
    # and, where an index is summed, one addition per combination.
    sizes = {"a": 2, "b": 3, "c": 4, "d": 5}
    inputs = [("a", "b"), ("b", "c"), ("c", "d")]
    plan = plan_contraction(inputs, ("a", "d"), sizes, path)
    assert [step.fma for step in plan.steps] == [6] * (len(path) - 1) + [2 * 120]
    _, info = opt_einsum.contract_path("ab,bc,cd->ad", (2, 3), (3, 4), (4, 5), shapes=True, optimize=list(path))
    assert int(info.opt_cost) == plan.fma + 120


def test_plan_repr_by_hand():
    # the batch label shows as "…"; each step costs the product of the sizes of the labels it touches
    sizes = {BATCH_LABEL: 100, "i": 3, "r": 2, "o": 5}
    plan = plan_contraction([(BATCH_LABEL, "i"), ("i", "r"), ("r", "o")], (BATCH_LABEL, "o"), sizes, ((0, 1), (0, 1)))
    assert repr(plan) == (
        "ContractionPlan(3 operands -> (… o), 1,600 FMA)\n"
        "  0: (i r) · (… i) -> (r …)  600 FMA\n"
        "  1: (r …) · (r o) -> (… o)  1,000 FMA"
    )
    assert plan.steps[1].describe() == "(r …) · (r o) -> (… o)"


@pytest.mark.parametrize(
    ("inputs", "output", "message"),
    [
        ([], (), r"^a contraction needs at least one operand$"),
        ([("a", "e")], ("a",), r"^label 'e' has no size; sizes are given for \['a', 'b', 'c', 'd'\]$"),
        ([("a", "b")], ("a", "c", "d"), r"^output labels \['c', 'd'\] appear in no operand$"),
    ],
)
def test_contraction_label_messages(inputs, output, message):
    sizes = {"a": 2, "b": 3, "c": 4, "d": 5}
    for optimize in ("greedy", ((0,),) * bool(inputs)):
        with pytest.raises(ValueError, match=message):
            plan_contraction(inputs, output, sizes, optimize)


# ---------------------------------------------------------------- the "absorb first" candidate
def test_absorb_first_path_by_hand():
    # Operands: 0 U(n, r), 1 a(b, n), 2 C(i, r, s), 3 z(b, i), 4 D(s, o); result (b, o).
    # Each two-leg operand is contracted into the only other operand sharing a leg that is not
    # in the result: a into U (step (0, 1), giving (b, r)); a is then skipped; z's leg b is in the
    # result, its leg i joins it to C (step (0, 1): C and z are now first, giving (b, r, s));
    # D's leg o is in the result, its leg s joins (b, r, s) (step (0, 2), giving (b, r, o)).
    # The two operands left take one more step.
    sizes = {"n": 3, "r": 2, "i": 5, "s": 2, "o": 4, "b": 6}
    inputs = [("n", "r"), ("b", "n"), ("i", "r", "s"), ("b", "i"), ("s", "o")]
    paths = candidate_paths(inputs, ("b", "o"), sizes)
    assert ((0, 1), (0, 1), (0, 2), (0, 1)) in paths
    # Everything absorbed: W(n, i, o) takes a(b, n), then z(b, i); no search of a single operand.
    paths = candidate_paths([("n", "i", "o"), ("b", "n"), ("b", "i")], ("b", "o"), sizes)
    assert ((0, 1), (0, 1)) in paths
    for path in paths:
        assert all(len(step) == 2 for step in path)


@given(named_networks(), st.integers(1, 8))
def test_every_candidate_path_is_pairwise_and_contracts_every_operand(network, batch):
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch}
    for path in candidate_paths(inputs, output, sizes, thorough=True):
        assert all(len(step) == 2 for step in path)
        assert len(path) == len(inputs) - 1


#: The seeded randomised greedy searches asked beyond dynamic programming: fixed trials, no clock.
RANDOM_GREEDY = [
    ("RandomGreedy", "flops", RANDOM_GREEDY_REPEATS, None),
    ("RandomGreedy", "size", RANDOM_GREEDY_REPEATS, None),
]


def _finder(optimize):
    """A finder passed to opt_einsum, described by what matters for the search."""
    if isinstance(optimize, str):
        return optimize
    if isinstance(optimize, opt_einsum.paths.DynamicProgramming):
        size = "-size" if optimize.minimize == "size" else ""
        return ("dp+outer" if optimize.search_outer else "dp") + size
    return (type(optimize).__name__, optimize.minimize, optimize.max_repeats, optimize.max_time)


def test_a_forward_pass_of_twelve_to_fourteen_operands_also_asks_for_outer_products_within_the_bound(monkeypatch):
    asked = []
    search = mumoe_tn.contractions.search.find_path

    def recording(inputs, output, sizes, optimizer, memory_limit=None):
        asked.append((_finder(optimizer), memory_limit))
        return search(inputs, output, sizes, optimizer, memory_limit)

    monkeypatch.setattr(mumoe_tn.contractions.search, "find_path", recording)
    network = get_format("tucker").build((16,) * 5, 769, 3072, 8)  # 14 operands
    plan = plan_forward(network, 1024)
    assert ("dp+outer", 4 * 1024 * 3072) in asked
    assert plan.largest_intermediate <= 4 * 1024 * 3072
    # It pairs coefficient projections before they meet the core, which no other finder does here.
    monkeypatch.setattr(mumoe_tn.contractions.search, "BOUNDED_DP_OUTER_MAX_OPERANDS", 11)
    assert plan.fma < plan_forward(network, 1024).fma


@pytest.mark.parametrize(
    ("n_operands", "thorough", "expected"),
    [
        (7, False, ["greedy", "optimal", "dp+outer", "dp"]),
        (8, False, ["greedy", "dp+outer", "dp"]),
        (9, True, ["greedy", "dp+outer", "dp", "branch-2"]),
        (10, True, ["greedy", "dp+outer", "dp"]),
        (11, False, ["greedy", "dp"]),  # with outer products over 11 kept legs: above its effort bound (1 s)
        (12, False, ["greedy", "dp"]),  # with outer products only for results of one or two legs
        (14, False, ["greedy", "dp"]),
        (15, False, ["greedy", *RANDOM_GREEDY]),
        (17, False, ["greedy", *RANDOM_GREEDY]),
    ],
)
def test_path_finders_asked_follow_the_documented_bounds(monkeypatch, capsys, n_operands, thorough, expected):
    # A chain of matrices with the first and last legs kept: no operand has two legs that can be
    # absorbed, so only the size-dependent finders are asked (in the documented order).
    asked = []
    search = mumoe_tn.contractions.search.find_path

    def recording(inputs, output, sizes, optimizer, memory_limit=None):
        asked.append(_finder(optimizer))
        return search(inputs, output, sizes, optimizer, memory_limit)

    monkeypatch.setattr(mumoe_tn.contractions.search, "find_path", recording)
    inputs = [(f"x{k}", f"x{k + 1}", f"y{k}") for k in range(n_operands)]
    output = ("x0", f"x{n_operands}", *(f"y{k}" for k in range(n_operands)))
    sizes = {label: 2 for labels in inputs for label in labels}
    paths = candidate_paths(inputs, output, sizes, thorough=thorough)
    assert asked == expected
    assert paths and capsys.readouterr().out == ""


# ---------------------------------------------------------------- explicit paths, constant steps, layouts
def test_explicit_path_messages():
    sizes = {"a": 2, "b": 3, "c": 4, "d": 5}
    inputs = [("a", "b"), ("b", "c"), ("c", "d"), ("d",)]
    message = r"^explicit path step 1 \(0, 3\) refers to a position outside 0\.\.2 \(the operand list has 3 entries"
    with pytest.raises(ValueError, match=message):
        plan_contraction(inputs, ("a",), sizes, ((0, 1), (0, 3)))
    message = r"^explicit path \(\(0, 1\),\) leaves 3 operand\(s\) of 4; a path must contract every operand into one"
    with pytest.raises(ValueError, match=message):
        plan_contraction(inputs, ("a",), sizes, ((0, 1),))


def test_constant_steps_by_hand():
    # A·B (step 0) and then C·(AB) (step 1) use only the three constant operands; x enters last.
    sizes = {"a": 2, "b": 3, "c": 4, "d": 5}
    inputs = [("a", "b"), ("b", "c"), ("c", "d"), ("d",)]
    plan = plan_contraction(inputs, ("a",), sizes, ((0, 1), (0, 2), (0, 1)))
    assert constant_steps(plan, 3) == {0, 1}
    assert constant_steps(plan, 2) == {0}
    assert constant_steps(plan, 0) == set()
    plan = plan_contraction(inputs, ("a",), sizes, ((2, 3), (0, 1), (0, 1)))
    assert constant_steps(plan, 3) == {1}


@given(named_networks(), st.integers(2, 8))
def test_forward_candidates_keep_the_batch_leading(network, batch):
    for plan in forward_candidates(network, batch):
        for step in plan.steps:
            assert BATCH_LABEL not in step.output or step.output[0] == BATCH_LABEL


def test_per_call_fma_and_constant_elements_by_hand():
    sizes = {"a": 2, "b": 3, "c": 4, "d": 5}
    inputs = [("a", "b"), ("b", "c"), ("c", "d"), ("d",)]
    plan = plan_contraction(inputs, ("a",), sizes, ((0, 1), (0, 2), (0, 1)))
    assert [step.fma for step in plan.steps] == [2 * 3 * 4, 2 * 4 * 5, 2 * 5]
    assert per_call_fma(plan, frozenset({0, 1})) == 2 * 5
    assert per_call_fma(plan, frozenset()) == plan.fma
    assert constant_elements(plan, frozenset({0, 1})) == 2 * 4 + 2 * 5  # (a, c) and (a, d)


def test_single_and_two_operand_contractions_with_a_named_optimizer():
    sizes = {"a": 2, "b": 3, "c": 4}
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, generator=gen, dtype=DTYPE), torch.randn(3, 4, generator=gen, dtype=DTYPE)
    for optimize in ("greedy", "optimal", "auto"):
        plan = plan_contraction([("a", "b")], ("b", "a"), sizes, optimize)
        assert plan.path == ((0,),)
        torch.testing.assert_close(run_plan(plan, [x]), x.T)
        plan = plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), sizes, optimize)
        assert plan.path == ((0, 1),)
        torch.testing.assert_close(run_plan(plan, [x, y]), x @ y)


def test_explicit_path_steps_must_be_tuples_of_positions():
    sizes = {"a": 2, "b": 3, "c": 4}
    with pytest.raises(
        ValueError, match=r"^explicit path step 0 must be a non-empty tuple of distinct int positions, got 5$"
    ):
        plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), sizes, (5,))
    plan = plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), sizes, [[0, 1]])  # lists are taken as tuples
    assert plan.path == ((0, 1),)


def test_dense_plans_are_cached_for_names_but_fresh_for_cotengra_and_objects():
    network = build("tr", (3, 2), 4, 5, (2, 3, 2, 2))
    assert plan_dense(network) is plan_dense(network, "auto")
    assert plan_dense(network, "greedy") is plan_dense(network, "greedy")
    gen = torch.Generator().manual_seed(0)
    cores = [torch.randn(shape, generator=gen, dtype=DTYPE) for shape in network.core_shapes.values()]
    inputs, output = network.dense_equation()
    symbols = {label: opt_einsum.get_symbol(k) for k, label in enumerate(network.sizes)}
    equation = ",".join("".join(symbols[x] for x in labels) for labels in inputs)
    expected = torch.einsum(equation + "->" + "".join(symbols[x] for x in output), *cores)
    optimizers = [opt_einsum.paths.DynamicProgramming(), plan_dense(network).path]
    if importlib.util.find_spec("cotengra") is not None:
        optimizers.append("cotengra")
        assert plan_dense(network, "cotengra") is not plan_dense(network, "cotengra")  # a fresh search each time
    for optimize in optimizers:
        torch.testing.assert_close(run_plan(plan_dense(network, optimize), cores), expected)
    assert len(inputs) == 4
    outer_first = ((0, 2), (0, 1), (0, 1))  # two cores sharing no bond first: no planner picks it
    assert plan_dense(network).path != outer_first
    assert plan_dense(network, outer_first).path == outer_first


def test_cotengra_missing_is_reported(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cotengra" else found(name, *a))
    message = r"^optimize='cotengra' needs the optional dependency cotengra \(pip install cotengra\)$"
    with pytest.raises(ValueError, match=message):
        plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), {"a": 2, "b": 3, "c": 4}, "cotengra")


def test_inference_plan_respects_the_cache_limit_and_keeps_the_batch_leading():
    network = build("tucker", (2, 2), 16, 16, (8, 8, 4, 4))
    plan, steps = plan_inference(network, 16)
    assert steps and constant_elements(plan, steps) > 0
    plan, steps = plan_inference(network, 16, max_cached=0)
    assert steps == frozenset()
    assert plan.fma == per_call_fma(plan, steps) == plan_forward(network, 16).fma
    for step in plan_inference(network, 16)[0].steps:
        assert BATCH_LABEL not in step.output or step.output[0] == BATCH_LABEL


def test_einsum_equation_takes_up_to_52_labels():
    labels = tuple(f"x{k}" for k in range(53))
    equation = einsum_equation([labels[:26], labels[26:52]], labels[:52])
    assert equation == string.ascii_lowercase + "," + string.ascii_uppercase + "->" + string.ascii_letters
    with pytest.raises(
        ValueError, match=r"^a contraction step joins 53 distinct labels but torch\.einsum accepts at most 52"
    ):
        einsum_equation([labels[:27], labels[27:]], labels)


@pytest.mark.parametrize("optimize", ["greedy", "optimal", "dp"])
def test_named_optimizers_keep_the_batch_leading(optimize):
    for plan in (
        plan_forward(build("tr", (3, 2), 4, 5, (2, 3, 2, 2)), 8, optimize),
        plan_forward(tt(6, 3, 10, (2, 7)), 8, optimize),
    ):
        for step in plan.steps:
            assert BATCH_LABEL not in step.output or step.output[0] == BATCH_LABEL
