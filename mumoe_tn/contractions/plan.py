"""Planning: an opt_einsum path turned into explicit pairwise steps.

opt_einsum only *plans* here (it finds a path from shapes); the steps are executed by
[`mumoe_tn.contractions.execute.run_plan`][mumoe_tn.contractions.execute.run_plan] as plain ``torch.einsum`` calls,
which keeps the forward pass compile-friendly (no backend import at call time), autocast-safe (no ``tensordot``
on mixed dtypes) and free of per-call path searches. This module does not import torch.

Cost model
----------
A plan is judged on two numbers, both computed from shapes alone:

FMAs
    Fused multiply-adds (1 FMA = 1 multiply + 1 add): a step joining ``k ≥ 2`` operands costs
    ``(k − 1) · Π sizes`` over the union of its labels, a one-operand sum ``Π sizes``
    (see [`ContractionStep`][mumoe_tn.contractions.plan.ContractionStep]).
Peak
    The largest intermediate or result, in elements
    ([`ContractionPlan.largest_intermediate`][mumoe_tn.contractions.plan.ContractionPlan]): what the
    contraction allocates beyond its operands, one step at a time (and what the backward pass keeps).

``"auto"`` keeps the candidate with the fewest FMAs among those whose peak respects a memory
bound ([`choose_plan`][mumoe_tn.contractions.plan.choose_plan]). Without ``memory_limit=`` the bound is
[`PEAK_FACTOR`][mumoe_tn.contractions.plan] × the largest tensor the contraction holds anyway (an
operand or the result; for a layer's forward pass at a large batch, its output activations), or,
where no candidate fits that, [`PEAK_SLACK`][mumoe_tn.contractions.plan] × the smallest peak any
candidate reaches (the candidates then include the smallest peak of any pairwise path, on
networks of up to 16 operands whose result has at most two legs, unless ``smallest_peak=False``). With
``memory_limit=`` (an element count, or ``"max_input"`` for the largest operand, as in opt_einsum)
the bound is that limit (or the result's size, which every path allocates, if that is larger), and
a contraction that no candidate fits is refused with the smallest peak found. A named optimizer or
an explicit path is followed as given; ``memory_limit=`` then only checks it.

Every finder ``"auto"`` asks is deterministic (see ``mumoe_tn.contractions.search``):
the same network, shapes and optimizer give the same plan in every process, and
[`ContractionPlan.to_dict`][mumoe_tn.contractions.plan.ContractionPlan.to_dict] /
[`from_dict`][mumoe_tn.contractions.plan.ContractionPlan.from_dict] carry a plan to another process as it is.

Planning time is bounded by the network's size: every path search is first given an expected
effort, counted from the operands, their labels and sizes (``mumoe_tn.contractions.effort``), and
runs only within its bound. ``"auto"`` leaves a search beyond its bound out of its candidates; a
named optimizer beyond its bound (``"optimal"`` over more than 8 operands, ``"dp"`` on a densely
bonded network, …) is replaced by the greedy path. Either way the plan's ``note`` says which search
was left out and why, and its ``repr`` (as ``mumoe-tn plan`` prints it) shows the note.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any

from mumoe_tn.contractions.intermediate_order import consumer_orders
from mumoe_tn.contractions.plan_inputs import (
    check_labels,
    check_memory_limit,
    check_path,
    einsum_equation,
    limit_elements,
)
from mumoe_tn.contractions.search import PEAK_FACTOR, bounded_candidates, bounded_path
from mumoe_tn.network import BATCH_LABEL, ExpertNetwork

__all__ = [
    "OPTIMIZERS",
    "ContractionPlan",
    "ContractionStep",
    "autotune_candidates",
    "candidate_plans",
    "check_memory_limit",
    "choose_plan",
    "einsum_equation",
    "forward_candidates",
    "memory_bound",
    "plan_contraction",
    "plan_dense",
    "plan_forward",
    "resolve_optimizer",
]

#: Named path optimizers accepted as ``optimize=``. ``"auto"`` (the default) is this library's
#: size-aware planner (`mumoe_tn.contractions.search`): FMA-optimal among several exact
#: searches on small networks, bounded-time heuristics on large ones. ``"autotune"`` plans like
#: ``"auto"`` here; a [`FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts] module given it also times the
#: best candidate paths on its device once per batch-size bucket and keeps the fastest. The other
#: names are opt_einsum's (they can take long on large networks), ``"cotengra"`` needs cotengra.
OPTIMIZERS = (
    "auto",
    "autotune",
    "auto-hq",
    "optimal",
    "dp",
    "greedy",
    "branch-all",
    "branch-2",
    "branch-1",
    "random-greedy",
    "random-greedy-128",
    "cotengra",
)

#: The planners that pick among candidate paths by FMA count.
SIZE_AWARE = ("auto", "autotune")

#: Default bound of ``"auto"`` where no candidate fits `PEAK_FACTOR`: this multiple of the smallest peak found.
PEAK_SLACK = 1.5
#: Version of the dictionaries written by `ContractionPlan.to_dict`.
PLAN_FORMAT = 1
#: Longest note a saved plan may carry.
MAX_NOTE_CHARS = 4096

Labels = tuple[str, ...]


@dataclass(frozen=True)
class ContractionStep:
    """One step of a plan: contract the operands at ``positions`` with ``equation``.

    Attributes
    ----------
    positions : tuple of int
        Positions in the current operand list, in the order the equation takes them. They
        are removed from the list and the result is appended (opt_einsum's convention).
    equation : str
        The ``torch.einsum`` equation of the step.
    output : tuple of str
        Labels of the intermediate (or final) result.
    fma : int
        Fused multiply-adds of the step: ``(k - 1) · Π sizes`` over the union of the step's
        labels for ``k ≥ 2`` operands, ``Π sizes`` for a one-operand sum.
    operands : tuple of tuple of str
        Labels of the step's operands, in equation order.
    """

    positions: tuple[int, ...]
    equation: str
    output: Labels
    fma: int
    operands: tuple[Labels, ...] = ()

    def describe(self) -> str:
        """The step in the network's own labels, e.g. ``(… i) · (r2 i r3) -> (… r2 r3)`` (``…`` is the batch)."""

        def show(labels: Labels) -> str:
            return "(" + " ".join("…" if x == BATCH_LABEL else x for x in labels) + ")"

        return " · ".join(show(x) for x in self.operands) + " -> " + show(self.output)


@dataclass(frozen=True)
class ContractionPlan:
    """A contraction planned from shapes, as explicit steps.

    Attributes
    ----------
    inputs : tuple of tuple of str
        Labels of every operand.
    output : tuple of str
        Labels of the result.
    sizes : Mapping[str, int]
        Size of every label used for planning.
    steps : tuple of ContractionStep
        The pairwise (or single-operand) steps in execution order.
    path : tuple of tuple of int
        The opt_einsum path the steps follow.
    note : str
        Why a path search asked for was not run (its expected effort was above its bound, see
        ``mumoe_tn.contractions.effort``), or ``""``. Not part of the plan's identity.
    """

    inputs: tuple[Labels, ...]
    output: Labels
    sizes: Mapping[str, int]
    steps: tuple[ContractionStep, ...]
    path: tuple[tuple[int, ...], ...]
    note: str = field(default="", compare=False)

    @property
    def fma(self) -> int:
        """Total fused multiply-adds of the planned contraction (1 FMA = 1 FLOP)."""
        return sum(step.fma for step in self.steps)

    @cached_property
    def largest_intermediate(self) -> int:
        """Number of elements of the largest intermediate or result (worked out once: a plan does not change)."""
        return max((_size(step.output, self.sizes) for step in self.steps), default=0)

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-able dict (labels, sizes, path and every step's operand positions and result).

        [`from_dict`][mumoe_tn.contractions.plan.ContractionPlan.from_dict] rebuilds the same plan, so a plan
        found once can be saved with a checkpoint or broadcast to every process of a distributed job.
        """
        return {
            "format": PLAN_FORMAT,
            "inputs": [list(labels) for labels in self.inputs],
            "output": list(self.output),
            "sizes": {label: int(size) for label, size in self.sizes.items()},
            "path": [list(step) for step in self.path],
            "steps": [{"positions": list(step.positions), "output": list(step.output)} for step in self.steps],
            **({"note": self.note} if self.note else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ContractionPlan:
        """Rebuild a plan written by [`to_dict`][mumoe_tn.contractions.plan.ContractionPlan.to_dict].

        Every step is checked against the labels (positions in range, result labels carried by its
        operands, the last result equal to the output), and equations and FMAs are recomputed.

        Parameters
        ----------
        data : Mapping[str, Any]
            A dict from ``to_dict`` (e.g. read back from JSON).

        Returns
        -------
        ContractionPlan
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"a saved plan is a dict from ContractionPlan.to_dict(), got {type(data).__name__}")
        missing = [key for key in ("format", "inputs", "output", "sizes", "path", "steps") if key not in data]
        if missing:
            raise ValueError(f"a saved plan needs the keys {missing} (written by ContractionPlan.to_dict())")
        if data["format"] != PLAN_FORMAT:
            raise ValueError(f"saved plan format {data['format']!r} is not the supported {PLAN_FORMAT}")
        try:
            inputs = tuple(tuple(str(x) for x in labels) for labels in data["inputs"])
            output = tuple(str(x) for x in data["output"])
            sizes = {str(label): int(size) for label, size in dict(data["sizes"]).items()}
            path = tuple(tuple(int(k) for k in step) for step in data["path"])
            steps = [(tuple(int(k) for k in step["positions"]), tuple(str(x) for x in step["output"]))
                     for step in data["steps"]]  # fmt: skip
        except (TypeError, ValueError, KeyError) as problem:
            raise ValueError(f"a saved plan has malformed entries: {problem}") from None
        check_labels(inputs, output, sizes)
        check_path(path, len(inputs))
        if len(steps) != len(path) or any(set(p) != set(q) for (p, _), q in zip(steps, path, strict=False)):
            raise ValueError(f"a saved plan's steps {[p for p, _ in steps]} do not follow its path {path}")
        current = list(inputs)
        laid_out = []
        for number, (positions, result) in enumerate(steps):
            if sorted(positions, reverse=True) != list(positions) or not all(0 <= k < len(current) for k in positions):
                raise ValueError(f"saved plan step {number} has positions {positions} outside 0..{len(current) - 1}")
            operands = tuple(current.pop(k) for k in positions)
            carried = {x for labels in operands for x in labels}
            if not set(result) <= carried or len(set(result)) != len(result):
                raise ValueError(f"saved plan step {number} returns labels {result} its operands do not carry")
            laid_out.append(_step(positions, operands, result, sizes))
            current.append(result)
        if laid_out[-1].output != output:
            raise ValueError(f"a saved plan ends in {laid_out[-1].output}, not the output {output}")
        note = data.get("note", "")
        if not isinstance(note, str) or len(note) > MAX_NOTE_CHARS:
            raise ValueError(f"a saved plan's note must be a string of at most {MAX_NOTE_CHARS} characters")
        return cls(inputs, output, dict(sizes), tuple(laid_out), path, note)

    def __repr__(self) -> str:
        output = " ".join("…" if x == BATCH_LABEL else x for x in self.output)
        lines = [f"ContractionPlan({len(self.inputs)} operands -> ({output}), {self.fma:,} FMA)"]
        lines += [f"  {k}: {step.describe()}  {step.fma:,} FMA" for k, step in enumerate(self.steps)]
        lines += [f"  note: {line}" for line in self.note.splitlines()]
        return "\n".join(lines)


def resolve_optimizer(optimize: Any) -> Any:
    """Validate ``optimize`` and return what the planner hands to the path search.

    Call it once per plan: a named optimizer is resolved to a *fresh* object every time (a
    cotengra ``HyperOptimizer`` keeps its best tree across calls, so sharing one between plans
    for different batch sizes would reuse a tree found for another size).

    Parameters
    ----------
    optimize : str or opt_einsum.paths.PathOptimizer or callable or Sequence
        A name from [`OPTIMIZERS`][mumoe_tn.contractions.plan] (``"cotengra"`` builds a ``cotengra.HyperOptimizer``),
        an optimizer object (opt_einsum or cotengra, used as given), or an explicit path as a
        sequence of position tuples (checked when planning).

    Returns
    -------
    object
        A name, an optimizer object, or the path as a tuple of tuples.
    """
    if isinstance(optimize, str):
        if optimize not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimize!r}; choose one of {list(OPTIMIZERS)} or pass an object")
        if optimize == "cotengra":
            if importlib.util.find_spec("cotengra") is None:
                raise ValueError("optimize='cotengra' needs the optional dependency cotengra (pip install cotengra)")
            import cotengra

            return cotengra.HyperOptimizer(max_repeats=32, progbar=False, methods=["greedy"])
        return optimize
    if callable(optimize):
        return optimize
    if isinstance(optimize, Sequence) and not isinstance(optimize, bytes | bytearray):
        return tuple(tuple(step) if isinstance(step, Sequence) else step for step in optimize)
    raise TypeError(f"optimize must be an optimizer name, an optimizer object or a path, got {optimize!r}")


