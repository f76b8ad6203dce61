"""How cost tables look: number formats, memory in bytes, and terminal tables that fit a width.

Numbers are never shortened: integers carry thousands separators, ratios a ``×`` sign, and a
terminal table too wide for its width leaves out whole columns (least important first) rather
than cutting cells, or, to show every column, splits them over several tables of the same rows.
Text cells wrap at word boundaries only.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "FOOTNOTE_MARKS",
    "TERMINAL_HEADERS",
    "bytes_per_element",
    "cells",
    "column_groups",
    "format_bytes",
    "format_value",
    "print_tables",
    "rich_table",
    "rich_tables",
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

FOOTNOTE_MARKS = "¹²³⁴⁵⁶⁷⁸⁹"
"""The marks of a table's footnotes, in order (a tenth note and beyond reuse ``⁹``)."""


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
            (
                format_value(key, None)
                if key == "peak_bytes" and record["peak_elements"] is None
                else format_bytes(record["peak_elements"] * size)
                if key == "peak_bytes"
                else format_value(key, record[key])
            )
            for key in keys
        ]
        for record in records
    ]


def _marked(records: Sequence[Mapping[str, Any]], notes: Mapping[int, str] | None) -> tuple[list[dict], list[str]]:
    """Records with a footnote mark after the name of every noted row, and the footnote lines."""
    marked = [dict(record) for record in records]
    lines = []
    for number, (index, note) in enumerate(sorted((notes or {}).items())):
        mark = FOOTNOTE_MARKS[min(number, len(FOOTNOTE_MARKS) - 1)]
        marked[index]["name"] = f"{marked[index]['name']}{mark}"
        lines.append(f"{mark} {note}")
    return marked, lines


