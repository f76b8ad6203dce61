"""Planning: an opt_einsum path turned into explicit pairwise steps.

opt_einsum only *plans* here (it finds a path from shapes); the steps are executed by
[`mumoe_tn.contractions.execute.run_plan`][mumoe_tn.contractions.execute.run_plan] as plain ``torch.einsum`` calls,
which keeps the forward pass compile-friendly (no backend import at call time), autocast-safe (no ``tensordot``
on mixed dtypes) and free of per-call path searches. This module does not import torch.
"""

from __future__ import annotations

import importlib.util
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import opt_einsum

from mumoe_tn.contractions.search import candidate_paths
from mumoe_tn.network import BATCH_LABEL, ExpertNetwork

__all__ = [
    "OPTIMIZERS",
    "ContractionPlan",
    "ContractionStep",
    "autotune_candidates",
    "candidate_plans",
    "constant_elements",
    "constant_steps",
    "einsum_equation",
    "forward_candidates",
    "per_call_fma",
    "plan_contraction",
    "plan_dense",
    "plan_forward",
    "plan_inference",
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

#: torch.einsum accepts only these subscripts: symbols are assigned per pairwise step.
EINSUM_SYMBOLS = string.ascii_letters

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
    """

    inputs: tuple[Labels, ...]
    output: Labels
    sizes: Mapping[str, int]
    steps: tuple[ContractionStep, ...]
    path: tuple[tuple[int, ...], ...]

    @property
    def fma(self) -> int:
        """Total fused multiply-adds of the planned contraction (1 FMA = 1 FLOP)."""
        return sum(step.fma for step in self.steps)

    @property
    def largest_intermediate(self) -> int:
        """Number of elements of the largest intermediate or result."""
        return max((_size(step.output, self.sizes) for step in self.steps), default=0)

    def __repr__(self) -> str:
        output = " ".join("…" if x == BATCH_LABEL else x for x in self.output)
        lines = [f"ContractionPlan({len(self.inputs)} operands -> ({output}), {self.fma:,} FMA)"]
        lines += [f"  {k}: {step.describe()}  {step.fma:,} FMA" for k, step in enumerate(self.steps)]
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


def _check_path(path: Sequence[Any], n_operands: int) -> tuple[tuple[int, ...], ...]:
    """Check an explicit path against the operand count; return it as tuples of ints."""
    remaining = n_operands
    checked = []
    for number, step in enumerate(path):
        if (
            not isinstance(step, tuple)
            or not step
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in step)
            or len(set(step)) != len(step)
        ):
            raise ValueError(
                f"explicit path step {number} must be a non-empty tuple of distinct int positions, got {step!r}"
            )
        if not all(0 <= k < remaining for k in step):
            raise ValueError(
                f"explicit path step {number} {step!r} refers to a position outside 0..{remaining - 1} "
                f"(the operand list has {remaining} entries at that step)"
            )
        remaining -= len(step) - 1
        checked.append(step)
    if remaining != 1 or not checked:
        raise ValueError(
            f"explicit path {tuple(path)!r} leaves {remaining} operand(s) of {n_operands}; "
            "a path must contract every operand into one result"
        )
    return tuple(checked)


def einsum_equation(operands: Sequence[Labels], result: Labels) -> str:
    """A ``torch.einsum`` equation for labelled operands, with symbols assigned per call (a-z, A-Z).

    Parameters
    ----------
    operands : Sequence of tuple of str
        Labels of each operand.
    result : tuple of str
        Labels of the result.

    Returns
    -------
    str
        E.g. ``"ab,bc->ac"``; a ``ValueError`` when more than 52 distinct labels meet.
    """
    labels = list(dict.fromkeys((*(x for labels in operands for x in labels), *result)))
    if len(labels) > len(EINSUM_SYMBOLS):
        raise ValueError(
            f"a contraction step joins {len(labels)} distinct labels but torch.einsum accepts at most "
            f"{len(EINSUM_SYMBOLS)} per call: {labels}"
        )
    symbol = dict(zip(labels, EINSUM_SYMBOLS, strict=False))
    equation = ",".join("".join(symbol[x] for x in labels) for labels in operands)
    return equation + "->" + "".join(symbol[x] for x in result)


def _layout(
    inputs: tuple[Labels, ...],
    output: Labels,
    sizes: Mapping[str, int],
    path: Sequence[tuple[int, ...]],
    lead: str | None,
) -> ContractionPlan:
    """Turn a path into explicit steps with their equations and FMA counts."""
    steps = []
    current = list(inputs)
    for number, positions in enumerate(path):
        positions = tuple(sorted(positions, reverse=True))
        operands = [current.pop(k) for k in positions]
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
        union = {label for labels in operands for label in labels}
        factor = max(len(operands) - 1, 1)
        equation = einsum_equation(operands, result)
        steps.append(ContractionStep(positions, equation, result, factor * _size(union, sizes), tuple(operands)))
        current.append(result)
    return ContractionPlan(inputs, output, dict(sizes), tuple(steps), tuple(tuple(p) for p in path))


def _check_labels(inputs: tuple[Labels, ...], output: Labels, sizes: Mapping[str, int]) -> None:
    if not inputs:
        raise ValueError("a contraction needs at least one operand")
    for labels in (*inputs, output):
        for label in labels:
            if label not in sizes:
                raise ValueError(f"label {label!r} has no size; sizes are given for {sorted(sizes)}")
    missing = set(output) - {x for labels in inputs for x in labels}
    if missing:
        raise ValueError(f"output labels {sorted(missing)} appear in no operand")


def candidate_plans(
    inputs: Sequence[Sequence[str]],
    output: Sequence[str],
    sizes: Mapping[str, int],
    *,
    lead: str | None = None,
    thorough: bool = False,
) -> list[ContractionPlan]:
    """Distinct plans from the path finders suited to the network's size, cheapest first.

    Parameters
    ----------
    inputs, output, sizes, lead
        As for [`plan_contraction`][mumoe_tn.contractions.plan.plan_contraction].
    thorough : bool, optional
        Ask slower finders too on small networks (more candidates to time when autotuning).

    Returns
    -------
    list of ContractionPlan
        Sorted by FMA count, then by largest intermediate (ties keep the finders' order).
    """
    inputs = tuple(tuple(labels) for labels in inputs)
    output = tuple(output)
    _check_labels(inputs, output, sizes)
    plans, problems = [], []
    for path in candidate_paths(inputs, output, sizes, thorough=thorough):
        try:
            plans.append(_layout(inputs, output, sizes, path, lead))
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
        keeps the cheapest of the candidate paths of [`candidate_plans`][mumoe_tn.contractions.plan.candidate_plans],
        with bounded planning time.
    lead : str, optional
        A label kept first in every intermediate that carries it (the batch label), so that
        pairwise steps run as batched matrix products with the batch leading.

    Returns
    -------
    ContractionPlan
    """
    inputs = tuple(tuple(labels) for labels in inputs)
    output = tuple(output)
    optimizer = resolve_optimizer(optimize)
    if isinstance(optimizer, str) and optimizer in SIZE_AWARE:
        return candidate_plans(inputs, output, sizes, lead=lead)[0]
    _check_labels(inputs, output, sizes)
    if isinstance(optimizer, tuple):
        path = _check_path(optimizer, len(inputs))
    elif len(inputs) == 1:
        path = ((0,),)
    else:
        symbol = {label: opt_einsum.get_symbol(k) for k, label in enumerate(sizes)}
        equation = ",".join("".join(symbol[x] for x in labels) for labels in inputs)
        equation += "->" + "".join(symbol[x] for x in output)
        shapes = [tuple(sizes[x] for x in labels) for labels in inputs]
        found, _ = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=optimizer)
        path = tuple(tuple(step) for step in found)
    return _layout(inputs, output, sizes, path, lead)


def constant_steps(plan: ContractionPlan, n_constant: int) -> frozenset[int]:
    """Indices of the steps whose inputs descend only from the first ``n_constant`` operands.

    With the cores first (as in [`plan_forward`][mumoe_tn.contractions.plan.plan_forward]), these are the parameter-only
    sub-contractions that inference can compute once and reuse.

    Parameters
    ----------
    plan : ContractionPlan
        The plan.
    n_constant : int
        How many leading operands are constant.

    Returns
    -------
    frozenset of int
    """
    constant = [k < n_constant for k in range(len(plan.inputs))]
    found = set()
    for number, step in enumerate(plan.steps):
        flags = [constant.pop(k) for k in step.positions]
        constant.append(all(flags))
        if all(flags):
            found.add(number)
    return frozenset(found)


def constant_elements(plan: ContractionPlan, steps: frozenset[int]) -> int:
    """Elements held by the cached results of ``steps``."""
    return sum(_size(plan.steps[number].output, plan.sizes) for number in steps)


def per_call_fma(plan: ContractionPlan, steps: frozenset[int]) -> int:
    """FMAs of a call that reuses the results of ``steps``."""
    return sum(step.fma for number, step in enumerate(plan.steps) if number not in steps)


def _check_batch(batch_size: object) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (rows of the flattened batch), got {batch_size!r}")
    return batch_size


def plan_forward(network: ExpertNetwork, batch_size: int, optimize: Any = "auto") -> ContractionPlan:
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

    Returns
    -------
    ContractionPlan
    """
    batch_size = _check_batch(batch_size)
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch_size}
    return plan_contraction(inputs, output, sizes, optimize, lead=BATCH_LABEL)


def forward_candidates(network: ExpertNetwork, batch_size: int, *, thorough: bool = True) -> list[ContractionPlan]:
    """Candidate plans of the forward pass, cheapest first (see `candidate_plans`).

    Parameters
    ----------
    network : ExpertNetwork
        The decomposition.
    batch_size : int
        Rows of the flattened batch.
    thorough : bool, optional
        Ask slower finders too on small networks (default True).

    Returns
    -------
    list of ContractionPlan
    """
    batch_size = _check_batch(batch_size)
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: batch_size}
    return candidate_plans(inputs, output, sizes, lead=BATCH_LABEL, thorough=thorough)


#: How many of the cheapest candidate paths (by FMA count) autotuning times, each in two layouts.
AUTOTUNE_CANDIDATES = 3
#: Candidate paths costing more than this multiple of the cheapest one's FMAs are not timed.
AUTOTUNE_FMA_SLACK = 4.0


def autotune_candidates(network: ExpertNetwork, batch_size: int) -> list[ContractionPlan]:
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

    Returns
    -------
    list of ContractionPlan
        Cheapest path first; the same FMA count for both layouts of a path.
    """
    plans = forward_candidates(network, batch_size)
    cheapest = plans[0].fma
    chosen = [plan for plan in plans if plan.fma <= AUTOTUNE_FMA_SLACK * cheapest][:AUTOTUNE_CANDIDATES]
    found: dict[tuple[ContractionStep, ...], ContractionPlan] = {}
    for plan in chosen:
        for variant in (plan, _layout(plan.inputs, plan.output, plan.sizes, plan.path, None)):
            found.setdefault(variant.steps, variant)
    return list(found.values())


#: Batch multipliers at which inference planning also searches: at a larger batch the finders
#: favour contracting the cores among themselves, which inference pays only once.
INFERENCE_SCALES = (1, 1 << 16)
#: Cached core-only intermediates may always hold this many elements (4 MiB in float32).
INFERENCE_CACHE_ELEMENTS = 1 << 20


def plan_inference(
    network: ExpertNetwork, batch_size: int, *, max_cached: int | None = None
) -> tuple[ContractionPlan, frozenset[int]]:
    """Plan the forward pass for constant cores: fewest FMAs per call, core-only steps free.

    Parameters
    ----------
    network : ExpertNetwork
        The decomposition.
    batch_size : int
        Rows of the flattened batch.
    max_cached : int, optional
        Most elements the cached core-only intermediates may hold (default: the larger of
        4 × the network's parameter count and [`INFERENCE_CACHE_ELEMENTS`][mumoe_tn.contractions.plan]). Plans that
        would cache more are counted without caching.

    Returns
    -------
    plan : ContractionPlan
        The plan (its ``fma`` counts every step).
    constant : frozenset of int
        The core-only steps to compute once (see [`constant_steps`][mumoe_tn.contractions.plan.constant_steps]); a call
        then costs [`per_call_fma`][mumoe_tn.contractions.plan.per_call_fma] FMAs.
    """
    batch_size = _check_batch(batch_size)
    limit = max(4 * network.n_params, INFERENCE_CACHE_ELEMENTS) if max_cached is None else max_cached
    inputs, output = network.forward_equation()
    inputs = tuple(tuple(labels) for labels in inputs)
    output = tuple(output)
    sizes = {**network.sizes, BATCH_LABEL: batch_size}
    best: tuple[tuple[int, int], ContractionPlan, frozenset[int]] | None = None
    for scale in INFERENCE_SCALES:
        for path in candidate_paths(inputs, output, {**sizes, BATCH_LABEL: batch_size * scale}):
            try:
                plan = _layout(inputs, output, sizes, path, BATCH_LABEL)
            except ValueError:
                continue
            steps = constant_steps(plan, len(network.cores))
            if constant_elements(plan, steps) > limit:
                steps = frozenset()
            key = (per_call_fma(plan, steps), constant_elements(plan, steps))
            if best is None or key < best[0]:
                best = (key, plan, steps)
    if best is None:
        plan = plan_forward(network, batch_size)
        return plan, frozenset()
    return best[1], best[2]


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


def _size(labels: Sequence[str] | set[str], sizes: Mapping[str, int]) -> int:
    total = 1
    for label in labels:
        total *= sizes[label]
    return total