def _layout(
    inputs: tuple[Labels, ...],
    output: Labels,
    sizes: Mapping[str, int],
    path: Sequence[tuple[int, ...]],
    lead: str | None,
) -> ContractionPlan:
    """Turn a path into explicit steps with their equations and FMA counts.

    Without ``lead`` each intermediate holds its labels in the order its operands bring them; with
    it, in the order the step that reads it takes them (``lead`` first; see
    [`mumoe_tn.contractions.intermediate_order`][mumoe_tn.contractions.intermediate_order]).
    """
    results = _results(inputs, output, path, lead)
    if lead is not None:
        results = consumer_orders(inputs, output, path, results, lead)
    steps = []
    current = list(inputs)
    for positions, result in zip(path, results, strict=True):
        positions = tuple(sorted(positions, reverse=True))
        operands = [current.pop(k) for k in positions]
        steps.append(_step(positions, tuple(operands), result, sizes))
        current.append(result)
    return ContractionPlan(inputs, output, dict(sizes), tuple(steps), tuple(tuple(p) for p in path))


def _results(
    inputs: tuple[Labels, ...], output: Labels, path: Sequence[tuple[int, ...]], lead: str | None
) -> list[Labels]:
    """Each step's result: the labels still needed, in the order its operands bring them (``lead`` first)."""
    results = []
    current = list(inputs)
    for number, positions in enumerate(path):
        operands = [current.pop(k) for k in sorted(positions, reverse=True)]
        remaining = {label for labels in current for label in labels} | set(output)
        if number == len(path) - 1:
            result = output
        else:
            seen: list[str] = []
            for labels in operands:
                seen += [x for x in labels if x in remaining and x not in seen]
            if lead in seen:
                seen.remove(lead)
                seen.insert(0, lead)
            result = tuple(seen)
        results.append(result)
        current.append(result)
    return results


