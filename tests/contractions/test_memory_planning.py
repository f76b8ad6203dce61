"""Memory-aware planning: the chosen plan's largest intermediate stays bounded as networks grow.

The grid is the layers the library is used for: every shipped format and random custom networks
with E = 1…6 expert modes of 16, parameter-matched to ``nn.Linear(768, 3072)``, planned for 1,024
tokens. The reference smallest peak comes from opt_einsum's dynamic programming minimising the
largest intermediate over all pairwise orders (outer products included), called directly.
Planning only: nothing is executed.
"""

import warnings

import opt_einsum
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import custom_networks, rank_of, shipped_formats

from mumoe_tn.contractions import choose_plan, memory_bound, plan_contraction, plan_forward, plan_inference
from mumoe_tn.contractions.inference_plan import per_call_peak
from mumoe_tn.costs import linear
from mumoe_tn.costs.matching import MatchingWarning, match_layer
from mumoe_tn.decompositions import get_format
from mumoe_tn.network import BATCH_LABEL

TOKENS = 1024
IN, OUT = 768, 3072
#: 4 × the larger of the layer's input and output activations.
ACTIVATION_BOUND = 4 * TOKENS * max(IN + 1, OUT)


def smallest_peak(network, batch=TOKENS):
    """The smallest largest-intermediate over every pairwise order (opt_einsum, outer products searched)."""
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch}
    symbol = {label: opt_einsum.get_symbol(k) for k, label in enumerate(sizes)}
    equation = ",".join("".join(symbol[x] for x in labels) for labels in inputs) + "->"
    equation += "".join(symbol[x] for x in output)
    shapes = [tuple(sizes[x] for x in labels) for labels in inputs]
    optimizer = opt_einsum.paths.DynamicProgramming(search_outer=True, minimize="size")
    _, info = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=optimizer)
    return max(int(info.largest_intermediate), batch * network.out_features)  # the result is held too


def matched(network):
    if not network.bonds:
        return network  # sized by its legs alone (MxD): planned as built
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MatchingWarning)  # planning is judged here, not the match
        return match_layer(network, linear(IN, OUT).params).networks[0]


def assert_bounded(network):
    """Within 4× the activations where some path is, else within 1.5× the smallest peak there is."""
    peak = plan_forward(network, TOKENS).largest_intermediate
    smallest = smallest_peak(network)
    assert peak <= (ACTIVATION_BOUND if smallest <= ACTIVATION_BOUND else 1.5 * smallest), (network, peak, smallest)


@pytest.mark.parametrize("modes", range(1, 7))
@pytest.mark.parametrize("name", shipped_formats())
def test_every_format_keeps_its_planned_peak_near_the_activations(name, modes):
    network = matched(get_format(name).build((16,) * modes, IN + 1, OUT, rank_of(name, 4)))
    assert_bounded(network)


@pytest.mark.parametrize("dims", [(256,), (8, 8, 8, 8, 4, 4), (16, 16, 8, 8, 8, 8), (64, 32, 32), (8, 8, 4, 4, 4)])
@pytest.mark.parametrize("name", shipped_formats())
def test_uneven_expert_modes_keep_the_planned_peak_near_the_activations(name, dims):
    network = matched(get_format(name).build(dims, IN + 1, OUT, rank_of(name, 4)))
    assert_bounded(network)


def test_a_path_within_the_bound_is_found_where_the_cheapest_candidates_leave_it():
    # Matched TT over 8×8×8×8×4×4 (15 operands, beyond the unbounded DP searches): the greedy
    # candidates either peak at 1024 × 4 × 4096 (over the bound) or cost 5× the FMAs; the bounded
    # dynamic programming keeps to the output's size with fewer FMAs than either.
    network = matched(get_format("tt").build((8, 8, 8, 8, 4, 4), IN + 1, OUT, 4))
    plan = plan_forward(network, TOKENS)
    greedy = plan_forward(network, TOKENS, "greedy")
    assert greedy.largest_intermediate > ACTIVATION_BOUND
    assert plan.largest_intermediate == TOKENS * OUT
    assert plan.fma <= greedy.fma


