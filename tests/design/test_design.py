"""The design search: its front against brute force, budgets, named formats and upcycling."""

import math
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn import MuMoE
from mumoe_tn.conversion import upcycle_linear
from mumoe_tn.costs import TOLERANCE, compare
from mumoe_tn.design import design, evaluate, expert_factorizations, pareto_front
from mumoe_tn.design.space import named_shapes, topology_shapes
from mumoe_tn.network import ExpertNetwork

SMALL = {"in_features": 24, "out_features": 20, "experts": 8, "max_modes": 2, "expert_ranks": (2, 4)}


def _naive_front(vectors):
    """Non-dominated vectors by the definition (all minimised), no sorting tricks."""

    def dominated(v):
        return any(
            all(a <= b for a, b in zip(w, v, strict=True)) and any(a < b for a, b in zip(w, v, strict=True))
            for w in vectors
        )

    return {v for v in vectors if not dominated(v)}


@given(st.lists(st.tuples(*[st.integers(0, 5)] * 3), min_size=1, max_size=30))
def test_pareto_front_is_the_set_of_non_dominated_points(vectors):
    front = pareto_front(vectors, lambda v: v)
    assert set(front) == _naive_front(vectors)
    assert front == [v for v in vectors if v in set(front)]  # given order, duplicates kept


def test_expert_factorizations_multiply_to_the_count():
    found = expert_factorizations(24, 3)
    assert all(math.prod(dims) == 24 and 1 <= len(dims) <= 3 and min(dims) >= 2 for dims in found)
    # every multiset of factors >= 2 with at most 3 factors: 24, 12·2, 8·3, 6·4, 6·2·2, 4·3·2, 3·2·2·2 (too long)
    assert {tuple(sorted(d)) for d in found} == {(24,), (2, 12), (3, 8), (4, 6), (2, 2, 6), (2, 3, 4)}


def test_relabelled_networks_are_kept_once():
    a = ExpertNetwork(
        {"A": "n1 x", "B": "n2 x y", "C": "i y z", "D": "o z"},
        {"n1": 3, "n2": 3, "i": 5, "o": 4, "x": 2, "y": 2, "z": 2},
    )
    # the same network with cores, bonds and the two equal expert modes renamed
    b = ExpertNetwork(
        {"P": "n2 u", "Q": "n1 u v", "R": "i v w", "S": "o w"},
        {"n1": 3, "n2": 3, "i": 5, "o": 4, "u": 2, "v": 2, "w": 2},
    )
    # not the same: input and output swapped ends
    c = ExpertNetwork(
        {"A": "n1 x", "B": "n2 x y", "C": "o y z", "D": "i z"},
        {"n1": 3, "n2": 3, "i": 5, "o": 4, "x": 2, "y": 2, "z": 2},
    )
    from mumoe_tn.design.space import Shape, deduplicate

    shapes = [
        Shape("x", (3, 3), name, (), lambda i, o, net=net: net) for name, net in zip("abc", (a, b, c), strict=True)
    ]
    assert [s.label for s in deduplicate(shapes)] == ["a", "c"]


def test_front_equals_brute_force_over_the_undeduplicated_space():
    result = design(**SMALL, budget=0.6, progress=False)
    raw = []
    for dims in expert_factorizations(8, 2):
        raw += named_shapes(dims, (2, 4)) + topology_shapes(dims, (2, 4))
    assert len(raw) > result.config["searched"]  # the search deduplicated
    points = [evaluate(shape, result.config["target_params"], 24, 20) for shape in raw]
    vectors = {p.objectives() for p in points if not isinstance(p, str)}
    assert {p.objectives() for p in result.front} == _naive_front(vectors)
    assert len({p.objectives() for p in result.front}) == len(result.front)


def _by_hand(network: ExpertNetwork, in_features: int) -> int:
    """Parameters: every core's size product, plus an I × N_e gate per expert mode."""
    experts = sum(math.prod(network.sizes[x] for x in labels) for labels in network.cores.values())
    return experts + in_features * sum(network.expert_dims)


@pytest.mark.parametrize("budget", [0.6, 1.0, "linear", 450])
def test_every_point_meets_the_budget_within_the_tolerance(budget):
    result = design(**SMALL, budget=budget, progress=False)
    target = result.config["target_params"]
    assert target == {0.6: 300, 1.0: 500, "linear": 500, 450: 450}[budget]  # nn.Linear: 25·20
    for point in result.points:
        assert point.params == _by_hand(point.network, 24)
        assert abs(point.params - target) <= TOLERANCE * target, point


