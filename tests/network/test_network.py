"""ExpertNetwork: validation rules, spec strings and derived facts."""

import math
import time

import pytest
from hypothesis import given
from strategies import any_network, custom_networks, named_networks

from mumoe_tn import ExpertNetwork
from mumoe_tn.decompositions import available, build, cp, tr, tt, tucker

PHYS = {"n1": 3, "i": 4, "o": 5}


def net(cores, **sizes):
    return ExpertNetwork(cores, {**PHYS, **sizes})


@given(any_network())
def test_spec_round_trip_and_counts(network):
    again = ExpertNetwork.from_spec(
        network.to_spec(),
        expert_dims=network.expert_dims,
        in_features=network.in_features,
        out_features=network.out_features,
        ranks={bond: network.sizes[bond] for bond in network.bonds},
        name=network.name,
    ).with_format(network.format, name=network.name)
    assert again == network and hash(again) == hash(network)
    if network.format is not None:
        # The same cores under the format's name but without the format are a different network.
        assert again.with_format(None, name=network.name) != network
    assert network.n_params == sum(math.prod(network.sizes[x] for x in labels) for labels in network.cores.values())
    assert network.dense_shape == (*network.expert_dims, network.in_features, network.out_features)
    assert network.n_experts == math.prod(network.expert_dims)


@given(named_networks())
def test_from_shapes_recovers_named_networks(network):
    again = ExpertNetwork.from_shapes(dict(network.cores), network.core_shapes)
    assert again.with_format(network.format) == network


def test_registry_lists_named_decompositions():
    assert {"cp", "tr", "tt", "tucker"} <= set(available())
    with pytest.raises(ValueError, match=r"unknown decomposition 'cpx'.*'cp'"):
        build("cpx", 4, 5, 6, 2)


@pytest.mark.parametrize("n_modes", [1, 2, 3, 4])
def test_named_structure(n_modes):
    dims = tuple(range(2, 2 + n_modes))
    c = cp(dims, 7, 9, 5)
    assert c.hyperedges == ("r",) and len(c.cores_with("r")) == n_modes + 2
    assert c.n_params == 5 * (sum(dims) + 7 + 9)
    ring = tr(dims, 7, 9, 11)
    ranks = [ring.sizes[b] for b in ring.bonds]
    assert ranks == [4] * (n_modes + 1) + [11]  # the paper's R1 = R2 = 4, the i–o bond gets R
    assert ring.core_of("i") == "G_i" and ring.cores["G_o"] == (f"r{n_modes + 2}", "o", "r1")
    train = tt(dims, 7, 9, [2] * (n_modes + 1))
    assert train.cores["G_n1"] == ("n1", "r1") and train.cores["G_o"] == (f"r{n_modes + 1}", "o")
    tk = tucker(dims, 7, 9, 3)
    assert tk.core_shape("core") == (3,) * (n_modes + 2)


def test_tr_expert_rank_option():
    ring = tr(8, 16, 32, 10, expert_rank=2)
    assert [ring.sizes[b] for b in ring.bonds] == [2, 2, 10]
    explicit = tr(8, 16, 32, (3, 5, 7))
    assert [explicit.sizes[b] for b in explicit.bonds] == [3, 5, 7]


@pytest.mark.parametrize(
    ("cores", "sizes", "error", "match"),
    [
        ({"A": "n1 a a", "B": "a i o"}, {"a": 2}, ValueError, r"core 'A' has label 'a' twice"),
        ({"A": "n1 a", "B": "a i"}, {"a": 2}, ValueError, r"no output leg 'o'"),
        ({"A": "a i o", "B": "a"}, {"a": 2}, ValueError, r"no expert leg 'n1'"),
        ({"A": "n1 n3 a", "B": "a i o"}, {"a": 2, "n3": 2}, ValueError, r"unknown expert leg\(s\) \['n3'\]"),
        (
            {"A": "n1 a b", "B": "a i o"},
            {"a": 2, "b": 2},
            ValueError,
            r"bond 'b' appears only in core 'A' \(dangling\)",
        ),
        ({"A": "n1 a", "B": "a i", "C": "o c", "D": "c"}, {"a": 2, "c": 2}, ValueError, r"disconnected.*\['C', 'D'\]"),
        ({"A": "n1 a", "B": "a i o"}, {"a": 0}, ValueError, r"size of label 'a' must be a positive int, got 0"),
        ({"A": "n1 a", "B": "a i o"}, {"a": 2.0}, TypeError, r"size of label 'a' must be a positive int, got 2.0"),
        ({"A": "n1 a", "B": "a i o"}, {}, ValueError, r"no size given for label\(s\) \['a'\]"),
        ({"A": "n1 a", "B": "a i o"}, {"a": 2, "z": 3}, ValueError, r"size given for unknown label\(s\) \['z'\]"),
        ({"A": "n1 a-b", "B": "a i o"}, {"a": 2}, ValueError, r"core 'A': label 'a-b' is not a valid name"),
        ({"A": "", "B": "n1 i o"}, {}, ValueError, r"core 'A' has no labels"),
        ({"1A": "n1 i o"}, {}, ValueError, r"core name '1A' is not a Python identifier"),
    ],
)
def test_invalid_networks_are_named_in_the_error(cores, sizes, error, match):
    with pytest.raises(error, match=match):
        net(cores, **sizes)


