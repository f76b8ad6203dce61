"""Independent checks: hand computations against the gate, the rank bound, the closed-form
FMAs, every compare() column and the executor's folded-bias paths.

Each expected value here is computed by hand (numbers written out with their formula) or by a
reference that shares no code with mumoe_tn (the ``entmax`` package, a brute-force cut
enumeration, an explicit column of ones). Several tests pin mutants that once survived the
suite (see tests/README.md).
"""

import itertools
import math

import entmax
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import any_network, binding_networks, custom_networks, named_networks, tree_networks
from torch_calls import TorchCalls

from mumoe_tn import ExpertNetwork, FactorizedExperts
from mumoe_tn.analysis.coefficients import ExpertStatistics
from mumoe_tn.analysis.ranks import expert_ranks
from mumoe_tn.contractions import plan_contraction, plan_forward, run_plan
from mumoe_tn.costs import (
    collapsed_expert_modes,
    compare,
    dense_forward_fma,
    gate_fma,
    layer_flops,
    min_cut,
    rank_bound,
)
from mumoe_tn.costs.params import block_parameters, layer_in_features
from mumoe_tn.decompositions import build, cp, tr, tt, tucker
from mumoe_tn.gates.modules import ExpertGate, TopKRouter
from mumoe_tn.gates.records import gate_losses
from mumoe_tn.gates.specs import Gate, TopKGate, gate_fma_per_token, gate_from_options, gate_parameter_count

DTYPE = torch.float64
EPS = 1e-5  # BatchNorm1d / LayerNorm default


# ----------------------------------------------------------------------------- the gate
def hand_sparsemax(x):
    """Sparsemax by sorting (Martins & Astudillo 2016, Alg. 1), row-wise."""
    ordered, _ = torch.sort(x, dim=-1, descending=True)
    cumulative = ordered.cumsum(-1)
    k = torch.arange(1, x.shape[-1] + 1, dtype=x.dtype)
    support = (1 + k * ordered > cumulative).sum(-1, keepdim=True)
    tau = (cumulative.gather(-1, support - 1) - 1) / support
    return (x - tau).clamp_min(0)


