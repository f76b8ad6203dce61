"""Expert-matrix rank bounds from the network's graph: a minimum cut (torch-free).

Fixing every expert index slices the expert legs away; what remains maps leg ``i`` to leg
``o`` through the bonds, and any set of bonds whose removal separates ``i`` from ``o`` bounds
the expert matrix's rank by the product of their sizes. The best such bound is a minimum cut
with capacities ``log(size)``: computed with networkx's max-flow on a graph where each core is a
node, each bond an arc pair (a hyperedge becomes a node pair joined by one arc of its weight),
and a source and sink attach to the cores holding ``i`` and ``o`` through arcs of capacity
``log I`` and ``log O``. This reproduces the paper's CP ``min{I, O, R}``, TR
``min{R3·min{R1, R2}, I, O}`` and Tucker ``min{I, R_I, R_O, O}``.
"""

from __future__ import annotations

import math

import networkx as nx

from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork

__all__ = ["min_cut", "rank_bound"]

_SOURCE, _SINK = ("__source__",), ("__sink__",)


def min_cut(network: ExpertNetwork) -> tuple[tuple[str, ...], int]:
    """The labels of a minimum cut between legs ``i`` and ``o``, and the product of their sizes.

    Parameters
    ----------
    network : ExpertNetwork
        The expert network.

    Returns
    -------
    labels : tuple of str
        Cut labels: bonds, or the physical legs ``"i"``/``"o"`` when cutting a leg is best.
    bound : int
        The product of their sizes: an upper bound on every expert matrix's rank.
    """
    graph = nx.DiGraph()
    arcs: dict[tuple, str] = {}

    def add(u: object, v: object, label: str | None) -> None:
        capacity = math.inf if label is None else math.log(network.sizes[label])
        if graph.has_edge(u, v):
            graph[u][v]["capacity"] += capacity
        else:
            graph.add_edge(u, v, capacity=capacity)
        if label is not None:
            arcs.setdefault((u, v), label)

    add(_SOURCE, ("core", network.core_of(INPUT_LEG)), INPUT_LEG)
    add(("core", network.core_of(OUTPUT_LEG)), _SINK, OUTPUT_LEG)
    for bond in network.bonds:
        owners = network.cores_with(bond)
        if len(owners) == 2:
            first, second = (("core", c) for c in owners)
            add(first, second, bond)
            add(second, first, bond)
        else:
            inner, outer = ("in", bond), ("out", bond)
            add(inner, outer, bond)
            for core in owners:
                add(("core", core), inner, None)
                add(outer, ("core", core), None)
    _, (reachable, _) = nx.minimum_cut(graph, _SOURCE, _SINK)
    # Parallel bonds share one arc: recover every label crossing the cut.
    crossing: list[str] = []
    for u, v in graph.edges:
        if u in reachable and v not in reachable and (u, v) in arcs:
            crossing += _labels_between(network, u, v)
    labels = tuple(dict.fromkeys(crossing))
    return labels, math.prod(network.sizes[label] for label in labels)


def _labels_between(network: ExpertNetwork, u: tuple, v: tuple) -> list[str]:
    if u == _SOURCE:
        return [INPUT_LEG]
    if v == _SINK:
        return [OUTPUT_LEG]
    if u[0] == "in":
        return [u[1]]
    first, second = set(network.cores[u[1]]), set(network.cores[v[1]])
    return [bond for bond in network.bonds if bond in first and bond in second and len(network.cores_with(bond)) == 2]


def rank_bound(network: ExpertNetwork) -> int:
    """Upper bound on the rank of every expert matrix of ``network`` (its minimum cut)."""
    return min_cut(network)[1]
