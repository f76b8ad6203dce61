"""Custom networks are first-class: a format registered here, in the test file, gets every tool.

Also one test per known failure mode (custom networks named like a format, upcycling
and matching of custom networks, mixed cost tables, collapsed matches).
"""

import copy
import math
import pickle
import re
import warnings

import pytest
import torch
from hypothesis import given
from strategies import named_networks
from torch import nn

from mumoe_tn import ExpertNetwork, MuMoE, MuMoEMLP
from mumoe_tn.cli import main
from mumoe_tn.contractions import materialise
from mumoe_tn.conversion.fitting.upcycling import decompose_dense, upcycle_experts, upcycle_linear
from mumoe_tn.costs import (
    MatchingWarning,
    collapsed_expert_modes,
    compare,
    layer_flops,
    layer_parameters,
    linear,
    match_layer,
    rank_bound,
)
from mumoe_tn.decompositions import Format, available, build, cp, get_format, normalise_ranks, tr, unregister
from mumoe_tn.layers.init import init_cores
from mumoe_tn.network import physical_sizes

HT_SPEC = "U1: n1 a, U2: n2 b, Ui: i c, Uo: o d, L: a b e, R: c d e"


class HierarchicalTucker(Format, name="htucker_test"):
    """Two expert modes, a balanced binary tree: (n1 n2) and (i o) joined by the root bond e."""

    def network(self, expert_dims, in_features, out_features, rank, **options):
        ranks = dict(zip("abcde", normalise_ranks(self.name, rank, 5), strict=True))
        sizes = physical_sizes(expert_dims, in_features, out_features)  # checks the physical sizes
        return ExpertNetwork.from_spec(
            HT_SPEC, expert_dims=expert_dims, in_features=sizes["i"], out_features=sizes["o"], ranks=ranks
        )

    def matched_bonds(self, network):
        return ("c", "d", "e")


def test_hierarchical_tucker_spec_parses_as_intended():
    net = HierarchicalTucker.get().build((4, 3), 9, 8, (2, 2, 3, 3, 2))
    assert dict(net.cores) == {
        "U1": ("n1", "a"),
        "U2": ("n2", "b"),
        "Ui": ("i", "c"),
        "Uo": ("o", "d"),
        "L": ("a", "b", "e"),
        "R": ("c", "d", "e"),
    }
    assert net.format is HierarchicalTucker.get() and "htucker_test" in available()


def _reference_dense(net, cores):
    """W from the cores by one plain einsum over the network's own labels (an independent check)."""
    letters = {label: chr(ord("a") + k) for k, label in enumerate(net.sizes)}
    inputs = ",".join("".join(letters[x] for x in labels) for labels in net.cores.values())
    output = "".join(letters[x] for x in (*net.expert_legs, "i", "o"))
    return torch.einsum(f"{inputs}->{output}", *cores.values())


def test_registered_format_gets_layers_costs_init_and_pickling():
    layer = MuMoE(12, 10, (4, 3), "htucker_test", (2, 2, 3, 3, 2), dtype=torch.float64).eval()
    net = layer.network
    assert net.format is get_format("htucker_test")
    x = torch.randn(5, 12, dtype=torch.float64)
    coefficients = layer.gate(x)
    weight = _reference_dense(net, layer.experts.cores)
    z = torch.cat([x, torch.ones(5, 1, dtype=torch.float64)], -1)
    expected = torch.einsum("bn,bm,nmio,bi->bo", *coefficients, weight, z)
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.experts.to_dense(), weight)
    # Costs: no closed form (the format states none), the planned count and the min-cut bound.
    flops = layer_flops(net, batch=8)
    assert flops.closed_form is None and flops.planned > 0
    assert rank_bound(net) == 3  # the only i–o path is i–c–R–d–o: min(I, c, d, O) = min(13, 3, 3, 10)
    assert layer_parameters(net).total == sum(p.numel() for p in layer.parameters())
    # Init: the generic variance-targeted rule (the format names no other).
    mean_square = float(weight.pow(2).mean())
    assert mean_square == pytest.approx(1 / (3 * 12), rel=1e-9)
    again = pickle.loads(pickle.dumps(net))
    assert again == net and again.format is net.format
    assert copy.deepcopy(net) == net


def test_rank_bound_of_hierarchical_tucker():
    net = HierarchicalTucker.get().build((4, 3), 13, 10, (2, 2, 3, 5, 2))
    # i–o paths: i-c-R-d-o (cut c=3 or d=5) and through e? e joins R and L only: no second path.
    assert rank_bound(net) == 3