def test_where_no_path_fits_the_plan_stays_within_half_again_the_smallest_peak():
    # Matched Tucker over one mode of 256: every path holds more than 4× the output.
    network = matched(get_format("tucker").build((256,), IN + 1, OUT, 4))
    smallest = smallest_peak(network)
    assert smallest > ACTIVATION_BOUND
    assert plan_forward(network, TOKENS).largest_intermediate <= 1.5 * smallest


def test_tucker_with_four_expert_modes_no_longer_plans_a_batch_times_core_intermediate():
    # Matched Tucker 16^4 has rank 11 on every bond: contracting a coefficient vector into the core
    # first builds 1024 × 11^5 = 164,916,224 elements; pairing the vectors first stays at the output.
    network = get_format("tucker").build((16,) * 4, IN + 1, OUT, 11)
    plan = plan_forward(network, TOKENS)
    assert plan.largest_intermediate == TOKENS * OUT
    greedy = plan_forward(network, TOKENS, "greedy")
    assert greedy.largest_intermediate == TOKENS * 11**5  # what a memory-blind path builds
    assert plan.fma < greedy.fma


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(custom_networks(max_modes=6, max_cores=4, physical_sizes=st.just(16), bond_sizes=st.integers(1, 4), max_extra=1))
def test_custom_networks_keep_their_planned_peak_near_the_activations(network):
    network = network.with_sizes(i=IN + 1, o=OUT)
    try:
        network = matched(network)
    except ValueError as error:
        assert "below the smallest possible count" in str(error), error
        assume(False)  # a budget this network cannot reach: drawn again, not counted as checked
    assert_bounded(network)


# ---------------------------------------------------------------- memory_limit
def test_memory_limit_is_honoured_or_refused_with_the_smallest_peak():
    network = get_format("tucker").build((16,) * 3, 65, 64, 6)
    free = plan_forward(network, 256)
    limit = smallest_peak(network, 256)
    assert limit > 256 * 64  # an intermediate larger than the result is unavoidable here
    assert plan_forward(network, 256, memory_limit=limit).largest_intermediate <= limit
    with pytest.raises(ValueError, match=rf"within memory_limit={limit - 1} .* smallest peak found is {limit:,}"):
        plan_forward(network, 256, memory_limit=limit - 1)
    assert free.largest_intermediate <= memory_bound([free])


def test_memory_limit_checks_a_named_optimizers_path():
    network = get_format("tucker").build((16,) * 4, 65, 64, 11)
    greedy = plan_forward(network, 64, "greedy")
    assert plan_forward(network, 64, "greedy", memory_limit=greedy.largest_intermediate) == greedy
    with pytest.raises(ValueError, match="no contraction path found keeps every intermediate"):
        plan_forward(network, 64, "greedy", memory_limit=greedy.largest_intermediate - 1)


def test_max_input_is_the_largest_operand():
    sizes = {"a": 2, "b": 30, "c": 3}
    # (a b)·(b c) -> (a c): the largest operand holds 90 elements, the result 6.
    plan = plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), sizes, memory_limit="max_input")
    assert plan.largest_intermediate == 6
    assert memory_bound([plan], "max_input") == 90


@pytest.mark.parametrize("limit", [0, -3, 2.5, True, "max", "1000"])
def test_a_memory_limit_that_is_not_a_positive_int_is_refused(limit):
    with pytest.raises(ValueError, match=r"^memory_limit must be None, a positive int .* got "):
        plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), {"a": 2, "b": 3, "c": 4}, memory_limit=limit)


def test_choose_plan_takes_the_fewest_fmas_within_the_bound():
    sizes = {"a": 8, "b": 8, "c": 8, "d": 8}
    inputs = [("a", "b"), ("b", "c"), ("c", "d")]
    outer_first = plan_contraction(inputs, ("a",), sizes, ((0, 2), (0, 1)))  # (c a b) first: 512
    chain = plan_contraction(inputs, ("a",), sizes, ((0, 1), (0, 1)))  # (a c), then (a)
    assert outer_first.largest_intermediate == 8**3 and chain.largest_intermediate == 64
    # Default bound: 4 × the largest operand (64 elements) = 256.
    assert choose_plan([outer_first, chain]) is chain
    # Pretend the outer product saved FMAs: it wins once the limit lets it in, and only then.
    cost = {id(outer_first): 1, id(chain): 2}
    assert choose_plan([outer_first, chain], fma=lambda plan: cost[id(plan)]) is chain
    assert choose_plan([outer_first, chain], 8**3, fma=lambda plan: cost[id(plan)]) is outer_first
    with pytest.raises(ValueError, match=r"memory_limit=63 \(63 elements\); the smallest peak found is 64 elements"):
        choose_plan([outer_first, chain], memory_limit=63)


