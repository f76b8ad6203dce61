"""Paired comparisons of two replacements of one block, by a bootstrap over held-out sequences.

Two methods evaluated on the same held-out sequences are compared sequence by sequence: each
resample draws the sequences with replacement once and computes both methods' scores on that
draw, so the noise the two share (hard sequences are hard for both) cancels, and the interval of
the difference is much narrower than the two intervals side by side. With several seeds (one
table per seed, each evaluated on the same sequences) the difference is averaged over the seeds
within every resample: the interval is then that of the seed-averaged difference over the
sequences' noise. Seeds themselves are not resampled — with two or three of them a resampling of
seeds says nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mumoe_tn.distillation.methods import reference_methods

__all__ = [
    "MAX_SEQUENCES",
    "PairedDifference",
    "SequenceLosses",
    "check_bootstrap",
    "paired_against",
    "paired_difference",
]

#: Most held-out sequences a table keeps per-sequence losses of (a saved table is read back as data).
MAX_SEQUENCES = 1_000_000


def _vector(name: str, values: Any, length: int | None = None) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers") from None
    if array.ndim != 1 or (length is not None and array.shape[0] != length):
        expected = "a 1-D list" if length is None else f"{length} numbers (one per sequence)"
        raise ValueError(f"{name} must hold {expected}, got shape {array.shape}")
    if array.shape[0] > MAX_SEQUENCES:
        raise ValueError(f"{name} holds {array.shape[0]:,} sequences, more than the {MAX_SEQUENCES:,} allowed")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must hold finite numbers")
    return array


@dataclass(frozen=True, eq=False)
class SequenceLosses:
    """Per held-out sequence: summed next-token cross-entropies (nats) and predictions.

    Attributes
    ----------
    tokens : numpy.ndarray
        Predictions per sequence.
    clean : numpy.ndarray
        The model as it is.
    zero : Mapping[str, numpy.ndarray]
        Block -> the model with that block zero-ablated.
    spliced : Mapping[str, Mapping[str, numpy.ndarray]]
        Block -> method -> the model with that replacement spliced in.
    """

    tokens: np.ndarray
    clean: np.ndarray
    zero: Mapping[str, np.ndarray]
    spliced: Mapping[str, Mapping[str, np.ndarray]]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists of numbers) for JSON."""
        return {
            "tokens": self.tokens.tolist(),
            "clean": self.clean.tolist(),
            "zero": {block: values.tolist() for block, values in self.zero.items()},
            "spliced": {b: {m: v.tolist() for m, v in methods.items()} for b, methods in self.spliced.items()},
        }

    @classmethod
    def from_dict(cls, data: Any) -> SequenceLosses:
        """The losses [`to_dict`][mumoe_tn.distillation.paired.SequenceLosses.to_dict] wrote, checked field by field."""
        if not isinstance(data, Mapping) or set(data) != {"tokens", "clean", "zero", "spliced"}:
            raise ValueError("a table's sequences must be an object with tokens, clean, zero and spliced")
        tokens = _vector("sequences.tokens", data["tokens"])
        if np.any(tokens < 0) or np.any(tokens != np.round(tokens)):
            raise ValueError("sequences.tokens must be whole numbers of predictions, none negative")
        length = tokens.shape[0]
        clean = _vector("sequences.clean", data["clean"], length)
        zero, spliced = data["zero"], data["spliced"]
        if not isinstance(zero, Mapping) or not isinstance(spliced, Mapping) or set(zero) != set(spliced):
            raise ValueError("sequences.zero and sequences.spliced must be objects over the same blocks")
        if any(not isinstance(methods, Mapping) for methods in spliced.values()):
            raise ValueError("sequences.spliced must map each block to an object of methods")
        return cls(
            tokens,
            clean,
            {block: _vector(f"sequences.zero[{block!r:.60}]", values, length) for block, values in zero.items()},
            {
                block: {
                    method: _vector(f"sequences.spliced[{block!r:.60}][{method!r:.60}]", values, length)
                    for method, values in methods.items()
                }
                for block, methods in spliced.items()
            },
        )


@dataclass(frozen=True)
class PairedDifference:
    """``method − baseline`` on one block, with bootstrap intervals over the held-out sequences.

    Attributes
    ----------
    block, method, baseline : str
        What was compared.
    seeds, sequences : int
        Tables (seeds) averaged over; held-out sequences resampled.
    score, score_low, score_high : float
        The CE-loss score's difference (positive: ``method`` recovers more of the block) and its
        interval; NaN where the block's zero-ablation does not raise the loss.
    ce, ce_low, ce_high : float
        The spliced cross-entropy's difference in nats per prediction (negative: ``method`` is
        better) and its interval.
    level : float
        The intervals' coverage.
    """

    block: str
    method: str
    baseline: str
    seeds: int
    sequences: int
    score: float
    score_low: float
    score_high: float
    ce: float
    ce_low: float
    ce_high: float
    level: float

    @property
    def decided(self) -> bool:
        """Whether the CE interval excludes 0: one method is better beyond the sequences' noise."""
        return self.ce_low > 0 or self.ce_high < 0

    def __str__(self) -> str:
        def interval(value: float, low: float, high: float, digits: int) -> str:
            if math.isnan(value):
                return "n/a"
            return f"{value:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"

        score = interval(self.score, self.score_low, self.score_high, 3)
        ce = interval(self.ce, self.ce_low, self.ce_high, 4)
        return (
            f"{self.method} − {self.baseline} on {self.block}: score {score}, CE {ce} nats "
            f"({self.seeds} seed(s), {self.sequences} sequences)"
        )


