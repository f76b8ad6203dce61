"""The sparsity–accuracy frontier of distilled MLP replacements: its rows, table and plot (torch-free).

Each row is one replacement of one MLP block, measured on held-out text as the field reports it
(Transcoders, Dunefsky et al. 2024; Mixture of Decoders, Oldfield et al. 2025):

- ``l0``: units active per token — latents for a transcoder, experts for a μMoE block (with
  several expert modes, the product of the modes' active counts);
- ``nmse``: normalised MSE of the block's output, ``Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t‖²``;
- ``explained_variance``: ``1 − Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t − ȳ‖²``;
- ``ce_clean``, ``ce_spliced``, ``ce_zero``: the model's next-token cross-entropy (nats per
  token) as it is, with the replacement spliced in for the block, and with the block's output zero;
- ``score``: the CE-loss score ``(CE_zero − CE_spliced) / (CE_zero − CE_clean)`` — 1 when the
  replacement is as good as the block, 0 when it is as bad as removing it — with a percentile
  bootstrap interval over the held-out sequences (``score_low``, ``score_high``). The score means
  nothing when zero-ablating the block does not raise the loss beyond its noise: when the
  bootstrap interval of the gap ``CE_zero − CE_clean`` (``gap_low``, ``gap_high``) reaches 0, or
  the gap is not positive, ``score`` is NaN (an empty cell) and the row is not ``meaningful``;
- ``kl_score``: ``1 − KL(clean ‖ spliced) / KL(clean ‖ zero-ablated)``, the KL divergences of
  the next-token distributions per token (``kl_spliced``, ``kl_zero``);
- ``loss_increase``: ``CE_spliced − CE_clean`` in nats per token;
- ``dead``: units never active on the evaluation tokens (of ``units``; a μMoE block's units
  are the coefficients of all its expert modes);
- ``extra``: the values of the other registered metrics (see
  [`mumoe_tn.distillation.metrics`][mumoe_tn.distillation.metrics]) by name, extra columns of the tables.

The tables mark what deserves a second look, with a footnote: a normalised MSE above 1 (worse
than predicting zero), an L0 below the requested one (the number after ``@``; a ReLU top-k gate
can leave some of its k units at zero), dead units above
[`DEAD_FRACTION`][mumoe_tn.distillation.frontier.DEAD_FRACTION] of the units, and a CE-loss score
outside [0, 1] whose whole interval is outside too (the spliced model better than the model itself,
or worse than removing the block: usually text unlike the model's training text).

A method's name may carry its sparsity setting after an ``@`` (``"transcoder@16"``): the plot
draws one line per name before the ``@``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from mumoe_tn.costs.display import FOOTNOTE_MARKS
from mumoe_tn.distillation.paired import PairedDifference, SequenceLosses, check_bootstrap, paired_difference

__all__ = [
    "DEAD_FRACTION",
    "L0_TOLERANCE",
    "FrontierRow",
    "FrontierTable",
    "ScoreInterval",
    "bootstrap_ce_score",
    "ce_loss_score",
    "frontier_figure",
    "plot_frontier",
]

DEAD_FRACTION = 0.1
"""A row is flagged when more than this fraction of its units never fired."""

L0_TOLERANCE = 0.01
"""A row is flagged when its L0 is below ``(1 − L0_TOLERANCE) × k`` for the requested ``k``."""


def ce_loss_score(ce_clean: float, ce_spliced: float, ce_zero: float) -> float:
    """``(CE_zero − CE_spliced) / (CE_zero − CE_clean)``; NaN when zero-ablation does not change the loss."""
    gap = ce_zero - ce_clean
    return (ce_zero - ce_spliced) / gap if gap != 0 else math.nan


@dataclass(frozen=True)
class ScoreInterval:
    """Percentile bootstrap intervals of a CE-loss score and of its zero-ablation gap (nats per token)."""

    score_low: float
    score_high: float
    gap_low: float
    gap_high: float


def bootstrap_ce_score(
    clean: Sequence[float],
    spliced: Sequence[float],
    zero: Sequence[float],
    tokens: Sequence[int],
    *,
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> ScoreInterval:
    """Bootstrap the CE-loss score over sequences: resample them with replacement, take percentiles.

    Each resample draws as many sequences as there are, with replacement, and computes the score
    of the summed losses ``(Z − S) / (Z − C)`` (the token-weighted score of those sequences) and
    the gap ``(Z − C) / tokens``; the interval is the central ``level`` of their percentiles
    (Efron's percentile interval). The same ``seed`` draws the same resamples for every
    replacement of a block, so their intervals are paired.

    Parameters
    ----------
    clean, spliced, zero : Sequence[float]
        Per sequence: the summed next-token cross-entropy (nats) of the model as it is, with the
        replacement, and with the block zero-ablated.
    tokens : Sequence[int]
        Per sequence: the predictions summed.
    resamples : int, optional
        Bootstrap resamples (default 1,000).
    level : float, optional
        Coverage of the interval (default 0.95).
    seed : int, optional
        Seeds the resamples.

    Returns
    -------
    ScoreInterval
        NaN bounds where fewer than two sequences hold tokens; a resample whose gap is 0 has no
        score and is left out of the score's percentiles.
    """
    arrays = [np.asarray(values, dtype=np.float64) for values in (clean, spliced, zero, tokens)]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
        raise ValueError(f"clean, spliced, zero and tokens must be 1-D of one length, got {[a.shape for a in arrays]}")
    check_bootstrap(resamples, level)
    c, s, z, n = arrays
    if int((n > 0).sum()) < 2:
        return ScoreInterval(math.nan, math.nan, math.nan, math.nan)
    picks = np.random.default_rng(seed).integers(0, c.size, size=(resamples, c.size))
    c, s, z, n = (a[picks].sum(1) for a in (c, s, z, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        scores = (z - s) / (z - c)
        gaps = (z - c) / n
    tail = 100 * (1 - level) / 2
    finite = scores[np.isfinite(scores)]
    score_low, score_high = np.percentile(finite, [tail, 100 - tail]) if finite.size else (math.nan, math.nan)
    gap_low, gap_high = np.nanpercentile(gaps, [tail, 100 - tail])
    return ScoreInterval(float(score_low), float(score_high), float(gap_low), float(gap_high))


@dataclass(frozen=True)
class FrontierRow:
    """One replacement of one block, measured (see the module's notes for every field)."""

    block: str
    method: str
    params: int
    l0: float
    nmse: float
    explained_variance: float
    ce_clean: float
    ce_spliced: float
    ce_zero: float
    dead: int
    units: int
    tokens: int
    score_low: float = math.nan
    score_high: float = math.nan
    gap_low: float = math.nan
    gap_high: float = math.nan
    kl_spliced: float = math.nan
    kl_zero: float = math.nan
    extra: Mapping[str, float] = field(default_factory=dict, hash=False)

    @property
    def gap(self) -> float:
        """``CE_zero − CE_clean``: what removing the block costs (nats per token)."""
        return self.ce_zero - self.ce_clean

    @property
    def meaningful(self) -> bool:
        """Whether the CE-loss score means something: a positive gap whose interval stays above 0."""
        return self.gap > 0 and not self.gap_low <= 0

    @property
    def score(self) -> float:
        """The CE-loss score; NaN when it is not ``meaningful``."""
        return ce_loss_score(self.ce_clean, self.ce_spliced, self.ce_zero) if self.meaningful else math.nan

    @property
    def kl_score(self) -> float:
        """``1 − KL(clean ‖ spliced) / KL(clean ‖ zero-ablated)``; NaN when zero-ablation changes nothing."""
        return 1 - self.kl_spliced / self.kl_zero if self.kl_zero > 0 else math.nan

    @property
    def loss_increase(self) -> float:
        """``CE_spliced − CE_clean`` (nats per token)."""
        return self.ce_spliced - self.ce_clean

    @property
    def requested_l0(self) -> int | None:
        """The sparsity after the method's ``@`` (``"cp@16"`` → 16), or None."""
        _, at, setting = self.method.rpartition("@")
        return int(setting) if at and setting.isdigit() else None

    @property
    def score_out_of_range(self) -> bool:
        """Whether the CE-loss score lies outside [0, 1].

        A score above 1 says the spliced model predicts the held-out text better than the model
        itself, below 0 worse than without the block: text unlike the model's training text, or
        too few evaluation tokens. The cell's interval says whether the excess is within the
        sequences' noise; the flag asks for a second look either way.
        """
        score = self.score
        return math.isfinite(score) and not 0 <= score <= 1

    @property
    def flags(self) -> tuple[str, ...]:
        """The columns that deserve a second look.

        ``"nmse"`` above 1, ``"l0"`` below the requested, ``"dead"`` units above ``DEAD_FRACTION``,
        ``"score"`` outside [0, 1] (see ``score_out_of_range``).
        """
        flagged = []
        if self.nmse > 1:
            flagged.append("nmse")
        if self.requested_l0 is not None and self.l0 < (1 - L0_TOLERANCE) * self.requested_l0:
            flagged.append("l0")
        if self.units and self.dead > DEAD_FRACTION * self.units:
            flagged.append("dead")
        if self.score_out_of_range:
            flagged.append("score")
        return tuple(flagged)

    @property
    def family(self) -> str:
        """The method's name before any ``@`` (one line of the plot)."""
        return self.method.split("@", 1)[0]


#: Column key -> Markdown header, in display order.
COLUMNS = {
    "block": "block",
    "method": "method",
    "params": "params",
    "l0": "L0",
    "nmse": "normalised MSE",
    "explained_variance": "explained variance",
    "ce_clean": "CE clean",
    "ce_spliced": "CE spliced",
    "ce_zero": "CE zero-ablated",
    "score": "CE-loss score [95 % interval]",
    "kl_score": "KL score",
    "loss_increase": "loss increase (nats)",
    "dead": "dead units",
    "units": "units",
}

#: Flag -> (the column it marks, its footnote).
FLAG_NOTES = {
    "nmse": ("nmse", "normalised MSE above 1: worse than predicting zero"),
    "l0": ("l0", "L0 below the requested k (the number after @): some of the k chosen units are zero"),
    "dead": ("dead", f"more than {DEAD_FRACTION:.0%} of the units never fired on the evaluation tokens"),
    "score": (
        "score",
        "CE-loss score outside [0, 1]: the spliced model does better than the model itself (above 1) or worse "
        "than without the block (below 0); the text is likely unlike the model's training text, or too short "
        "(an interval that reaches back into [0, 1] says the excess is within the noise)",
    ),
}

#: Properties of a row that its records carry beside the fields.
_DERIVED = ("score", "kl_score", "loss_increase")


def _json_value(value: Any) -> Any:
    """``value`` for JSON: NaN as None, also inside a mapping."""
    if isinstance(value, Mapping):
        return {k: _json_value(v) for k, v in value.items()}
    return None if isinstance(value, float) and math.isnan(value) else value


_TEXT_FIELDS = ("block", "method")
_COUNT_FIELDS = ("params", "dead", "units", "tokens")


def _number(field: str, value: object) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} = {value!r:.80} is invalid: it must be a number or null")
    return float(value)


def _row_from_data(record: object, field: str) -> FrontierRow:
    """One row from parsed JSON (NaN written as null); derived columns (``score``, …) are ignored."""
    if not isinstance(record, dict):
        raise ValueError(f"{field} = {record!r:.80} is invalid: a frontier row is an object")
    required = [f.name for f in fields(FrontierRow) if f.default is MISSING]
    missing = [name for name in required if name not in record]
    if missing:
        raise ValueError(f"{field} lacks {missing}: {record!r:.120}")
    values: dict[str, Any] = {}
    for spec in fields(FrontierRow):
        if spec.name not in record:
            continue
        value, where = record[spec.name], f"{field}.{spec.name}"
        if spec.name in _TEXT_FIELDS:
            if not isinstance(value, str) or len(value) > 1024:
                raise ValueError(f"{where} = {value!r:.80} is invalid: it must be a string of at most 1,024 characters")
        elif spec.name in _COUNT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where} = {value!r:.80} is invalid: it must be an int >= 0")
        elif spec.name == "extra":
            if not isinstance(value, dict):
                raise ValueError(f"{where} = {value!r:.80} is invalid: a frontier row's extra must be an object")
            value = {str(k): _number(f"{where}[{k!r:.40}]", v) for k, v in value.items()}
        else:
            value = _number(where, value)
        values[spec.name] = value
    return FrontierRow(**values)


