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
  replacement is as good as the block, 0 when it is as bad as removing it;
- ``dead``: units never active on the evaluation tokens (of ``units``; a μMoE block's units
  are the coefficients of all its expert modes).

A method's name may carry its sparsity setting after an ``@`` (``"transcoder@16"``): the plot
draws one line per name before the ``@``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["FrontierRow", "FrontierTable", "ce_loss_score", "plot_frontier"]


def ce_loss_score(ce_clean: float, ce_spliced: float, ce_zero: float) -> float:
    """``(CE_zero − CE_spliced) / (CE_zero − CE_clean)``; NaN when zero-ablation does not change the loss."""
    gap = ce_zero - ce_clean
    return (ce_zero - ce_spliced) / gap if gap != 0 else math.nan


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

    @property
    def score(self) -> float:
        """The CE-loss score."""
        return ce_loss_score(self.ce_clean, self.ce_spliced, self.ce_zero)

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
    "score": "CE-loss score",
    "dead": "dead units",
    "units": "units",
}


def _cell(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float) and math.isnan(value):
        return "–"
    if key == "l0":
        return f"{value:.1f}"
    if key == "nmse":
        return f"{value:.4f}"
    return f"{value:.3f}"


@dataclass(frozen=True)
class FrontierTable:
    """Rows of the frontier and the configuration that produced them.

    Attributes
    ----------
    rows : tuple of FrontierRow
    config : Mapping[str, Any]
        Plain data describing the run (model, tokens, budget, …).
    """

    rows: tuple[FrontierRow, ...]
    config: Mapping[str, Any] = field(default_factory=dict)

    def records(self) -> list[dict[str, Any]]:
        """Rows as plain dicts, the CE-loss score included."""
        return [{**asdict(row), "score": row.score} for row in self.rows]

    def to_json(self) -> str:
        """The configuration and the rows as JSON (NaN written as null)."""
        rows = [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in self.records()
        ]
        return json.dumps({"config": dict(self.config), "rows": rows}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> FrontierTable:
        """A table from [`to_json`][mumoe_tn.distillation.frontier.FrontierTable.to_json]'s text."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError("frontier JSON must be an object with a 'rows' list")
        names = [f.name for f in fields(FrontierRow)]
        rows = []
        for record in data["rows"]:
            missing = [name for name in names if name not in record]
            if missing:
                raise ValueError(f"a frontier row lacks {missing}: {record!r:.120}")
            values = {name: math.nan if record[name] is None else record[name] for name in names}
            rows.append(FrontierRow(**values))
        return cls(tuple(rows), data.get("config", {}))

    def to_csv(self) -> str:
        """The rows as CSV with the column keys as header."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[*COLUMNS, "tokens"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.records())
        return buffer.getvalue()

    def to_markdown(self) -> str:
        """The rows as a GitHub-flavoured Markdown table."""
        keys = list(COLUMNS)
        lines = ["| " + " | ".join(COLUMNS.values()) + " |"]
        lines.append("|" + "".join("---|" if key in ("block", "method") else "---:|" for key in keys))
        for record in self.records():
            lines.append("| " + " | ".join(_cell(key, record[key]) for key in keys) + " |")
        return "\n".join(lines)

    def to_rich(self) -> Any:
        """The rows as a ``rich.table.Table``."""
        from rich.table import Table

        table = Table(title=self.title())
        for key, header in COLUMNS.items():
            table.add_column(header, justify="left" if key in ("block", "method") else "right")
        for record in self.records():
            table.add_row(*(_cell(key, record[key]) for key in COLUMNS))
        return table

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
    figure, axes = plt.subplots(1, len(blocks), figsize=(4.6 * len(blocks), 3.9), squeeze=False, sharey=True)
    families = list(dict.fromkeys(row.family for row in table.rows))
    for panel, block in zip(axes[0], blocks, strict=True):
        for family in families:
            rows = sorted((r for r in table.rows if r.block == block and r.family == family), key=lambda r: r.l0)
            if rows:
                values = [r.score if y == "score" else getattr(r, y) for r in rows]
                panel.plot([r.l0 for r in rows], values, marker="o", markersize=4, label=family)
        panel.set_xscale("log", base=2)
        panel.set_xlabel("L0 (active units per token)")
        panel.set_title(block, fontsize=9)
        panel.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(axes_names[y])
    axes[0][-1].legend(fontsize=7)
    figure.suptitle(title or table.title(), fontsize=9)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