def test_registered_format_matching_upcycling_decomposition_and_cli(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MatchingWarning)
        layer = MuMoE(64, 48, (4, 4), "htucker_test", (2, 2, 1, 1, 1), match="linear", dtype=torch.float64)
    net = layer.network
    assert net.sizes["a"] == net.sizes["b"] == 2  # the format scales only c, d, e; rank= sets a, b
    target = linear(64, 48).params
    assert abs(layer_parameters(net).total - target) <= 0.05 * target
    # With a, b left at 1 the experts would collapse along both modes: matching raises them.
    matched = match_layer(build("htucker_test", (4, 4), 65, 48, 1), target)
    assert dict(matched.lifted) == {"a": 4, "b": 4} and not matched.problems
    assert not collapsed_expert_modes(matched.networks[0])
    good = match_layer(build("htucker_test", (4, 4), 65, 48, (2, 2, 1, 1, 1)), target)
    assert not good.problems and good.bonds == ("c", "d", "e")

    # Upcycling takes the generic path (no closed form) and is exact when the network holds W.
    linear_layer = nn.Linear(6, 5).double()
    upcycled, error = upcycle_linear(linear_layer, (3, 2), "htucker_test", (2, 2, 5, 5, 5))
    assert error < 1e-6
    x = torch.randn(7, 6, dtype=torch.float64)
    torch.testing.assert_close(upcycled.train()(x), linear_layer(x), atol=1e-5, rtol=1e-5)
    # Dense decomposition into the format: a tensor made by the network is recovered.
    source = MuMoE(6, 5, (3, 2), "htucker_test", (2, 2, 2, 2, 2), dtype=torch.float64)
    dense = source.experts.to_dense()
    experts, error = decompose_dense(dense, "htucker_test", (2, 2, 2, 2, 2), n_iter_max=60)
    assert error < 1e-2  # ALS converges towards the exact cores (slowly near the end)
    reported = float((experts.to_dense() - dense).norm() / dense.norm())
    assert reported == pytest.approx(error, rel=1e-6, abs=1e-12)

    # The CLI knows the format with no edits to the package.
    assert main(["compare", "--decompositions", "cp", "htucker_test", "--experts", "8", "8", "--markdown"]) == 0
    assert "htucker_test μMoE" in capsys.readouterr().out


def test_unregister_and_duplicate_names():
    class Temporary(Format, name="temporary_test"):
        def network(self, expert_dims, in_features, out_features, rank, **options):
            return cp(expert_dims, in_features, out_features, rank).with_format(None)

    assert "temporary_test" in available()
    with pytest.raises(ValueError, match=r"a format named 'temporary_test' is already registered"):

        class Again(Format, name="Temporary_Test"):
            pass

    unregister("temporary_test")
    assert "temporary_test" not in available()
    with pytest.raises(ValueError, match=r"unknown decomposition 'temporary_test'; registered: \["):
        get_format("temporary_test")


# ------------------------------------------------------------------ known failure modes
def test_custom_network_named_like_a_format_takes_the_generic_path():
    spec = "A: n1 a b, B: a i c, C: b c o"
    net = ExpertNetwork.from_spec(spec, expert_dims=8, in_features=9, out_features=7, ranks=2, name="tr")
    assert net.format is None and net.name == "tr"
    flops = layer_flops(net, batch=4)  # was KeyError: 'r1'
    assert flops.closed_form is None and flops.hand_order is None
    # A network named "cp" with an extra core: no CP closed form, and the generic init.
    extra = ExpertNetwork.from_spec(
        "U_n1: n1 r, U_i: i r, U_o: o r s, X: s r", expert_dims=4, in_features=5, out_features=6, ranks=3, name="cp"
    )
    assert layer_flops(extra).closed_form is None
    cores = {name: torch.empty(shape, dtype=torch.float64) for name, shape in extra.core_shapes.items()}
    init_cores(extra, cores)  # "auto" -> the generic "linear" rule: exact variance
    weight = materialise(extra, cores)
    assert float(weight.pow(2).mean()) == pytest.approx(1 / (3 * 5), rel=1e-9)
    assert ExpertNetwork.from_spec(spec, expert_dims=8, in_features=9, out_features=7, ranks=2, name=None).name == (
        "custom"
    )
    with pytest.raises(ValueError, match=r"network name must be a non-empty string"):
        ExpertNetwork.from_spec(spec, expert_dims=8, in_features=9, out_features=7, ranks=2, name="a\nb")
    with pytest.raises(ValueError, match=r"does not follow format 'cp'"):
        ExpertNetwork(dict(extra.cores), dict(extra.sizes), format=get_format("cp"))


