"""Hypothesis strategies drawing registered formats and arbitrary valid custom networks.

- :func:`named_networks` draws every format mumoe_tn registers, by introspection
  (:func:`mumoe_tn.decompositions.available`); the number of ranks a format takes is read from
  the format itself (``fmt.ranks_of(fmt.build(dims, I, O, 1))``), so a newly registered format
  is drawn with no edit here.
- :func:`custom_networks` draws random cores with physical legs placed anywhere, a random
  spanning tree of bonds, optional parallel bonds (two or more bonds joining the same pair of
  cores) and optional hyperedges (one bond shared by three or more cores).
- :func:`binding_networks` draws custom networks whose rank bound binds: ``i`` and ``o`` sit on
  different cores and the bonds are smaller than ``I`` and ``O``, so the min cut is below
  ``min(I, O)``.
- :func:`tree_networks` draws custom networks whose bond graph is a tree (no parallel bonds, no
  hyperedges): there the min-cut bound is attained by generic cores.
- :func:`any_network` is mostly custom networks (three draws in four).
"""

from hypothesis import reject
from hypothesis import strategies as st

from mumoe_tn import ExpertNetwork
from mumoe_tn.decompositions import available, get_format


def shipped_formats():
    """Every format registered by mumoe_tn itself (not the temporary ones tests register)."""
    return tuple(name for name in available() if type(get_format(name)).__module__.startswith("mumoe_tn."))


def ranked_formats():
    """The shipped formats whose networks have bonds (parameter matching scales ranks)."""
    return tuple(name for name in shipped_formats() if rank_count(name, (2,), 2, 2))


def rank_of(name, rank):
    """``rank`` for a format with bonds, ``()`` for one without (MxD: sized by its legs alone)."""
    return rank if rank_count(name, (2,), 2, 2) else ()


def rank_count(name, dims, in_features, out_features):
    """How many ranks format ``name`` takes for these sizes (asked of the format, not a table)."""
    fmt = get_format(name)
    return len(fmt.ranks_of(fmt.build(dims, in_features, out_features, 1)))


@st.composite
def named_networks(draw, names=None, max_modes=4, max_size=4, max_rank=3):
    """A registered format with E = 1..max_modes expert modes and small sizes.

    ``names`` defaults to every format mumoe_tn registers (read from the registry at draw
    time); sizes a format rejects are not drawn.
    """
    name = draw(st.sampled_from(tuple(names) if names is not None else shipped_formats()))
    n_modes = draw(st.integers(1, max_modes))
    dims = tuple(draw(st.lists(st.integers(1, max_size), min_size=n_modes, max_size=n_modes)))
    in_features = draw(st.integers(1, max_size + 1))
    out_features = draw(st.integers(1, max_size + 1))
    try:
        count = rank_count(name, dims, in_features, out_features)
    except (TypeError, ValueError):
        reject()
    ranks = draw(st.lists(st.integers(1, max_rank), min_size=count, max_size=count))
    return get_format(name).build(dims, in_features, out_features, ranks)