def hand_softmax(x):
    e = torch.exp(x - x.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


PHI = {"entmax15": lambda x: entmax.entmax15(x, dim=-1), "sparsemax": hand_sparsemax, "softmax": hand_softmax}


def hand_norm(logits, norm, *, mean=None, var=None):
    if norm == "none":
        return logits
    if norm == "layer":
        mu = logits.mean(-1, keepdim=True)
        return (logits - mu) / torch.sqrt(((logits - mu) ** 2).mean(-1, keepdim=True) + EPS)
    if mean is None:  # BatchNorm, training: this batch's statistics, biased variance
        mean = logits.mean(0)
        var = ((logits - mean) ** 2).mean(0)
    return (logits - mean) / torch.sqrt(var + EPS)


@pytest.mark.parametrize("activation", sorted(PHI))
@pytest.mark.parametrize("norm", ["batch", "layer", "none"])
def test_gate_is_phi_of_normalised_projection(activation, norm):
    dims, width = (3, 4), 5
    gate = ExpertGate(width, dims, activation, norm, dtype=DTYPE)
    gen = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(2, 3, width, generator=gen, dtype=DTYPE)  # leading dims (2, 3): 6 tokens
    weights = [gate.projections[f"n{e + 1}"].weight.detach() for e in range(len(dims))]
    gate.train()
    got = gate(z)
    flat = z.reshape(6, width)
    for e, (a, g) in enumerate(zip(got, weights, strict=True)):
        assert a.shape == (2, 3, dims[e])
        expected = PHI[activation](hand_norm(flat @ g.T, norm))
        torch.testing.assert_close(a.reshape(6, -1), expected)
    if norm != "batch":
        return
    # Eval mode: running statistics after that one training batch (momentum 0.1, unbiased var).
    gate.eval()
    got = gate(z[:1, :1])
    for a, g in zip(got, weights, strict=True):
        logits = flat @ g.T
        mean = 0.1 * logits.mean(0)
        var = 0.9 + 0.1 * logits.var(0, unbiased=True)
        expected = PHI[activation](hand_norm(z[0, 0] @ g.T, "batch", mean=mean, var=var))
        torch.testing.assert_close(a.reshape(-1), expected)


def test_gate_normalisation_changes_the_coefficients():
    """Removing the logit normalisation must be visible: same weights, different norms."""
    torch.manual_seed(0)
    z = 5 * torch.randn(8, 4, dtype=DTYPE) + 2
    outputs = {}
    for norm in ("batch", "layer", "none"):
        torch.manual_seed(1)
        outputs[norm] = ExpertGate(4, 6, "softmax", norm, dtype=DTYPE)(z)[0]
    assert not torch.allclose(outputs["batch"], outputs["none"])
    assert not torch.allclose(outputs["layer"], outputs["none"])


def test_top_k_router_is_softmax_of_the_top_logits():
    router = TopKRouter(5, (4, 3), k=(2, 1), norm="none", dtype=DTYPE)
    z = torch.randn(7, 5, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    for a, (leg, projection), k in zip(router(z), router.projections.items(), (2, 1), strict=True):
        logits = z @ projection.weight.detach().T
        expected = torch.zeros_like(logits)
        for row in range(7):
            top = sorted(range(logits.shape[1]), key=lambda j, row=row: -logits[row, j])[:k]
            weights = hand_softmax(logits[row, top])
            expected[row, top] = weights
        torch.testing.assert_close(a, expected, msg=leg)


# ----------------------------------------------------------------------------- rank bound
def brute_force_cut(network):
    """min over core subsets S (i's side): Π sizes of the cut labels (a label is cut when its cores, and
    the source for i or the sink for o, fall on both sides)."""
    names = list(network.cores)
    best = math.inf
    for mask in itertools.product((False, True), repeat=len(names)):
        side = dict(zip(names, mask, strict=True))  # True: on i's side
        cost = 1
        # i sits with the source, o with the sink: a leg is cut when a core holding it is across
        if not all(side[c] for c in network.cores_with("i")):
            cost *= network.in_features
        if any(side[c] for c in network.cores_with("o")):
            cost *= network.out_features
        for bond in network.bonds:
            if len({side[c] for c in network.cores_with(bond)}) == 2:
                cost *= network.sizes[bond]
        best = min(best, cost)
    return best


@given(st.one_of(any_network(max_modes=3), binding_networks(), custom_networks(min_cores=3, max_cores=5)))
def test_min_cut_equals_brute_force_cut(network):
    assert rank_bound(network) == brute_force_cut(network)


@pytest.mark.parametrize(("a", "b", "expected"), [(2, 3, 6), (3, 3, 8), (1, 5, 5)])
def test_parallel_bonds_multiply(a, b, expected):
    network = ExpertNetwork.from_spec(
        "A: n1 i a b, B: a b o", expert_dims=2, in_features=8, out_features=8, ranks={"a": a, "b": b}
    )
    assert rank_bound(network) == expected  # min(a·b, I, O)
    assert set(expert_ranks(_generic(network, 0)).values()) == {expected}


def test_hyperedge_is_cut_once():
    # h joins A, B, C; i on A, o on C, bond a joins A and C: every i–o cut crosses h and a (2·3)
    network = ExpertNetwork.from_spec(
        "A: n1 i h a, B: n2 h, C: h a o", expert_dims=(2, 2), in_features=9, out_features=7, ranks={"h": 2, "a": 3}
    )
    assert rank_bound(network) == 6
    assert max(expert_ranks(_generic(network, 1)).values()) == 6


def _generic(network, seed):
    experts = FactorizedExperts(network, dtype=DTYPE)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=DTYPE))
    return experts


def _first_and_last(network):
    return [(0,) * network.n_expert_modes, tuple(n - 1 for n in network.expert_dims)]


@given(tree_networks(), st.integers(0, 100))
def test_generic_tree_networks_attain_the_min_cut(network, seed):
    ranks = expert_ranks(_generic(network, seed), _first_and_last(network))
    assert set(ranks.values()) == {rank_bound(network)}


@given(binding_networks(), st.integers(0, 100))
def test_binding_bound_is_below_min_io_and_never_exceeded(network, seed):
    bound = rank_bound(network)
    assert bound < min(network.in_features, network.out_features)
    assert max(expert_ranks(_generic(network, seed), _first_and_last(network)).values()) <= bound