def test_upcycling_a_custom_network():
    torch.manual_seed(1)
    original = nn.Linear(16, 12)
    layer, error = upcycle_linear(original, 4, "n1 a, a i o", 3)  # was KeyError: 's_i'
    assert error < 1e-5
    x = torch.randn(9, 16)
    torch.testing.assert_close(layer(x), original(x), atol=1e-5, rtol=1e-5)
    # Too narrow to hold the matrix: the best fit, with its error reported (close to the SVD bound).
    narrow = ExpertNetwork.from_spec(
        "A: n1 a, B: a i c, C: c o", expert_dims=4, in_features=17, out_features=12, ranks=2
    )
    layer = MuMoE(16, 12, decomposition=narrow)
    error = upcycle_experts(layer.experts, torch.cat([original.weight.T, original.bias[None]]).detach())
    singular = torch.linalg.svdvals(torch.cat([original.weight.T, original.bias[None]]).detach().double())
    best = float(singular[2:].norm() / singular.norm())
    assert best <= error + 1e-6 and error < best + 1e-3


@given(named_networks(max_size=4, max_rank=3))
def test_generic_upcycling_matches_the_closed_form(network):
    # Strip the format: the generic ALS path must reach the closed form's (optimal) error.
    torch.manual_seed(0)
    matrix = torch.randn(network.in_features, network.out_features, dtype=torch.float64)
    named = MuMoE(network.in_features, network.out_features, decomposition=network, bias=False, dtype=torch.float64)
    generic_net = network.with_format(None)
    generic = MuMoE(
        network.in_features, network.out_features, decomposition=generic_net, bias=False, dtype=torch.float64
    )
    closed_error = upcycle_experts(named.experts, matrix)
    generic_error = upcycle_experts(generic.experts, matrix, max_iter=100)
    assert generic_error <= closed_error + 1e-4 or closed_error > rank_bound(network)  # never worse, up to ALS noise
    for index in ((0,) * network.n_expert_modes, tuple(n - 1 for n in network.expert_dims)):
        torch.testing.assert_close(generic.experts.expert(index), generic.experts.expert((0,) * network.n_expert_modes))


def test_cost_tables_take_names_specs_and_networks():
    net = ExpertNetwork.from_spec(
        "A: n1 a b, B: a i c, C: b c o",
        expert_dims=64,
        in_features=129,
        out_features=256,
        ranks={"a": 4, "b": 4, "c": 32},
    )
    spec = "n1 a b, a i c, b c o"
    table = compare(768, 3072, 256, ("cp", "tr", net, spec))  # was TypeError / "unknown decomposition"
    names = [row.name for row in table.rows]
    assert names[:4] == ["cp μMoE", "tr μMoE", "custom 1 μMoE", "custom 2 μMoE"]
    for row in table.rows[:4]:
        (network,) = row.networks
        assert network.in_features == 769 and network.out_features == 3072 and network.expert_dims == (256,)
        assert row.spec == network.to_spec()
        assert row.params_total == layer_parameters(network).total
        assert row.max_rank == rank_bound(network)
    assert table.rows[2].networks[0].to_spec() == net.to_spec()
    assert table.rows[2].networks[0].sizes["c"] == 32  # a ready network keeps its bonds …
    rescaled = compare(768, 3072, 256, (net,), bonds={"custom 1": ["c"]}).rows[0].networks[0]
    assert rescaled.sizes["c"] != 32 and rescaled.sizes["a"] == 4  # … unless bonds= names some to match
    assert [r["spec"] for r in table.records()][:2] == [
        cp(256, 769, 3072, 1).to_spec(),
        tr(256, 769, 3072, 1).to_spec(),
    ]
    # Explicit ranks keyed by label or spec; a network without ranks keeps its bonds under match=None.
    fixed = compare(64, 48, 16, ("cp", spec, net), ranks={"cp": 5, spec: {"a": 2, "b": 3, "c": 4}}, match=None)
    assert fixed.rows[0].networks[0].sizes["r"] == 5
    assert dict(fixed.rows[1].networks[0].sizes) | {} == dict(
        ExpertNetwork.from_spec(
            spec, expert_dims=16, in_features=65, out_features=48, ranks={"a": 2, "b": 3, "c": 4}
        ).sizes
    )
    assert fixed.rows[2].networks[0].sizes["c"] == 32
    assert "expert rank bound" in fixed.to_markdown()
    # Fractional targets, as tensorly-torch's rank=0.5.
    half = compare(64, 48, 16, ("cp",), match=0.5)
    assert half.config["target_params"] == round(0.5 * linear(64, 48).params)