def _step(
    positions: tuple[int, ...], operands: tuple[Labels, ...], result: Labels, sizes: Mapping[str, int]
) -> ContractionStep:
    """One step with its equation and FMA count."""
    union = {label for labels in operands for label in labels}
    factor = max(len(operands) - 1, 1)
    return ContractionStep(positions, einsum_equation(operands, result), result, factor * _size(union, sizes), operands)


def memory_bound(
    plans: Sequence[ContractionPlan],
    memory_limit: int | str | None = None,
    *,
    peak: Callable[[ContractionPlan], int] | None = None,
) -> int:
    """The largest peak ``"auto"`` accepts among ``plans`` (candidates for one contraction).

    Parameters
    ----------
    plans : Sequence of ContractionPlan
        Candidate plans of the same contraction.
    memory_limit : int or "max_input" or None, optional
        An explicit bound in elements (``"max_input"``: the largest operand) on the intermediates;
        the result itself is always allowed. Default: [`PEAK_FACTOR`][mumoe_tn.contractions.plan]
        × the largest operand or result where some plan fits that, else
        [`PEAK_SLACK`][mumoe_tn.contractions.plan] × the smallest peak among ``plans``.
    peak : callable, optional
        The peak of a plan (default: its largest intermediate).

    Returns
    -------
    int
        Elements.
    """
    first = plans[0]
    limit = limit_elements(memory_limit, first.inputs, first.sizes)
    if limit is not None:
        return max(limit, _size(first.output, first.sizes))  # the result is allocated whatever the path
    peak = peak or (lambda plan: plan.largest_intermediate)
    held = max(_size(labels, first.sizes) for labels in (*first.inputs, first.output))
    smallest = min(peak(plan) for plan in plans)
    return PEAK_FACTOR * held if smallest <= PEAK_FACTOR * held else math.floor(PEAK_SLACK * smallest)


