"""The points of a design search and their Pareto front, as tables (rich, Markdown, JSON, CSV) and a plot."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mumoe_tn.costs.display import bytes_per_element, format_bytes, format_value
from mumoe_tn.network import ExpertNetwork

__all__ = ["COLUMNS", "DesignPoint", "DesignResult"]

#: Column keys and headers, in display order (``upcycle_error`` and ``latency_ms`` only when present).
COLUMNS = {
    "structure": "structure",
    "experts": "experts",
    "ranks": "ranks",
    "params": "params",
    "fma": "FMA per token",
    "peak_elements": "peak intermediate (elements)",
    "rank_bound": "expert rank bound",
    "upcycle_error": "upcycle error",
    "latency_ms": "latency (ms)",
}
_TEXT = ("structure", "experts", "ranks")
#: Two-line headers for the terminal.
_SHORT = {
    "FMA per token": "FMA per\ntoken",
    "peak intermediate": "peak\nelements",
    "peak": "peak\nmemory",
    "expert rank bound": "rank\nbound",
    "upcycle error": "upcycle\nerror",
    "latency": "latency\nms",
}
#: Which columns a narrow terminal loses first (higher first).
_DROP_FIRST = {"peak": 6, "peak intermediate": 5, "ranks": 4, "latency": 3, "experts": 2, "FMA per token": 1}


@dataclass(frozen=True)
class DesignPoint:
    """One matched network of a design search with its costs.

    Attributes
    ----------
    family : str
        ``"cp"``, ``"tr"``, ``"tt"``, ``"tucker"``, ``"mxd"`` or a generated topology (``"chain"``,
        ``"ring"``, ``"star"``, ``"tree"``).
    structure : str
        The shape's description, e.g. ``"tr R1=4 R2=4"``.
    networks : tuple of ExpertNetwork
        The matched network (two for an MLP block).
    params : int
        Total parameters (gating counted unless the search said not to).
    fma : float
        Planned FMAs per token, gating included.
    peak_elements : int
        Largest intermediate of the planned contraction at the search's batch.
    rank_bound : int
        Expert-matrix rank bound (the smaller of a block's two).
    upcycle_error : float or None
        Relative error of starting every expert as the given pretrained layer (None without one).
    latency_ms : float or None
        Measured forward time (None unless measured).
    """

    family: str
    structure: str
    networks: tuple[ExpertNetwork, ...] = field(repr=False)
    params: int
    fma: float
    peak_elements: int
    rank_bound: int
    upcycle_error: float | None = None
    latency_ms: float | None = None

    @property
    def network(self) -> ExpertNetwork:
        """The (first layer's) network: ``MuMoE(..., decomposition=point.network)`` builds it."""
        return self.networks[0]

    @property
    def experts(self) -> str:
        """The expert dims, e.g. ``"16×16"``."""
        return "×".join(map(str, self.network.expert_dims))

    @property
    def ranks(self) -> str:
        """Bond sizes, e.g. ``"r1=4, r2=4, r3=141"`` (``"—"`` for a network without a bond, such as MxD)."""
        return ", ".join(f"{bond}={self.network.sizes[bond]}" for bond in self.network.bonds) or "—"

    def objectives(self) -> tuple[float, ...]:
        """What the front minimises: parameters, FMAs, peak, minus the rank bound (and the upcycle error)."""
        values: tuple[float, ...] = (self.params, self.fma, self.peak_elements, -self.rank_bound)
        return values if self.upcycle_error is None else (*values, self.upcycle_error)

    def with_error(self, error: float) -> DesignPoint:
        """A copy of the point with its upcycle error."""
        return replace(self, upcycle_error=float(error))

    def with_latency(self, milliseconds: float) -> DesignPoint:
        """A copy of the point with its measured latency."""
        return replace(self, latency_ms=float(milliseconds))

    def record(self) -> dict[str, Any]:
        """Column key -> value, plus the family and the network's spec."""
        values = {key: getattr(self, key) for key in COLUMNS}
        return {**values, "family": self.family, "spec": self.network.to_spec()}


@dataclass(frozen=True)
class DesignResult:
    """What a design search found.

    Attributes
    ----------
    points : tuple of DesignPoint
        Every point that met the budget and the constraints.
    front : tuple of DesignPoint
        The Pareto front of ``points`` (fewer parameters, FMAs and peak memory, a higher rank
        bound, a lower upcycle error when fitted).
    config : dict
        The search's inputs, the number of shapes searched and the dropped ones by reason.
    """

    points: tuple[DesignPoint, ...]
    front: tuple[DesignPoint, ...]
    config: dict[str, Any]

    @property
    def best_point(self) -> DesignPoint:
        """The front's chosen point: the lowest upcycle error when fitted, else the highest rank bound.

        Ties go to fewer FMAs per token, then fewer parameters. Points within the budget are
        preferred to those the matcher's tolerance lets exceed it.
        """
        within = [p for p in self.front if p.params <= self.config["target_params"]] or list(self.front)
        if self.config.get("fitted"):
            return min(within, key=lambda p: (p.upcycle_error, p.fma, p.params))
        return min(within, key=lambda p: (-p.rank_bound, p.fma, p.params))

    @property
    def best(self) -> ExpertNetwork:
        """The chosen network: ``MuMoE(in, out, decomposition=result.best)`` builds it."""
        return self.best_point.network

    def _keys(self) -> list[str]:
        keys = list(COLUMNS)
        if not self.config.get("fitted"):
            keys.remove("upcycle_error")
        if not self.config.get("measured"):
            keys.remove("latency_ms")
        return keys

    def records(self, *, every: bool = False) -> list[dict[str, Any]]:
        """The front's points (every point with ``every=True``) as plain dicts."""
        return [point.record() for point in (self.points if every else self.front)]

    def to_json(self, *, every: bool = False) -> str:
        """The configuration and the front (or every point) as JSON; ranks as ``{bond: size}``."""
        rows = []
        for point in self.points if every else self.front:
            record = point.record()
            record["ranks"] = {bond: point.network.sizes[bond] for bond in point.network.bonds}
            rows.append(record)
        return json.dumps({"config": self.config, "best": self.best_point.structure, "points": rows}, indent=2)

    def to_csv(self, *, every: bool = False) -> str:
        """The front (or every point) as CSV with the column keys as header."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[*self._keys(), "family", "spec"], lineterminator="\n")
        writer.writeheader()
        for record in self.records(every=every):
            writer.writerow({key: record[key] for key in writer.fieldnames})
        return buffer.getvalue()

    def _cells(self, every: bool, dtype: str | None) -> tuple[list[bool], list[str], list[list[str]]]:
        """``(is text, per column), headers, rows`` of formatted cells."""
        keys = self._keys()
        headers = [COLUMNS[key] for key in keys]
        text = [key in _TEXT for key in keys]
        size = None if dtype is None else bytes_per_element(dtype)
        if size is not None:
            at = keys.index("peak_elements") + 1
            headers.insert(at, f"peak ({dtype})")
            text.insert(at, False)
        rows = []
        for record in self.records(every=every):
            row = [_cell(key, record[key]) for key in keys]
            if size is not None:
                row.insert(at, format_bytes(record["peak_elements"] * size))
            rows.append(row)
        return text, headers, rows

    def to_markdown(self, *, every: bool = False, dtype: str | None = "float32") -> str:
        """The front (or every point) as a GitHub-flavoured Markdown table."""
        text, headers, rows = self._cells(every, dtype)
        rule = "|" + "".join("---|" if left else "---:|" for left in text)
        lines = ["| " + " | ".join(headers) + " |", rule, *("| " + " | ".join(row) + " |" for row in rows)]
        return "\n".join(lines)

    def to_rich(self, *, every: bool = False, dtype: str | None = "float32", width: int | None = None) -> Any:
        """The front (or every point) as a ``rich.table.Table``.

        Parameters
        ----------
        every : bool, optional
            Every matched network instead of the front.
        dtype : str, optional
            Show the peak intermediate's memory for this dtype (None: elements only).
        width : int, optional
            The terminal's width: columns are left out, least important first, until every cell
            fits in full (the caption names them). None keeps every column.
        """
        text, headers, rows = self._cells(every, dtype)
        shown = list(range(len(headers)))
        while True:
            table = self._rich(text, headers, rows, shown)
            if width is None or len(shown) <= 2 or _minimum_width(table) <= width:
                break
            shown.remove(max(shown[2:], key=lambda k: _DROP_FIRST.get(headers[k].split(" (")[0], 0)))
        left_out = [headers[k] for k in range(len(headers)) if k not in shown]
        caption = f"best: {self.best_point.structure} ({self.best_point.experts} experts)"
        table.caption = caption + (f"; left out to fit {width} columns: {', '.join(left_out)}" if left_out else "")
        return table

    def _rich(self, text: list[bool], headers: list[str], rows: list[list[str]], shown: list[int]) -> Any:
        from rich import box
        from rich.table import Table

        table = Table(title=self.title(), box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for k in shown:
            header = _SHORT.get(headers[k].split(" (")[0], headers[k])
            if text[k]:
                table.add_column(header, justify="left", overflow="fold")
            else:  # numbers: never wrapped, never cut
                longest = max((len(row[k]) for row in rows), default=1)
                table.add_column(header, justify="right", no_wrap=True, min_width=longest)
        for row in rows:
            table.add_row(*(row[k] for k in shown))
        return table

    def title(self) -> str:
        """One line: the layer, the budget, the search's size and the front's."""
        c = self.config
        shape = f"{c['in_features']} → {c['out_features']}" + (f" → {c['in_features']} block" if c["block"] else "")
        return (
            f"Pareto front: {shape}, {c['experts']} experts, budget {c['target_params']:,} parameters "
            f"({c['budget']}); {len(self.front)} of {len(self.points)} matched networks "
            f"({c['searched']} searched); FMA per token, peak at {c['batch']:,} token{'s' if c['batch'] != 1 else ''}"
        )

    def __str__(self) -> str:
        return self.title() + "\n\n" + self.to_markdown()

    def plot(self, path: str | Path) -> Path:
        """Save FMAs per token against the expert rank bound: every point, the front, the named formats.

        Parameters
        ----------
        path : str or Path
            Where to write the figure (the suffix chooses the format, e.g. ``.png``).

        Returns
        -------
        Path
        """
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 4.8), constrained_layout=True)
        families = sorted({p.family for p in self.points})
        markers = dict(zip(families, "osD^v<>ph*", strict=False))
        for family in families:
            group = [p for p in self.points if p.family == family]
            ax.scatter(
                [p.rank_bound for p in group], [p.fma for p in group], s=14, alpha=0.35, marker=markers[family],
                label=family,
            )  # fmt: skip
        front = sorted(self.front, key=lambda p: p.rank_bound)
        ax.scatter(
            [p.rank_bound for p in front], [p.fma for p in front], s=60, facecolors="none", edgecolors="black",
            linewidths=1.2, label="Pareto front",
        )  # fmt: skip
        best = self.best_point
        ax.scatter([best.rank_bound], [best.fma], s=160, marker="*", color="crimson", label=f"best: {best.structure}")
        ax.set_xlabel("expert-matrix rank bound (higher is better)")
        ax.set_ylabel("FMA per token (lower is better)")
        ax.set_title(self.title().split(";")[0], fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        target = Path(path)
        fig.savefig(target, dpi=130)
        plt.close(fig)
        return target


def _cell(key: str, value: Any) -> str:
    if key == "upcycle_error":
        return "—" if value is None else f"{value:.3g}"
    if key == "latency_ms":
        return "—" if value is None else f"{value:.3f}"
    return format_value(key, value)


def _minimum_width(table: Any) -> int:
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).minimum