def test_builders_and_match_fractions_in_layers():
    def builder(expert_dims, in_features, out_features, rank):
        return ExpertNetwork.from_spec(
            "n1 a, n2 b, a b i c, c o",
            expert_dims=expert_dims,
            in_features=in_features,
            out_features=out_features,
            ranks=rank,
        )

    target = linear(64, 64).params
    with pytest.warns(MatchingWarning, match=r"\+5\.8% from the target .* \(a=4, b=4, c=3; the candidates are 1,104"):
        MuMoE(64, 64, (8, 8), builder, match="linear")  # a·b·c: even bond by bond the steps are coarse
    layer = MuMoE(64, 64, (8, 8), builder, 2, match="linear", match_bonds=["c"])
    assert layer.network.sizes["a"] == layer.network.sizes["b"] == 2
    assert abs(layer_parameters(layer.network).total - target) <= 0.05 * target
    # a = b = 1 (built at rank 1, not scaled) would collapse both expert modes: they are raised to 4.
    layer = MuMoE(64, 64, (8, 8), builder, match=0.6, match_bonds=["c"])
    assert layer.network.sizes["a"] == layer.network.sizes["b"] == 4
    message = r"below the smallest possible count .* \(with a=4, b=4: bonds not scaled, raised from 1 so that no"
    with pytest.raises(ValueError, match=message):
        MuMoE(64, 64, (8, 8), builder, match=0.5, match_bonds=["c"])
    block = MuMoEMLP(32, 64, expert_dims=8, decomposition="tr", match=1.0)
    assert block.experts1.network.format is get_format("tr")
    with pytest.raises(ValueError, match=r"match_bonds= names the bonds match= scales"):
        MuMoE(64, 64, 8, "cp", 4, match_bonds=["r"])


def test_match_never_degenerates_silently():
    net = ExpertNetwork.from_spec(HT_SPEC, expert_dims=(8, 8), in_features=65, out_features=64, ranks=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MatchingWarning)
        matched = match_layer(net, linear(64, 64).params, bonds=["c", "d", "e"])
    assert (matched.networks[0].sizes["a"], matched.networks[0].sizes["b"]) == (4, 4) == tuple(matched.lifted.values())
    assert not collapsed_expert_modes(matched.networks[0]) and not matched.problems
    # CP at r = 1 is the closer count (54 vs 76 for 65) but its experts are multiples of one matrix.
    with pytest.warns(MatchingWarning, match=r"from the target"):
        far = match_layer(cp(4, 9, 9, 1), 65)  # 22·r + 32 gate parameters: 54 or 76
    assert far.rank == 2 and abs(far.relative_error) > 0.05 and far.problems


def test_named_formats_are_networks_of_their_format():
    for name in ("cp", "tr", "tt", "tucker"):
        net = build(name, (3, 2), 5, 4, 2)
        assert net.format is get_format(name)
        assert net.with_sizes(i=7).format is net.format
        assert math.prod(net.dense_shape) == 3 * 2 * 5 * 4


def test_compare_counts_a_custom_gate_descriptor():
    from mumoe_tn.gates.specs import Gate

    class WideGate(Gate):
        """The default gate plus a bias per expert: more parameters and FMAs than I·ΣN."""

        def parameter_count(self, in_features, expert_dims):
            return super().parameter_count(in_features, expert_dims) + sum(expert_dims)

        def fma_per_token(self, in_features, expert_dims):
            return super().fma_per_token(in_features, expert_dims) + sum(expert_dims)

    plain = compare(64, 48, 16, ("cp",), ranks={"cp": 4}, match=None).rows[0]
    wide = compare(64, 48, 16, ("cp",), ranks={"cp": 4}, match=None, gate=WideGate()).rows[0]
    assert wide.params_gate == plain.params_gate + 16 == 64 * 16 + 16
    assert wide.fma_planned == plain.fma_planned + 16
    assert wide.params_total == plain.params_total + 16