@given(named_networks(max_size=5, max_rank=3), st.integers(0, 100))
def test_registered_formats_attain_their_closed_form_bound(network, seed):
    bound = network.format.closed_form_rank_bound(network)
    if bound is None:  # a format without a stated bound: the min cut still bounds the rank
        bound = rank_bound(network)
    assert bound == rank_bound(network)
    assert set(expert_ranks(_generic(network, seed), _first_and_last(network)).values()) == {bound}


# ----------------------------------------------------------------------------- closed-form FMAs
@pytest.mark.parametrize(
    ("network", "expected"),
    [
        (cp((3,), 5, 4, 2), 24),  # R(N + I + O) = 2·12
        (tt((3,), 5, 4, (2, 3)), 54),  # N R1 + R1 I R2 + R1 R2 + R2 O = 6 + 30 + 6 + 12
        (tt((3, 2), 5, 4, (2, 3, 4)), 112),  # 6 + (12 + 6) + (60 + 12) + 16
        (tucker((3,), 5, 4, (2, 3, 4)), 73),  # N s1 + I s_i + s_o O + P + P/s1 = 6 + 15 + 16 + 24 + 12
        (tucker((3, 2), 5, 4, (2, 2, 3, 4)), 6 + 4 + 15 + 16 + 48 + 24 + 12),  # P = 48
        (tr((3,), 5, 4, (2, 3, 4)), 134),  # R1 N R2 + R2 I R3 + R1 R2 R3 + R3 O R1 = 18 + 60 + 24 + 32
    ],
)
def test_closed_form_fma_by_hand(network, expected):
    fma = network.format.closed_form_fma(network)
    assert fma == expected and type(fma) is int
    assert layer_flops(network, batch=3, gate=False).closed_form == 3 * expected


def test_gate_fma_drops_the_bias_column():
    network = cp((3, 2), 5, 4, 2)  # leg i = 4 inputs + the folded bias
    assert gate_fma(network, bias=True) == 4 * (3 + 2)
    assert gate_fma(network, bias=False) == 5 * (3 + 2)
    assert gate_fma(network, gate=False) == 0
    assert gate_fma(network) == 4 * (3 + 2)  # bias=True by default


def test_block_parameters_by_hand():
    count = block_parameters(cp(3, 5, 16, 2), cp(3, 17, 4, 2))  # bias and the default gate by default
    assert count.experts == 2 * (3 + 5 + 16) + 2 * (3 + 17 + 4)
    assert (count.gate, count.norm, count.total) == (4 * 3, 0, 96 + 12)
    assert block_parameters(cp(3, 5, 16, 2), cp(3, 16, 4, 2), bias=False, gate=False).gate == 0


def test_layer_flops_fields_and_defaults():
    network = cp((3,), 5, 4, 2)  # i = 4 inputs + bias
    flops = layer_flops(network, batch=3)
    assert (flops.batch, flops.gate) == (3, 3 * 4 * 3)  # bias=True by default: gate width 4
    assert flops.closed_form == 3 * 24 and flops.hand_order == 3 * 26
    assert layer_flops(network, batch=3, gate=False).gate == 0
    assert layer_flops(network, bias=False).gate == 5 * 3
    with pytest.raises(TypeError, match=r"layer_flops needs an ExpertNetwork, got 'cp' \(str\)"):
        layer_flops("cp")
    with pytest.raises(ValueError, match=r"^batch must be a positive int, got 0"):
        layer_flops(network, batch=0)
    with pytest.raises((TypeError, ValueError), match="no-such-optimizer"):
        layer_flops(network, optimize="no-such-optimizer")