def test_bond_size_mismatch_from_shapes():
    with pytest.raises(ValueError, match=r"bond size mismatch: label 'a' has size 4 in core 'A' but 5 in core 'B'"):
        ExpertNetwork.from_shapes({"A": "n1 a", "B": "a i o"}, {"A": (3, 4), "B": (5, 4, 5)})
    with pytest.raises(ValueError, match=r"core 'B' has labels \('a', 'i', 'o'\) \(3 legs\) but a tensor of shape"):
        ExpertNetwork.from_shapes({"A": "n1 a", "B": "a i o"}, {"A": (3, 4), "B": (4, 4)})


@pytest.mark.parametrize("builder", [cp, tr, tt, tucker])
@pytest.mark.parametrize(
    ("rank", "error", "match"),
    [(0, ValueError, "got 0"), (-2, ValueError, "got -2"), (2.5, TypeError, "got 2.5"), ("3", TypeError, "'3'")],
)
def test_bad_ranks(builder, rank, error, match):
    with pytest.raises(error, match=match):
        builder(4, 5, 6, rank)


def test_wrong_number_of_ranks():
    with pytest.raises(ValueError, match=r"tr needs 4 ranks \(one per bond\), got 3"):
        tr((2, 3), 4, 5, (1, 2, 3))
    with pytest.raises(ValueError, match=r"tucker needs 3 ranks"):
        tucker(2, 4, 5, (1, 2))


def test_spec_errors():
    kwargs = dict(expert_dims=(3, 2), in_features=4, out_features=5, ranks=2)
    with pytest.raises(ValueError, match=r"no leg \['n2'\]"):
        ExpertNetwork.from_spec("n1 a, a i o", **kwargs)
    with pytest.raises(ValueError, match=r"names core 'A' twice"):
        ExpertNetwork.from_spec("A: n1 n2 a, A: a i o", **kwargs)
    with pytest.raises(ValueError, match=r"ranks given for label\(s\) \['q'\]"):
        ExpertNetwork.from_spec("n1 n2 a, a i o", **{**kwargs, "ranks": {"a": 2, "q": 3}})
    with pytest.raises(ValueError, match=r"empty core at position 1"):
        ExpertNetwork.from_spec("n1 n2 a,, a i o", **kwargs)
    with pytest.raises(TypeError, match=r"expert_dims\[1\] must be a positive int"):
        ExpertNetwork.from_spec("n1 n2 a, a i o", **{**kwargs, "expert_dims": (3, "2")})


@given(custom_networks())
def test_graph_has_one_node_per_core_and_is_connected(network):
    import networkx as nx

    graph = network.graph()
    assert set(graph.nodes) == set(network.cores)
    assert nx.is_connected(graph)


def test_a_network_with_one_wide_hyperedge_is_checked_in_linear_time():
    width = 3000  # a graph of every pair of its cores would have 4.5 million edges
    cores = {"A": "n1 i o h", **{f"C{k}": "h" for k in range(width)}}
    start = time.perf_counter()
    network = ExpertNetwork(cores, {"n1": 2, "i": 3, "o": 4, "h": 2})
    assert time.perf_counter() - start < 1.0
    assert network.bonds == ("h",)
    with pytest.raises(ValueError, match="the network is disconnected"):
        ExpertNetwork({**cores, "Z": "z", "Y": "z"}, {"n1": 2, "i": 3, "o": 4, "h": 2, "z": 2})