def test_decompose_dense_clipped_ranks_and_bad_tensors():
    torch.manual_seed(0)
    weight = torch.randn(3, 4, 5, dtype=torch.float64)
    # ranks a tensor of this shape cannot use are clipped, with a warning
    with pytest.warns(UserWarning, match="were clipped"):
        experts, error = decompose_dense(weight, "tucker", 50)
    assert experts.network.sizes["s_i"] == 4 and error < 1e-10
    with pytest.warns(UserWarning, match="were clipped: r1 4 → 3"):
        experts, error = decompose_dense(weight, "tt", 2)
    assert experts.network.core_shape("G_i") == (3, 4, 2) and 0 < error < 1  # r1 = 3 (clipped expert rank), r2 = 2
    reported = float((experts.to_dense() - weight).norm() / weight.norm())
    assert reported == pytest.approx(error, rel=1e-9)
    with pytest.raises(TypeError, match=r"weight must be a floating-point tensor, got dtype torch.int64"):
        decompose_dense(torch.ones(3, 4, 5, dtype=torch.int64), "cp", 2)
    with pytest.raises(TypeError, match=r"got dtype torch.complex64"):
        decompose_dense(torch.ones(3, 4, 5, dtype=torch.complex64), "cp", 2)
    with pytest.raises(ValueError, match=r"weight has NaN or infinite entries"):
        decompose_dense(torch.full((3, 4, 5), float("nan")), "cp", 2)


def test_registry_messages_in_full():
    from mumoe_tn.decompositions import register

    for bad in ("  ", ""):
        with pytest.raises(ValueError, match="^" + re.escape(f"a format needs a non-empty name, got {bad!r}") + "$"):

            class Blank(Format, name=bad):
                pass

    with pytest.raises(ValueError, match=r"^a format needs a non-empty name, got 3$"):

        class Numbered(Format, name=3):
            pass

    with pytest.raises(TypeError, match=r"^register\(\) takes a Format instance, got int$"):
        register(3)
    with pytest.raises(ValueError, match=r"^a format needs a non-empty name$"):
        register(Format())  # the base class has no name
    cp_format = get_format("cp")
    assert build(cp_format, 3, 5, 4, 2) == build("cp", 3, 5, 4, 2)  # a Format is used as given


def exactly(message):
    return "^" + re.escape(message) + "$"


def test_resolve_network_messages_and_options():
    from mumoe_tn.decompositions import resolve_network

    with pytest.raises(ValueError, match=exactly("in_features (leg i) must be a positive int, got 0")):
        resolve_network("cp", 3, 0, 4, 2)
    with pytest.raises(ValueError, match=exactly("out_features (leg o) must be a positive int, got 0")):
        resolve_network("cp", 3, 5, 0, 2)
    with pytest.raises(
        TypeError, match=exactly("expert_dims is required unless the decomposition is an ExpertNetwork")
    ):
        resolve_network("cp", None, 5, 4, 2)
    with pytest.raises(TypeError, match=exactly("rank is required for decomposition 'cp' (or give match=)")):
        resolve_network("cp", 3, 5, 4, None)
    with pytest.raises(TypeError, match=exactly("rank is required for decomposition TRFormat (or give match=)")):
        resolve_network(get_format("tr"), 3, 5, 4, None)
    ring = resolve_network(get_format("tr"), 3, 5, 4, 6, options={"expert_rank": 2})  # options reach a Format
    assert (ring.sizes["r1"], ring.sizes["r2"], ring.sizes["r3"]) == (2, 2, 6)
    with pytest.raises(TypeError, match=exactly("a spec string takes no builder options, got ['x']")):
        resolve_network("n1 a, a i o", 3, 5, 4, 2, options={"x": 1})
    with pytest.raises(
        TypeError,
        match=exactly(
            "decomposition must be a format name, a Format, a spec string, an ExpertNetwork or a builder, got 3 (int)"
        ),
    ):
        resolve_network(3, 3, 5, 4, 2)


