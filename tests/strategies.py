"""Hypothesis strategies drawing named decompositions and arbitrary valid custom networks."""

from hypothesis import strategies as st

from mumoe_tn import ExpertNetwork
from mumoe_tn.decompositions import build

NAMED = ("cp", "tr", "tt", "tucker")


@st.composite
def named_networks(draw, names=NAMED, max_modes=4, max_size=4, max_rank=3):
    """A named decomposition with E = 1..max_modes expert modes and small sizes."""
    name = draw(st.sampled_from(names))
    n_modes = draw(st.integers(1, max_modes))
    dims = draw(st.lists(st.integers(1, max_size), min_size=n_modes, max_size=n_modes))
    in_features = draw(st.integers(1, max_size + 1))
    out_features = draw(st.integers(1, max_size + 1))
    n_ranks = {"cp": 1, "tr": n_modes + 2, "tt": n_modes + 1, "tucker": n_modes + 2}[name]
    ranks = draw(st.lists(st.integers(1, max_rank), min_size=n_ranks, max_size=n_ranks))
    return build(name, dims, in_features, out_features, ranks)


@st.composite
def custom_networks(draw, max_modes=4, max_cores=4, max_size=3):
    """A random valid network: random cores, physical legs placed anywhere, a random spanning
    tree of bonds (connected) plus random extra bonds and hyperedges."""
    n_cores = draw(st.integers(1, max_cores))
    n_modes = draw(st.integers(1, max_modes))
    cores = [[] for _ in range(n_cores)]
    sizes = {}
    legs = [f"n{m}" for m in range(1, n_modes + 1)] + ["i", "o"]
    for leg in legs:
        cores[draw(st.integers(0, n_cores - 1))].append(leg)
        sizes[leg] = draw(st.integers(1, max_size))
    bond = 0
    for k in range(1, n_cores):  # random spanning tree
        parent = draw(st.integers(0, k - 1))
        label = f"b{bond}"
        bond += 1
        cores[k].append(label)
        cores[parent].append(label)
        sizes[label] = draw(st.integers(1, max_size))
    if n_cores >= 2:
        for _ in range(draw(st.integers(0, 2))):  # extra bonds, possibly hyperedges
            members = draw(st.sets(st.integers(0, n_cores - 1), min_size=2, max_size=n_cores))
            label = f"b{bond}"
            bond += 1
            for k in members:
                cores[k].append(label)
            sizes[label] = draw(st.integers(1, max_size))
    order = draw(st.permutations(range(n_cores)))
    spec = {}
    for k in order:  # every core has a leg: core 0 is every other core's ancestor
        spec[f"c{k}"] = tuple(draw(st.permutations(cores[k])))
    return ExpertNetwork(spec, sizes, name="custom")


def any_network(max_modes=4):
    return st.one_of(named_networks(max_modes=max_modes), custom_networks(max_modes=max_modes))
