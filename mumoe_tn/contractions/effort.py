"""Path-search effort bounded by the network's size: which searches may run, and why one may not.

Every path search the planner asks of opt_einsum has an expected effort that is computed here
from the network alone (its operands, coefficient and input rows included, their labels and the
labels' sizes), before the search runs. A search whose effort is above its bound is not run:
``"auto"`` leaves it out of its candidates, a named optimizer is replaced by the greedy path, and
the plan says so in its ``note`` (see [`ContractionPlan`][mumoe_tn.contractions.plan.ContractionPlan]).
The effort is a count, never a clock, so the same network gets the same answer in every process.

The bounds (measured on one core of a 2-CPU machine, on the worst network for each search that
the record checks admit: a clique of cores, every pair of cores joined by a bond of size 1, where
no bound prunes anything):

Exhaustive searches (``"optimal"``, ``"branch-all"``)
    At most `EXHAUSTIVE_MAX_OPERANDS` operands (8: up to 8!·7!/2⁷ ≈ 1.6 million orders, 0.35 s;
    9 operands take 10 s).
``"branch-2"``
    At most `BRANCH_TWO_MAX_OPERANDS` operands (16: 0.17 s; 18 take 0.5 s).
Dynamic programming (``"dp"``, ``"auto-hq"`` from 6 operands, the searches ``"auto"`` asks)
    At most `DP_EFFORT_BOUND` pair comparisons (`SMALLEST_PEAK_EFFORT_BOUND` for the search for
    the smallest peak, asked only where nothing else fits the memory bound): the pairs of
    sub-networks each sweep of its rising cost cap may compare (connected sub-networks without
    outer products, any with them; only those whose intermediate fits the memory limit and the
    sweep's cap), summed over the sweeps up to the cost of a known path, once more per
    `LABELS_PER_WEIGHT` labels. The sub-networks are counted up to `ENUMERATION_CAP`; a network
    with more is over the bound. The count is an upper bound: met on the clique, loose on chains.
Randomised and one-branch greedy searches (``"random-greedy"``, ``"random-greedy-128"``, ``"branch-1"``)
    At most `GREEDY_EFFORT_BOUND`: trials × pairs of operands sharing a summed label × labels.
``"greedy"``
    Always: it is what every other search falls back to.

opt_einsum's optimizer objects are counted as the searches they are, and a cotengra
``HyperOptimizer`` (what ``"cotengra"`` builds: 32 greedy trials) as a randomised greedy search of
its trials. Other objects (a callable, a cotengra optimizer of another kind) are the caller's code
and run as given.
This module does not import torch.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence

__all__ = [
    "BRANCH_TWO_MAX_OPERANDS",
    "DP_EFFORT_BOUND",
    "ENUMERATION_CAP",
    "EXHAUSTIVE_MAX_OPERANDS",
    "GREEDY_EFFORT_BOUND",
    "SMALLEST_PEAK_EFFORT_BOUND",
    "dp_effort",
    "greedy_effort",
    "search_refusal",
]

Labels = tuple[str, ...]

#: Most operands for an exhaustive search (``"optimal"``, ``"branch-all"``).
EXHAUSTIVE_MAX_OPERANDS = 8
#: Most operands for ``"branch-2"`` (it keeps two branches at each of its steps).
BRANCH_TWO_MAX_OPERANDS = 16
#: Most pair comparisons × cost-cap sweeps a dynamic-programming search may be expected to make
#: (a clique of 9 cores, 11 operands, counts 2.4 million: 0.4 s; a clique of 10 cores, 6.7 million: 1 s).
DP_EFFORT_BOUND = 2_000_000
#: The same for the search for the smallest peak, asked only where no other candidate fits the memory
#: bound (Tucker over 8·8·8·8·4·4 experts at 1,024 tokens: 1.3·10⁷, 0.5 s).
SMALLEST_PEAK_EFFORT_BOUND = 16_000_000
#: A comparison handles the labels of two sub-networks: each further this many labels count it once more.
LABELS_PER_WEIGHT = 32
#: Most sub-networks counted to estimate a dynamic-programming search (beyond: over the bound).
ENUMERATION_CAP = 1 << 16
#: Most trials × adjacent operand pairs × labels a greedy-based search may be expected to take
#: (about 0.06 µs each: 32 trials over a chain of 256 cores, 511 operands, count 16.7 million: 1 s).
GREEDY_EFFORT_BOUND = 16_000_000
#: Trials of opt_einsum's named randomised searches.
RANDOM_GREEDY_TRIALS = {"random-greedy": 32, "random-greedy-128": 128}
#: opt_einsum's ``"auto-hq"`` runs ``"optimal"`` below this many operands, dynamic programming up to
#: `AUTO_HQ_DP_MAX_OPERANDS`, then ``"random-greedy-128"``.
AUTO_HQ_OPTIMAL_BELOW = 6
AUTO_HQ_DP_MAX_OPERANDS = 16


def exhaustive_orders(n_operands: int) -> int:
    """Pairwise contraction orders of ``n_operands`` operands: ``n!·(n−1)!/2^(n−1)``."""
    return math.prod(k * (k - 1) // 2 for k in range(2, n_operands + 1))


class _Network:
    """The operands as bit masks of their labels, for counting the sub-networks a search may keep."""

    def __init__(self, inputs: Sequence[Labels], output: Labels, sizes: Mapping[str, int]) -> None:
        labels = list(dict.fromkeys(x for operand in inputs for x in operand))
        bit = {label: 1 << k for k, label in enumerate(labels)}
        self.n = len(inputs)
        self.masks = [sum(bit[x] for x in set(operand)) for operand in inputs]
        self.output = sum(bit[x] for x in set(output) if x in bit)
        summed = ~self.output
        self.neighbours = [
            sum(1 << b for b in range(self.n) if b != a and self.masks[a] & self.masks[b] & summed)
            for a in range(self.n)
        ]
        # Unions of operand labels, and products of label sizes, looked up by halves and by bytes.
        self.half = self.n // 2
        self.low = _subset_unions(self.masks[: self.half])
        self.high = _subset_unions(self.masks[self.half :])
        self.everything = (1 << self.n) - 1
        values = [sizes[label] for label in labels]
        self.products = [_subset_products(values[k : k + 8]) for k in range(0, len(values), 8)]

    def union(self, subset: int) -> int:
        return self.low[subset & ((1 << self.half) - 1)] | self.high[subset >> self.half]

    def intermediate(self, subset: int) -> int:
        """Elements of the tensor that contracting ``subset`` leaves (its labels still needed outside it)."""
        kept = self.union(subset) & (self.union(self.everything & ~subset) | self.output)
        total = 1
        for table in self.products:
            total *= table[kept & 0xFF]
            kept >>= 8
        return total

    def components(self) -> list[int]:
        """The operands grouped by summed labels (dynamic programming without outer products searches each alone)."""
        left, found = self.everything, []
        while left:
            reached = frontier = left & -left
            while frontier:
                grown = 0
                for k in _bits(frontier):
                    grown |= self.neighbours[k]
                frontier = grown & ~reached
                reached |= frontier
            found.append(reached)
            left &= ~reached
        return found

    def connected_subsets(self, within: int) -> Iterator[int]:
        """Every connected set of operands inside ``within``, once each (grown from its lowest operand)."""
        for start in _bits(within):
            yield 1 << start
            yield from self._grow(1 << start, ((1 << (start + 1)) - 1) | (self.everything & ~within))

    def _grow(self, subset: int, excluded: int) -> Iterator[int]:
        frontier = 0
        for k in _bits(subset):
            frontier |= self.neighbours[k]
        frontier &= ~excluded & ~subset
        if not frontier:
            return
        extensions = []
        part = frontier
        while part:  # every non-empty subset of the frontier
            extensions.append(subset | part)
            part = (part - 1) & frontier
        yield from extensions
        for grown in extensions:
            yield from self._grow(grown, excluded | frontier)


def _subset_unions(masks: Sequence[int]) -> list[int]:
    """The union of ``masks`` for every subset of them (indexed by the subset's bits)."""
    table = [0]
    for mask in masks:
        table += [found | mask for found in table]
    return table


def _subset_products(values: Sequence[int]) -> list[int]:
    """The product of ``values`` for every subset of them (indexed by the subset's bits), padded to 256 entries."""
    table = [1]
    for value in values:
        table += [found * value for found in table]
    return table + [1] * (256 - len(table))


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _pairs(counts: Sequence[int]) -> int:
    """Pairs dynamic programming compares in one sweep when it keeps ``counts[k]`` sub-networks of ``k`` operands."""
    top = len(counts) - 1
    return sum(counts[m] * counts[n - m] for n in range(2, top + 1) for m in range(1, n // 2 + 1))


def cost_caps(output: Labels, sizes: Mapping[str, int], used: set[str], most_cost: int) -> list[int]:
    """The cost caps of opt_einsum's dynamic programming, sweep by sweep, until one reaches ``most_cost``.

    The first cap is the result's size; each sweep multiplies it by the smallest label size (at least 2).
    """
    cap = max(1, math.prod(sizes[x] for x in set(output)))
    step = max(2, min((sizes[x] for x in used), default=2))
    caps = [cap]
    while caps[-1] < most_cost:
        caps.append(caps[-1] * step)
    return caps


def dp_effort(
    inputs: Sequence[Labels],
    output: Labels,
    sizes: Mapping[str, int],
    *,
    outer: bool,
    most_cost: int,
    memory_limit: int | None = None,
    bound: int = 0,
) -> int | None:
    """Expected effort of opt_einsum's dynamic programming on this contraction, in pair comparisons.

    Each sweep of the search compares pairs of the sub-networks it keeps: connected ones (any,
    with outer products) whose intermediate fits ``memory_limit`` and the sweep's cost cap (a
    sub-network costs at least its intermediate's size). The sweeps raise the cap until it reaches
    ``most_cost``; the effort is the sum over them.

    Parameters
    ----------
    inputs, output, sizes
        Each operand's labels, the result's, and every label's size.
    outer : bool
        Whether the search considers outer products.
    most_cost : int
        The cost a known path reaches (its FMAs; its peak for a search minimising the peak).
    memory_limit : int, optional
        The search's memory limit (elements).
    bound : int, optional
        Below this, the sub-networks are not counted one by one where every subset of operands
        taken as one would stay below it too (a quicker, looser answer; default 0: always count).

    Returns
    -------
    int or None
        None where the network has more than `ENUMERATION_CAP` sub-networks to count.
    """
    used = {x for operand in inputs for x in operand}
    caps = cost_caps(output, sizes, used, most_cost)
    n = len(inputs)
    every_subset = len(caps) * _pairs([math.comb(n, k) for k in range(n + 1)]) * _label_weight(used)
    if every_subset <= bound:
        return every_subset
    network = _Network(inputs, output, sizes)
    if outer:
        if n > ENUMERATION_CAP.bit_length() - 1:
            return None
        groups: list[Iterator[int] | range] = [range(1, 1 << n)]
    else:
        groups = [network.connected_subsets(component) for component in network.components()]
    ceiling = caps[-1] if memory_limit is None else min(caps[-1], memory_limit)
    weight = _label_weight(used)
    total = seen = 0
    for subsets in groups:
        first_sweep = [[0] * (n + 1) for _ in caps]  # sub-networks of k operands first kept at each sweep
        for subset in subsets:
            seen += 1
            if seen > ENUMERATION_CAP:
                return None
            size = subset.bit_count()
            if size == 1:
                first_sweep[0][1] += 1
                continue
            elements = network.intermediate(subset)
            if elements <= ceiling:
                first_sweep[bisect_left(caps, elements)][size] += 1
        kept = [0] * (n + 1)
        for added in first_sweep:
            kept = [a + b for a, b in zip(kept, added, strict=True)]
            total += _pairs(kept)
    return total * weight


def _label_weight(used: set[str]) -> int:
    """How much dearer a comparison is for the labels it handles: one more per `LABELS_PER_WEIGHT` labels."""
    return -(-len(used) // LABELS_PER_WEIGHT)


def greedy_effort(inputs: Sequence[Labels], output: Labels, trials: int) -> int:
    """Expected effort of ``trials`` greedy searches: trials × operand pairs sharing a summed label × labels."""
    holders: dict[str, int] = {}
    for operand in inputs:
        for label in set(operand):
            holders[label] = holders.get(label, 0) + 1
    kept = set(output)
    pairs = sum(count * (count - 1) // 2 for label, count in holders.items() if label not in kept)
    return trials * max(1, pairs + len(inputs)) * max(1, len(holders))


def search_refusal(
    optimizer: object,
    inputs: Sequence[Labels],
    output: Labels,
    sizes: Mapping[str, int],
    *,
    most_cost: int,
    memory_limit: int | None = None,
) -> str | None:
    """Why a path search is above its effort bound, or None where it may run.

    Parameters
    ----------
    optimizer : str or object
        An opt_einsum finder name or an opt_einsum optimizer object (other objects: None).
    inputs, output, sizes
        The contraction.
    most_cost : int
        A known path's cost (FMAs), the cost an unbounded dynamic-programming search climbs to.
    memory_limit : int, optional
        The memory limit handed to the search.

    Returns
    -------
    str or None
        E.g. ``"'optimal' is an exhaustive search over 9 operands (about 5.7e+07 orders); exhaustive
        searches run on at most 8"``.
    """
    n = len(inputs)
    if n <= 2:
        return None
    name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    if name == "auto-hq":
        if n < AUTO_HQ_OPTIMAL_BELOW:
            return None
        name = "dp" if n <= AUTO_HQ_DP_MAX_OPERANDS else "random-greedy-128"
        return _named(name, inputs, output, sizes, most_cost, memory_limit, shown="'auto-hq'")
    if name == "DynamicProgramming":
        outer = bool(getattr(optimizer, "search_outer", False))
        peak = getattr(optimizer, "minimize", "flops") == "size"
        fewest = "peak" if peak else "FMAs"
        shown = f"dynamic programming ({'with' if outer else 'without'} outer products, fewest {fewest})"
        bound = SMALLEST_PEAK_EFFORT_BOUND if peak else DP_EFFORT_BOUND
        return _dp(inputs, output, sizes, outer, most_cost, memory_limit, shown, bound)
    if name in ("RandomGreedy", "HyperOptimizer"):  # opt_einsum's, and the one "cotengra" builds
        trials = getattr(optimizer, "max_repeats", RANDOM_GREEDY_TRIALS["random-greedy-128"])
        if not isinstance(trials, int) or isinstance(trials, bool):
            return None
        return _greedy(inputs, output, trials, f"a randomised search of {trials} trials")
    if name == "BranchBound":
        branches = getattr(optimizer, "nbranch", None)
        name = {None: "branch-all", 1: "branch-1", 2: "branch-2"}.get(branches, "branch-all")
    if isinstance(name, str):
        return _named(name, inputs, output, sizes, most_cost, memory_limit, shown=repr(name))
    return None


def _named(
    name: str,
    inputs: Sequence[Labels],
    output: Labels,
    sizes: Mapping[str, int],
    most_cost: int,
    memory_limit: int | None,
    shown: str,
) -> str | None:
    n = len(inputs)
    if name in ("optimal", "branch-all"):
        if n <= EXHAUSTIVE_MAX_OPERANDS:
            return None
        return (
            f"{shown} is an exhaustive search over {n} operands (about {exhaustive_orders(n):.1e} orders); "
            f"exhaustive searches run on at most {EXHAUSTIVE_MAX_OPERANDS}"
        )
    if name == "branch-2":
        if n <= BRANCH_TWO_MAX_OPERANDS:
            return None
        return f"{shown} over {n} operands; it runs on at most {BRANCH_TWO_MAX_OPERANDS}"
    if name == "dp":
        return _dp(inputs, output, sizes, False, most_cost, memory_limit, shown)
    if name in RANDOM_GREEDY_TRIALS:
        return _greedy(inputs, output, RANDOM_GREEDY_TRIALS[name], shown)
    if name == "branch-1":
        return _greedy(inputs, output, n, shown)
    return None


def _dp(
    inputs: Sequence[Labels],
    output: Labels,
    sizes: Mapping[str, int],
    outer: bool,
    most_cost: int,
    memory_limit: int | None,
    shown: str,
    bound: int = DP_EFFORT_BOUND,
) -> str | None:
    effort = dp_effort(inputs, output, sizes, outer=outer, most_cost=most_cost, memory_limit=memory_limit, bound=bound)
    if effort is not None and effort <= bound:
        return None
    if effort is None:
        return f"{shown} over {len(inputs)} operands: more than {ENUMERATION_CAP:,} sub-networks to count"
    return f"{shown} over {len(inputs)} operands: about {effort:.1e} comparisons, above the bound {bound:.1e}"


def _greedy(inputs: Sequence[Labels], output: Labels, trials: int, shown: str) -> str | None:
    effort = greedy_effort(inputs, output, trials)
    if effort <= GREEDY_EFFORT_BOUND:
        return None
    return f"{shown} over {len(inputs)} operands: about {effort:.1e} steps, above the bound {GREEDY_EFFORT_BOUND:.1e}"