def test_resolve_network_builders_and_ready_networks():
    from mumoe_tn.decompositions import resolve_network

    def builder(expert_dims, in_features, out_features, rank, width=1):
        return ExpertNetwork.from_spec(
            "n1 a, a i o", expert_dims=expert_dims, in_features=in_features, out_features=out_features, ranks=width
        )

    assert resolve_network(builder, 3, 5, 4, 2, options={"width": 7}).sizes["a"] == 7  # options reach a builder
    with pytest.raises(TypeError, match=exactly("the decomposition builder returned int, not an ExpertNetwork")):
        resolve_network(lambda *args: 3, 3, 5, 4, 2)
    fixed = ExpertNetwork.from_spec("n1 a, a i o", expert_dims=4, in_features=9, out_features=6, ranks=2)
    legs = (
        "the network's legs {'n1': 4, 'i': 9, 'o': 6} do not match the requested {'n1': 4, 'i': 5, 'o': 6} "
        "(leg i includes a folded bias column)"
    )
    with pytest.raises(ValueError, match=exactly(legs)):  # a builder's network is never resized
        resolve_network(lambda *args: fixed, 4, 5, 6, 2)
    with pytest.raises(ValueError, match=exactly(legs)):  # nor a ready one, unless asked
        resolve_network(fixed, 4, 5, 6, None)
    assert resolve_network(fixed, 4, 5, 6, None, resize=True).in_features == 5
    assert resolve_network(fixed, None, 9, 6, None) is fixed
    with pytest.raises(ValueError, match=exactly("expert_dims=(3, 2) has 2 mode(s) but the network has 1 (('n1',))")):
        resolve_network(fixed, (3, 2), 9, 6, None)


def test_is_spec_tells_names_from_specs():
    from mumoe_tn.decompositions import is_spec

    assert not is_spec("cp") and not is_spec("CP") and not is_spec("Xy") and is_spec("n1 i o") and is_spec("A: n1 i o")

    class Spaced(Format, name="two words"):
        pass

    try:
        assert not is_spec("two words") and not is_spec("Two Words")  # a registered name, not a spec
    finally:
        unregister("two words")


def test_tr_rank_bound_takes_the_smallest_expert_bond():
    # R = (5, 4, 2, 6) for E = 2: min{R4 · min(R1, R2, R3), I, O} = min(6 · 2, 30, 30)
    network = tr((3, 2), 30, 30, (5, 4, 2, 6))
    assert network.format.closed_form_rank_bound(network) == rank_bound(network) == 12


def test_zero_pad_by_hand():
    from mumoe_tn.decompositions.tensor_support import zero_pad

    padded = zero_pad(torch.tensor([[1.0, 2.0]]), (2, 3))
    assert padded.tolist() == [[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match=exactly("cannot pad a tensor of shape (2, 3) to (2,)")):
        zero_pad(torch.ones(2, 3), (2,))
    with pytest.raises(ValueError, match=exactly("cannot pad a tensor of shape (3,) to (2,)")):
        zero_pad(torch.ones(3), (2,))


def test_format_messages_in_full():
    with pytest.raises(ValueError, match=exactly("tr rank[0] must be a positive int, got 0")):
        tr(3, 5, 4, 0)
    with pytest.raises(ValueError, match=exactly("tr expert_rank rank[0] must be a positive int, got 0")):
        tr(3, 5, 4, 2, expert_rank=0)

    class Broken(Format, name="broken_doc"):
        def network(self, expert_dims, in_features, out_features, rank, **options):
            return 3

    try:
        with pytest.raises(
            TypeError, match=exactly("format 'broken_doc': network() returned int, not an ExpertNetwork")
        ):
            build("broken_doc", 3, 5, 4, 2)
    finally:
        unregister("broken_doc")
    message = (
        "the network does not follow format 'cp': it has cores 'A: n1 r, B: r i, C: r o' but 'cp' builds "
        "'U_n1: n1 r, U_i: i r, U_o: o r'; leave format=None for a custom network"
    )
    with pytest.raises(ValueError, match=exactly(message)):
        ExpertNetwork({"A": "n1 r", "B": "r i", "C": "r o"}, {"n1": 3, "i": 5, "o": 4, "r": 2}, format=get_format("cp"))


def test_registry_lookup_messages():
    with pytest.raises(TypeError, match=exactly("a decomposition name must be a string, got 3 (int)")):
        get_format(3)
    with pytest.raises(ValueError, match=exactly("cp rank[1] must be a positive int, got 0")):
        normalise_ranks("cp", (2, 0), 2)


def test_builder_networks_must_have_the_requested_expert_dims():
    from mumoe_tn.decompositions import resolve_network

    fixed = ExpertNetwork.from_spec("n1 a, a i o", expert_dims=4, in_features=9, out_features=6, ranks=2)
    message = (
        "the network's legs {'n1': 4, 'i': 9, 'o': 6} do not match the requested {'n1': 3, 'i': 9, 'o': 6} "
        "(leg i includes a folded bias column)"
    )
    with pytest.raises(ValueError, match=exactly(message)):
        resolve_network(lambda *args: fixed, 3, 9, 6, 2)