def test_tucker_rank_bound_includes_the_output_leg():
    network = tucker((2,), 8, 3, (2, 5, 6))
    assert network.format.closed_form_rank_bound(network) == rank_bound(network) == 3  # min(I, s_i, s_o, O)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: build("cp", 3, 5, 4, 2, foo=1), TypeError, r"cp takes no options, got \['foo'\]"),
        (lambda: build("tucker", 3, 5, 4, 2, foo=1), TypeError, r"tucker takes no options, got \['foo'\]"),
        (lambda: build("cp", 3, 5, 4, (2, 3)), ValueError, r"^cp needs 1 ranks"),
        (lambda: build("tt", (3, 2), 5, 4, (2, 3)), ValueError, r"^tt needs 3 ranks"),
        (
            lambda: rank_bound("x"),
            TypeError,
            (
                r"^rank_bound needs an ExpertNetwork, got 'x' \(str\); build one with "
                r"mumoe_tn\.decompositions\.build\(name, expert_dims, in_features, out_features, rank\) "
                r"or ExpertNetwork\.from_spec$"
            ),
        ),
        (
            lambda: block_parameters(cp(3, 5, 16, 2), cp(2, 17, 4, 2)),
            ValueError,
            r"^a block's layers share coefficients: expert dims \(3,\) != \(2,\)$",
        ),
        (
            lambda: block_parameters(cp(3, 5, 16, 2), cp(3, 16, 4, 2)),
            ValueError,
            r"^the second layer's input \(15\) must be the first layer's output \(16\)$",
        ),
        (lambda: min_cut("x"), TypeError, r"^min_cut needs an ExpertNetwork"),
        (lambda: min_cut(cp(3, 5, 4, 2), ("x",)), ValueError, r"'x' is not a physical leg .* \['i', 'n1', 'o'\]"),
        (lambda: min_cut(cp(3, 5, 4, 2), (), ("o",)), ValueError, r"must be non-empty and disjoint"),
        (lambda: min_cut(cp(3, 5, 4, 2), ("i",), ()), ValueError, r"must be non-empty and disjoint"),
        (lambda: min_cut(cp(3, 5, 4, 2), ("i", "n1"), ("n1",)), ValueError, r"must be non-empty and disjoint"),
        (lambda: collapsed_expert_modes("x"), TypeError, r"^collapsed_expert_modes needs an ExpertNetwork"),
        (lambda: layer_in_features("x", True), TypeError, r"expected an ExpertNetwork, got 'x' \(str\)"),
        (lambda: layer_in_features(cp(3, 5, 4, 2), 1), TypeError, r"bias must be a bool, got 1"),
        (lambda: layer_in_features(cp(3, 1, 4, 2), True), ValueError, r"size >= 2, the network has i=1"),
    ],
)
def test_cost_and_format_errors_quote_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_dense_forward_fma_by_hand():
    fma = dense_forward_fma(cp((3, 2), 5, 4, 2))
    assert fma == 6 * 5 * 4 + 6 * 4 + 2 * 4 and type(fma) is int  # N·I·O + N1N2·O + N2·O


def test_tt_expert_rank_sets_the_expert_bonds():
    network = tt((3, 2), 5, 4, 6, expert_rank=2)
    assert (network.sizes["r1"], network.sizes["r2"], network.sizes["r3"]) == (2, 2, 6)


@pytest.mark.parametrize(
    ("network", "expected"),
    [
        (cp((1, 2), 5, 4, 1), ("n2",)),  # r = 1 cuts both modes off; a mode of size 1 is no collapse
        (cp((1, 3), 5, 4, 1), ("n2",)),
        (cp((1, 2), 5, 4, 3), ()),
        # n1 shares its core with i: a cut of size 1 (r) separates it from o only, not from i and o
        (ExpertNetwork({"A": "n1 i r", "B": "r o"}, {"n1": 3, "i": 4, "r": 1, "o": 4}), ()),
    ],
)
def test_collapsed_expert_modes_by_hand(network, expected):
    assert collapsed_expert_modes(network) == expected


# ----------------------------------------------------------------------------- compare()
def test_compare_block_columns_by_hand():
    # CP block 4 -> 16 -> 4, N = 3, R = 6, bias: layers (i=5, o=16) and (i=17, o=4)
    table = compare(4, 16, 3, ["cp"], ranks={"cp": 6}, match="mlp", batch=2)
    row = table.rows[0]
    assert row.params_experts == 6 * (3 + 5 + 16) + 6 * (3 + 17 + 4) == 288
    assert row.params_gate == 4 * 3
    assert row.params_total == 300
    assert row.fma_closed_form == 144 + 144 + 12  # R(N+I+O) per layer, plus the gate's I·N
    assert row.fma_planned == (144 + 6) + (144 + 6) + 12  # + E·R Hadamard per layer, + gate
    assert row.fma_planned >= row.fma_closed_form
    assert row.peak_elements == 2 * 16  # batch × the wider output (the first layer's)
    assert row.max_rank == min(min(5, 16, 6), min(17, 4, 6)) == 4
    mlp_params = 5 * 16 + 17 * 4
    assert row.params_vs_reference == pytest.approx(300 / mlp_params)
    assert row.fma_vs_reference == pytest.approx(312 / mlp_params)  # an MLP's FMAs count the bias too


