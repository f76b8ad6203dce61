"""Path search bounded by network size: which deterministic finders to ask for a contraction.

The ``"auto"`` planner asks several path finders for candidate paths and then keeps, among the
candidates whose largest intermediate respects a memory bound, the one with the fewest fused
multiply-adds (see [`choose_plan`][mumoe_tn.contractions.plan.choose_plan] for the cost model).
Which finders are asked depends on the number of operands, so that planning stays bounded
(well under a second on the networks of the reliability tests):

- up to `OPTIMAL_MAX_OPERANDS` operands: opt_einsum's exhaustive ``"optimal"`` search;
- up to `DP_OUTER_MAX_OPERANDS`: dynamic programming with outer products, fewest FMAs (up to
  `BOUNDED_DP_OUTER_MAX_OPERANDS` where the result has one or two legs, within the memory bound);
- up to `DP_MAX_OPERANDS`: dynamic programming without outer products, fewest FMAs;
- beyond `DP_MAX_OPERANDS`: seeded randomised greedy searches, one minimising FMAs and one
  minimising the largest intermediate (`RANDOM_GREEDY_REPEATS` trials each).

Every candidate list also holds the greedy path and an "absorb first" path, which contracts each
two-leg operand (a coefficient ``(b, n_e)``, the input ``(b, i)``) into the one operand that
shares its other leg before a search of the rest (greedy; DP with outer products when at most
`ABSORBED_DP_MAX_OPERANDS` operands are left; on large networks the randomised searches, which
then run on the rest only), so a valid plan always exists.

When the fewest-FMA candidate exceeds the memory bound (`PEAK_FACTOR` × the largest operand or
result, or the ``memory_limit`` asked for) and the network has at most `BOUNDED_DP_MAX_OPERANDS`
operands (`BOUNDED_DP_PAIRWISE_MAX_OPERANDS` where every summed label joins two operands, as in
trees and grids), dynamic programming without outer products is asked for the fewest FMAs among
the paths within the bound. When still no candidate fits and the network has at most
`SIZE_DP_MAX_OPERANDS` operands, dynamic programming with outer products that minimises the
largest intermediate is asked too, with the bound as its memory limit (and, where no path fits
it and the result has at most two legs, without: the smallest peak any pairwise path reaches,
which the planner then keeps near). That is the memory-safe
candidate: on Tucker layers it pairs the small coefficient vectors before they meet the core,
where every path without outer products builds a ``batch × R^(E+1)`` intermediate. It is asked
only then because its search time explodes on networks with many free legs (a chain of 14
matrices each keeping a leg: 35 s), where the other candidates already fit.

Each finder runs only where its expected effort, counted from the network before it runs, is
within its bound (see ``mumoe_tn.contractions.effort``); `bounded_candidates` says which finders
it left out. On densely bonded networks (a clique of cores) that leaves the greedy paths.

Every finder is deterministic: the same network, shapes and optimizer give the same path in
every process (see [`find_path`][mumoe_tn.contractions.search.find_path]: labels are handed to
opt_einsum as ints, whose set order does not depend on the process's string hashing; the
randomised searches run a fixed number of trials from fixed seeds, with Python's global random
state saved and restored around them; nothing is time-boxed).
This module does not import torch.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence

import opt_einsum

from mumoe_tn.contractions.effort import search_refusal

__all__ = [
    "BOUNDED_DP_MAX_OPERANDS",
    "BOUNDED_DP_OUTER_MAX_OPERANDS",
    "BOUNDED_DP_PAIRWISE_MAX_OPERANDS",
    "DP_MAX_OPERANDS",
    "DP_OUTER_MAX_OPERANDS",
    "OPTIMAL_MAX_OPERANDS",
    "PEAK_FACTOR",
    "RANDOM_GREEDY_REPEATS",
    "SIZE_DP_MAX_OPERANDS",
    "bounded_candidates",
    "bounded_path",
    "candidate_paths",
    "find_path",
]

Labels = tuple[str, ...]
Path = tuple[tuple[int, ...], ...]

#: Largest operand count for which opt_einsum's exhaustive ``"optimal"`` search is tried.
OPTIMAL_MAX_OPERANDS = 7
#: Largest operand count for which dynamic programming searches outer products for fewest FMAs.
DP_OUTER_MAX_OPERANDS = 11
#: Largest operand count for which dynamic programming with outer products is asked for the fewest
#: FMAs within the memory bound, for results of one or two legs (the bound prunes its search:
#: 0.04-0.11 s on the 13-14 operands of layers with five expert modes).
BOUNDED_DP_OUTER_MAX_OPERANDS = 14
#: Largest operand count for which dynamic programming without outer products is tried.
DP_MAX_OPERANDS = 14
#: Largest operand count for which dynamic programming with outer products minimises the
#: largest intermediate, when no other candidate fits the memory bound.
SIZE_DP_MAX_OPERANDS = 16
#: The memory bound: intermediates up to this multiple of the largest operand or result.
PEAK_FACTOR = 4
#: Largest operand count for which dynamic programming without outer products is asked for the
#: fewest FMAs within the memory bound, when the fewest-FMA candidate exceeds it (its search time
#: grows fast on networks joined by one hyperedge: CP with 19 operands, 2.7 s; 21, 70 s).
BOUNDED_DP_MAX_OPERANDS = 16
#: The same where no summed label joins more than two operands (trees, chains, grids: a tree of
#: 12 cores over 6 expert modes, 21 operands, takes 0.01 s; a 3 × 4 grid, 25 operands, 0.09 s).
BOUNDED_DP_PAIRWISE_MAX_OPERANDS = 24
#: Largest operand count, after absorbing two-leg operands, for a DP search of the rest.
ABSORBED_DP_MAX_OPERANDS = 9
#: Trials of each seeded randomised greedy search on networks beyond `DP_MAX_OPERANDS`.
RANDOM_GREEDY_REPEATS = 32


def _random_greedy() -> list[object]:
    """Seeded randomised greedy searches (fixed trials, no clock): fewest FMAs, smallest peak."""
    return [opt_einsum.RandomGreedy(max_repeats=RANDOM_GREEDY_REPEATS, minimize=x) for x in ("flops", "size")]


def _optimizers(n_operands: int, thorough: bool, randomised: bool = True) -> list[object]:
    """The opt_einsum optimizers (fresh objects) worth running for ``n_operands`` operands."""
    found: list[object] = ["greedy"]
    if n_operands <= OPTIMAL_MAX_OPERANDS:
        found.append("optimal")
    if n_operands <= DP_OUTER_MAX_OPERANDS:
        found.append(opt_einsum.paths.DynamicProgramming(search_outer=True))
    if n_operands <= DP_MAX_OPERANDS:
        found.append(opt_einsum.paths.DynamicProgramming())
    if thorough and n_operands <= 9:
        found.append("branch-2")
    if n_operands > DP_MAX_OPERANDS and randomised:
        found += _random_greedy()
    return found


def _equation(inputs: Sequence[Labels], output: Labels, sizes: Mapping[str, int]) -> tuple[str, list[tuple[int, ...]]]:
    symbol = {label: opt_einsum.get_symbol(k) for k, label in enumerate(sizes)}
    equation = ",".join("".join(symbol[x] for x in labels) for labels in inputs)
    equation += "->" + "".join(symbol[x] for x in output)
    return equation, [tuple(sizes[x] for x in labels) for labels in inputs]


def find_path(
    inputs: Sequence[Labels],
    output: Labels,
    sizes: Mapping[str, int],
    optimizer: object,
    memory_limit: int | None = None,
) -> Path:
    """The path ``optimizer`` finds, the same in every process.

    opt_einsum's finders (named, or opt_einsum objects) are called directly with every label
    replaced by its position in ``sizes``: they iterate over sets of labels, and the order of a set
    of strings changes from one process to the next (string hashing is randomised per process),
    which changes how their ties are broken; a set of small ints has one order everywhere. Their
    randomised finders seed Python's global generator per trial: the caller's state is restored.
    Other optimizer objects (cotengra's) go through ``opt_einsum.contract_path``.

    Parameters
    ----------
    inputs : Sequence of tuple of str
        Labels of each operand.
    output : tuple of str
        Labels of the result.
    sizes : Mapping[str, int]
        Size of every label.
    optimizer : str or object
        An opt_einsum path-finder name or optimizer object, or another object opt_einsum accepts.
    memory_limit : int, optional
        Passed to opt_einsum's finders (dynamic programming then skips every pair whose result
        holds more elements, and raises ``RuntimeError`` when no path is left).

    Returns
    -------
    tuple of tuple of int
        The path in opt_einsum's convention.
    """
    if len(inputs) == 1:
        return ((0,),)
    if len(inputs) == 2:
        return ((0, 1),)
    state = random.getstate()
    try:
        if isinstance(optimizer, str) or type(optimizer).__module__.startswith("opt_einsum."):
            index = {label: k for k, label in enumerate(sizes)}
            sets = [frozenset(index[x] for x in labels) for labels in inputs]
            finder = opt_einsum.paths.get_path_fn(optimizer) if isinstance(optimizer, str) else optimizer
            size_dict = {index[label]: size for label, size in sizes.items()}
            path = finder(sets, frozenset(index[x] for x in output), size_dict, memory_limit)
        else:
            equation, shapes = _equation(inputs, output, sizes)
            path, _ = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=optimizer)
    finally:
        random.setstate(state)
    return tuple(tuple(step) for step in path)


def _absorb_two_leg_operands(inputs: Sequence[Labels], output: Labels) -> tuple[Path, list[Labels]]:
    """Contract every two-leg operand into the only other operand sharing one of its legs.

    Returns the steps taken (opt_einsum's position convention) and the remaining operands.
    """
    current = [tuple(labels) for labels in inputs]
    steps: list[tuple[int, ...]] = []
    pending = [labels for labels in current if len(labels) == 2]
    for labels in pending:
        if labels not in current:  # already contracted as another operand's partner
            continue
        k = current.index(labels)
        for label in labels:
            holders = [j for j, other in enumerate(current) if label in other]
            if label in output or len(holders) != 2:
                continue
            j = holders[0] if holders[1] == k else holders[1]
            high, low = max(j, k), min(j, k)
            first, second = current.pop(high), current.pop(low)
            kept = {x for other in current for x in other} | set(output)
            current.append(tuple(dict.fromkeys(x for x in (*first, *second) if x in kept)))
            steps.append((high, low))
            break
    return tuple(steps), current


def candidate_paths(
    inputs: Sequence[Sequence[str]],
    output: Sequence[str],
    sizes: Mapping[str, int],
    *,
    thorough: bool = False,
    memory_limit: int | None = None,
    smallest_peak: bool = True,
) -> list[Path]:
    """Distinct contraction paths from the path finders suited to the network's size.

    Parameters
    ----------
    inputs : Sequence of Sequence of str
        Labels of each operand.
    output : Sequence of str
        Labels of the result.
    sizes : Mapping[str, int]
        Size of every label.
    thorough : bool, optional
        Also ask slower finders on small networks (used by autotuning, which wants a few
        different good paths to time).
    memory_limit : int, optional
        Elements an intermediate should not exceed (default `PEAK_FACTOR` × the largest operand
        or result); where no candidate fits, a search for the smallest peak is added.
    smallest_peak : bool, optional
        Whether that search may be added (default True). A caller with a cheaper fallback than
        the exact contraction turns it off: on 16 operands it can take seconds, only to confirm
        that nothing fits.

    Returns
    -------
    list of tuple of tuple of int
        Paths in opt_einsum's convention (positions popped, result appended), without
        duplicates, in the order the finders were asked. A finder whose expected effort is above
        its bound (see ``mumoe_tn.contractions.effort``) is not asked; `bounded_candidates` also
        says which.
    """
    return bounded_candidates(
        inputs, output, sizes, thorough=thorough, memory_limit=memory_limit, smallest_peak=smallest_peak
    )[0]


def bounded_candidates(
    inputs: Sequence[Sequence[str]],
    output: Sequence[str],
    sizes: Mapping[str, int],
    *,
    thorough: bool = False,
    memory_limit: int | None = None,
    smallest_peak: bool = True,
) -> tuple[list[Path], tuple[str, ...]]:
    """`candidate_paths`, and why each finder left out for its effort was left out.

    Returns
    -------
    paths : list of tuple of tuple of int
        As `candidate_paths`.
    notes : tuple of str
        One line per finder not asked (see ``mumoe_tn.contractions.effort.search_refusal``).
    """
    inputs = [tuple(labels) for labels in inputs]
    output = tuple(output)
    found: list[Path] = []
    notes: list[str] = []

    def ask(operands: list[Labels], optimizer: object, limit: int | None = None, minimize_peak: bool = False) -> Path:
        """The path ``optimizer`` finds on ``operands``, or () where its effort is above its bound."""
        if optimizer == "greedy":
            return find_path(operands, output, sizes, optimizer, limit)
        known = [p for p in found if p] or [find_path(operands, output, sizes, "greedy")]
        costs = [_costs(operands, output, sizes, p) for p in known]
        most = min(peak for _, peak in costs) if minimize_peak else min(fma for fma, _ in costs)
        refusal = search_refusal(optimizer, operands, output, sizes, most_cost=most, memory_limit=limit)
        if refusal is not None:
            notes.append(refusal)
            return ()
        return find_path(operands, output, sizes, optimizer, limit)

    absorbed, rest = _absorb_two_leg_operands(inputs, output)
    # Large networks: the randomised searches run on what is left after absorbing (faster, and
    # better on the networks tried), or on the whole network when nothing can be absorbed.
    for optimizer in _optimizers(len(inputs), thorough, randomised=not absorbed or len(rest) <= 1):
        found.append(ask(inputs, optimizer))
    found = [path for path in found if path]
    if absorbed:
        rest_finders: list[object] = ["greedy"]
        if len(rest) <= ABSORBED_DP_MAX_OPERANDS:
            rest_finders.append(opt_einsum.paths.DynamicProgramming(search_outer=True))
        elif len(inputs) > DP_MAX_OPERANDS:
            rest_finders += _random_greedy()
        rest_paths: list[Path] = []
        for optimizer in rest_finders:
            if len(rest) <= 1 or optimizer == "greedy":
                rest_paths.append(find_path(rest, output, sizes, optimizer) if len(rest) > 1 else ())
                continue
            known = rest_paths[:1] or [find_path(rest, output, sizes, "greedy")]
            most = _costs(rest, output, sizes, known[0])[0]
            refusal = search_refusal(optimizer, rest, output, sizes, most_cost=most)
            if refusal is not None:
                notes.append(refusal)
                continue
            rest_paths.append(find_path(rest, output, sizes, optimizer))
        found += [absorbed + path for path in rest_paths]
    bound = _bound(inputs, output, sizes, memory_limit)
    cheapest = min(found, key=lambda path: _costs(inputs, output, sizes, path)[0])
    if _peak(inputs, output, sizes, cheapest) > bound:
        # The fewest FMAs within the bound: often as cheap as the memory-blind path (a 15-operand
        # TT layer: fewer FMAs and a quarter of the bound, where every other candidate left it).
        limit = BOUNDED_DP_MAX_OPERANDS if _has_hyperedge(inputs, output) else BOUNDED_DP_PAIRWISE_MAX_OPERANDS
        if len(inputs) <= limit:
            try:
                found.append(ask(inputs, opt_einsum.paths.DynamicProgramming(), bound))
            except RuntimeError:  # no path without outer products fits
                pass
    if DP_OUTER_MAX_OPERANDS < len(inputs) <= BOUNDED_DP_OUTER_MAX_OPERANDS and 1 <= len(output) <= 2:
        # Outer products within the bound: Tucker over five modes of 16 pairs the small
        # coefficient projections before the core (0.5 % fewer FMAs, 10 % faster fwd+bwd). Only
        # for results of one or two legs (a forward pass: batch and output): every kept leg
        # multiplies the outer products to search (a chain of 14 matrices each keeping a leg: 11 s).
        try:
            found.append(ask(inputs, opt_einsum.paths.DynamicProgramming(search_outer=True), bound))
        except RuntimeError:  # nothing within the bound: the searches below take over
            pass
    found = [path for path in found if path]
    if (
        smallest_peak
        and len(inputs) <= SIZE_DP_MAX_OPERANDS
        and min(_peak(inputs, output, sizes, p) for p in found) > bound
    ):
        smallest = opt_einsum.paths.DynamicProgramming(search_outer=True, minimize="size")
        try:
            found.append(ask(inputs, smallest, bound, minimize_peak=True))
        except RuntimeError:  # no path within the bound: the smallest peak there is, to choose near it
            if len(output) <= 2:  # unpruned, the search explodes with the kept legs
                found.append(ask(inputs, smallest, minimize_peak=True))
    found = [path for path in found if path]
    # Positions within a step are a set: (0, 4) and (4, 0) are the same contraction.
    paths = list(dict.fromkeys(tuple(tuple(sorted(step)) for step in path) for path in found))
    return paths, tuple(dict.fromkeys(notes))


def bounded_path(
    inputs: Sequence[Labels],
    output: Labels,
    sizes: Mapping[str, int],
    optimizer: object,
) -> tuple[Path, str]:
    """The path ``optimizer`` finds where its expected effort is within its bound, else the greedy path.

    Parameters
    ----------
    inputs, output, sizes
        The contraction.
    optimizer : str or object
        A named finder or an optimizer object (objects other than opt_einsum's run as given).

    Returns
    -------
    path : tuple of tuple of int
    note : str
        Empty where ``optimizer`` ran; else why it did not (the path is then greedy's).
    """
    if len(inputs) <= 2 or optimizer == "greedy":
        return find_path(inputs, output, sizes, optimizer), ""
    greedy = find_path(inputs, output, sizes, "greedy")
    refusal = search_refusal(optimizer, inputs, output, sizes, most_cost=_costs(inputs, output, sizes, greedy)[0])
    if refusal is None:
        return find_path(inputs, output, sizes, optimizer), ""
    return greedy, f"{refusal}: planned with 'greedy'"


def _size(labels: Sequence[str], sizes: Mapping[str, int]) -> int:
    total = 1
    for label in labels:
        total *= sizes[label]
    return total


def _bound(inputs: Sequence[Labels], output: Labels, sizes: Mapping[str, int], memory_limit: int | None) -> int:
    """The memory bound of `candidate_paths` in elements (never below the result's size)."""
    if memory_limit is not None:
        return max(memory_limit, _size(output, sizes))
    return PEAK_FACTOR * max(_size(labels, sizes) for labels in (*inputs, output))


def _has_hyperedge(inputs: Sequence[Labels], output: Labels) -> bool:
    """Whether a summed label joins three or more operands (CP's rank: every subset of cores is connected)."""
    counts = Counter(label for labels in inputs for label in set(labels))
    return any(count > 2 for label, count in counts.items() if label not in output)


def _costs(inputs: Sequence[Labels], output: Labels, sizes: Mapping[str, int], path: Path) -> tuple[int, int]:
    """FMAs of ``path`` (a step of ``k`` operands: ``k − 1`` per element of its labels' union) and its peak.

    The peak is the elements of the largest intermediate or result along the path.
    """
    current = [set(labels) for labels in inputs]
    fma = peak = 0
    for step in path:
        operands = [current.pop(k) for k in sorted(step, reverse=True)]
        joined = set().union(*operands)
        fma += max(1, len(operands) - 1) * _size(list(joined), sizes)
        result = joined & (set().union(*current) | set(output))
        peak = max(peak, _size(list(result), sizes))
        current.append(result)
    return fma, peak


def _peak(inputs: Sequence[Labels], output: Labels, sizes: Mapping[str, int], path: Path) -> int:
    """Elements of the largest intermediate or result along ``path``."""
    return _costs(inputs, output, sizes, path)[1]