def rich_table(
    title: str,
    records: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    *,
    dtype: str | None = "float32",
    width: int | None = None,
    notes: Mapping[int, str] | None = None,
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
    notes : Mapping[int, str], optional
        Footnotes by row index: the row's name gets a mark (``¹``, ``²``, …) and the caption
        the note.

    Returns
    -------
    rich.table.Table
    """
    keys = [key for key in keys if key != "peak_bytes" or dtype is not None]
    records, footnotes = _marked(records, notes)
    rows = cells(records, keys, dtype)
    headers = [TERMINAL_HEADERS[key].format(dtype=dtype) for key in keys]
    text = [index for index, key in enumerate(keys) if key in _TEXT]
    shown = list(keys)
    while True:
        table = _build(title, headers, rows, [keys.index(key) for key in shown], text)
        if width is None or len(shown) <= 2 or _minimum_width(table) <= width:
            break
        shown.remove(next(key for key in reversed(_PRIORITY) if key in shown))
    if width is not None and _minimum_width(table) > width:  # too narrow even for whole words: fold them
        table = _build(title, headers, rows, [keys.index(key) for key in shown], text, whole_words=False)
    left_out = [key for key in keys if key not in shown]
    caption = list(footnotes)
    if left_out:
        names = ", ".join(TERMINAL_HEADERS[key].replace("\n", " ").format(dtype=dtype) for key in left_out)
        caption.append(f"left out to fit {width} columns: {names}")
    if caption:
        table.caption = "\n".join(caption)
        table.caption_justify = "left"
    return table


def rich_tables(
    title: str,
    records: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    *,
    dtype: str | None = "float32",
    width: int,
    notes: Mapping[int, str] | None = None,
) -> list[Any]:
    """Every column of ``records``, in as many tables of the same rows as ``width`` needs.

    The layer column repeats in every table; the title heads the first and the footnotes
    (see [`rich_table`][mumoe_tn.costs.display.rich_table]) follow the last.

    Returns
    -------
    list of rich.table.Table
    """
    keys = [key for key in keys if key != "peak_bytes" or dtype is not None]
    records, footnotes = _marked(records, notes)
    rows = cells(records, keys, dtype)
    headers = [TERMINAL_HEADERS[key].format(dtype=dtype) for key in keys]
    text = [index for index, key in enumerate(keys) if key in _TEXT]
    return column_groups(headers, rows, width=width, text=text, title=title, caption="\n".join(footnotes) or None)


def column_groups(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int,
    text: Sequence[int] = (0,),
    keep: int = 1,
    title: str | None = None,
    caption: str | None = None,
) -> list[Any]:
    """Tables that together show every column of ``rows``, each as narrow as ``width`` allows.

    Columns are taken in order; a table takes columns while its narrowest rendering fits
    ``width`` (a single column wider than that gets a table of its own: cells are never cut).
    Text columns wrap at word boundaries, other columns never wrap.

    Parameters
    ----------
    headers : Sequence[str]
        Column headers (a newline breaks a header's line).
    rows : Sequence of Sequence[str]
        Formatted cells.
    width : int
        The terminal width.
    text : Sequence[int], optional
        Indices of the left-aligned text columns (default: the first).
    keep : int, optional
        The first ``keep`` columns repeat in every table (default 1: the row's name).
    title, caption : str, optional
        Above the first table and below the last.

    Returns
    -------
    list of rich.table.Table

    Examples
    --------
    >>> tables = column_groups(["layer", "a", "b"], [["cp μMoE", "1,234,567", "2.00×"]], width=20)
    >>> [len(table.columns) for table in tables]
    [2, 2]
    """
    fixed = list(range(min(keep, len(headers))))
    groups: list[list[int]] = []
    current = list(fixed)
    for index in range(len(fixed), len(headers)):
        trial = [*current, index]
        if len(current) > len(fixed) and _minimum_width(_build(None, headers, rows, trial, text)) > width:
            groups.append(current)
            trial = [*fixed, index]
        current = trial
    groups.append(current)
    tables = []
    for number, group in enumerate(groups):
        table = _build(title if number == 0 else None, headers, rows, group, text)
        if _minimum_width(table) > width:  # too narrow even for whole words: fold them
            table = _build(title if number == 0 else None, headers, rows, group, text, whole_words=False)
        tables.append(table)
    if caption:
        tables[-1].caption = caption
        tables[-1].caption_justify = "left"
    return tables


def print_tables(console: Any, tables: Sequence[Any]) -> None:
    """Print rich tables at ``console``'s width, widened only where one column alone needs more.

    A table narrower than its cells would make rich cut numbers; such a table (a terminal too
    narrow for even one number column next to the names) is printed at the width it needs.
    """
    from rich.console import Console
    from rich.measure import Measurement

    for table in tables:
        needed = Measurement.get(console, console.options.update_width(10_000), table).minimum
        (console if needed <= console.width else Console(width=needed)).print(table)


def _add_column(table: Any, header: str, column: Sequence[str], *, is_text: bool, whole_words: bool = True) -> None:
    """Add a column: numbers never wrap; text wraps at spaces only, unless ``whole_words`` is False.

    A text column is never narrower than its longest word; without ``whole_words`` rich folds a
    word that is longer than the width left.
    """
    if is_text:
        longest_word = max((len(word) for cell in [header, *column] for word in cell.split()), default=1)
        table.add_column(header, justify="left", overflow="fold", min_width=longest_word if whole_words else None)
    else:  # a header wraps (at spaces) to its numbers' width, 12 at least; the numbers never wrap
        numbers = max(map(len, column), default=1)
        lines = [part for line in header.split("\n") for part in textwrap.wrap(line, max(numbers, 12)) or [""]]
        table.add_column("\n".join(lines), justify="right", no_wrap=True, min_width=max(numbers, *map(len, lines)))


def _build(
    title: str | None,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    chosen: Sequence[int],
    text: Sequence[int],
    *,
    whole_words: bool = True,
) -> Any:
    """A rich table of the ``chosen`` columns (indices into ``headers`` and each row)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for index in chosen:
        column = [row[index] for row in rows]
        _add_column(table, headers[index], column, is_text=index in text, whole_words=whole_words)
    for row in rows:
        table.add_row(*(row[index] for index in chosen))
    return table


def _minimum_width(table: Any) -> int:
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).minimum