def test_compare_layer_columns_by_hand():
    table = compare(6, 5, (2, 3), ["tt"], ranks={"tt": (2, 3, 4)}, match=None, batch=1, bias=False)
    row = table.rows[0]
    # tt((2, 3), 6, 5, (2, 3, 4)): cores n1 r1 | r1 n2 r2 | r2 i r3 | r3 o
    assert row.params_experts == 2 * 2 + 2 * 3 * 3 + 3 * 6 * 4 + 4 * 5 == 114
    assert row.params_gate == 6 * (2 + 3)
    assert row.params_total == 144
    closed = 2 * 2 + (2 * 3 * 3 + 2 * 3) + (3 * 6 * 4 + 3 * 4) + 4 * 5  # 126
    assert row.fma_closed_form == closed + 30
    assert row.fma_planned >= row.fma_closed_form - 30
    assert row.max_rank == min(4, 6, 5)
    assert row.params_vs_reference == pytest.approx(144 / 30)
    no_gate = compare(6, 5, (2, 3), ["tt"], ranks={"tt": (2, 3, 4)}, match=None, bias=False, gate=False).rows[0]
    assert no_gate.params_gate == 0 and no_gate.fma_closed_form == closed
    assert row.fma_planned - no_gate.fma_planned == 30


# ----------------------------------------------------------------------------- coefficients
def test_coefficient_std_is_the_population_std():
    a = torch.tensor([[0.2, 0.8], [0.6, 0.4], [1.0, 0.0]], dtype=DTYPE)
    stats = ExpertStatistics.empty(2, 1, None, 0.5)
    stats.update(a, None)
    torch.testing.assert_close(stats.mean, torch.tensor([0.6, 0.4], dtype=DTYPE))
    # E[a²] − E[a]²: (0.04 + 0.36 + 1)/3 − 0.36 = 0.32/3
    torch.testing.assert_close(stats.std, torch.full((2,), math.sqrt(0.32 / 3), dtype=DTYPE))


# ----------------------------------------------------------------------------- folded bias
def _bias_case(network, batch, optimize, seed):
    gen = torch.Generator().manual_seed(seed)
    cores = [torch.randn(shape, generator=gen, dtype=DTYPE) for shape in network.core_shapes.values()]
    coefficients = [torch.rand(batch, n, generator=gen, dtype=DTYPE) for n in network.expert_dims]
    z = torch.randn(batch, network.in_features - 1, generator=gen, dtype=DTYPE)
    plan = plan_forward(network, batch, optimize)
    folded = run_plan(plan, [*cores, *coefficients, z], ones_appended="i")
    explicit = run_plan(plan, [*cores, *coefficients, torch.cat([z, torch.ones(batch, 1, dtype=DTYPE)], -1)])
    torch.testing.assert_close(folded, explicit)


@pytest.mark.parametrize("optimize", ["optimal", "dp", "greedy"])
def test_folded_bias_fallback_equals_a_column_of_ones(optimize):
    _bias_case(tt(6, 3, 10, (2, 7)), 4, optimize, 0)  # reaches the explicit-concatenation fallback


@given(any_network(max_modes=3), st.integers(1, 4), st.sampled_from(["optimal", "greedy"]))
def test_folded_bias_equals_a_column_of_ones(network, batch, optimize):
    if network.in_features < 2:
        network = network.with_sizes(i=2)
    _bias_case(network, batch, optimize, 1)


@pytest.mark.parametrize("network", [cp(4, 6, 5, 3), tr((3, 2), 6, 5, (2, 3, 2, 2))], ids=["cp", "tr"])
def test_folded_bias_on_a_plain_step_copies_nothing(network):
    # A plain step adds T's last slice (y = z T[:I] + T[I]): the input is never concatenated with ones.
    gen = torch.Generator().manual_seed(0)
    cores = [torch.randn(shape, generator=gen, dtype=DTYPE) for shape in network.core_shapes.values()]
    coefficients = [torch.rand(4, n, generator=gen, dtype=DTYPE) for n in network.expert_dims]
    z = torch.randn(4, network.in_features - 1, generator=gen, dtype=DTYPE)
    plan = plan_forward(network, 4)
    with TorchCalls() as calls:
        folded = run_plan(plan, [*cores, *coefficients, z], ones_appended="i", memory_saving=False)
    assert "cat" not in calls.names and {"einsum", "mm"} & calls.names
    explicit = run_plan(plan, [*cores, *coefficients, torch.cat([z, torch.ones(4, 1, dtype=DTYPE)], -1)])
    torch.testing.assert_close(folded, explicit)


