"""Expert-matrix rank bounds from the network's graph: a minimum cut (torch-free).

Fixing every expert index slices the expert legs away; what remains maps leg ``i`` to leg
``o`` through the bonds, and any set of bonds whose removal separates ``i`` from ``o`` bounds
the expert matrix's rank by the product of their sizes. The best such bound is a minimum cut
with capacities ``log(size)``: computed with networkx's max-flow on a graph where each core is a
node, each bond an arc pair (a hyperedge becomes a node pair joined by one arc of its weight),
and a source and sink attach to the cores holding ``i`` and ``o`` through arcs of capacity
``log I`` and ``log O``. A physical leg held by several cores (a Hadamard factorisation such as
the Mixture of Decoders' ``D: i o, C: n1 o``) is a hyperedge that the source or sink joins as one
more place: cutting it costs its log size, which gives ``min(I, O)`` for that network. This
reproduces the paper's CP ``min{I, O, R}``, TR ``min{R3·min{R1, R2}, I, O}`` and Tucker
``min{I, R_I, R_O, O}``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx

from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork

__all__ = ["collapsed_expert_modes", "min_cut", "rank_bound"]

_SOURCE, _SINK = ("__source__",), ("__sink__",)


def _check_network(network: object, what: str) -> ExpertNetwork:
    if not isinstance(network, ExpertNetwork):
        raise TypeError(
            f"{what} needs an ExpertNetwork, got {network!r} ({type(network).__name__}); build one with "
            "mumoe_tn.decompositions.build(name, expert_dims, in_features, out_features, rank) "
            "or ExpertNetwork.from_spec"
        )
    return network


def min_cut(
    network: ExpertNetwork, sources: Sequence[str] = (INPUT_LEG,), sinks: Sequence[str] = (OUTPUT_LEG,)
) -> tuple[tuple[str, ...], int]:
    """The labels of a minimum cut between two sets of physical legs, and the product of their sizes.

    Expert legs in neither set are fixed (sliced away). With the defaults (``i`` against ``o``)
    the product bounds the rank of every expert matrix.

    Parameters
    ----------
    network : ExpertNetwork
        The expert network.
    sources, sinks : Sequence[str]
        Disjoint sets of physical legs (default ``("i",)`` and ``("o",)``).

    Returns
    -------
    labels : tuple of str
        Cut labels: bonds, or physical legs when cutting a leg is best.
    bound : int
        The product of their sizes: an upper bound on the rank of ``W`` unfolded as
        ``sources × sinks`` (for every fixed index of the other expert legs).
    """
    network = _check_network(network, "min_cut")
    sources, sinks = tuple(sources), tuple(sinks)
    physical = {*network.expert_legs, INPUT_LEG, OUTPUT_LEG}
    for leg in (*sources, *sinks):
        if leg not in physical:
            raise ValueError(f"{leg!r} is not a physical leg of the network; its physical legs are {sorted(physical)}")
    if not sources or not sinks or set(sources) & set(sinks):
        raise ValueError(f"sources {sources} and sinks {sinks} must be non-empty and disjoint")
    graph = nx.DiGraph()
    arcs: dict[tuple, list[str]] = {}

    def add(u: object, v: object, label: str | None) -> None:
        capacity = math.inf if label is None else math.log(network.sizes[label])
        if graph.has_edge(u, v):
            graph[u][v]["capacity"] += capacity
        else:
            graph.add_edge(u, v, capacity=capacity)
        if label is not None:
            arcs.setdefault((u, v), []).append(label)

    # Every label that joins more than two places (cores, the source, the sink) is a hyperedge:
    # a node pair joined by one arc of its weight. A source or sink leg held by one core is a
    # plain arc; one held by several cores (a Hadamard factorisation) is a hyperedge that the
    # source or sink joins as one more place.
    ends = {**dict.fromkeys(sources, _SOURCE), **dict.fromkeys(sinks, _SINK)}

    def link(u: object, v: object, label: str | None) -> None:
        if v != _SOURCE and u != _SINK:
            add(u, v, label)

    for label in (*ends, *network.bonds):
        places = [("core", core) for core in network.cores_with(label)]
        if label in ends:
            places.append(ends[label])
        if len(places) == 2:
            link(*places, label)
            link(*reversed(places), label)
            continue
        inner, outer = ("in", label), ("out", label)
        add(inner, outer, label)
        for place in places:
            link(place, inner, None)
            link(outer, place, None)
    _, (reachable, _) = nx.minimum_cut(graph, _SOURCE, _SINK)
    crossing: list[str] = []
    for u, v in graph.edges:
        if u in reachable and v not in reachable:
            crossing += arcs.get((u, v), [])
    labels = tuple(dict.fromkeys(crossing))
    return labels, math.prod(network.sizes[label] for label in labels)


def rank_bound(network: ExpertNetwork) -> int:
    """Upper bound on the rank of every expert matrix of ``network`` (its minimum ``i``–``o`` cut)."""
    return min_cut(_check_network(network, "rank_bound"))[1]


def collapsed_expert_modes(network: ExpertNetwork) -> tuple[str, ...]:
    """Expert legs along which experts differ only by a scalar factor (a cut of size 1 to ``i, o``).

    If leg ``n_e`` can be separated from ``i`` and ``o`` by bonds of total size 1, every expert
    along mode ``e`` (the other modes fixed) is a multiple of one matrix: the mode adds scale,
    not experts. Parameter matching warns about such solutions.

    Parameters
    ----------
    network : ExpertNetwork
        The expert network.

    Returns
    -------
    tuple of str
        The collapsed expert legs (empty when every mode carries distinct experts).
    """
    network = _check_network(network, "collapsed_expert_modes")
    return tuple(
        leg
        for leg in network.expert_legs
        if network.sizes[leg] > 1 and min_cut(network, (leg,), (INPUT_LEG, OUTPUT_LEG))[1] == 1
    )
