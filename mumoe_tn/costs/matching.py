"""Parameter matching: the rank whose parameter count is closest to a target (torch-free).

Notes
-----
Every count here is a polynomial in the scaled rank ``r`` with non-negative coefficients, so
it is non-decreasing in ``r``. The solver finds the largest ``r`` with ``count(r) ≤ target`` by
bisection and compares it with ``r + 1``; the closer count wins and **a tie goes to the smaller
rank** (fewer parameters). A target below ``count(1)`` is an error. With ``rank_multiple=m`` the
search runs over ``r = m, 2m, …`` only: matrix-multiply kernels run markedly faster when the
inner dimensions are multiples of the SIMD width or tensor-core tile (e.g. 16), at the price of a
coarser parameter match (one step adds ``m`` rank units). CP scales its rank ``R``;
TR and TT scale the bond between the input and output cores (``R_{E+2}``, resp. ``R_{E+1}``)
and keep the others (the paper's ``R1 = R2 = 4``); Tucker and custom networks scale the bonds
the caller names, all set to the same ``r``. A format's `matched_bonds` chooses the default;
a network without a format scales every bond.

A solution is checked before it is returned: when the closest count misses the target by more
than [`TOLERANCE`][mumoe_tn.costs.matching] (a rank step too coarse, or the fixed part alone too large), or when an
expert mode collapses (its experts differ only by a scalar factor, because a cut of size 1
separates the mode from ``i`` and ``o``; see
[`mumoe_tn.costs.rank.collapsed_expert_modes`][mumoe_tn.costs.rank.collapsed_expert_modes]), a
[`MatchingWarning`][mumoe_tn.costs.matching.MatchingWarning] says so with the numbers, and
[`Match.problems`][mumoe_tn.costs.matching.Match] lists it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mumoe_tn.costs.params import block_parameters, layer_parameters
from mumoe_tn.costs.rank import collapsed_expert_modes, rank_bound
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.validation import check_size

__all__ = [
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
    "solve_rank",
    "upcycle_capacity",
]

_MAX_RANK = 1 << 40

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
    closer = low if target - count(multiple * low) <= count(multiple * high) - target else high
    return multiple * closer


def scaled_bonds(network: ExpertNetwork, bonds: Sequence[str] | None = None) -> tuple[str, ...]:
    """The bonds parameter matching scales: ``bonds`` if given, else the format's default (all bonds without one)."""
    if not isinstance(network, ExpertNetwork):
        raise TypeError(f"parameter matching needs an ExpertNetwork, got {network!r} ({type(network).__name__})")
    if bonds is None:
        return network.bonds if network.format is None else network.format.matched_bonds(network)
    if isinstance(bonds, str) or not isinstance(bonds, Sequence):
        raise TypeError(f"bonds must be a sequence of bond labels, got {bonds!r}")
    bonds = tuple(bonds)
    unknown = [bond for bond in bonds if bond not in network.bonds]
    if not bonds or unknown:
        raise ValueError(f"bonds to scale must be bonds of the network {network.bonds}, got {bonds}")
    return bonds


@dataclass(frozen=True)
class Match:
    """A parameter-matched configuration.

    Attributes
    ----------
    rank : int
        The rank given to every scaled bond.
    bonds : tuple of str
        The scaled bonds.
    params : int
        Parameters at that rank (as counted by the matcher: layer or block, gating per the call).
    target : int
        The budget.
    step : int
        ``count(rank + m) - count(rank)`` with ``m`` the rank multiple (1 by default): one rank
        step, the resolution of the match.
    networks : tuple of ExpertNetwork
        The matched network(s).
    problems : tuple of str
        What is wrong with the solution (target missed by more than [`TOLERANCE`][mumoe_tn.costs.matching],
        collapsed expert modes); empty for a good match. Each was also warned about.
    """

    rank: int
    bonds: tuple[str, ...]
    params: int
    target: int
    step: int
    networks: tuple[ExpertNetwork, ...]
    problems: tuple[str, ...] = ()

    @property
    def relative_error(self) -> float:
        """``(params − target) / target``."""
        return (self.params - self.target) / self.target


def _checked(match: Match) -> Match:
    problems = []
    if abs(match.relative_error) > TOLERANCE:
        problems.append(
            f"the closest match has {match.params:,} parameters, {match.relative_error:+.1%} from the target "
            f"{match.target:,} (rank {match.rank} on bonds {match.bonds}; one rank step adds {match.step:,})"
        )
    for k, network in enumerate(match.networks):
        collapsed = collapsed_expert_modes(network)
        if collapsed:
            where = f"layer {k + 1}: " if len(match.networks) > 1 else ""
            problems.append(
                f"{where}expert mode(s) {list(collapsed)} collapse: their experts differ only by a scalar factor "
                f"(a cut of size 1 separates them from i and o; expert rank bound {rank_bound(network)}); give the "
                f"bonds of those modes a size > 1 or scale them too (bonds={list(match.bonds)} were scaled)"
            )
    for problem in problems:
        warnings.warn(f"parameter matching: {problem}", MatchingWarning, stacklevel=3)
    return Match(match.rank, match.bonds, match.params, match.target, match.step, match.networks, tuple(problems))


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

    def resized(r: int) -> ExpertNetwork:
        return network.with_sizes(**dict.fromkeys(names, r))

    def count(r: int) -> int:
        return layer_parameters(resized(r), bias=bias, gate=gate, input_norm=input_norm).total

    rank = solve_rank(count, target, what=f"a {network.name} layer scaling {names}", multiple=rank_multiple)
    step = count(rank + rank_multiple) - count(rank)
    return _checked(Match(rank, names, count(rank), target, step, (resized(rank),)))


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

    def resized(r: int) -> tuple[ExpertNetwork, ExpertNetwork]:
        return first.with_sizes(**dict.fromkeys(names, r)), second.with_sizes(**dict.fromkeys(names, r))

    def count(r: int) -> int:
        return block_parameters(*resized(r), bias=bias, gate=gate).total

    rank = solve_rank(count, target, what=f"a {first.name} block scaling {names}", multiple=rank_multiple)
    step = count(rank + rank_multiple) - count(rank)
    return _checked(Match(rank, names, count(rank), target, step, resized(rank)))


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