def test_folded_bias_fallback_with_two_batch_dimensions():
    # z (c, b, i) first meets the coefficients (an outer product keeping i): the fallback appends ones.
    sizes = {"c": 2, "b": 3, "i": 5, "n": 4, "o": 6}
    inputs = [("n", "i", "o"), ("c", "b", "n"), ("c", "b", "i")]
    plan = plan_contraction(inputs, ("c", "b", "o"), sizes, ((1, 2), (0, 1)))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 5, 6, generator=gen, dtype=DTYPE)
    a = torch.rand(2, 3, 4, generator=gen, dtype=DTYPE)
    z = torch.randn(2, 3, 4, generator=gen, dtype=DTYPE)
    with TorchCalls() as calls:
        folded = run_plan(plan, [weight, a, z], ones_appended="i")
    assert "cat" in calls.names
    z_ones = torch.cat([z, torch.ones(2, 3, 1, dtype=DTYPE)], -1)
    torch.testing.assert_close(folded, torch.einsum("nio,cbn,cbi->cbo", weight, a, z_ones))


# ----------------------------------------------------------------------------- gate descriptors
class _Reports:
    """A gate descriptor reporting fixed counts (to check how reports are validated)."""

    def __init__(self, value):
        self.value = value

    def parameter_count(self, in_features, expert_dims):
        return self.value

    def fma_per_token(self, in_features, expert_dims):
        return self.value

    def build(self, in_features, expert_dims, *, device=None, dtype=None):
        raise NotImplementedError

    def __repr__(self):
        return f"_Reports({self.value!r})"


def test_gate_reports_are_validated():
    assert gate_parameter_count(_Reports(0), 3, (2,)) == gate_fma_per_token(_Reports(0), 3, (2,)) == 0
    for what, count in (("parameter_count", gate_parameter_count), ("fma_per_token", gate_fma_per_token)):
        for bad in (True, -1, 2.0):
            with pytest.raises(ValueError, match=rf"^the gate _Reports\({bad!r}\) reported {what} = {bad!r}; it must"):
                count(_Reports(bad), 3, (2,))
    with pytest.raises(TypeError, match=r"^gate must be True \(the default gate\), False \(not counted\) or a gate"):
        gate_fma_per_token("x", 3, (2,))


@pytest.mark.parametrize("norm", ["batch", "layer", "none"])
def test_built_gate_has_exactly_the_counted_parameters(norm):
    spec = Gate(norm=norm)
    gate = spec.build(5, (4, 3))
    assert sum(p.numel() for p in gate.parameters()) == spec.parameter_count(5, (4, 3)) == 5 * 7


def test_top_k_router_defaults_and_descriptor_options():
    router = TopKRouter(5, 4)
    assert (router.k, router.norm, router.balance_loss, router.z_loss) == ((1,), "none", False, False)
    built = TopKGate(k=2, norm="layer").build(5, (4,), device="meta")
    assert (built.k, built.norm, built.projections["n1"].weight.device.type) == ((2,), "layer", "meta")


def test_gate_loss_errors_quote_the_rule():
    with pytest.raises(TypeError, match=r"^model must be an nn\.Module, got str$"):
        gate_losses("x")
    with pytest.raises(ValueError, match=r"^no forward pass of this gate in this thread yet: call the layer first"):
        ExpertGate(3, 2, balance_loss=True).losses()


def test_gate_descriptor_passes_the_device():
    gate = Gate(norm="layer").build(5, (4,), device="meta")
    assert gate.projections["n1"].weight.device.type == "meta"


@pytest.mark.parametrize("make", [lambda: TopKRouter(5, 4, k=2), lambda: ExpertGate(5, 4, "softmax", "none")])
def test_a_non_finite_row_spoils_only_that_row(make):
    z = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
    z[1, 2] = torch.nan
    (a,) = make()(z)
    assert torch.isnan(a[1]).all()
    assert torch.isfinite(a[[0, 2]]).all()


def test_batch_norm_gate_trains_on_two_tokens():
    (a,) = ExpertGate(3, 4)(torch.randn(2, 3, generator=torch.Generator().manual_seed(4)))
    torch.testing.assert_close(a.sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="needs at least 2 tokens per batch in training mode, got 1"):
        ExpertGate(3, 4)(torch.randn(1, 3))