def test_inference_plans_bound_what_a_call_computes():
    network = get_format("tucker").build((16,) * 4, IN + 1, OUT, 11)
    plan, steps = plan_inference(network, TOKENS)
    assert per_call_peak(plan, steps) <= ACTIVATION_BOUND


# ---------------------------------------------------------------- the layers and the command line
def test_layers_take_a_memory_limit_and_plan_within_it():
    from mumoe_tn import MuMoE, MuMoEMLP

    layer = MuMoE(64, 64, expert_dims=(16,) * 4, decomposition="tucker", rank=11, memory_limit=1 << 21, device="meta")
    assert layer.experts.memory_limit == 1 << 21
    assert layer.experts.plan(TOKENS).largest_intermediate <= 1 << 21
    block = MuMoEMLP(32, 64, expert_dims=8, rank=4, memory_limit="max_input", device="meta")
    assert all(layer.memory_limit == "max_input" for layer in block.modules() if hasattr(layer, "memory_limit"))
    with pytest.raises(ValueError, match=r"^memory_limit must be None, a positive int .* got -1$"):
        MuMoE(8, 8, expert_dims=4, rank=2, memory_limit=-1, device="meta")


def test_plan_command_shows_and_applies_the_memory_limit(capsys):
    from mumoe_tn.cli import main

    command = ["plan", "tucker", "--experts", "16", "16", "16", "16", "--rank", "11", "--batch", "1024"]
    assert main(command) == 0
    out = capsys.readouterr().out
    assert f"largest intermediate per batch: {TOKENS * OUT:,} elements" in out and "memory limit: auto" in out
    assert main([*command, "--memory-limit", str(TOKENS * OUT)]) == 0
    assert f"memory limit: {TOKENS * OUT:,}" in capsys.readouterr().out
    assert main([*command, "--memory-limit", "1000"]) == 0  # the result is always allowed
    assert f"largest intermediate per batch: {TOKENS * OUT:,} elements" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*command, "--optimize", "greedy", "--memory-limit", "1000"])
    captured = capsys.readouterr()
    assert "the path's largest intermediate holds 164,916,224 elements" in captured.out + captured.err


def test_the_smallest_peak_search_runs_only_where_no_candidate_fits(monkeypatch):
    import opt_einsum

    import mumoe_tn.contractions.search as search

    asked = []
    real = search.find_path

    def recording(inputs, output, sizes, optimizer, memory_limit=None):
        if isinstance(optimizer, opt_einsum.paths.DynamicProgramming) and optimizer.minimize == "size":
            asked.append(memory_limit)
        return real(inputs, output, sizes, optimizer, memory_limit)

    monkeypatch.setattr(search, "find_path", recording)
    # Memory-blind candidates peak at 1024 × 11^5; dynamic programming with outer products within
    # the bound pairs the coefficient vectors first: no smallest-peak search is needed.
    plan = plan_forward(get_format("tucker").build((16,) * 4, IN + 1, OUT, 11), TOKENS)
    assert plan.largest_intermediate == TOKENS * OUT and asked == []
    plan_forward(get_format("cp").build((16,) * 4, IN + 1, OUT, 500), TOKENS)
    assert asked == []
    # One mode of 256: no path fits 4× the output; the search is asked within the bound, then
    # without it (the smallest peak there is), and the plan keeps within 1.5× of that.
    network = matched(get_format("tucker").build((256,), IN + 1, OUT, 4))
    plan = plan_forward(network, TOKENS)
    assert asked == [4 * TOKENS * OUT, None]
    assert plan.largest_intermediate <= 1.5 * smallest_peak(network)