def choose_plan(
    plans: Sequence[ContractionPlan],
    memory_limit: int | str | None = None,
    *,
    peak: Callable[[ContractionPlan], int] | None = None,
    fma: Callable[[ContractionPlan], int] | None = None,
) -> ContractionPlan:
    """The plan with the fewest FMAs among ``plans`` whose peak is within the memory bound.

    The bound is [`memory_bound`][mumoe_tn.contractions.plan.memory_bound]'s.

    Ties go to the smaller peak, then to the earlier plan.

    Parameters
    ----------
    plans : Sequence of ContractionPlan
        Candidate plans of the same contraction.
    memory_limit : int or "max_input" or None, optional
        See `memory_bound`.
    peak, fma : callable, optional
        The peak and the FMA count of a plan (default: its largest intermediate and its FMAs).

    Returns
    -------
    ContractionPlan

    Raises
    ------
    ValueError
        If an explicit ``memory_limit`` is below every candidate's peak.
    """
    if not plans:
        raise ValueError("choosing a plan needs at least one candidate")
    peak = peak or (lambda plan: plan.largest_intermediate)
    fma = fma or (lambda plan: plan.fma)
    bound = memory_bound(plans, memory_limit, peak=peak)
    fitting = [plan for plan in plans if peak(plan) <= bound]
    if not fitting:
        smallest = peak(min(plans, key=peak))
        found = f"the smallest peak found is {smallest:,} elements ({len(plans)} candidate paths)"
        if len(plans) == 1:
            found = f"the path's largest intermediate holds {smallest:,} elements"
        raise ValueError(
            f"no contraction path found keeps every intermediate within memory_limit={memory_limit!r} "
            f"({bound:,} elements); {found}: raise the limit, plan a smaller batch or use optimize='auto'"
        )
    return min(fitting, key=lambda plan: (fma(plan), peak(plan)))