def check_bootstrap(resamples: int, level: float) -> None:
    """Refuse a bootstrap's options unless ``resamples`` is a positive int and ``level`` lies in (0, 1)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a positive int, got {resamples!r}")


def _losses(table: Any, block: str, names: Sequence[str]) -> SequenceLosses:
    """``table``'s per-sequence losses, with ``block`` and every method of ``names`` in them."""
    losses = table.sequences
    if block not in losses.spliced:
        raise ValueError(f"block {block!r} is not in the table; its blocks: {sorted(losses.spliced)}")
    missing = [name for name in names if name not in losses.spliced[block]]
    if missing:
        raise ValueError(
            f"method(s) {missing} not evaluated on {block!r}; its methods: {sorted(losses.spliced[block])}"
        )
    return losses


def paired_difference(
    tables: Any,
    method: str,
    baseline: str,
    *,
    block: str | None = None,
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> PairedDifference:
    """The paired difference ``method − baseline`` on one block, over one table or one per seed.

    Parameters
    ----------
    tables : FrontierTable or Sequence of FrontierTable
        One evaluation (one seed), or one per seed, each evaluated on the same held-out sequences.
    method, baseline : str
        Two methods of the block.
    block : str, optional
        The block (default the tables' only block).
    resamples, level, seed : optional
        As for [`bootstrap_ce_score`][mumoe_tn.distillation.frontier.bootstrap_ce_score]: 1,000
        resamples, 95 % intervals, seed 0 by default.

    Returns
    -------
    PairedDifference
        Point estimates from every sequence, percentile intervals from the resamples.
    """
    group = [tables] if hasattr(tables, "rows") else list(tables)
    if not group:
        raise ValueError("paired_difference needs at least one table")
    check_bootstrap(resamples, level)
    if any(not isinstance(getattr(table, "sequences", None), SequenceLosses) for table in group):
        raise ValueError(
            "this table keeps no per-sequence losses: evaluate the replacements with evaluate_replacements "
            "(a table read from an older file has none)"
        )
    if block is None:
        blocks = {b for table in group for b in table.sequences.spliced}
        if len(blocks) != 1:
            raise ValueError(f"give block= (the tables hold blocks {sorted(blocks)})")
        (block,) = blocks
    losses = [_losses(table, block, (method, baseline)) for table in group]
    first = losses[0]
    for k, other in enumerate(losses[1:], start=1):
        if not (np.array_equal(other.tokens, first.tokens) and np.allclose(other.clean, first.clean)):
            raise ValueError(
                f"table {k} was not evaluated on table 0's held-out sequences (their tokens or clean losses differ): "
                "a paired comparison needs the same sequences"
            )
    tokens = first.tokens
    gap = np.mean([lo.zero[block] for lo in losses], axis=0) - first.clean
    better = np.mean([lo.spliced[block][baseline] - lo.spliced[block][method] for lo in losses], axis=0)

    def estimates(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        gaps, gains, predictions = weights @ gap, weights @ better, weights @ tokens
        with np.errstate(divide="ignore", invalid="ignore"):
            return gains / gaps, -gains / predictions

    score, ce = (float(v[0]) for v in estimates(np.ones((1, tokens.shape[0]))))
    n = tokens.shape[0]
    generator = np.random.default_rng(seed)
    scores, ces = estimates(generator.multinomial(n, np.full(n, 1 / n), size=resamples).astype(np.float64))
    tail = 100 * (1 - level) / 2
    usable = np.isfinite(scores)
    score_low, score_high = np.percentile(scores[usable], [tail, 100 - tail]) if usable.sum() > 1 else (math.nan,) * 2
    ce_low, ce_high = np.percentile(ces[np.isfinite(ces)], [tail, 100 - tail]) if n > 1 else (math.nan,) * 2
    if not gap.sum() > 0:
        score = score_low = score_high = math.nan
    return PairedDifference(
        block, method, baseline, len(group), n,
        score, float(score_low), float(score_high), ce, float(ce_low), float(ce_high), level,
    )  # fmt: skip


def paired_against(table: Any, baselines: Sequence[str] | None = None, **options: Any) -> list[PairedDifference]:
    """Every other method of every block against each baseline at the same requested L0.

    Parameters
    ----------
    table : FrontierTable
        An evaluation that kept its per-sequence losses.
    baselines : Sequence[str], optional
        Method families (the name before ``@``) to compare against (default the registered
        references, the transcoders: see [`reference_methods`][mumoe_tn.distillation.methods.reference_methods]).
    **options
        Passed to [`paired_difference`][mumoe_tn.distillation.paired.paired_difference].

    Returns
    -------
    list of PairedDifference
        In the table's row order; empty where the table has no baseline or no per-sequence losses.
    """
    if not isinstance(getattr(table, "sequences", None), SequenceLosses):
        return []
    if baselines is None:
        baselines = reference_methods()
    found = []
    for row in table.rows:
        if row.family in baselines or row.requested_l0 is None:
            continue
        for baseline in baselines:
            reference = next(
                (r for r in table.rows if r.block == row.block and r.family == baseline
                 and r.requested_l0 == row.requested_l0),
                None,
            )  # fmt: skip
            if reference is not None:
                found.append(paired_difference(table, row.method, reference.method, block=row.block, **options))
    return found