def _cell(key: str, value: Any, record: Mapping[str, Any] | None = None) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "" if key == "score" else "–"
    if key == "l0":
        return f"{value:.1f}"
    if key == "nmse":
        return f"{value:.4f}"
    if key == "loss_increase":
        return f"{value:+.4f}"
    if key == "score" and record is not None and math.isfinite(record.get("score_low") or math.nan):
        return f"{value:.3f} [{record['score_low']:.3f}, {record['score_high']:.3f}]"
    return f"{value:.3f}"


@dataclass(frozen=True)
class FrontierTable:
    """Rows of the frontier and the configuration that produced them.

    Attributes
    ----------
    rows : tuple of FrontierRow
    config : Mapping[str, Any]
        Plain data describing the run (model, tokens, budget, …).
    headers : Mapping[str, str]
        An extra metric's name -> its column header (default the name).
    """

    rows: tuple[FrontierRow, ...]
    config: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    sequences: SequenceLosses | None = field(default=None, compare=False, repr=False)

    def paired(self, method: str, baseline: str, **options: Any) -> PairedDifference:
        """``method − baseline`` with bootstrap intervals over the held-out sequences (paired).

        See [`paired_difference`][mumoe_tn.distillation.paired.paired_difference] (its keyword
        options apply; several seeds' tables go there directly).
        """
        return paired_difference(self, method, baseline, **options)

    def extra_columns(self) -> list[str]:
        """The names of the rows' extra metrics, in order of first appearance (after the fixed columns)."""
        return list(dict.fromkeys(name for row in self.rows for name in row.extra))

    def records(self) -> list[dict[str, Any]]:
        """Rows as plain dicts, the CE-loss score, KL score and loss increase included."""
        return [{**asdict(row), **{key: getattr(row, key) for key in _DERIVED}} for row in self.rows]

    def _header(self, name: str) -> str:
        return self.headers.get(name, name)

    def to_json(self) -> str:
        """The configuration and the rows as JSON (NaN written as null).

        ``columns`` maps each row field to the header the tables print for it (``"nmse"`` →
        ``"normalised MSE"``); it is derived and ignored on reading. With per-sequence losses, they
        follow as ``sequences``.
        """
        rows = [{k: _json_value(v) for k, v in r.items()} for r in self.records()]
        headers = {"headers": dict(self.headers)} if self.headers else {}
        sequences = {} if self.sequences is None else {"sequences": self.sequences.to_dict()}
        keys = [key for key in (rows[0] if rows else COLUMNS) if key != "extra"]
        columns = {key: COLUMNS.get(key, key) for key in keys} | {n: self._header(n) for n in self.extra_columns()}
        body = {"config": dict(self.config), **headers, "columns": columns, "rows": rows, **sequences}
        return json.dumps(body, indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> FrontierTable:
        """A table from [`to_json`][mumoe_tn.distillation.frontier.FrontierTable.to_json]'s text.

        Raises
        ------
        ValueError
            Text that is not JSON, or a field of the wrong type (see ``from_data``), named.
        """
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as error:
            raise ValueError(f"frontier JSON is not valid JSON ({type(error).__name__}: {str(error)[:120]})") from None
        return cls.from_data(data)

    @classmethod
    def from_data(cls, data: object, source: str = "frontier JSON") -> FrontierTable:
        """A table from parsed JSON: every row's fields checked by type, errors naming the field.

        Parameters
        ----------
        data : object
            ``{"config": {...}, "headers": {...}, "rows": [...]}`` as parsed.
        source : str, optional
            Where the data comes from (quoted in errors).

        Raises
        ------
        ValueError
            A missing or unknown field, or a value of the wrong type, named (``rows[3].params``).
        """
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"{source} must be an object with a 'rows' list")
        config, headers = data.get("config", {}), data.get("headers", {})
        if not isinstance(config, dict) or not all(isinstance(key, str) for key in config):
            raise ValueError(f"{source}: config = {config!r:.80} is invalid: it must be an object")
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise ValueError(f"{source}: headers = {headers!r:.80} is invalid: it must map names to strings")
        rows = tuple(_row_from_data(record, f"{source}: rows[{i}]") for i, record in enumerate(data["rows"]))
        sequences = data.get("sequences")
        sequences = None if sequences is None else SequenceLosses.from_dict(sequences)
        return cls(rows, config, headers, sequences)

    def to_csv(self) -> str:
        """The rows as CSV with the column keys as header (the score's interval, the KL terms, then extra metrics)."""
        buffer = io.StringIO()
        extra = ["tokens", "score_low", "score_high", "gap_low", "gap_high", "kl_spliced", "kl_zero"]
        metrics = self.extra_columns()
        writer = csv.DictWriter(buffer, fieldnames=[*COLUMNS, *extra, *metrics], lineterminator="\n")
        writer.writeheader()
        writer.writerows({**{k: v for k, v in r.items() if k != "extra"}, **r["extra"]} for r in self.records())
        return buffer.getvalue()

    def footnotes(self) -> dict[str, str]:
        """The flags some row raises -> ``"<mark> <note>"``, one mark per kind of flag, in a fixed order."""
        raised = {flag for row in self.rows for flag in row.flags}
        kinds = [flag for flag in FLAG_NOTES if flag in raised]
        return {flag: f"{FOOTNOTE_MARKS[i]} {FLAG_NOTES[flag][1]}" for i, flag in enumerate(kinds)}

    def not_meaningful(self) -> list[str]:
        """The blocks whose CE-loss score is not meaningful (see FrontierRow.meaningful), in order."""
        return list(dict.fromkeys(row.block for row in self.rows if not row.meaningful))

    def _cells(self) -> list[list[str]]:
        notes = self.footnotes()
        marks = {flag: note.split(" ", 1)[0] for flag, note in notes.items()}
        metrics = self.extra_columns()
        table = []
        for row, record in zip(self.rows, self.records(), strict=True):
            cells = {key: _cell(key, record[key], record) for key in COLUMNS}
            for flag in row.flags:
                column = FLAG_NOTES[flag][0]
                cells[column] += marks[flag]
            table.append([cells[key] for key in COLUMNS] + [_cell(n, row.extra.get(n, math.nan)) for n in metrics])
        return table

    def _caption(self) -> list[str]:
        lines = list(self.footnotes().values())
        blocks = self.not_meaningful()
        if blocks:
            lines.append(
                f"No CE-loss score for {', '.join(blocks)}: zero-ablating the block does not raise the loss beyond "
                "its bootstrap noise; the KL score and the loss increase remain."
            )
        return lines

    def to_markdown(self) -> str:
        """The rows as a GitHub-flavoured Markdown table, with footnotes for the flagged cells."""
        keys = [*COLUMNS, *self.extra_columns()]
        lines = ["| " + " | ".join([*COLUMNS.values(), *map(self._header, self.extra_columns())]) + " |"]
        lines.append("|" + "".join("---|" if key in ("block", "method") else "---:|" for key in keys))
        lines.extend("| " + " | ".join(cells) + " |" for cells in self._cells())
        caption = self._caption()
        return "\n".join(lines + (["", *caption] if caption else []))

    def to_rich(self) -> Any:
        """The rows as a ``rich.table.Table`` (numbers never cut; footnotes as its caption)."""
        from rich.table import Table

        table = Table(title=self.title(), caption="\n".join(self._caption()) or None, caption_justify="left")
        for key, header in COLUMNS.items():
            table.add_column(header, justify="left" if key in ("block", "method") else "right", overflow="fold")
        for name in self.extra_columns():
            table.add_column(self._header(name), justify="right", overflow="fold")
        for cells in self._cells():
            table.add_row(*cells)
        return table

    def plot(self, path: str | Path, **options: Any) -> Path:
        """Save the frontier's plot: [`plot_frontier`][mumoe_tn.distillation.frontier.plot_frontier] of this table."""
        return plot_frontier(self, path, **options)

    def show(self, file: Any = None) -> None:
        """Print the table: rich in a terminal, plain Markdown when ``file`` (default stdout) is not one."""
        import sys

        file = sys.stdout if file is None else file
        if getattr(file, "isatty", lambda: False)():
            from rich.console import Console

            Console(file=file).print(self.to_rich())
        else:
            file.write(self.title() + "\n\n" + self.to_markdown() + "\n")

    def title(self) -> str:
        """A one-line description of the run."""
        c = self.config
        parts = ["Sparsity–accuracy frontier"]
        if "tokens" in c:
            parts.append(f"{c['tokens']:,} training tokens per replacement")
        if "eval_tokens" in c:
            parts.append(f"evaluated on {c['eval_tokens']:,} held-out tokens")
        if "budget" in c:
            parts.append(f"≈{c['budget']:,} parameters each")
        return ", ".join(parts)

    def __str__(self) -> str:
        return self.title() + "\n" + self.to_markdown()


