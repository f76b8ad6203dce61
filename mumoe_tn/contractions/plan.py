"""Planning: an opt_einsum path turned into explicit pairwise steps.

opt_einsum only *plans* here (it finds a path from shapes); the steps are executed by
[`mumoe_tn.contractions.execute.run_plan`][mumoe_tn.contractions.execute.run_plan] as plain ``torch.einsum`` calls,
which keeps the forward pass compile-friendly (no backend import at call time), autocast-safe (no ``tensordot``
on mixed dtypes) and free of per-call path searches. This module does not import torch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import opt_einsum

from mumoe_tn.network import _BATCH, ExpertNetwork

__all__ = [
    "OPTIMIZERS",
    "ContractionPlan",
    "ContractionStep",
    "plan_contraction",
    "plan_dense",
    "plan_forward",
    "resolve_optimizer",
]

#: Named path optimizers accepted as ``optimize=`` ("cotengra" needs cotengra installed).
OPTIMIZERS = (
    "auto",
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
            return "(" + " ".join("…" if x == _BATCH else x for x in labels) + ")"

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
        output = " ".join("…" if x == _BATCH else x for x in self.output)
        lines = [f"ContractionPlan({len(self.inputs)} operands -> ({output}), {self.fma:,} FMA)"]
        lines += [f"  {k}: {step.describe()}  {step.fma:,} FMA" for k, step in enumerate(self.steps)]
        return "\n".join(lines)


def resolve_optimizer(optimize: Any) -> Any:
    """Validate ``optimize`` and return what opt_einsum's ``optimize=`` accepts.

    Parameters
    ----------
    optimize : str or opt_einsum.paths.PathOptimizer or callable
        A name from [`OPTIMIZERS`][mumoe_tn.contractions.plan] (``"cotengra"`` builds a
        ``cotengra.HyperOptimizer``), an optimizer object (opt_einsum or cotengra), or an
        explicit path as a sequence of position tuples.

    Returns
    -------
    object
        The optimizer to hand to opt_einsum.
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
    if callable(optimize) or isinstance(optimize, Sequence):
        return optimize
    raise TypeError(f"optimize must be an optimizer name, an optimizer object or a path, got {optimize!r}")


def plan_contraction(
    inputs: Sequence[Sequence[str]],
    output: Sequence[str],
    sizes: Mapping[str, int],
    optimize: Any = "dp",
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
        Path optimizer (see [`resolve_optimizer`][mumoe_tn.contractions.plan.resolve_optimizer]); ``"dp"`` by default,
        which handles hyperedges well.
    lead : str, optional
        A label kept first in every intermediate that carries it (the batch label), so that
        pairwise steps run as batched matrix products with the batch leading.

    Returns
    -------
    ContractionPlan
    """
    inputs = tuple(tuple(labels) for labels in inputs)
    output = tuple(output)
    symbol = {label: opt_einsum.get_symbol(k) for k, label in enumerate(sizes)}
    equation = ",".join("".join(symbol[x] for x in labels) for labels in inputs)
    equation += "->" + "".join(symbol[x] for x in output)
    shapes = [tuple(sizes[x] for x in labels) for labels in inputs]
    if len(inputs) == 1:
        path: list[tuple[int, ...]] = [(0,)]
    else:
        path, _ = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=resolve_optimizer(optimize))
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
        step_eq = ",".join("".join(symbol[x] for x in labels) for labels in operands)
        step_eq += "->" + "".join(symbol[x] for x in result)
        steps.append(ContractionStep(positions, step_eq, result, factor * _size(union, sizes), tuple(operands)))
        current.append(result)
    return ContractionPlan(inputs, output, dict(sizes), tuple(steps), tuple(tuple(p) for p in path))


def plan_forward(network: ExpertNetwork, batch_size: int, optimize: Any = "dp") -> ContractionPlan:
    """Plan the factorized forward pass of ``network`` for a flattened batch of ``batch_size``.

    Operands: the cores in order, one coefficient tensor ``(B, N_e)`` per expert mode, then
    the input ``(B, I)``; result ``(B, O)``.
    """
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, _BATCH: batch_size}
    return plan_contraction(inputs, output, sizes, optimize, lead=_BATCH)


@lru_cache(maxsize=128)
def _cached_dense_plan(network: ExpertNetwork, optimize: str) -> ContractionPlan:
    inputs, output = network.dense_equation()
    return plan_contraction(inputs, output, network.sizes, optimize)


def plan_dense(network: ExpertNetwork, optimize: Any = "dp") -> ContractionPlan:
    """Plan the materialisation of the dense tensor ``W`` (cores -> ``n1 … nE i o``)."""
    if isinstance(optimize, str):
        return _cached_dense_plan(network, optimize)
    inputs, output = network.dense_equation()
    return plan_contraction(inputs, output, network.sizes, optimize)


def _size(labels: Sequence[str] | set[str], sizes: Mapping[str, int]) -> int:
    total = 1
    for label in labels:
        total *= sizes[label]
    return total
