"""Parameter matching: the bond sizes whose parameter count is closest to a target (torch-free).

Notes
-----
Every count here is a polynomial in the bond sizes with non-negative coefficients, so it is
non-decreasing in each. [`solve_bonds`][mumoe_tn.costs.matching.solve_bonds] first finds, by
bisection, the largest rank ``r`` with ``count ≤ target`` when every scaled bond has size ``r``;
then it raises the scaled bonds to ``r + 1`` one at a time (the bonds of the cores holding ``i``
and ``o`` first, since they bound the experts' rank: Tucker's factor ranks before the core's
expert ranks), and the closest count along that chain wins; **a tie goes to fewer parameters**.
With one scaled bond this is the closest single rank; with several, a chain step is a fraction of
one uniform rank step (Tucker with four expert modes of 16 matched to ``nn.Linear(768, 3072)``:
+1.4 % instead of −21 %). A target below ``count(1)`` is an error. With ``rank_multiple=m`` the
sizes are ``m, 2m, …`` only: matrix-multiply kernels run markedly faster when the inner
dimensions are multiples of the SIMD width or tensor-core tile (e.g. 16), at the price of a
coarser match. CP scales its rank ``R``; TR and TT scale the bond between the input and output
cores (``R_{E+2}``, resp. ``R_{E+1}``) and keep the others (the paper's ``R1 = R2 = 4``); Tucker
and custom networks scale the bonds the caller names. A format's `matched_bonds` chooses the
default; a network without a format scales every bond.

No match leaves an expert mode collapsed (its experts differing only by a scalar factor, because
a cut of size 1 separates the mode from ``i`` and ``o``; see
[`mumoe_tn.costs.rank.collapsed_expert_modes`][mumoe_tn.costs.rank.collapsed_expert_modes]): a bond
that is not scaled, of size 1, on such a cut is raised to [`LIFTED_BOND`][mumoe_tn.costs.matching]
first ([`Match.lifted`][mumoe_tn.costs.matching.Match] lists them), candidates at which a mode still
collapses are skipped, and a match that cannot avoid it is refused with a ``ValueError``. When the
closest count misses the target by more than [`TOLERANCE`][mumoe_tn.costs.matching] (the steps too
coarse, or the fixed part alone too large), a [`MatchingWarning`][mumoe_tn.costs.matching.MatchingWarning]
says so with the numbers, and [`Match.problems`][mumoe_tn.costs.matching.Match] lists it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mumoe_tn.costs.params import block_parameters, layer_parameters
from mumoe_tn.costs.rank import collapsed_expert_modes, min_cut, rank_bound
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork
from mumoe_tn.validation import check_size

__all__ = [
    "LIFTED_BOND",
    "MAX_FRACTION",
    "TOLERANCE",
    "Match",
    "MatchingWarning",
    "bond_cap",
    "match_block",
    "match_exact",
    "match_layer",
    "resolve_target",
    "scaled_bonds",
    "solve_bonds",
    "solve_rank",
    "upcycle_capacity",
]

_MAX_RANK = 1 << 40

#: The size a bond that is not scaled gets when it is of size 1 and would collapse an expert mode.
LIFTED_BOND = 4

#: Relative distance to the target above which a match is reported as missed.
TOLERANCE = 0.05

#: The largest fraction ``match=`` takes: a float far above 1 is a budget written as a float.
MAX_FRACTION = 10.0


class MatchingWarning(UserWarning):
    """A parameter match that misses its target or leaves experts that differ only by scale."""


def resolve_target(match: object, reference: int) -> int:
    """The parameter budget a ``match=`` value asks for.

    Parameters
    ----------
    match : int or float
        An int is a number of parameters; a float is a fraction of ``reference`` (as
        tensorly-torch's ``rank=0.5``).
    reference : int
        Parameters of what the μMoE replaces.

    Returns
    -------
    int
    """
    if isinstance(match, bool) or not isinstance(match, (int, float)):
        raise TypeError(f"match must be a number of parameters (int) or a fraction (float), got {match!r}")
    if isinstance(match, float):
        if not math.isfinite(match) or match <= 0:
            raise ValueError(f"a fractional match must be a finite number > 0, got {match!r}")
        if match > MAX_FRACTION:
            budget = f"{int(match):,}" if match.is_integer() else f"{match:g}"
            raise ValueError(
                f"match={match!r} is a fraction of the replaced layer's {reference:,} parameters, {match:g}× of it: "
                f"fractions above {MAX_FRACTION:g} are refused; for a budget of {budget} parameters pass an int"
            )
        return max(1, round(match * reference))
    if match <= 0:
        raise ValueError(f"match must be a positive number of parameters, got {match}")
    return match


def solve_rank(count: Callable[[int], int], target: int, *, what: str = "the layer", multiple: int = 1) -> int:
    """The rank ``r`` (a positive multiple of ``multiple``) whose ``count(r)`` is closest to ``target``.

    Ties go to the smaller ``r``.

    Parameters
    ----------
    count : Callable[[int], int]
        Parameters as a function of the rank; non-decreasing.
    target : int
        Parameter budget.
    what : str, optional
        Named in error messages.
    multiple : int, optional
        Consider only ranks that are multiples of this (default 1: every rank).

    Returns
    -------
    int
    """
    multiple = check_size("rank_multiple", multiple)
    if isinstance(target, bool) or not isinstance(target, int):
        raise TypeError(f"the parameter target must be a positive int, got {target!r} ({type(target).__name__})")
    if target <= 0:
        raise ValueError(f"the parameter target must be a positive int, got {target!r}")
    low = _floor_rank(count, target, what, multiple)
    closer = low if target - count(low) <= count(low + multiple) - target else low + multiple
    return closer


def _floor_rank(count: Callable[[int], int], target: int, what: str, multiple: int) -> int:
    """The largest multiple ``r`` of ``multiple`` with ``count(r) ≤ target`` (bisection)."""
    smallest = count(multiple)
    if target < smallest:
        raise ValueError(
            f"target of {target:,} parameters is below the smallest possible count for {what}: "
            f"{smallest:,} at rank {multiple}"
        )
    low, high = 1, 2  # in units of `multiple`
    while count(multiple * high) <= target:
        low, high = high, high * 2
        if multiple * high > _MAX_RANK:
            raise ValueError(f"no rank up to {_MAX_RANK:,} reaches {target:,} parameters for {what}")
    while high - low > 1:  # invariant: count(multiple * low) <= target < count(multiple * high)
        middle = (low + high) // 2
        if count(multiple * middle) <= target:
            low = middle
        else:
            high = middle
    return multiple * low


def scaled_bonds(network: ExpertNetwork, bonds: Sequence[str] | None = None) -> tuple[str, ...]:
    """The labels parameter matching scales: ``bonds`` if given, else the format's default.

    Without a format every bond is scaled; a network without bonds (a Hadamard factorisation
    such as ``D: i o, C: n1 o``) has its size set by its legs alone, and then its expert legs
    are scaled: matching chooses the number of experts. Expert legs may also be named in
    ``bonds`` for any network.
    """
    if not isinstance(network, ExpertNetwork):
        raise TypeError(f"parameter matching needs an ExpertNetwork, got {network!r} ({type(network).__name__})")
    if bonds is None:
        if network.format is not None:
            return network.format.matched_bonds(network)
        return network.bonds or network.expert_legs
    if isinstance(bonds, str) or not isinstance(bonds, Sequence):
        raise TypeError(f"bonds must be a sequence of bond labels, got {bonds!r}")
    bonds = tuple(bonds)
    scalable = (*network.bonds, *network.expert_legs)
    unknown = [bond for bond in bonds if bond not in scalable]
    if not bonds or unknown:
        raise ValueError(
            f"labels to scale must be bonds {network.bonds} or expert legs {network.expert_legs} of the network, "
            f"got {bonds}"
        )
    return bonds


def solve_bonds(
    count: Callable[[Mapping[str, int]], int],
    bonds: Sequence[str],
    target: int,
    *,
    what: str = "the layer",
    multiple: int = 1,
    first: Sequence[str] = (),
    acceptable: Callable[[Mapping[str, int]], bool] | None = None,
) -> tuple[dict[str, int], int]:
    """Per-bond sizes whose ``count`` is closest to ``target``, and the resolution of the match.

    One rank ``r`` for every bond first: the largest with ``count ≤ target`` (a multiple of
    ``multiple``). Then the bonds are raised to ``r + multiple`` one at a time — the bonds in
    ``first`` before the others, and among those the bond that adds the fewest parameters first —
    up to every bond at ``r + multiple``: the closest count along that chain wins (a tie goes to
    fewer parameters). With one bond this is the closest single rank; with several (Tucker's
    factor ranks and core) the chain steps are a fraction of one uniform rank step. Where the
    closest still misses ``target`` by more than `TOLERANCE`, each candidate is also tried with one
    bond not in ``first`` a step lower (finer steps: ``(r + 1)(r − 1) / r²`` of the count where
    the bonds multiply).

    Parameters
    ----------
    count : Callable[[Mapping[str, int]], int]
        Parameters for given sizes of ``bonds``; non-decreasing in each.
    bonds : Sequence[str]
        The bonds to size.
    target : int
        Parameter budget.
    what : str, optional
        Named in error messages.
    multiple : int, optional
        Give every bond a multiple of this.
    acceptable : Callable[[Mapping[str, int]], bool], optional
        Candidates it rejects are skipped (the matchers reject sizes at which an expert mode
        collapses); the last candidate, every bond at ``r + multiple``, is always kept.
    first : Sequence[str], optional
        Bonds to raise before the others (the matchers pass the scaled bonds of the cores holding
        ``i`` and ``o``, which bound the experts' rank: Tucker's input and output factor ranks
        before the core's expert ranks).

    Returns
    -------
    sizes : dict of str to int
        The size of every bond.
    step : int
        The largest difference between consecutive candidates of the chain: the resolution of the
        match (the target lies between two of them, so the closest is within ``step / 2``).
    """
    multiple = check_size("rank_multiple", multiple)
    solve_rank(lambda r: count(dict.fromkeys(bonds, r)), target, what=what, multiple=multiple)  # checks
    low = _floor_rank(lambda r: count(dict.fromkeys(bonds, r)), target, what, multiple)
    base = dict.fromkeys(bonds, low)
    added = {bond: count({**base, bond: low + multiple}) for bond in bonds}
    chain = [dict(base)]
    for bond in sorted(bonds, key=lambda bond: (bond not in first, added[bond])):  # stable: ties keep the order
        chain.append({**chain[-1], bond: low + multiple})
    counts = [count(sizes) for sizes in chain]
    kept = [k for k in range(len(chain) - 1) if acceptable is None or acceptable(chain[k])] + [len(chain) - 1]
    best = min(kept, key=lambda k: (abs(counts[k] - target), counts[k]))
    step = max(after - before for before, after in itertools.pairwise(counts))
    if abs(counts[best] - target) <= TOLERANCE * target:
        return chain[best], step
    # A chain step larger than the tolerance (a Tucker core over many small modes: one rank up
    # multiplies it by (r + 1) / r): each candidate with one other bond a step lower, never one
    # of the bonds in ``first``, which bound the experts' rank.
    lowered = [
        {**chain[k], bond: chain[k][bond] - multiple}
        for k in kept
        for bond in bonds
        if bond not in first and chain[k][bond] > multiple
    ]
    candidates = [(counts[best], chain[best])] + [
        (count(sizes), sizes) for sizes in lowered if acceptable is None or acceptable(sizes)
    ]
    _, sizes = min(candidates, key=lambda candidate: (abs(candidate[0] - target), candidate[0]))
    return sizes, step


def _lift_collapsing_bonds(networks: Sequence[ExpertNetwork], scaled: Sequence[str]) -> dict[str, int]:
    """Bonds not scaled, of size 1, that cut an expert mode off from ``i`` and ``o``, with a size for each.

    Each is given `LIFTED_BOND` (the paper's expert ranks ``R1 = R2 = 4``), or less where the
    expert leg it cuts off is smaller or the core holding that leg cannot use more (the product
    of its other labels). Scaled bonds count as larger than 1 (they
    will be). Cuts are looked for again after every lift, until no such bond is left.
    """
    lifted: dict[str, int] = {}
    while True:
        found = {}
        for network in networks:
            probe = network.with_sizes(**dict.fromkeys(scaled, 2), **lifted)
            for leg in collapsed_expert_modes(probe):
                labels, _ = min_cut(probe, (leg,), (INPUT_LEG, OUTPUT_LEG))
                for bond in labels:
                    if bond in scaled or bond not in probe.bonds or probe.sizes[bond] != 1:
                        continue
                    size = min(probe.sizes[leg], LIFTED_BOND)
                    for core in probe.cores_with(leg):
                        holder = probe.cores[core]
                        if bond in holder:
                            size = min(size, math.prod(probe.sizes[x] for x in holder if x != bond))
                    if size > 1:
                        found[bond] = max(found.get(bond, 1), size)
        if not found:
            return lifted
        lifted.update(found)


@dataclass(frozen=True)
class Match:
    """A parameter-matched configuration.

    Attributes
    ----------
    rank : int
        The smallest size among the scaled bonds (every scaled bond's, with one).
    bonds : tuple of str
        The scaled bonds.
    params : int
        Parameters at that rank (as counted by the matcher: layer or block, gating per the call).
    target : int
        The budget.
    step : int
        The resolution of the match (see [`solve_bonds`][mumoe_tn.costs.matching.solve_bonds]; with one
        scaled bond, ``count(r + m) - count(r)`` around the target, ``m`` the rank multiple).
    networks : tuple of ExpertNetwork
        The matched network(s).
    problems : tuple of str
        What is wrong with the solution (target missed by more than [`TOLERANCE`][mumoe_tn.costs.matching]);
        empty for a good match. Each was also warned about.
    ranks : Mapping[str, int]
        The size of every scaled bond.
    lifted : Mapping[str, int]
        Bonds not scaled that were of size 1 and cut an expert mode off from ``i`` and ``o``
        (its experts would differ only by a scalar factor), with the size they were given.
    """

    rank: int
    bonds: tuple[str, ...]
    params: int
    target: int
    step: int
    networks: tuple[ExpertNetwork, ...]
    problems: tuple[str, ...] = ()
    ranks: Mapping[str, int] = field(default_factory=dict)
    lifted: Mapping[str, int] = field(default_factory=dict)

    @property
    def relative_error(self) -> float:
        """``(params − target) / target``."""
        return (self.params - self.target) / self.target


def _closer_collapsing(
    count: Callable[[Mapping[str, int]], int],
    sizes: Mapping[str, int],
    target: int,
    multiple: int,
    networks: Callable[[Mapping[str, int]], Sequence[ExpertNetwork]],
) -> str:
    """A note on the closest smaller candidate the matcher skipped because an expert mode collapses there ("" if none).

    Every scaled bond one step lower, then each alone: the first whose count is closer to ``target``
    than the match's and at which an expert mode collapses is named with its count and the mode.
    """
    matched = abs(count(sizes) - target)
    lower = [dict.fromkeys(sizes, min(sizes.values()) - multiple)]
    lower += [{**sizes, bond: size - multiple} for bond, size in sizes.items()]
    for candidate in lower:
        if min(candidate.values()) < 1 or abs(count(candidate) - target) >= matched:
            continue
        collapsed = sorted({leg for network in networks(candidate) for leg in collapsed_expert_modes(network)})
        if collapsed:
            ranks = ", ".join(f"{bond}={size}" for bond, size in candidate.items())
            return (
                f"; {ranks} gives {count(candidate):,} parameters but collapses expert mode(s) {collapsed} (their "
                "experts would differ only by a scalar factor), so it is not a match"
            )
    return ""


def _checked(match: Match, note: str = "") -> Match:
    for k, network in enumerate(match.networks):
        collapsed = collapsed_expert_modes(network)
        if collapsed:
            where = f"layer {k + 1}: " if len(match.networks) > 1 else ""
            raise ValueError(
                f"parameter matching: {where}expert mode(s) {list(collapsed)} collapse at the matched sizes "
                f"{match.ranks}: their experts differ only by a scalar factor (a cut of size 1 separates them "
                f"from i and o; expert rank bound {rank_bound(network)}); the budget of {match.target:,} parameters "
                f"is too small for bonds {list(match.bonds)} of size > 1, or another bond of size 1 cuts them off: "
                "give it a size > 1 or scale it too"
            )
    problems = []
    if abs(match.relative_error) > TOLERANCE:
        ranks = ", ".join(f"{bond}={size}" for bond, size in match.ranks.items())
        problems.append(
            f"the closest match has {match.params:,} parameters, {match.relative_error:+.1%} from the target "
            f"{match.target:,} ({ranks}; the candidates are {match.step:,} apart){note}"
        )
    for problem in problems:
        warnings.warn(f"parameter matching: {problem}", MatchingWarning, stacklevel=3)
    return dataclasses.replace(match, problems=tuple(problems))


def match_layer(
    network: ExpertNetwork,
    target: int,
    *,
    bonds: Sequence[str] | None = None,
    bias: bool = True,
    gate: bool = True,
    input_norm: bool = False,
    rank_multiple: int = 1,
) -> Match:
    """Scale ``network``'s bonds so the μMoE layer's total parameters are closest to ``target``.

    Parameters
    ----------
    network : ExpertNetwork
        A network whose other sizes stay fixed.
    target : int
        Parameter budget (e.g. [`mumoe_tn.costs.linear`][mumoe_tn.costs.baselines.linear] ``(I, O).params``).
    bonds : Sequence[str], optional
        Bonds to scale; the format's default (every bond without a format) if omitted.
    bias, gate, input_norm : bool, optional
        As for [`mumoe_tn.costs.layer_parameters`][mumoe_tn.costs.params.layer_parameters].
    rank_multiple : int, optional
        Give the scaled bonds a multiple of this (default 1); see the module notes.

    Returns
    -------
    Match
    """
    names = scaled_bonds(network, bonds)
    lifted = _lift_collapsing_bonds([network], names)
    network = network.with_sizes(**lifted)

    def count(sizes: Mapping[str, int]) -> int:
        return layer_parameters(network.with_sizes(**sizes), bias=bias, gate=gate, input_norm=input_norm).total

    return _checked(*_scaled_match([network], names, lifted, count, target, rank_multiple, f"a {network.name} layer"))


def match_block(
    first: ExpertNetwork,
    second: ExpertNetwork,
    target: int,
    *,
    bonds: Sequence[str] | None = None,
    bias: bool = True,
    gate: bool = True,
    rank_multiple: int = 1,
) -> Match:
    """Scale both layers of a two-layer μMoE block by one rank to match ``target`` parameters.

    Parameters
    ----------
    first, second : ExpertNetwork
        The layers ``I → H`` and ``H → O`` (same decomposition and expert dims).
    target : int
        Parameter budget (e.g. [`mumoe_tn.costs.mlp`][mumoe_tn.costs.baselines.mlp] ``(I, H, O).params``).
    bonds : Sequence[str], optional
        Bonds to scale in both layers; the format's default (every bond without a format) if omitted.
    bias, gate : bool, optional
        As for [`mumoe_tn.costs.block_parameters`][mumoe_tn.costs.params.block_parameters].
    rank_multiple : int, optional
        Give the scaled bonds a multiple of this (default 1); see the module notes.

    Returns
    -------
    Match
    """
    names = scaled_bonds(first, bonds)
    scaled_bonds(second, names)
    lifted = _lift_collapsing_bonds([first, second], names)
    first, second = first.with_sizes(**_own(first, lifted)), second.with_sizes(**_own(second, lifted))

    def count(sizes: Mapping[str, int]) -> int:
        return block_parameters(first.with_sizes(**sizes), second.with_sizes(**sizes), bias=bias, gate=gate).total

    return _checked(
        *_scaled_match([first, second], names, lifted, count, target, rank_multiple, f"a {first.name} block")
    )


def _scaled_match(
    networks: Sequence[ExpertNetwork],
    names: tuple[str, ...],
    lifted: Mapping[str, int],
    count: Callable[[Mapping[str, int]], int],
    target: int,
    rank_multiple: int,
    what: str,
) -> tuple[Match, str]:
    """The sizes of the bonds ``names`` of ``networks`` (``lifted`` already) whose ``count`` is closest to ``target``.

    The bonds that limit the input and output factor ranks are tried first, and no size that
    collapses an expert mode of any network is accepted. Returns the match, not yet checked, and
    the note on a closer size that would collapse one (checked by the caller, whose caller the
    warnings name).
    """

    def resized(sizes: Mapping[str, int]) -> tuple[ExpertNetwork, ...]:
        return tuple(network.with_sizes(**sizes) for network in networks)

    what = f"{what} scaling {names}" + _lifted_note(lifted)
    limiting = tuple(bond for network in networks for bond in _rank_limiting(network, names))
    sizes, step = solve_bonds(
        count, names, target, what=what, multiple=rank_multiple, first=limiting, acceptable=_whole(networks)
    )
    note = _closer_collapsing(count, sizes, target, rank_multiple, resized)
    matched = resized(sizes)
    return Match(min(sizes.values()), names, count(sizes), target, step, matched, (), sizes, lifted), note


def _lifted_note(lifted: Mapping[str, int]) -> str:
    if not lifted:
        return ""
    sizes = ", ".join(f"{bond}={size}" for bond, size in lifted.items())
    return f" (with {sizes}: bonds not scaled, raised from 1 so that no expert mode collapses)"


def _whole(networks: Sequence[ExpertNetwork]) -> Callable[[Mapping[str, int]], bool]:
    """Whether no expert mode of ``networks`` collapses at the given bond sizes."""
    return lambda sizes: not any(collapsed_expert_modes(network.with_sizes(**sizes)) for network in networks)


def _rank_limiting(network: ExpertNetwork, names: Sequence[str]) -> tuple[str, ...]:
    """The scaled bonds of the cores holding ``i`` and ``o`` (the input and output factor ranks)."""
    holders = {core for leg in (INPUT_LEG, OUTPUT_LEG) for core in network.cores_with(leg)}
    held = {label for core in holders for label in network.cores[core]}
    return tuple(bond for bond in names if bond in held)


def _own(network: ExpertNetwork, sizes: Mapping[str, int]) -> dict[str, int]:
    return {bond: size for bond, size in sizes.items() if bond in network.sizes}


def upcycle_capacity(network: ExpertNetwork) -> int:
    """How many singular components of a matrix every expert of ``network`` can hold when upcycled.

    The format's closed form says (e.g. TR: its input–output bond); a network without one is
    fitted generically, which can reach its expert-matrix rank bound
    ([`rank_bound`][mumoe_tn.costs.rank.rank_bound]: a min cut between ``i`` and ``o``).
    """
    capacity = None if network.format is None else network.format.upcycle_capacity(network)
    return rank_bound(network) if capacity is None else capacity


def bond_cap(network: ExpertNetwork, bond: str) -> int:
    """The largest size of ``bond`` that can matter for any tensor the network represents.

    A bond joining two cores can be compressed to the rank of either core seen as a matrix (its
    other labels × the bond), at most the product of its other sizes. A hyperedge (CP's rank)
    sums rank-one terms of the legs it joins, and no tensor needs more of them than its number of
    entries over its largest leg.

    Parameters
    ----------
    network : ExpertNetwork
        The network, at its current sizes.
    bond : str
        One of its bonds.

    Returns
    -------
    int
    """
    owners = network.cores_with(bond)
    if len(owners) > 2:
        legs = [network.sizes[label] for label in network.sizes if label not in network.bonds]
        return max(1, math.prod(legs) // max(legs))
    caps = []
    for core in owners:
        others = [label for label in network.cores[core] if label != bond]
        caps.append(math.prod(network.sizes[label] for label in others))
    return max(1, min(caps))


def match_exact(
    networks: Sequence[ExpertNetwork], *, bonds: Sequence[str] | None = None, multiple: int = 1
) -> tuple[int, tuple[ExpertNetwork, ...]]:
    """The smallest rank at which every expert of every network can equal any matrix of its layer.

    The bonds parameter matching would scale (``bonds``, else the format's) are set to one rank
    ``r`` — each capped where a larger size cannot matter (a bond between two cores beyond the
    product of either core's other sizes) — and ``r`` is the smallest with
    [`upcycle_capacity`][mumoe_tn.costs.matching.upcycle_capacity] ``≥ min(I, O)`` for every network: upcycling
    at that rank is exact (up to rounding) for any pretrained layer, for any network.

    Parameters
    ----------
    networks : Sequence of ExpertNetwork
        The layers of one block (one network for a single layer); other sizes stay as they are.
    bonds : Sequence[str], optional
        Bonds to scale; the format's default (every bond without a format) if omitted.
    multiple : int, optional
        Round ``r`` up to a multiple of this (default 1).

    Returns
    -------
    rank : int
        ``r``.
    networks : tuple of ExpertNetwork
        The networks at ``r``.

    Raises
    ------
    ValueError
        If no rank reaches ``min(I, O)`` because a bond that is not scaled bounds the capacity.
    """
    networks = tuple(networks)
    names = scaled_bonds(networks[0], bonds)
    for network in networks[1:]:
        scaled_bonds(network, names)

    def resized(r: int) -> tuple[ExpertNetwork, ...]:
        uncapped = tuple(net.with_sizes(**dict.fromkeys(names, r)) for net in networks)
        return tuple(net.with_sizes(**{bond: min(r, bond_cap(net, bond)) for bond in names}) for net in uncapped)

    def holds(r: int) -> bool:
        return all(upcycle_capacity(net) >= min(net.in_features, net.out_features) for net in resized(r))

    high = max(max(net.in_features, net.out_features, *net.sizes.values()) for net in networks)
    if not holds(high):
        worst = min(networks, key=lambda net: upcycle_capacity(resized(high)[networks.index(net)]))
        raise ValueError(
            f"no rank of the bonds {list(names)} lets every expert of {worst!r} hold a {worst.in_features} × "
            f"{worst.out_features} matrix: another bond bounds it (capacity "
            f"{upcycle_capacity(resized(high)[networks.index(worst)])}); scale that bond too (match_bonds=) or "
            "give ranks"
        )
    low = 1
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    rank = check_size("multiple", multiple) * math.ceil(low / multiple)
    return rank, resized(rank)