def plot_frontier(
    table: FrontierTable,
    path: str | Path,
    *,
    y: str = "score",
    blocks: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Save the frontier: ``y`` (default the CE-loss score) against L0, one line per method, one panel per block.

    The CE-loss score is drawn with its bootstrap interval as a band, where the run measured one;
    the title wraps to the figure's width.

    Parameters
    ----------
    table : FrontierTable
    path : str or Path
        Output image (format by its suffix).
    y : {"score", "nmse", "explained_variance", "ce_spliced"}, optional
        The vertical axis.
    blocks : Sequence[str], optional
        The blocks to draw (default every block of the table).
    title : str, optional
        The figure's title (default the table's).

    Returns
    -------
    Path
    """
    figure = frontier_figure(table, y=y, blocks=blocks, title=title)
    import matplotlib.pyplot as plt

    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def frontier_figure(
    table: FrontierTable, *, y: str = "score", blocks: Sequence[str] | None = None, title: str | None = None
) -> Any:
    """The figure [`plot_frontier`][mumoe_tn.distillation.frontier.plot_frontier] saves (a matplotlib ``Figure``).

    Parameters are those of ``plot_frontier`` without the path; the caller closes the figure.
    """
    axes_names = {"score": "CE-loss score", "nmse": "normalised MSE", "explained_variance": "explained variance",
                  "ce_spliced": "CE spliced (nats)"}  # fmt: skip
    if y not in axes_names:
        raise ValueError(f"y must be one of {sorted(axes_names)}, got {y!r}")
    if not table.rows:
        raise ValueError("the frontier table has no rows to plot")
    known = list(dict.fromkeys(row.block for row in table.rows))
    blocks = known if blocks is None else list(blocks)
    unknown = [block for block in blocks if block not in known]
    if unknown or not blocks:
        raise ValueError(f"blocks must be blocks of the table {known}, got {blocks}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'mumoe_tn[plot]'") from error
    width = 4.6 * len(blocks)
    figure, axes = plt.subplots(1, len(blocks), figsize=(width, 3.9), squeeze=False, sharey=True, layout="constrained")
    families = list(dict.fromkeys(row.family for row in table.rows))
    for panel, block in zip(axes[0], blocks, strict=True):
        for family in families:
            rows = sorted((r for r in table.rows if r.block == block and r.family == family), key=lambda r: r.l0)
            if rows:
                l0s = [r.l0 for r in rows]
                values = [r.score if y == "score" else getattr(r, y) for r in rows]
                (line,) = panel.plot(l0s, values, marker="o", markersize=4, label=family)
                if y == "score" and any(math.isfinite(r.score_low) for r in rows):
                    # The score's bootstrap interval, where the run measured one.
                    low = [r.score_low if math.isfinite(r.score_low) else v for r, v in zip(rows, values, strict=True)]
                    high = [
                        r.score_high if math.isfinite(r.score_high) else v for r, v in zip(rows, values, strict=True)
                    ]
                    panel.fill_between(l0s, low, high, color=line.get_color(), alpha=0.18, linewidth=0)
        panel.set_xscale("log", base=2)
        panel.set_xlabel("L0 (active units per token)")
        panel.set_title(block, fontsize=9)
        panel.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(axes_names[y])
    axes[0][-1].legend(fontsize=7)
    # Wrapped to the figure's width (at most 12 characters an inch at 9 points): never clipped at the sides.
    figure.suptitle(textwrap.fill(title or table.title(), width=max(int(width * 12), 40)), fontsize=9)
    return figure
