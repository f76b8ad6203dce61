"""What every ``mumoe-tn`` command shares: argument types, one-line usage errors, output checks.

A command module reports a problem with its inputs by raising [`UsageError`][mumoe_tn.cli.arguments.UsageError]
(or the library's ``ValueError`` / ``TypeError``) before doing any work; the entry point prints it as
one line with exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import math
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mumoe_tn.decompositions.registry import available

__all__ = [
    "UsageError",
    "add_layer_shape",
    "add_output_formats",
    "budget",
    "by_bond",
    "check_names",
    "check_plot",
    "closest",
    "memory_limit",
    "named_rank",
    "positive",
    "ranks",
    "unknown_name",
]


class UsageError(Exception):
    """A problem with the command line's inputs or outputs, found before any work is done."""


def closest(name: str, known: Sequence[str]) -> str:
    """``"; did you mean 'cp'?"`` for the known name closest to ``name`` (difflib), else ``""``."""
    found = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=1, cutoff=0.5)
    return f"; did you mean {found[0]!r}?" if found else ""


def unknown_name(kind: str, name: str, known: Sequence[str]) -> str:
    """The one-line message for an unknown name: the known ones, and the closest."""
    return f"unknown {kind} {name!r}; the known ones are {', '.join(known)}{closest(name, known)}"


def positive(text: str) -> int:
    """A positive integer argument."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def memory_limit(text: str) -> int | str:
    """A positive integer, or ``max_input`` (the largest operand)."""
    return "max_input" if text == "max_input" else positive(text)


def ranks(text: str) -> tuple[int, ...]:
    """``"4,4,64"`` -> ``(4, 4, 64)``; every rank a positive integer."""
    parts = [part.strip() for part in text.split(",")]
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"ranks must be positive integers such as 64 or 4,4,64, got {text!r}"
        ) from None
    if any(rank < 1 for rank in values):
        raise argparse.ArgumentTypeError(f"ranks must be positive integers such as 64 or 4,4,64, got {text!r}")
    return values


def named_rank(text: str) -> tuple[str, int | tuple[int, ...] | dict[str, int]]:
    """``cp=512`` / ``mine=8,8,8`` (per bond, in order) / ``mine=a=8,b=16`` (by bond); NAME kept as typed."""
    name, sep, value = text.partition("=")
    usage = f"--rank takes NAME=R, NAME=R1,R2,… (per bond, in order) or NAME=BOND=R,BOND=R,…, got {text!r}"
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(usage)
    if "=" not in value:
        values = ranks(value)
        return name.strip(), values[0] if len(values) == 1 else values
    return name.strip(), by_bond(value, usage)


def by_bond(text: str, usage: str) -> dict[str, int]:
    """``"a=8,b=16"`` -> ``{"a": 8, "b": 16}``; ``usage`` is the error for a malformed or repeated pair."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        bond, sep, size = (piece.strip() for piece in part.partition("="))
        if not sep or not bond or bond in sizes:
            raise argparse.ArgumentTypeError(usage + ("" if bond not in sizes else f" (bond {bond!r} twice)"))
        values = ranks(size)
        if len(values) != 1:  # pragma: no cover - the split at commas leaves one size per pair
            raise argparse.ArgumentTypeError(usage)
        sizes[bond] = values[0]
    return sizes


def budget(text: str) -> str | int | float:
    """A parameter budget: ``linear``, ``mlp``, a number of parameters or a fraction such as 0.5."""
    if text in ("linear", "mlp"):
        return text
    message = f"--match takes 'linear', 'mlp', a number of parameters or a fraction such as 0.5, got {text!r}"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(message) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(message)
    return int(value) if value == int(value) and value >= 1 else value


def add_layer_shape(parser: argparse.ArgumentParser, *, experts_help: str) -> None:
    """Add ``--in``, ``--out`` and ``--experts``: the layer's shape, the paper's GPT-2 layer by default.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        A command's parser.
    experts_help : str
        What ``--experts`` means to the command.
    """
    parser.add_argument("--in", dest="in_features", type=positive, default=768, help="input features (default 768)")
    parser.add_argument(
        "--out", dest="out_features", type=positive, default=3072, help="output features (default 3072)"
    )
    parser.add_argument("--experts", type=positive, nargs="+", default=[256], help=experts_help)


def add_output_formats(
    parser: argparse.ArgumentParser,
    *,
    json: str = "print JSON",
    markdown: str = "print a Markdown table",
    csv: str | None = "print CSV",
) -> None:
    """Add ``--json``, ``--markdown`` and ``--csv`` (at most one of them), each with its help text.

    Without any of them a command prints a rich table sized to the terminal; ``csv=None`` leaves
    ``--csv`` out.
    """
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help=json)
    output.add_argument("--markdown", action="store_true", help=markdown)
    if csv is not None:
        output.add_argument("--csv", action="store_true", help=csv)


def check_plot(path: str | None, extra: str) -> None:
    """Fail before any work if ``path`` cannot be written or matplotlib is missing."""
    if path is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"--plot needs matplotlib, which is not installed: pip install 'mumoe_tn[{extra}]'")
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise UsageError(f"--plot {path!r} is a directory; give a file name such as {str(target / 'plot.png')!r}")
    if not folder.is_dir():
        raise UsageError(f"--plot {path!r}: the directory {str(folder)!r} does not exist")
    try:  # a real write: permission bits alone do not tell (root, read-only file systems)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mumoe-tn-write-check-"):
            pass
    except OSError as error:
        raise UsageError(f"--plot {path!r}: cannot write to the directory {str(folder)!r} ({error.strerror})") from None
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"--plot {path!r}: the file exists and is not writable")


def check_names(names: Sequence[str], kind: str = "decomposition") -> None:
    """Refuse a registered-name-like word that names no format (a spec string has spaces or commas)."""
    known = available()
    for name in names:
        if re.fullmatch(r"[\w.+-]+", name) and name.lower() not in known:
            raise UsageError(unknown_name(kind, name, known))
