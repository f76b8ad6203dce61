"""The search space of a design: network shapes over the legs, each with the bonds matching scales.

A [`Shape`][mumoe_tn.design.space.Shape] is a network *structure*: a builder of the network for
given leg sizes (one layer ``I → O``, or both layers of a block), the bonds parameter matching
scales, and the sizes of the bonds it keeps fixed. The space holds

- every registered format that joins the search (``Format.in_search``), with the structures it
  names ([`Format.search_structures`][mumoe_tn.decompositions.format.Format.search_structures]):
  CP, TR (expert ranks ``R1``/``R2`` over a few powers of two), TT, Tucker and MxD (a Hadamard
  factorisation: decoder ``D: i o`` and expert matrices ``C_ne: ne o``; over several expert
  modes, hierarchical MxD) as shipped, and a user's registered format alike;
- every factorization of the number of experts into 1 … ``max_modes`` expert modes;
- generated custom topologies with one core per leg: chains and rings in every leg order, stars
  (a hub core with no leg, or one leg's core as the hub) and trees (every labelled tree of the
  leg cores), with every bond scaled, or the bonds of expert cores fixed and the rest scaled;
  and each of them as a Hadamard network, its expert cores also holding the output leg
  (``⊙o``: every expert is a sum of shared matrices scaled column-wise,
  ``W_n = Σ_b V_b · diag(c_{n,b})`` over the bonds ``b`` joining the expert cores to the rest;
  MxD is the case without a bond) or the input leg (``⊙i``: ``Σ_b diag(c_{n,b}) · V_b``).

The design fixes the number of experts, so matching scales only bonds: the expert legs a format
would scale (MxD's) stay at the factorization's sizes. A shape with no bond at all is evaluated
at its fixed size (see [`evaluate`][mumoe_tn.design.structure_search.evaluate]).

Shapes that are the same network up to relabelling (core and bond names, expert modes of equal
size) are kept once (networkx isomorphism on a graph of cores, bonds and physical legs, where a
leg held by several cores is one node joined to each of them).
Everything here is torch-free.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import networkx as nx

from mumoe_tn.decompositions.registry import available, get_format
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork, expert_leg, physical_sizes
from mumoe_tn.validation import check_size

__all__ = [
    "DEFAULT_EXPERT_RANKS",
    "HADAMARD_LEGS",
    "TOPOLOGIES",
    "Shape",
    "expert_factorizations",
    "families",
    "named_shapes",
    "search_space",
    "searched_formats",
    "topology_shapes",
]

#: Sizes tried for the bonds a TR/TT keeps fixed (the paper's TR uses 4) and for the fixed expert
#: bonds of generated topologies.
DEFAULT_EXPERT_RANKS = (2, 4, 8, 16)

#: The generated topologies of a search space, after the registered formats.
TOPOLOGIES = ("chain", "ring", "star", "tree")


def searched_formats() -> tuple[str, ...]:
    """The registered formats the design search draws, in registration order."""
    return tuple(name for name in available() if get_format(name).in_search)


def families() -> tuple[str, ...]:
    """The families of a search space, in the order they are generated: the searched formats, then `TOPOLOGIES`."""
    return (*searched_formats(), *TOPOLOGIES)


#: Physical legs the expert cores of generated topologies also hold, one Hadamard variant each:
#: ``"o"`` (output side, ``Σ_b V_b · diag(c_{n,b})``), ``"i"`` (input side, ``Σ_b diag(c_{n,b}) · V_b``),
#: ``"io"`` (both).
HADAMARD_LEGS = ("o", "i")

#: A bond the matcher scales is marked with this size before matching.
SCALED = 1


@dataclass(frozen=True)
class Shape:
    """A network structure with the bonds matching scales.

    Attributes
    ----------
    family : str
        A registered format's name (``"cp"``, ``"tr"``, …, or a user's) or a generated topology
        (``"chain"``, ``"ring"``, ``"star"``, ``"tree"``).
    expert_dims : tuple of int
        ``N_1 … N_E``.
    label : str
        A short description for tables, e.g. ``"tr R1=4 R2=8"``, ``"chain n1-i-o"`` or
        ``"chain n1-i-o ⊙o"`` (the expert cores also hold the output leg).
    scaled : tuple of str
        The bonds parameter matching scales (all to one rank); empty for a network without a bond
        (MxD), which is evaluated at its fixed size.
    make : Callable[[int, int], ExpertNetwork]
        ``(i, o) -> network`` with the scaled bonds at size 1 (``i`` counts a folded bias).
    """

    family: str
    expert_dims: tuple[int, ...]
    label: str
    scaled: tuple[str, ...]
    make: Callable[[int, int], ExpertNetwork] = field(compare=False, repr=False)


def expert_factorizations(n_experts: int, max_modes: int) -> list[tuple[int, ...]]:
    """Every way to write ``n_experts`` as a product of 1 … ``max_modes`` factors ≥ 2.

    Each multiset of factors comes in descending and ascending order (the order matters for
    chains and rings; other orders are relabellings for CP and Tucker).

    Examples
    --------
    >>> expert_factorizations(8, 3)
    [(8,), (4, 2), (2, 4), (2, 2, 2)]
    """
    check_size("n_experts", n_experts)
    check_size("max_modes", max_modes)

    def multisets(rest: int, largest: int, modes: int) -> Iterator[tuple[int, ...]]:
        if rest == 1:
            yield ()
            return
        if modes == 0:
            return
        for factor in range(min(rest, largest), 1, -1):
            if rest % factor == 0:
                for tail in multisets(rest // factor, factor, modes - 1):
                    yield (factor, *tail)

    found: list[tuple[int, ...]] = [(1,)] if n_experts == 1 else []
    for factors in multisets(n_experts, n_experts, max_modes):
        for ordered in (factors, factors[::-1]):
            if ordered not in found:
                found.append(ordered)
    return found


def named_shapes(
    expert_dims: tuple[int, ...],
    expert_ranks: Sequence[int] = DEFAULT_EXPERT_RANKS,
    formats: Sequence[str] | None = None,
) -> list[Shape]:
    """The structures every searched format names over ``expert_dims`` (default: `searched_formats`).

    A structure the format cannot build over these expert dims (a format written for two expert
    modes, asked for one) is not part of the space: its builder's ``ValueError`` or ``TypeError``
    leaves it out, so a user's format joins the search wherever it fits.
    """
    shapes = []
    for name in searched_formats() if formats is None else formats:
        fmt = get_format(name)
        for description, rank in fmt.search_structures(tuple(expert_dims), expert_ranks):
            try:
                shapes.append(_named_shape(name, expert_dims, description, rank))
            except (ValueError, TypeError):
                continue
    return shapes


def _named_shape(name: str, dims: tuple[int, ...], description: str, rank: int | tuple[int, ...] | None) -> Shape:
    """A registered format at ``rank``, scaling the bonds the format itself matches.

    Expert legs the format would scale are left out: the design fixes the number of experts.
    """
    fmt = get_format(name)
    network = fmt.build(dims, 2, 2, rank)
    matched = tuple(label for label in fmt.matched_bonds(network) if label in network.bonds)
    return Shape(name, dims, description, matched, _format_maker(name, dims, rank))


def _format_maker(
    name: str, dims: tuple[int, ...], rank: int | tuple[int, ...] | None
) -> Callable[[int, int], ExpertNetwork]:
    def make(i: int, o: int) -> ExpertNetwork:
        return get_format(name).build(dims, i, o, rank)

    return make


def _legs(expert_dims: tuple[int, ...]) -> list[str]:
    return [*(expert_leg(m) for m in range(1, len(expert_dims) + 1)), INPUT_LEG, OUTPUT_LEG]


def _trees(nodes: Sequence[str]) -> Iterator[tuple[tuple[str, str], ...]]:
    """Every labelled tree on ``nodes`` (Prüfer sequences)."""
    if len(nodes) == 2:
        yield ((nodes[0], nodes[1]),)
        return
    for sequence in itertools.product(range(len(nodes)), repeat=len(nodes) - 2):
        tree = nx.from_prufer_sequence(list(sequence))
        yield tuple((nodes[a], nodes[b]) for a, b in tree.edges)


def _topologies(legs: list[str]) -> Iterator[tuple[str, str, tuple[tuple[str, str], ...]]]:
    """``(family, description, edges)``; nodes are legs (one core each) or ``"hub"``."""
    for order in itertools.permutations(legs):
        if order[0] < order[-1]:
            yield "chain", "-".join(order), tuple(itertools.pairwise(order))
    first, *rest = legs
    for order in itertools.permutations(rest):
        if len(order) < 2 or order[0] < order[-1]:
            ring = (first, *order)
            if len(ring) >= 3:
                yield "ring", "-".join(ring), tuple(zip(ring, (*ring[1:], ring[0]), strict=True))
    yield "star", "hub", tuple(("hub", leg) for leg in legs)
    for centre in legs:
        yield "star", f"hub {centre}", tuple((centre, leg) for leg in legs if leg != centre)
    for edges in _trees(legs):
        yield "tree", " ".join(f"{a}-{b}" for a, b in edges), edges


def check_hadamard(hadamard: Sequence[str]) -> tuple[str, ...]:
    """``hadamard`` as a tuple, or a ValueError naming the allowed values."""
    allowed = ("o", "i", "io")
    if isinstance(hadamard, str) or not isinstance(hadamard, Sequence) or any(h not in allowed for h in hadamard):
        raise ValueError(
            f"hadamard must be a sequence of {list(allowed)} (the physical legs the expert cores also hold), "
            f"got {hadamard!r}"
        )
    return tuple(dict.fromkeys(hadamard))


def topology_shapes(
    expert_dims: tuple[int, ...],
    expert_ranks: Sequence[int] = DEFAULT_EXPERT_RANKS,
    hadamard: Sequence[str] = HADAMARD_LEGS,
) -> list[Shape]:
    """Generated chains, rings, stars and trees with one core per leg (see the module docstring).

    Every bond is scaled; and for each size ``s`` of ``expert_ranks``, the bonds of the expert
    cores are fixed at ``s`` and the other bonds scaled (where some remain). Each of
    ``hadamard`` (``"o"``, ``"i"``, ``"io"``) adds every topology again with those physical legs
    also held by every expert core, a Hadamard (Khatri–Rao) factorisation along them.
    """
    legs = _legs(expert_dims)
    shapes = []
    for family, description, edges in _topologies(legs):
        bonds = {f"b{k}": edge for k, edge in enumerate(edges, start=1)}
        cores: dict[str, list[str]] = {}
        for node in (*legs, "hub"):
            owned = [bond for bond, edge in bonds.items() if node in edge]
            if owned:
                cores[f"C_{node}"] = ([node] if node != "hub" else []) + owned
        expert_bonds = tuple(b for b, edge in bonds.items() if any(end.startswith("n") for end in edge))
        policies: list[tuple[str, tuple[str, ...], int]] = [("", tuple(bonds), 1)]
        free = tuple(b for b in bonds if b not in expert_bonds)
        if free and expert_bonds:
            policies += [(f" Rn={s}", free, s) for s in expert_ranks]
        expert_cores = {f"C_{leg}" for leg in legs if leg not in (INPUT_LEG, OUTPUT_LEG)}
        for shared in ("", *check_hadamard(hadamard)):
            extra = [leg for leg in (INPUT_LEG, OUTPUT_LEG) if leg in shared]
            held = {core: labels + extra if core in expert_cores else labels for core, labels in cores.items()}
            mark = f" ⊙{shared}" if shared else ""
            for suffix, scaled, fixed in policies:
                sizes = {b: (SCALED if b in scaled else fixed) for b in bonds}
                label = f"{family} {description}{suffix}{mark}"
                shapes.append(Shape(family, expert_dims, label, scaled, _maker(held, sizes, expert_dims)))
    return shapes


def _maker(
    cores: dict[str, list[str]], bond_sizes: dict[str, int], dims: tuple[int, ...]
) -> Callable[[int, int], ExpertNetwork]:
    def make(i: int, o: int) -> ExpertNetwork:
        return ExpertNetwork(cores, {**physical_sizes(dims, i, o), **bond_sizes})

    return make


def signature_graph(network: ExpertNetwork, scaled: Iterable[str] = ()) -> nx.Graph:
    """A graph of ``network`` for isomorphism tests: cores, bonds and physical legs as nodes.

    Every label is one node joined to each core that holds it, so a physical leg shared by
    several cores (a Hadamard factorisation) is a hyperedge of the graph. A bond's attribute is
    its size, or ``"scaled"``; a physical leg's is its name (``i``, ``o``), an expert leg's its
    size only, so expert modes of equal size are interchangeable.
    """
    scaled = set(scaled)
    graph = nx.Graph()
    experts = set(network.expert_legs)
    for core, labels in network.cores.items():
        _node(graph, ("core", core), ("core",))
        for label in labels:
            if label in network.bonds:
                kind: tuple[object, ...] = ("bond", "scaled" if label in scaled else network.sizes[label])
            elif label in experts:
                kind = ("leg", "n", network.sizes[label])
            else:
                kind = ("leg", label)
            _node(graph, ("label", label), kind)
            graph.add_edge(("core", core), ("label", label))
    return graph


def _node(graph: nx.Graph, node: tuple[str, str], kind: tuple[object, ...]) -> None:
    graph.add_node(node, kind=kind, text=repr(kind))


def _same(a: nx.Graph, b: nx.Graph) -> bool:
    return nx.is_isomorphic(a, b, node_match=lambda x, y: x["kind"] == y["kind"])


def deduplicate(shapes: Iterable[Shape], width: int = 7, out: int = 5) -> list[Shape]:
    """``shapes`` without the ones equal to an earlier one up to relabelling (the first is kept).

    Compared on the networks at legs ``i = width``, ``o = out`` with the scaled bonds marked, so
    two shapes are equal exactly when they build the same network for every rank.
    """
    kept: list[Shape] = []
    buckets: dict[str, list[nx.Graph]] = {}
    for shape in shapes:
        graph = signature_graph(shape.make(width, out), shape.scaled)
        key = nx.weisfeiler_lehman_graph_hash(graph, node_attr="text")
        bucket = buckets.setdefault(key, [])
        if any(_same(graph, other) for other in bucket):
            continue
        bucket.append(graph)
        kept.append(shape)
    return kept


def search_space(
    n_experts: int | Sequence[int],
    *,
    max_modes: int = 3,
    families: Sequence[str] | None = None,
    expert_ranks: Sequence[int] = DEFAULT_EXPERT_RANKS,
    topology_modes: int = 2,
    hadamard: Sequence[str] = HADAMARD_LEGS,
) -> list[Shape]:
    """Every shape of the search, deduplicated.

    Parameters
    ----------
    n_experts : int or Sequence[int]
        The total number of experts, factored into 1 … ``max_modes`` modes, or fixed expert dims.
    max_modes : int, optional
        Most expert modes of a factorization (default 3).
    families : Sequence[str], optional
        Which of [`families`][mumoe_tn.design.space.families] to generate (default all: every
        searched registered format and every topology).
    expert_ranks : Sequence[int], optional
        Sizes tried for the fixed bonds (TR's ``R1``/``R2``, TT's and the topologies' expert bonds).
    topology_modes : int, optional
        Generated topologies only for factorizations with at most this many modes (default 2:
        their number grows factorially with the legs).
    hadamard : Sequence[str], optional
        Hadamard variants of the generated topologies: the physical legs their expert cores also
        hold (default ``("o", "i")``; ``()`` for none).

    Returns
    -------
    list of Shape
    """
    known = (*searched_formats(), *TOPOLOGIES)
    chosen = known if families is None else tuple(families)
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        raise ValueError(f"families must be a non-empty selection of {list(known)}, got {list(chosen)}")
    for size in expert_ranks:
        check_size("expert_ranks", size)
    hadamard = check_hadamard(hadamard)
    if isinstance(n_experts, int):
        factorizations = expert_factorizations(n_experts, max_modes)
    else:
        factorizations = [tuple(check_size("expert_dims", n) for n in n_experts)]
    shapes = []
    for dims in factorizations:
        shapes += named_shapes(dims, expert_ranks, [name for name in searched_formats() if name in chosen])
        if len(dims) <= topology_modes:
            shapes += [s for s in topology_shapes(dims, expert_ranks, hadamard) if s.family in chosen]
    return deduplicate(shapes)
