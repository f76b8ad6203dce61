"""How cost tables look: number formats, memory in bytes, and terminal tables that fit a width.

Numbers are never shortened: integers carry thousands separators, ratios a ``×`` sign, and a
terminal table too wide for its width leaves out whole columns (least important first) rather
than cutting cells.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "TERMINAL_HEADERS",
    "bytes_per_element",
    "cells",
    "format_bytes",
    "format_value",
    "rich_table",
]

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
"""Bytes per element of the dtypes a table can state memory in."""

TERMINAL_HEADERS = {
    "name": "layer",
    "ranks": "ranks",
    "params_experts": "expert\nparams",
    "params_gate": "gate\nparams",
    "params_total": "total\nparams",
    "fma_closed_form": "FMA/token\nclosed form",
    "fma_planned": "FMA/token\nplanned",
    "peak_elements": "peak/batch\nelements",
    "peak_bytes": "peak/batch\n{dtype}",
    "max_rank": "rank\nbound",
    "params_vs_reference": "params\n÷ ref",
    "fma_vs_reference": "FMA\n÷ ref",
}
"""Two-line column headers for the terminal; ``{dtype}`` is filled in."""

#: The order in which columns are kept when the terminal is narrow (first = kept longest).
_PRIORITY = (
    "name",
    "params_total",
    "fma_planned",
    "params_vs_reference",
    "fma_vs_reference",
    "peak_elements",
    "peak_bytes",
    "max_rank",
    "ranks",
    "params_experts",
    "params_gate",
    "fma_closed_form",
)

_TEXT = ("name", "ranks")


def format_value(key: str, value: Any) -> str:
    """One cell: ``1,234,567``, ``1.05×``, ``1,048,917×``, ``—`` for a missing value.

    Parameters
    ----------
    key : str
        The column key (ratios end in ``_vs_reference``).
    value : Any
        The value.

    Returns
    -------
    str

    Examples
    --------
    >>> format_value("params_total", 2362368), format_value("fma_vs_reference", 1048916.889)
    ('2,362,368', '1,048,917×')
    >>> format_value("params_vs_reference", 1.0049), format_value("fma_closed_form", None)
    ('1.00×', '—')
    """
    if value is None:
        return "—"
    if key.endswith("_vs_reference"):
        if value >= 100:
            return f"{value:,.0f}×"
        return f"{value:.2f}×" if value >= 0.01 or value == 0 else f"{value:.1e}×"
    if isinstance(value, float):
        return f"{value:,.0f}" if value == int(value) else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_bytes(count: int) -> str:
    """A byte count in binary units: ``512 B``, ``3.0 KiB``, ``1.5 GiB``.

    Examples
    --------
    >>> format_bytes(512), format_bytes(3072), format_bytes(3 * 2**29)
    ('512 B', '3.0 KiB', '1.5 GiB')
    """
    if count < 1024:
        return f"{count} B"
    size = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        size /= 1024
        if size < 1024 or unit == "PiB":
            return f"{size:,.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def bytes_per_element(dtype: str) -> int:
    """The size of one element of ``dtype`` (a key of [`DTYPE_BYTES`][mumoe_tn.costs.display.DTYPE_BYTES]).

    Raises
    ------
    ValueError
        For a dtype not in the table.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def cells(records: Sequence[Mapping[str, Any]], keys: Sequence[str], dtype: str | None) -> list[list[str]]:
    """Formatted cells of ``records`` for the column ``keys`` (``peak_bytes`` from ``dtype``)."""
    size = bytes_per_element(dtype) if dtype is not None else 0
    return [
        [
            format_bytes(record["peak_elements"] * size) if key == "peak_bytes" else format_value(key, record[key])
            for key in keys
        ]
        for record in records
    ]


def rich_table(
    title: str,
    records: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    *,
    dtype: str | None = "float32",
    width: int | None = None,
) -> Any:
    """A ``rich.table.Table`` of ``records``, left with only the columns that fit ``width``.

    Parameters
    ----------
    title : str
        The table's title (wrapped to the table's width).
    records : Sequence of Mapping
        Rows as column key -> value.
    keys : Sequence[str]
        The columns, in display order; ``"peak_bytes"`` is computed from ``peak_elements``.
    dtype : str, optional
        The dtype of the ``peak_bytes`` column; None leaves that column out.
    width : int, optional
        The terminal width. Columns are dropped, least important first, until every cell fits
        in full; the caption names what was left out. None keeps every column.

    Returns
    -------
    rich.table.Table
    """
    keys = [key for key in keys if key != "peak_bytes" or dtype is not None]
    rows = cells(records, keys, dtype)
    shown = list(keys)
    while True:
        table = _table(title, rows, keys, shown, dtype)
        if width is None or len(shown) <= 2 or _minimum_width(table) <= width:
            break
        shown.remove(next(key for key in reversed(_PRIORITY) if key in shown))
    left_out = [key for key in keys if key not in shown]
    if left_out:
        names = ", ".join(TERMINAL_HEADERS[key].replace("\n", " ").format(dtype=dtype) for key in left_out)
        table.caption = f"left out to fit {width} columns: {names}"
    return table


def _table(title: str, rows: list[list[str]], keys: Sequence[str], shown: Sequence[str], dtype: str | None) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for key in shown:
        column = [row[keys.index(key)] for row in rows]
        if key in _TEXT:
            table.add_column(TERMINAL_HEADERS[key], justify="left", overflow="fold")
        else:  # numbers: never wrapped, never cut
            header = TERMINAL_HEADERS[key].format(dtype=dtype)
            table.add_column(header, justify="right", no_wrap=True, min_width=max(map(len, column), default=1))
    for row in rows:
        table.add_row(*(row[keys.index(key)] for key in shown))
    return table


def _minimum_width(table: Any) -> int:
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).minimum