def candidate_plans(
    inputs: Sequence[Sequence[str]],
    output: Sequence[str],
    sizes: Mapping[str, int],
    *,
    lead: str | None = None,
    thorough: bool = False,
    memory_limit: int | str | None = None,
    smallest_peak: bool = True,
) -> list[ContractionPlan]:
    """Distinct plans from the path finders suited to the network's size, cheapest first.

    Parameters
    ----------
    inputs, output, sizes, lead
        As for [`plan_contraction`][mumoe_tn.contractions.plan.plan_contraction].
    thorough : bool, optional
        Ask slower finders too on small networks (more candidates to time when autotuning).
    memory_limit : int or "max_input", optional
        The bound the candidates should fit (see ``mumoe_tn.contractions.search.candidate_paths``);
        default: its own.
    smallest_peak : bool, optional
        Whether a search for the smallest peak is added where no candidate fits (default True;
        see ``candidate_paths``).

    Returns
    -------
    list of ContractionPlan
        Sorted by FMA count, then by largest intermediate (ties keep the finders' order).
    """
    inputs = tuple(tuple(labels) for labels in inputs)
    output = tuple(output)
    check_labels(inputs, output, sizes)
    plans, problems = [], []
    limit = limit_elements(memory_limit, inputs, sizes)
    found, notes = bounded_candidates(
        inputs, output, sizes, thorough=thorough, memory_limit=limit, smallest_peak=smallest_peak
    )
    for path in found:
        try:
            plans.append(replace(_layout(inputs, output, sizes, path, lead), note=_left_out(notes)))
        except ValueError as problem:  # a step torch.einsum cannot express; other paths may do
            problems.append(problem)
    if not plans:
        raise problems[0]
    return sorted(plans, key=lambda plan: (plan.fma, plan.largest_intermediate))