@pytest.mark.parametrize("alpha", [1.5, 1.0001, 3])
def test_entmax_alpha_above_one_is_accepted(alpha):
    assert Gate(activation=alpha).activation == alpha


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"activation": 1.0}, ValueError, r"^entmax alpha must be a finite number > 1 .*got 1\.0$"),
        ({"activation": math.inf}, ValueError, r"^entmax alpha must be a finite number > 1 .*got inf$"),
        ({"norm": ""}, TypeError, r"^norm must be a non-empty name, got ''$"),
        ({"balance_loss": 1}, TypeError, r"^balance_loss must be a bool, got 1$"),
        ({"z_loss": "yes"}, TypeError, r"^z_loss must be a bool, got 'yes'$"),
    ],
)
def test_gate_descriptor_options_are_checked(options, error, message):
    with pytest.raises(error, match=message):
        Gate(**options)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: TopKGate(k=True), ValueError, r"^k must be a positive int or a sequence of them .*got True$"),
        (lambda: TopKGate(k=(1, 0)), ValueError, r"^k must be a positive int .*got \(1, 0\)$"),
        (lambda: TopKGate(norm=""), TypeError, r"^norm must be a non-empty name, got ''$"),
        (lambda: TopKGate(init="x"), ValueError, r"^unknown gate init 'x'; choose one of \['default', 'zeros'\]$"),
        (lambda: TopKGate(balance_loss=1), TypeError, r"^balance_loss must be a bool, got 1$"),
        (lambda: TopKGate(z_loss=1), TypeError, r"^z_loss must be a bool, got 1$"),
        (lambda: gate_from_options("x"), TypeError, r"^gate must be a gate descriptor with parameter_count, fma_per"),
        (
            lambda: gate_from_options(Gate(), activation="softmax", init="zeros"),
            TypeError,
            r"^pass either gate= or activation, gate_init, not both \(the descriptor Gate\(",
        ),
        (lambda: ExpertGate(0, 2), ValueError, r"^in_features must be a positive int, got 0$"),
        (lambda: ExpertGate(True, 2), ValueError, r"^in_features must be a positive int, got True$"),
        (lambda: ExpertGate(1.0, 2), ValueError, r"^in_features must be a positive int, got 1\.0$"),
        (lambda: ExpertGate(3, 2, norm="x"), ValueError, r"^unknown gate norm 'x'; choose one of \['batch', 'layer'"),
        (lambda: ExpertGate(3, 2, init="x"), ValueError, r"^unknown gate init 'x'; choose one of \['default', 'zeros'"),
        (lambda: ExpertGate(3, 2, balance_loss=1), TypeError, r"^balance_loss must be a bool, got 1$"),
        (lambda: ExpertGate(3, 2, z_loss=1), TypeError, r"^z_loss must be a bool, got 1$"),
        (lambda: TopKRouter(3, (2, 2), k=(1, True)), ValueError, r"^k must be an int in \[1, N_e\]"),
    ],
)
def test_gate_errors_state_the_rule(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_gate_fields_and_one_input():
    gate = ExpertGate(1, 2)
    assert (gate.in_features, gate.activation, gate.balance_loss, gate.z_loss) == (1, "entmax15", False, False)
    assert TopKGate(k=(1, 2)).k == (1, 2)


def test_top_k_gate_stores_k_as_a_tuple():
    assert TopKGate(k=[1, 2]).k == (1, 2)


def test_float32_gate_on_float64_input_computes_in_float64():
    gate = ExpertGate(3, 4, "softmax", "none")
    z = torch.randn(5, 3, dtype=DTYPE)
    (a,) = gate(z)
    assert a.dtype == DTYPE
    torch.testing.assert_close(a, hand_softmax(z @ gate.projections["n1"].weight.detach().double().T))


def test_reset_parameters_resets_the_batch_norm_statistics():
    gate = ExpertGate(3, 4)
    gate(torch.randn(6, 3) * 5 + 3)
    norm = gate.norms["n1"]
    assert not torch.allclose(norm.running_mean, torch.zeros(4))
    gate.reset_parameters()
    torch.testing.assert_close(norm.running_mean, torch.zeros(4))
    torch.testing.assert_close(norm.running_var, torch.ones(4))
