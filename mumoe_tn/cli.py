"""The ``mumoe-tn`` command line: ``compare`` cost tables, ``plan`` a contraction, ``design``, ``demo``, ``explore``.

Every error — a bad argument, an output that cannot be written, a missing optional package, or
an error from the library — is printed as one line naming the problem, with exit status 2. Every
warning is one line on stderr, ``mumoe-tn COMMAND: warning: ...``, without Python's file and source
line.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import math
import os
import re
import shutil
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path

from mumoe_tn.costs.display import DTYPE_BYTES, FOOTNOTE_MARKS, print_tables, rich_table, rich_tables
from mumoe_tn.costs.matching import TOLERANCE, MatchingWarning
from mumoe_tn.costs.table import CostTable, compare
from mumoe_tn.decompositions.registry import available

__all__ = ["main"]


class UsageError(Exception):
    """A problem with the command line's inputs or outputs, found before any work is done."""


def closest(name: str, known: Sequence[str]) -> str:
    """``"; did you mean 'cp'?"`` for the known name closest to ``name`` (difflib), else ``""``."""
    found = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=1, cutoff=0.5)
    return f"; did you mean {found[0]!r}?" if found else ""


def unknown_name(kind: str, name: str, known: Sequence[str]) -> str:
    """The one-line message for an unknown name: the known ones, and the closest."""
    return f"unknown {kind} {name!r}; the known ones are {', '.join(known)}{closest(name, known)}"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is one ``--help`` away).

    An invalid choice (a command, ``--dtype``, ``--gates``) also names the closest valid one.
    """

    def error(self, message: str) -> None:  # type: ignore[override]
        choice = re.match(r"argument .*: invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if choice:
            message += closest(
                choice.group(1), re.findall(r"'([^']*)'", choice.group(2)) or choice.group(2).split(", ")
            )
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _memory_limit(text: str) -> int | str:
    return "max_input" if text == "max_input" else _positive(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _ranks(text: str) -> tuple[int, ...]:
    """``"4,4,64"`` -> ``(4, 4, 64)``; every rank a positive integer."""
    parts = [part.strip() for part in text.split(",")]
    try:
        ranks = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"ranks must be positive integers such as 64 or 4,4,64, got {text!r}"
        ) from None
    if any(rank < 1 for rank in ranks):
        raise argparse.ArgumentTypeError(f"ranks must be positive integers such as 64 or 4,4,64, got {text!r}")
    return ranks


def _named_rank(text: str) -> tuple[str, int | tuple[int, ...] | dict[str, int]]:
    """``cp=512`` / ``mine=8,8,8`` (per bond, in order) / ``mine=a=8,b=16`` (by bond); NAME kept as typed."""
    name, sep, value = text.partition("=")
    usage = f"--rank takes NAME=R, NAME=R1,R2,… (per bond, in order) or NAME=BOND=R,BOND=R,…, got {text!r}"
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(usage)
    if "=" not in value:
        ranks = _ranks(value)
        return name.strip(), ranks[0] if len(ranks) == 1 else ranks
    return name.strip(), _by_bond(value, usage)


def _by_bond(text: str, usage: str) -> dict[str, int]:
    """``"a=8,b=16"`` -> ``{"a": 8, "b": 16}``; ``usage`` is the error for a malformed or repeated pair."""
    by_bond: dict[str, int] = {}
    for part in text.split(","):
        bond, sep, size = (piece.strip() for piece in part.partition("="))
        if not sep or not bond or bond in by_bond:
            raise argparse.ArgumentTypeError(usage + ("" if bond not in by_bond else f" (bond {bond!r} twice)"))
        ranks = _ranks(size)
        if len(ranks) != 1:  # pragma: no cover - the split at commas leaves one size per pair
            raise argparse.ArgumentTypeError(usage)
        by_bond[bond] = ranks[0]
    return by_bond


def _plan_rank(text: str) -> tuple[int, ...] | dict[str, int]:
    """One word of ``plan --rank``: ``64``, ``4,4,64`` (per bond, in order) or ``a=4,b=4,c=64`` (by bond)."""
    if "=" not in text:
        return _ranks(text)
    usage = f"--rank takes R, R1,R2,… (per bond, in order) or BOND=R,BOND=R,… (by bond), got {text!r}"
    return _by_bond(text, usage)


def _plan_ranks(words: Sequence[tuple[int, ...] | dict[str, int]]) -> int | tuple[int, ...] | dict[str, int]:
    """The words of ``plan --rank`` as one rank, ranks in bond order, or ``{bond: size}``."""
    if all(isinstance(word, tuple) for word in words):
        ranks = tuple(rank for word in words for rank in word)  # type: ignore[union-attr]
        return ranks[0] if len(ranks) == 1 else ranks
    if not all(isinstance(word, dict) for word in words):
        raise UsageError(
            "--rank takes ranks in bond order (4,4,32) or bond=size pairs (a=4,b=4,c=32), not both, got "
            + " ".join(_rank_word(word) for word in words)
        )
    merged: dict[str, int] = {}
    for word in words:
        for bond, size in word.items():  # type: ignore[union-attr]
            if bond in merged:
                raise UsageError(f"--rank gives bond {bond!r} twice ({merged[bond]} and {size})")
            merged[bond] = size
    return merged


def _rank_word(word: tuple[int, ...] | dict[str, int]) -> str:
    if isinstance(word, dict):
        return ",".join(f"{bond}={size}" for bond, size in word.items())
    return ",".join(map(str, word))


def _match(text: str) -> str | int | float:
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


#: The entry-point group under which a package declares the module that registers its formats.
FORMATS_ENTRY_POINTS = "mumoe_tn.formats"


def _load_user_formats(argv: Sequence[str]) -> None:
    """Import the modules that register user formats: every ``--import MODULE``, then the entry points.

    Runs before the full parser is built, so registered formats appear in ``--help`` and are
    accepted by ``--decompositions``. A module that cannot be imported ends the command with one
    line naming it.
    """
    from importlib import import_module
    from importlib.metadata import entry_points

    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--import", dest="modules", action="append", default=[])
    known, _ = early.parse_known_args(list(argv))
    for point in entry_points(group=FORMATS_ENTRY_POINTS):
        try:
            point.load()
        except Exception as error:
            raise UsageError(
                f"the {FORMATS_ENTRY_POINTS} entry point {point.name!r} ({point.value}) failed: {error}"
            ) from None
    for module in known.modules:
        try:
            import_module(module)
        except Exception as error:
            raise UsageError(f"--import {module}: cannot import it ({type(error).__name__}: {error})") from None


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mumoe-tn", description="Multilinear mixture-of-experts tools.")
    parser.add_argument(
        "--import",
        dest="modules",
        action="append",
        default=[],
        metavar="MODULE",
        help=(
            "import MODULE first, e.g. the module that registers your own formats (repeatable); packages "
            f"can declare such modules under the {FORMATS_ENTRY_POINTS!r} entry-point group instead"
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True)

    cmp = commands.add_parser(
        "compare",
        help="cost table of μMoE decompositions against nn.Linear, MLP blocks and MoEs",
        description=(
            "Parameters, FMAs per token (1 FMA = 1 FLOP), the peak intermediate per batch and expert-rank "
            "bounds. Defaults: the paper's GPT-2 MLP layer, 768 -> 3072 with 256 experts, CP and TR "
            "parameter-matched to nn.Linear. The table fits the terminal: columns that do not fit are left "
            "out (named under the table); --wide shows them all."
        ),
    )
    cmp.add_argument("--in", dest="in_features", type=_positive, default=768, help="input features (default 768)")
    cmp.add_argument("--out", dest="out_features", type=_positive, default=3072, help="output features (default 3072)")
    cmp.add_argument(
        "--experts", type=_positive, nargs="+", default=[256], help="experts per mode, e.g. 256 or 32 32 32 32"
    )
    cmp.add_argument("--decompositions", nargs="+", default=["cp", "tr"], help=f"any of {available()} (default cp tr)")
    cmp.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="SPEC",
        help="also a custom network, e.g. 'A: n1 a b, B: a i c, C: b c o', or named for its row and --rank: "
        "'mine=A: n1 a b, B: a i c, C: b c o' (repeatable; unnamed ones are 'custom 1', 'custom 2', …)",
    )
    cmp.add_argument(
        "--rank",
        type=_named_rank,
        action="append",
        default=[],
        help="explicit ranks of a row: cp=512, tr=4,4,128, one per bond in order (mine=8,8,8) or by bond "
        "(mine=a=8,b=16)",
    )
    cmp.add_argument(
        "--match",
        type=_match,
        default="linear",
        help="parameter target for decompositions without --rank: linear (default), mlp (compare in->out->in blocks), "
        "a number of parameters, or a fraction of the reference's. TR/TT scale the input-output bond, Tucker all its "
        "bonds.",
    )
    cmp.add_argument(
        "--rank-multiple",
        type=_positive,
        default=1,
        help="matched ranks are multiples of this (e.g. 16: faster matrix multiplies; default 1)",
    )
    cmp.add_argument("--no-bias", dest="bias", action="store_false", help="no folded bias (and no baseline bias)")
    cmp.add_argument("--no-gating", dest="gate", action="store_false", help="do not count gating parameters/FMAs")
    cmp.add_argument(
        "--batch", type=_positive, default=1, help="tokens per forward, for the planned FMAs and the peak intermediate"
    )
    cmp.add_argument(
        "--top-k",
        type=_positive,
        default=None,
        help="K of the sparse MoE baseline (default 2; not applicable with fewer experts)",
    )
    cmp.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="float32", help="dtype of the memory column (default float32)"
    )
    cmp.add_argument(
        "--wide",
        action="store_true",
        help="show every column: in several tables of the same rows where the terminal is too narrow for one",
    )
    output = cmp.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON")
    output.add_argument("--markdown", action="store_true", help="print a Markdown table (every column)")
    output.add_argument("--csv", action="store_true", help="print CSV")
    cmp.add_argument("--plot", metavar="FILE.png", help="also save parameters vs number of experts (2 to 16,384)")

    plan = commands.add_parser(
        "plan",
        help="show the planned contraction of a decomposition or a spec string",
        description="The input leg i counts the folded bias (i = in + 1), as in compare; --no-bias for i = in.",
    )
    plan.add_argument("network", help=f"a registered name {available()} or a spec such as 'n1 a b, a i c, b c o'")
    plan.add_argument("--in", dest="in_features", type=_positive, default=768, help="input features (default 768)")
    plan.add_argument("--out", dest="out_features", type=_positive, default=3072, help="output features (default 3072)")
    plan.add_argument(
        "--experts", type=_positive, nargs="+", default=[256], help="experts per mode, e.g. 256 or 32 32 (default 256)"
    )
    plan.add_argument(
        "--rank",
        type=_plan_rank,
        nargs="+",
        default=None,
        help="one rank for every bond (64), one per bond in order (4,4,64 or 4 4 64) or by bond name "
        "(a=4,b=4,c=64); default 64 for every bond. A network without bonds takes none",
    )
    plan.add_argument("--batch", type=_positive, default=1, help="tokens per forward (default 1)")
    plan.add_argument("--no-bias", dest="bias", action="store_false", help="no folded bias: i = in")
    plan.add_argument(
        "--optimize", default="auto", help="path optimizer: auto (default), dp, optimal, greedy, cotengra, …"
    )
    plan.add_argument(
        "--memory-limit",
        type=_memory_limit,
        default=None,
        help="most elements any intermediate may hold (an int, or max_input: the largest operand); "
        "default: 4x the largest operand or result, or 1.5x the smallest peak any path reaches",
    )

    demo = commands.add_parser(
        "demo",
        help="mean expert polysemanticity vs number of experts on scikit-learn's digits",
        description="Trains a CP μMoE classification head per expert count on 8×8 digits, ablates every expert, "
        "and prints test accuracy and mean class-level polysemanticity (as the paper defines it). "
        "Writes no file unless --plot is given.",
    )
    demo.add_argument(
        "--experts",
        type=_positive,
        nargs="+",
        default=[8, 16, 32, 64, 128, 256],
        help="expert counts, one head each (default 8 16 32 64 128 256)",
    )
    demo.add_argument("--epochs", type=_positive, default=40, help="training epochs per head (default 40)")
    demo.add_argument("--rank", type=_positive, default=32, help="CP rank of the head (default 32)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the data split and the training (default 0)")
    demo.add_argument("--plot", metavar="FILE.png", help="also save the curve to this file")

    from mumoe_tn.experiments.specialisation import configure_parser

    configure_parser(
        commands.add_parser(
            "specialisation",
            help="does expert class-polysemanticity fall with more experts? (the paper's specialisation figure)",
            description="Trains CP μMoE final layers (N = 16 … 1,024; entmax15/softmax; BatchNorm/none; several "
            "seeds) on 100 generated classes, ablates every expert and reports mean class-level polysemanticity.",
        )
    )
    from mumoe_tn.design.command import configure_parser as configure_design

    configure_design(
        commands.add_parser(
            "design",
            help="which network for a budget? the Pareto front of a structure and rank search",
            description="Searches CP, TR, TT, Tucker, every factorization of the experts into modes and generated "
            "topologies (chains, rings, stars, trees), matches each to the budget, and prints the Pareto front of "
            "parameters, FMAs per token, peak memory and the expert-rank bound. Defaults: the paper's GPT-2 layer, "
            "768 -> 3072 with 256 experts, the nn.Linear's parameters.",
        ),
        positive=_positive,
        budget=_match,
    )
    from mumoe_tn.analysis.explorer.command import configure_parser as configure_explore

    configure_explore(
        commands.add_parser(
            "explore",
            help="write a self-contained HTML page showing what each expert of a model does",
            description="Runs the model a Python function builds over its data and writes one HTML page (no network "
            "needed to open it): per layer the experts' usage, sparsity, dead experts and specialisation; per expert "
            "(or slice of a hierarchical mode) its top-activating examples in context, a histogram of its "
            "coefficient and the effect of ablating it on the loss and outputs.",
        ),
        positive=_positive,
    )
    from mumoe_tn.distillation.study import configure_parser as configure_distill

    configure_distill(
        commands.add_parser(
            "distill",
            help="distil a model's MLP blocks into μMoE blocks and transcoders: the sparsity-accuracy frontier",
            description="Distils each MLP block of a causal language model into sparse replacements (μMoE blocks of "
            "any format, flat or hierarchical, TopK transcoders and skip transcoders) at one parameter budget and "
            "several sparsities L0, on streamed activations, then measures L0, normalised MSE, explained variance, "
            "next-token cross-entropy clean / spliced / zero-ablated and the CE-loss score on held-out text. Without "
            "--model a GPT-2-shaped model is built and trained on Python's pydoc_data first (needs the hf extra).",
        )
    )
    for command in commands.choices.values():  # --import may also stand after the command
        command.add_argument(
            "--import", dest="modules", action="append", default=argparse.SUPPRESS, metavar="MODULE",
            help="import MODULE first (as before the command)",
        )  # fmt: skip
    return parser


def _check_plot(path: str | None, extra: str) -> None:
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


def _check_names(names: Sequence[str], kind: str = "decomposition") -> None:
    """Refuse a registered-name-like word that names no format (a spec string has spaces or commas)."""
    known = available()
    for name in names:
        if re.fullmatch(r"[\w.+-]+", name) and name.lower() not in known:
            raise UsageError(unknown_name(kind, name, known))


def _compare(args: argparse.Namespace) -> int:
    _check_plot(args.plot, "plot")
    _check_names(args.decompositions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MatchingWarning)
        table = _compare_table(args)
    notes = _budget_misses(table, [w for w in caught if issubclass(w.category, MatchingWarning)])
    for warning in caught:  # the rest go to main's one-line report
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if args.json:
        print(table.to_json())
    elif args.markdown:
        markdown = table.to_markdown(dtype=args.dtype)
        for (index, _), (mark, note) in zip(sorted(notes.items()), _marks(notes), strict=True):
            name = table.rows[index].name
            markdown = markdown.replace(f"\n| {name} |", f"\n| {name}{mark} |", 1) + f"\n\n{mark} {note}"
        print(table.title() + "\n\n" + markdown)
    elif args.csv:
        print(table.to_csv(), end="")
    else:
        _print_rich(table, args.dtype, args.wide, notes)
    if args.plot:
        from mumoe_tn.costs.plots import plot_parameters_vs_experts

        path = plot_parameters_vs_experts(table, args.plot)
        print(f"saved {path}", file=sys.stderr)
    return 0


def _budget_misses(table: CostTable, caught: Sequence[warnings.WarningMessage]) -> dict[int, str]:
    """Footnotes for the rows whose parameter match missed its budget, by row index.

    A row missed when a [`MatchingWarning`][mumoe_tn.costs.matching.MatchingWarning] of the
    comparison names its parameter count as the closest match.
    """
    target = table.config["target_params"]
    notes = {}
    for index, row in enumerate(table.rows):
        if row.networks and any(f"closest match has {row.params_total:,} parameters" in str(w.message) for w in caught):
            miss = (row.params_total - target) / target
            notes[index] = (
                f"{row.name}: {row.params_total:,} parameters, {miss:+.1%} from the budget of {target:,}; the closest "
                f"match its rank steps allow (the matcher's tolerance is ±{TOLERANCE:.0%})"
            )
    return notes


def _marks(notes: dict[int, str]) -> list[tuple[str, str]]:
    """``(mark, note)`` pairs in row order, marked as the terminal table marks them."""
    ordered = [note for _, note in sorted(notes.items())]
    return [(FOOTNOTE_MARKS[min(k, len(FOOTNOTE_MARKS) - 1)], note) for k, note in enumerate(ordered)]


def _compare_table(args: argparse.Namespace) -> CostTable:
    return compare(
        args.in_features,
        args.out_features,
        tuple(args.experts),
        (*(name.lower() for name in args.decompositions), *args.spec),
        ranks=dict(args.rank),
        match=args.match,
        rank_multiple=args.rank_multiple,
        bias=args.bias,
        gate=args.gate,
        batch=args.batch,
        top_k=args.top_k,
    )


def _print_rich(table: CostTable, dtype: str, wide: bool, notes: dict[int, str]) -> None:
    from rich.console import Console

    console = Console()  # sized by the terminal (or $COLUMNS)
    keys = [*table.records()[0]]
    keys.remove("spec")
    keys.insert(keys.index("peak_elements") + 1, "peak_bytes")
    if wide:
        rendered = rich_tables(table.title(), table.records(), keys, dtype=dtype, width=console.width, notes=notes)
    else:
        rendered = [rich_table(table.title(), table.records(), keys, dtype=dtype, width=console.width, notes=notes)]
        if "left out to fit" in (rendered[0].caption or ""):
            rendered[0].caption += "; --wide shows them"
    print_tables(console, rendered)


#: ``plan``'s rank for every bond when ``--rank`` is left out.
_DEFAULT_RANK = 64


def _plan(args: argparse.Namespace) -> int:
    from mumoe_tn.contractions.plan import plan_forward
    from mumoe_tn.costs.rank import min_cut
    from mumoe_tn.decompositions.resolve import resolve_network, spec_ranks

    rank = None if args.rank is None else _plan_ranks(args.rank)
    width = args.in_features + int(args.bias)
    dims = tuple(args.experts)
    _check_names([args.network], "network name")
    named = args.network.lower() in available()
    decomposition = args.network.lower() if named else args.network
    if named and not isinstance(rank, dict):
        network = resolve_network(
            decomposition, dims, width, args.out_features, _DEFAULT_RANK if rank is None else rank
        )
    else:  # a spec string, or bonds by name: the shape first (every bond 1), then the sizes
        shape = resolve_network(decomposition, dims, width, args.out_features, 1)
        if not shape.bonds and rank is not None:
            given = " ".join(map(_rank_word, args.rank))
            raise UsageError(f"{args.network!r} has no bonds, so --rank {given} has nothing to size: leave it out")
        network = shape.with_sizes(**spec_ranks(shape.bonds, _DEFAULT_RANK if rank is None else rank, shape.name))
    plan = plan_forward(network, args.batch, args.optimize, memory_limit=args.memory_limit)
    labels, bound = min_cut(network)
    bias = f"{args.in_features} inputs + 1 folded bias, as in compare" if args.bias else "no bias"
    per_token = plan.fma / args.batch
    limit = (
        "auto (4x the largest operand or result, or 1.5x the smallest peak found)"
        if args.memory_limit is None
        else f"{args.memory_limit:,}"
    )
    if args.memory_limit == "max_input":
        limit = "max_input (the largest operand)"
    _print_fitted(
        f"i = {width} ({bias}); batch {args.batch:,}",
        str(network),
        str(plan),
        f"largest intermediate per batch: {plan.largest_intermediate:,} elements; FMA per token: {per_token:,.0f}",
        f"memory limit: {limit}",
        f"expert rank <= {bound} (cut {labels})",
    )
    return 0


def _print_fitted(*texts: str) -> None:
    """Print lines wrapped at spaces to the terminal's width (or $COLUMNS); a word is never split."""
    columns = shutil.get_terminal_size().columns
    for line in "\n".join(texts).splitlines():
        if len(line) <= columns:
            print(line)
        else:
            indent = " " * (len(line) - len(line.lstrip()) + 4)
            print(
                textwrap.fill(line, columns, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
            )


def _demo(args: argparse.Namespace) -> int:
    _check_plot(args.plot, "examples")
    if importlib.util.find_spec("sklearn") is None:
        raise UsageError(
            "the demo needs scikit-learn's digits, which is not installed: pip install 'mumoe_tn[examples]'"
        )
    from mumoe_tn.experiments.demo import format_rows, run_demo

    rows = run_demo(args.experts, epochs=args.epochs, rank=args.rank, seed=args.seed, plot=args.plot)
    print(format_rows(rows))
    if args.plot:
        print(f"saved {args.plot}", file=sys.stderr)
    return 0


def _specialisation(args: argparse.Namespace) -> int:
    from mumoe_tn.experiments.specialisation import run

    return run(args)


def _explore(args: argparse.Namespace) -> int:
    from mumoe_tn.analysis.explorer.command import run

    return run(args)


def _design(args: argparse.Namespace) -> int:
    _check_plot(args.plot, "plot")
    from mumoe_tn.design.command import run

    return run(args)


def _distill(args: argparse.Namespace) -> int:
    _check_plot(args.plot, "plot")
    if importlib.util.find_spec("transformers") is None:
        raise UsageError("distill needs transformers: pip install 'mumoe_tn[hf]'")
    from mumoe_tn.distillation.study import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mumoe-tn`` command; returns the exit status (2 for any error, printed as one line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _load_user_formats(argv)
    except UsageError as error:
        _Parser(prog="mumoe-tn").exit(2, f"mumoe-tn: error: {error}\n")
    parser = _parser()
    args = parser.parse_args(argv)
    commands = {
        "compare": _compare,
        "plan": _plan,
        "demo": _demo,
        "specialisation": _specialisation,
        "design": _design,
        "explore": _explore,
        "distill": _distill,
    }
    with warnings.catch_warnings(record=True) as caught:  # the filters in force decide what is shown
        try:
            return commands[args.command](args)
        except Exception as error:  # the command line prints every failure as one line, never a traceback
            kind = "" if isinstance(error, (UsageError, ValueError, TypeError)) else f"{type(error).__name__}: "
            message = " ".join(str(error).split())
            parser.exit(2, f"mumoe-tn {args.command}: error: {kind}{message}\n")
        finally:
            _report(args.command, caught)
    return 2  # pragma: no cover - parser.exit raises


def _report(command: str, caught: Sequence[warnings.WarningMessage]) -> None:
    """Every distinct warning as one line on stderr, in the program's words (no file, no source line)."""
    seen = set()
    for warning in caught:
        message = " ".join(str(warning.message).split())
        if message not in seen:
            seen.add(message)
            print(f"mumoe-tn {command}: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
