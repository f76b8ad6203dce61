"""Path search bounded by network size: which optimizers to try for a contraction.

The ``"auto"`` planner asks several path finders for candidate paths and keeps the one with
the fewest fused multiply-adds under this library's convention (see
[`ContractionStep`][mumoe_tn.contractions.plan.ContractionStep]). Which finders are asked depends on the
number of operands, so that planning stays bounded (well under a second on the networks of the
reliability tests) while small networks get an FMA-optimal path:

- up to `OPTIMAL_MAX_OPERANDS` operands: opt_einsum's exhaustive ``"optimal"`` search
  and its dynamic programming with and without outer products;
- up to `DP_OUTER_MAX_OPERANDS`: dynamic programming with and without outer products;
- up to `DP_MAX_OPERANDS`: dynamic programming without outer products;
- beyond: greedy searches only (and cotengra's hyper-optimizer, time-boxed, when installed).

Every candidate list also holds the greedy path and an "absorb first" path, which contracts each
two-leg operand (a coefficient ``(b, n_e)``, the input ``(b, i)``) into the one operand that
shares its other leg before a greedy or DP search of the rest, so a valid plan always exists.
This module does not import torch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence

import opt_einsum

__all__ = [
    "DP_MAX_OPERANDS",
    "DP_OUTER_MAX_OPERANDS",
    "OPTIMAL_MAX_OPERANDS",
    "candidate_paths",
]

Labels = tuple[str, ...]
Path = tuple[tuple[int, ...], ...]

#: Largest operand count for which opt_einsum's exhaustive ``"optimal"`` search is tried.
OPTIMAL_MAX_OPERANDS = 7
#: Largest operand count for which dynamic programming searches outer products too.
DP_OUTER_MAX_OPERANDS = 11
#: Largest operand count for which dynamic programming is tried at all.
DP_MAX_OPERANDS = 14
#: Largest operand count, after absorbing two-leg operands, for a DP search of the rest.
ABSORBED_DP_MAX_OPERANDS = 9
#: Seconds cotengra's hyper-optimizer may search on large networks (when installed).
COTENGRA_SECONDS = 0.3


def _optimizers(n_operands: int, thorough: bool) -> list[object]:
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
    if n_operands > DP_MAX_OPERANDS and importlib.util.find_spec("cotengra") is not None:
        import cotengra

        found.append(
            cotengra.HyperOptimizer(
                methods=["greedy"],
                max_repeats=32,
                max_time=COTENGRA_SECONDS,
                progbar=False,
                parallel=False,
                reconf_opts=None,
                simulated_annealing_opts=None,
                slicing_opts=None,
                slicing_reconf_opts=None,
            )
        )
    return found


def _equation(inputs: Sequence[Labels], output: Labels, sizes: Mapping[str, int]) -> tuple[str, list[tuple[int, ...]]]:
    symbol = {label: opt_einsum.get_symbol(k) for k, label in enumerate(sizes)}
    equation = ",".join("".join(symbol[x] for x in labels) for labels in inputs)
    equation += "->" + "".join(symbol[x] for x in output)
    return equation, [tuple(sizes[x] for x in labels) for labels in inputs]


def _search(inputs: Sequence[Labels], output: Labels, sizes: Mapping[str, int], optimizer: object) -> Path:
    if len(inputs) == 1:
        return ((0,),)
    equation, shapes = _equation(inputs, output, sizes)
    path, _ = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=optimizer)
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
    inputs: Sequence[Sequence[str]], output: Sequence[str], sizes: Mapping[str, int], *, thorough: bool = False
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

    Returns
    -------
    list of tuple of tuple of int
        Paths in opt_einsum's convention (positions popped, result appended), without
        duplicates, in the order the finders were asked.
    """
    inputs = [tuple(labels) for labels in inputs]
    output = tuple(output)
    found: list[Path] = []
    for optimizer in _optimizers(len(inputs), thorough):
        found.append(_search(inputs, output, sizes, optimizer))
    absorbed, rest = _absorb_two_leg_operands(inputs, output)
    if absorbed:
        rest_finders: list[object] = ["greedy"]
        if len(rest) <= ABSORBED_DP_MAX_OPERANDS:
            rest_finders.append(opt_einsum.paths.DynamicProgramming(search_outer=True))
        for optimizer in rest_finders:
            found.append(absorbed + _search(rest, output, sizes, optimizer) if len(rest) > 1 else absorbed)
    # Positions within a step are a set: (0, 4) and (4, 0) are the same contraction.
    return list(dict.fromkeys(tuple(tuple(sorted(step)) for step in path) for path in found))