def plan_contraction(
    inputs: Sequence[Sequence[str]],
    output: Sequence[str],
    sizes: Mapping[str, int],
    optimize: Any = "auto",
    *,
    lead: str | None = None,
    memory_limit: int | str | None = None,
    smallest_peak: bool = True,
) -> ContractionPlan:
    """Plan a contraction from labels and sizes, and lay it out as explicit steps.

    Parameters
    ----------
    inputs : Sequence of Sequence of str
        Labels of each operand.
    output : Sequence of str
        Labels of the result, in order.
    sizes : Mapping[str, int]
        Size of every label.
    optimize : str or object, optional
        Path optimizer (see [`resolve_optimizer`][mumoe_tn.contractions.plan.resolve_optimizer]). ``"auto"`` (default)
        keeps the cheapest of the candidate paths of [`candidate_plans`][mumoe_tn.contractions.plan.candidate_plans]
        within the memory bound of [`choose_plan`][mumoe_tn.contractions.plan.choose_plan], with bounded, deterministic
        planning.
    lead : str, optional
        A label kept first in every intermediate that carries it (the batch label), so that
        pairwise steps run as batched matrix products with the batch leading.
    memory_limit : int or "max_input", optional
        Most elements any intermediate may hold (opt_einsum's ``memory_limit``; ``"max_input"``: the
        largest operand). ``"auto"`` chooses among the paths that fit; a named optimizer's path is
        checked against it. A ``ValueError`` when nothing fits.
    smallest_peak : bool, optional
        With ``"auto"``: whether a search for the smallest peak is added where no candidate fits
        the memory bound (default True; off, planning stays fast where the caller has a fallback).

    Returns
    -------
    ContractionPlan
    """
    inputs = tuple(tuple(labels) for labels in inputs)
    output = tuple(output)
    optimizer = resolve_optimizer(optimize)
    if isinstance(optimizer, str) and optimizer in SIZE_AWARE:
        plans = candidate_plans(
            inputs, output, sizes, lead=lead, memory_limit=memory_limit, smallest_peak=smallest_peak
        )
        return choose_plan(plans, memory_limit)
    check_labels(inputs, output, sizes)
    check_memory_limit(memory_limit)
    note = ""
    if isinstance(optimizer, tuple):
        path = check_path(optimizer, len(inputs))
    else:
        path, note = bounded_path(inputs, output, sizes, optimizer)
    plan = replace(_layout(inputs, output, sizes, path, lead), note=note)
    if memory_limit is not None:
        choose_plan([plan], memory_limit)  # refuses a path beyond the limit
    return plan


def _check_batch(batch_size: object) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (rows of the flattened batch), got {batch_size!r}")
    return batch_size


def plan_forward(
    network: ExpertNetwork, batch_size: int, optimize: Any = "auto", *, memory_limit: int | str | None = None
) -> ContractionPlan:
    """Plan the factorized forward pass of ``network`` for a flattened batch of ``batch_size``.

    Operands: the cores in order, one coefficient tensor ``(B, N_e)`` per expert mode, then
    the input ``(B, I)``; result ``(B, O)``.

    Parameters
    ----------
    network : ExpertNetwork
        The decomposition.
    batch_size : int
        Rows of the flattened batch (a positive int).
    optimize : str or object, optional
        Path optimizer, see [`plan_contraction`][mumoe_tn.contractions.plan.plan_contraction] (default ``"auto"``).
    memory_limit : int or "max_input", optional
        Most elements any intermediate may hold, see `plan_contraction` (default: the bound of
        [`memory_bound`][mumoe_tn.contractions.plan.memory_bound]).

    Returns
    -------
    ContractionPlan
    """
    batch_size = _check_batch(batch_size)
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch_size}
    return plan_contraction(inputs, output, sizes, optimize, lead=BATCH_LABEL, memory_limit=memory_limit)