@st.composite
def custom_networks(
    draw,
    max_modes=4,
    max_cores=4,
    max_size=3,
    *,
    min_cores=1,
    physical_sizes=None,
    io_sizes=None,
    bond_sizes=None,
    max_extra=2,
    parallel=True,
    hyperedges=True,
    split_io=False,
    shared=True,
    min_shared=0,
):
    """A random valid network: random cores, physical legs anywhere, a random spanning tree of
    bonds (connected), plus (when allowed) parallel bonds and hyperedges.

    Parameters
    ----------
    physical_sizes, io_sizes, bond_sizes : strategy, optional
        Sizes of expert legs, of ``i`` and ``o`` (default: as expert legs) and of bonds
        (default ``integers(1, max_size)``).
    max_extra : int
        At most this many parallel bonds, and this many hyperedges.
    parallel, hyperedges : bool
        Allow extra bonds between two cores already joined / among three or more cores.
    split_io : bool
        Put ``i`` and ``o`` on different cores (needs ``min_cores >= 2``).
    shared : bool
        Allow physical legs held by several cores (Hadamard factorisations).
    min_shared : int
        At least this many physical legs are shared (needs ``min_cores >= 2``); a core joined to
        the others by a shared leg needs no bond.
    """
    if physical_sizes is None:
        physical_sizes = st.integers(1, max_size)
    if io_sizes is None:
        io_sizes = physical_sizes
    if bond_sizes is None:
        bond_sizes = st.integers(1, max_size)
    n_cores = draw(st.integers(min_cores, max_cores))
    n_modes = draw(st.integers(1, max_modes))
    cores = [[] for _ in range(n_cores)]
    sizes = {}
    for leg in [f"n{m}" for m in range(1, n_modes + 1)]:
        cores[draw(st.integers(0, n_cores - 1))].append(leg)
        sizes[leg] = draw(physical_sizes)
    where_i = draw(st.integers(0, n_cores - 1))
    others = [k for k in range(n_cores) if k != where_i] if split_io else list(range(n_cores))
    where_o = draw(st.sampled_from(others))
    cores[where_i].append("i")
    cores[where_o].append("o")
    sizes["i"], sizes["o"] = draw(io_sizes), draw(io_sizes)
    n_shared = 0
    if shared and n_cores >= 2:
        legs = [*(f"n{m}" for m in range(1, n_modes + 1)), "i", "o"]
        chosen = draw(st.sets(st.sampled_from(legs), min_size=min(min_shared, len(legs)), max_size=len(legs)))
        for leg in sorted(chosen):
            holders = [k for k in range(n_cores) if leg in cores[k]]
            free = [k for k in range(n_cores) if k not in holders]
            extra = draw(st.sets(st.sampled_from(free), min_size=1, max_size=len(free)))
            for k in sorted(extra):
                cores[k].append(leg)
        n_shared = len(chosen)
    bond = 0
    edges = []
    for k in range(1, n_cores):  # random spanning tree; an edge may be left out where a shared leg joins
        parent = draw(st.integers(0, k - 1))
        edges.append((parent, k))
        if n_shared and set(cores[k]) & set(cores[parent]) and draw(st.booleans()):
            continue
        label = f"b{bond}"
        bond += 1
        cores[k].append(label)
        cores[parent].append(label)
        sizes[label] = draw(bond_sizes)
    if parallel and edges:
        for _ in range(draw(st.integers(0, max_extra))):  # a second bond along a tree edge
            first, second = draw(st.sampled_from(edges))
            label = f"b{bond}"
            bond += 1
            cores[first].append(label)
            cores[second].append(label)
            sizes[label] = draw(bond_sizes)
    if hyperedges and n_cores >= 3:
        for _ in range(draw(st.integers(0, max_extra))):
            members = draw(st.sets(st.integers(0, n_cores - 1), min_size=3, max_size=n_cores))
            label = f"b{bond}"
            bond += 1
            for k in members:
                cores[k].append(label)
            sizes[label] = draw(bond_sizes)
    order = draw(st.permutations(range(n_cores)))
    spec = {f"c{k}": tuple(draw(st.permutations(cores[k]))) for k in order}
    try:
        return ExpertNetwork(spec, sizes, name="custom")
    except ValueError:
        reject()  # a left-out tree edge disconnected the network


def binding_networks(max_modes=3, max_cores=4):
    """Custom networks with ``i`` and ``o`` on different cores, ``I, O ∈ [28, 32]`` and bonds of
    size 1..3 (at most one parallel bond and one hyperedge): cutting the tree bond next to ``o``
    costs at most 3³ = 27, so the min cut is below ``min(I, O)``."""
    return custom_networks(
        max_modes=max_modes,
        max_cores=max_cores,
        min_cores=2,
        physical_sizes=st.integers(1, 4),
        io_sizes=st.integers(28, 32),
        bond_sizes=st.integers(1, 3),
        max_extra=1,
        split_io=True,
        shared=False,
    )


def tree_networks(max_modes=3, max_cores=4, max_size=4):
    """Custom networks whose bonds form a tree (no parallel bonds, no hyperedges)."""
    return custom_networks(
        max_modes=max_modes,
        max_cores=max_cores,
        physical_sizes=st.integers(1, max_size + 2),
        bond_sizes=st.integers(1, max_size),
        parallel=False,
        hyperedges=False,
        shared=False,
    )


def hadamard_networks(max_modes=3, max_cores=4, max_size=3):
    """Custom networks with at least one physical leg held by two or more cores."""
    return custom_networks(max_modes=max_modes, max_cores=max_cores, max_size=max_size, min_cores=2, min_shared=1)


def any_network(max_modes=4):
    """Mostly custom networks: registered formats one draw in four."""
    return st.one_of(
        named_networks(max_modes=max_modes),
        custom_networks(max_modes=max_modes),
        binding_networks(max_modes=min(max_modes, 3)),
        custom_networks(max_modes=max_modes, min_cores=3, max_cores=5),
        hadamard_networks(max_modes=min(max_modes, 3)),
    )