def test_named_formats_are_on_or_behind_the_front():
    """compare()'s CP, TR, TT and Tucker rows at the same budget: each is matched or beaten by a front point."""
    result = design(64, 48, 16, budget=3000, max_modes=2, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = compare(64, 48, 16, ("cp", "tr", "tt", "tucker"), match=3000)
    assert len(table.rows) == 4 + 3
    for row in table.rows[:4]:
        mine = (row.params_total, row.fma_planned, row.peak_elements, -row.max_rank)
        assert any(all(a <= b for a, b in zip(p.objectives(), mine, strict=True)) for p in result.front), row


def test_best_builds_a_layer_that_runs():
    result = design(**SMALL, budget=0.8, progress=False)
    layer = MuMoE(24, 20, decomposition=result.best)
    assert layer.network.sizes == result.best.sizes
    assert layer(torch.randn(3, 24)).shape == (3, 20)
    assert result.best_point in result.front


def _pretrained(in_features: int, out_features: int) -> nn.Linear:
    """A layer with a decaying spectrum, as trained layers have."""
    generator = torch.Generator().manual_seed(0)
    left, _ = torch.linalg.qr(torch.randn(out_features, out_features, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(in_features, in_features, generator=generator, dtype=torch.float64))
    spectrum = 0.6 ** torch.arange(min(in_features, out_features), dtype=torch.float64)
    layer = nn.Linear(in_features, out_features).double()
    with torch.no_grad():
        layer.weight.copy_(left[:, : spectrum.numel()] * spectrum @ right[:, : spectrum.numel()].T)
        layer.bias.mul_(0.1)
    return layer


@pytest.fixture
def one_thread():
    """Small least-squares fits run fastest (and steadiest on a shared machine) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_with_a_pretrained_layer_the_choice_upcycles_at_least_as_well_as_every_named_format(one_thread):
    linear = _pretrained(32, 24)
    budget = 600  # nn.Linear has 792
    result = design(32, 24, 8, budget=budget, weight=linear, max_modes=2, expert_ranks=(2, 4), fit_iterations=20)
    named = []
    for name in ("cp", "tr", "tt", "tucker"):  # the paper's settings, matched by the layers themselves
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                named.append(upcycle_linear(linear, 8, name, match=budget, progress=False)[1])
            except ValueError:  # tr/tt at R1 = R2 = 4 cannot go as low as the budget
                pass
    assert len(named) >= 2, named
    best = result.best_point
    assert best.upcycle_error <= min(named) + 1e-9, (best, named)
    # Eckart–Young: no expert of rank <= k is closer to M = [Wᵀ; b] than its best rank-k approximation
    matrix = torch.cat([linear.weight.T, linear.bias[None]]).detach()
    singular = torch.linalg.svdvals(matrix)

    def eckart_young(k: int) -> float:
        return float(singular[k:].square().sum().sqrt() / singular.square().sum().sqrt())

    for point in result.points:
        assert point.upcycle_error >= eckart_young(point.rank_bound) - 1e-9, point
    assert 0 < best.upcycle_error < 1


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="budget must be 'linear', 'mlp', a number"):
        design(12, 10, 8, budget="huge")
    with pytest.raises(ValueError, match=r"families must be a non-empty selection of \['cp'"):
        design(12, 10, 8, families=("cp", "mera"))
    with pytest.raises(ValueError, match="max_fma must be a positive number or None, got -3"):
        design(12, 10, 8, max_fma=-3)
    with pytest.raises(ValueError, match="no network of the search meets the budget"):
        design(12, 10, 8, min_rank=50, progress=False)
    with pytest.raises(ValueError, match=r"nn.Linear's layout \(out, in\) = \(10, 12\), got \(12, 10\)"):
        design(12, 10, 8, weight=torch.zeros(12, 10), progress=False)


def test_the_search_imports_no_torch():
    code = (
        "import sys; from mumoe_tn.design import design; "
        "design(12, 10, 8, max_modes=2, progress=False); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _mxd_params(in_features: int, out_features: int, dims: tuple[int, ...]) -> int:
    """MxD written out: D (I+1) × O, one N_e × O matrix per mode, an I × N_e gate per mode."""
    return (in_features + 1) * out_features + sum(dims) * out_features + in_features * sum(dims)


def test_mxd_is_searched_at_its_fixed_number_of_experts():
    from mumoe_tn.design.structure_search import FIXED_MISS

    flat, hierarchical = _mxd_params(24, 20, (8,)), _mxd_params(24, 20, (4, 2))
    assert (flat, hierarchical) == (852, 764)
    result = design(**SMALL, budget=flat, progress=False)
    (point,) = [p for p in result.points if p.family == "mxd"]
    assert point.network.to_spec() == "D: i o, C_n1: n1 o" and point.network.expert_dims == (8,)
    assert point.params == flat and point.ranks == "—"
    assert point.rank_bound == 20  # min(I + 1, O): every expert is full rank
    assert result.best_point is point  # no other point reaches rank 20 at this budget
    assert result.config["dropped"][FIXED_MISS] == 1  # the hierarchical one, 10 % below
    # hierarchical MxD: 4 × 2 and 2 × 4 are one network; kept at its own budget
    result = design(**SMALL, budget=hierarchical, progress=False)
    (point,) = [p for p in result.points if p.family == "mxd"]
    assert point.structure == "hierarchical mxd" and sorted(point.network.expert_dims) == [2, 4]
    assert point.network.to_spec() == "D: i o, C_n1: n1 o, C_n2: n2 o" and point.params == hierarchical
    # far from the budget: refused with the reason, never rescaled to other experts
    result = design(**SMALL, budget=0.6, progress=False)
    assert not [p for p in result.points if p.family == "mxd"]
    assert result.config["dropped"][FIXED_MISS] == 2


def test_hadamard_topologies_hold_the_shared_legs_in_every_expert_core():
    plain = topology_shapes((4, 2), (2,), hadamard=())
    shapes = topology_shapes((4, 2), (2,), hadamard=("o", "i", "io"))
    assert len(shapes) == 4 * len(plain)
    for shape in shapes:
        net = shape.make(7, 5)
        shared = shape.label.split("⊙")[1] if "⊙" in shape.label else ""
        for leg, size in (("i", 7), ("o", 5)):
            holders = set(net.cores_with(leg))
            experts = {core for core, labels in net.cores.items() if any(label.startswith("n") for label in labels)}
            if leg in shared:
                assert holders == experts | {f"C_{leg}"}, (shape.label, net.to_spec())
            else:
                assert holders == {f"C_{leg}"}, (shape.label, net.to_spec())
            assert net.sizes[leg] == size
    with pytest.raises(ValueError, match=r"hadamard must be a sequence of \['o', 'i', 'io'\].*got \['x'\]"):
        design(**SMALL, hadamard=["x"], progress=False)


def test_deduplication_tells_apart_which_cores_share_a_leg():
    from mumoe_tn.design.space import Shape, deduplicate

    sizes = {"n1": 3, "n2": 3, "i": 5, "o": 4, "x": 2}
    # the same legs per core, but n1 joins A to the input core in one and to the other output core in the other
    a = ExpertNetwork({"A": "n1 o", "B": "n1 i x", "C": "n2 o x"}, sizes)
    b = ExpertNetwork({"A": "n1 o", "B": "n2 i x", "C": "n1 o x"}, sizes)
    # a relabelling of a (cores renamed, expert modes swapped)
    c = ExpertNetwork({"P": "n2 i x", "Q": "n1 o x", "R": "n2 o"}, sizes)
    shapes = [
        Shape("x", (3, 3), name, (), lambda i, o, net=net: net) for name, net in zip("abc", (a, b, c), strict=True)
    ]
    assert [s.label for s in deduplicate(shapes)] == ["a", "b"]


def test_hadamard_points_meet_the_budget_and_are_on_the_front_where_they_should_be():
    result = design(**SMALL, budget=0.9, families=("chain", "star"), progress=False)
    hadamard = [p for p in result.points if "⊙" in p.structure]
    assert hadamard
    for point in hadamard:
        assert point.params == _by_hand(point.network, 24)
        assert point.network.shared_legs
    assert {p.objectives() for p in result.front} == _naive_front({p.objectives() for p in result.points})