def forward_candidates(
    network: ExpertNetwork, batch_size: int, *, thorough: bool = True, memory_limit: int | str | None = None
) -> list[ContractionPlan]:
    """Candidate plans of the forward pass, cheapest first (see `candidate_plans`).

    Parameters
    ----------
    network : ExpertNetwork
        The decomposition.
    batch_size : int
        Rows of the flattened batch.
    thorough : bool, optional
        Ask slower finders too on small networks (default True).
    memory_limit : int or "max_input", optional
        As for `candidate_plans`.

    Returns
    -------
    list of ContractionPlan
    """
    batch_size = _check_batch(batch_size)
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch_size}
    return candidate_plans(inputs, output, sizes, lead=BATCH_LABEL, thorough=thorough, memory_limit=memory_limit)


#: How many of the cheapest candidate paths (by FMA count) autotuning times, each in two layouts.
AUTOTUNE_CANDIDATES = 3
#: Candidate paths costing more than this multiple of the cheapest one's FMAs are not timed.
AUTOTUNE_FMA_SLACK = 4.0


def autotune_candidates(
    network: ExpertNetwork, batch_size: int, *, memory_limit: int | str | None = None
) -> list[ContractionPlan]:
    """The plans autotuning times: the cheapest few paths, each batch-leading and as found.

    Up to [`AUTOTUNE_CANDIDATES`][mumoe_tn.contractions.plan] distinct paths within
    [`AUTOTUNE_FMA_SLACK`][mumoe_tn.contractions.plan] of the cheapest, each laid out with the batch leading every
    intermediate (batched matrix products) and with the labels in the order the operands bring them; identical layouts
    appear once.

    Parameters
    ----------
    network : ExpertNetwork
        The decomposition.
    batch_size : int
        Rows of the flattened batch.
    memory_limit : int or "max_input", optional
        Only paths within this bound are timed (default: the bound of
        [`memory_bound`][mumoe_tn.contractions.plan.memory_bound]).

    Returns
    -------
    list of ContractionPlan
        Cheapest path first; the same FMA count for both layouts of a path.
    """
    plans = forward_candidates(network, batch_size, memory_limit=memory_limit)
    choose_plan(plans, memory_limit)  # refuses a limit that no candidate fits
    bound = memory_bound(plans, memory_limit)
    plans = [plan for plan in plans if plan.largest_intermediate <= bound]
    cheapest = plans[0].fma
    chosen = [plan for plan in plans if plan.fma <= AUTOTUNE_FMA_SLACK * cheapest][:AUTOTUNE_CANDIDATES]
    found: dict[tuple[ContractionStep, ...], ContractionPlan] = {}
    for plan in chosen:
        for variant in (plan, replace(_layout(plan.inputs, plan.output, plan.sizes, plan.path, None), note=plan.note)):
            found.setdefault(variant.steps, variant)
    return list(found.values())


@lru_cache(maxsize=128)
def _cached_dense_plan(network: ExpertNetwork, optimize: str) -> ContractionPlan:
    inputs, output = network.dense_equation()
    return plan_contraction(inputs, output, network.sizes, optimize)


def plan_dense(network: ExpertNetwork, optimize: Any = "auto") -> ContractionPlan:
    """Plan the materialisation of the dense tensor ``W`` (cores -> ``n1 … nE i o``)."""
    if isinstance(optimize, str) and optimize != "cotengra":
        return _cached_dense_plan(network, optimize)
    inputs, output = network.dense_equation()
    return plan_contraction(inputs, output, network.sizes, optimize)


def _left_out(notes: Sequence[str]) -> str:
    """The note of a plan chosen among candidates when some finders were left out for their effort."""
    return "\n".join(f"left out {note}" for note in notes)


def _size(labels: Sequence[str] | set[str], sizes: Mapping[str, int]) -> int:
    total = 1
    for label in labels:
        total *= sizes[label]
    return total
