"""The block-level metrics of the frontier: small registered objects that the evaluation updates.

A metric is a [`Metric`][mumoe_tn.distillation.metrics.Metric]: a fresh one per replacement is
[`update`][mumoe_tn.distillation.metrics.Metric.update]d with every held-out batch — the
replacement's prediction and the block's output at the real tokens (float64 ``(rows, O)``), and
its sparse code, one ``(rows, units_e)`` per expert mode (None for a replacement without one) —
and its [`value`][mumoe_tn.distillation.metrics.Metric.value] is read at the end. A class
registers itself when it is defined with a ``name=`` keyword, as losses do;
[`register_metric`][mumoe_tn.distillation.metrics.register_metric] does the same for a class
defined without one. A new metric is one class in one place:

```python
from mumoe_tn.distillation.metrics import Metric

class MeanAbsoluteError(Metric, name="mae", column="mean absolute error"):
    def __init__(self):
        self.total, self.count = 0.0, 0

    def update(self, prediction, target, codes):
        self.total += float((prediction - target).abs().sum())
        self.count += target.numel()

    def value(self):
        return self.total / self.count
```

[`evaluate_replacements`][mumoe_tn.distillation.faithfulness.evaluate_replacements] measures every
registered metric (or those its ``metrics=`` names): the shipped ones fill the
[`FrontierRow`][mumoe_tn.distillation.frontier.FrontierRow]'s own fields, the others its
``extra`` (extra columns of the table). The shipped metrics:

- ``"l0"``: units active per token (with several expert modes, the product of the modes' counts);
- ``"nmse"``: ``Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t‖²``;
- ``"explained-variance"``: ``1 − Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t − ȳ‖²``;
- ``"dead"``: units never active; ``"units"``: the units (every expert mode's coefficients).

Names are case-insensitive and unique. This module is the only place that maps a name to a metric.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import torch

from mumoe_tn.registry import Registry

__all__ = [
    "L0",
    "METRICS",
    "NMSE",
    "ROW_METRICS",
    "Dead",
    "ExplainedVariance",
    "Metric",
    "Units",
    "available_metrics",
    "register_metric",
    "resolve_metrics",
    "unregister_metric",
]

_Class = TypeVar("_Class", bound=type)

Code = tuple[torch.Tensor, ...] | None


class Metric:
    """A block-level metric of one replacement: ``update`` per batch, then ``value``.

    Subclass with ``name=`` (and optionally ``column=``, the table's header; default the name) to
    register (``class MyMetric(Metric, name="my-metric")``; a name already registered raises
    ``ValueError`` unless ``replace=True`` is given too), set the running state in
    ``__init__`` (called without arguments, once per replacement) and implement ``update`` and
    ``value``.
    """

    name: ClassVar[str] = ""
    column: ClassVar[str] = ""
    #: The FrontierRow field a shipped metric fills; None (a user's metric) puts it in ``extra``.
    row_field: ClassVar[str | None] = None

    def __init_subclass__(
        cls, *, name: str | None = None, column: str | None = None, replace: bool = False, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if column is not None:
            cls.column = column
        if name is not None:
            register_metric(cls, name=name, replace=replace)

    def update(self, prediction: torch.Tensor, target: torch.Tensor, codes: Code) -> None:
        """Add one batch: ``prediction`` and ``target`` float64 ``(rows, O)`` at the real tokens; the sparse code."""
        raise NotImplementedError(f"{type(self).__name__} must implement update(prediction, target, codes)")

    def value(self) -> float:
        """The metric over every batch added so far."""
        raise NotImplementedError(f"{type(self).__name__} must implement value()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


#: The registered metric classes by lower-case name (a [`Registry`][mumoe_tn.registry.Registry]).
METRICS: Registry[str, type[Metric]] = Registry("metric", normalise=str.lower)


def register_metric(cls: _Class, *, name: str | None = None, replace: bool = False) -> _Class:
    """Register a [`Metric`][mumoe_tn.distillation.metrics.Metric] subclass under ``name`` (default its ``name``).

    Subclassing ``Metric`` with ``name=`` calls this for you.

    Parameters
    ----------
    cls : type
        A subclass of ``Metric``.
    name : str, optional
        The name (lower-cased); default the class's ``name`` attribute.
    replace : bool, optional
        Replace a metric already registered under that name (default: raise).

    Returns
    -------
    type
        ``cls``, for use as a decorator.

    Raises
    ------
    TypeError
        If ``cls`` is not a ``Metric`` subclass.
    ValueError
        If the name is empty, or taken and ``replace`` is False.
    """
    METRICS.register_subclass(cls, Metric, name=name, replace=replace)
    if not cls.column:
        cls.column = cls.name
    return cls


def unregister_metric(name: str) -> None:
    """Remove the metric registered under ``name`` (e.g. at the end of a test); an unknown name is ignored."""
    METRICS.unregister(name)


def available_metrics() -> list[str]:
    """Sorted names of the registered metrics."""
    return METRICS.names()


def resolve_metrics(spec: Sequence[str | type[Metric]] | None = None) -> tuple[type[Metric], ...]:
    """The metric classes to measure: the row's own, then the others ``spec`` names.

    Parameters
    ----------
    spec : Sequence of str or Metric subclasses, optional
        Registered names or named ``Metric`` subclasses (default every registered metric). The
        row's own ([`ROW_METRICS`][mumoe_tn.distillation.metrics.ROW_METRICS]) come first, always.

    Returns
    -------
    tuple of type
    """
    if spec is None:
        spec = available_metrics()
    if isinstance(spec, (str, type)) or not isinstance(spec, Sequence):
        raise TypeError(f"metrics must be a sequence of metric names or Metric subclasses, got {spec!r:.80}")
    chosen: list[type[Metric]] = []
    for item in spec:
        if isinstance(item, str):
            chosen.append(METRICS.lookup(item))
        elif isinstance(item, type) and issubclass(item, Metric) and item.name:
            chosen.append(item)
        else:
            raise TypeError(f"a metric must be a registered name or a named Metric subclass, got {item!r:.80}")
    others = [cls for cls in dict.fromkeys(chosen) if cls.row_field is None]
    return (*ROW_METRICS, *others)


class L0(Metric, name="l0", column="L0"):
    """Units active per token: with several expert modes, the product of the modes' active counts."""

    row_field = "l0"

    def __init__(self) -> None:
        self.active, self.tokens, self.coded = 0.0, 0, False

    def update(self, prediction: torch.Tensor, target: torch.Tensor, codes: Code) -> None:
        self.tokens += target.shape[0]
        if codes:
            count = torch.ones(codes[0].shape[0], dtype=torch.float64, device=codes[0].device)
            for part in codes:
                count = count * (part != 0).sum(-1).double()
            self.active += float(count.sum())
            self.coded = True

    def value(self) -> float:
        return self.active / max(self.tokens, 1) if self.coded else math.nan


class NMSE(Metric, name="nmse", column="normalised MSE"):
    """``Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t‖²`` (NaN when the target is zero)."""

    row_field = "nmse"

    def __init__(self) -> None:
        self.squared_error, self.target_energy = 0.0, 0.0

    def update(self, prediction: torch.Tensor, target: torch.Tensor, codes: Code) -> None:
        self.squared_error += float((prediction - target).pow(2).sum())
        self.target_energy += float(target.pow(2).sum())

    def value(self) -> float:
        return self.squared_error / self.target_energy if self.target_energy > 0 else math.nan


class ExplainedVariance(NMSE, name="explained-variance", column="explained variance"):
    """``1 − Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t − ȳ‖²`` (NaN when the target does not vary)."""

    row_field = "explained_variance"

    def __init__(self) -> None:
        super().__init__()
        self.target_sum: torch.Tensor | None = None
        self.tokens = 0

    def update(self, prediction: torch.Tensor, target: torch.Tensor, codes: Code) -> None:
        super().update(prediction, target, codes)
        total = target.sum(0)
        self.target_sum = total if self.target_sum is None else self.target_sum + total
        self.tokens += target.shape[0]

    def value(self) -> float:
        if self.target_sum is None:
            return math.nan
        mean = self.target_sum / max(self.tokens, 1)
        variance = self.target_energy - self.tokens * float(mean.pow(2).sum())
        return 1 - self.squared_error / variance if variance > 0 else math.nan


class Units(Metric, name="units", column="units"):
    """The units of the sparse code (every expert mode's); 0 for a replacement without one."""

    row_field = "units"

    def __init__(self) -> None:
        self.hits: torch.Tensor | None = None

    def update(self, prediction: torch.Tensor, target: torch.Tensor, codes: Code) -> None:
        if codes:
            hits = torch.cat([(part != 0).sum(0) for part in codes]).cpu()
            self.hits = hits if self.hits is None else self.hits + hits

    def value(self) -> int:
        return 0 if self.hits is None else self.hits.numel()


class Dead(Units, name="dead", column="dead units"):
    """Units never active on the evaluation tokens."""

    row_field = "dead"

    def value(self) -> int:
        return 0 if self.hits is None else int((self.hits == 0).sum())


ROW_METRICS: tuple[type[Metric], ...] = (L0, NMSE, ExplainedVariance, Dead, Units)
"""The metrics every frontier row holds in its own fields, always measured."""
