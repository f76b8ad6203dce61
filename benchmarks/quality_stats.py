"""Statistics of the quality benchmark: mean ± standard deviation and t-intervals over seeds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats

__all__ = ["Interval", "mean_std", "paired_differences", "t_interval"]


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided confidence interval over ``n`` values."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        """Half the interval's width (``nan`` for fewer than two values)."""
        return (self.high - self.low) / 2

    def excludes_zero(self) -> bool:
        """Whether the interval lies entirely on one side of 0."""
        return self.low > 0 or self.high < 0


def _values(values: Sequence[float]) -> list[float]:
    values = [float(v) for v in values]
    if not values:
        raise ValueError("need at least one value, got none")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"values must be finite, got {values}")
    return values


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``n - 1`` in the denominator; ``nan`` for one value)."""
    values = _values(values)
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Student-t interval of the mean: ``mean ± t_{(1+c)/2, n-1} · s / √n`` (``nan`` bounds for one value)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    mean, spread = mean_std(values)
    n = len(values)
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * spread / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def paired_differences(
    values: Mapping[int, float], reference: Mapping[int, float], relative: bool = True
) -> list[float]:
    """Per-seed differences ``values[s] - reference[s]`` over the seeds both hold, in % of the reference if relative.

    Pairing by seed: the runs of one seed share the training batches, the evaluation batches and
    the initialisation of every part but the compared block, so the difference cancels what the
    seed does to both runs alike.
    """
    seeds = sorted(set(values) & set(reference))
    if not seeds:
        raise ValueError(f"no seed in common: {sorted(values)} and {sorted(reference)}")
    if relative:
        return [100.0 * (values[s] - reference[s]) / reference[s] for s in seeds]
    return [values[s] - reference[s] for s in seeds]
