"""``mumoe-tn compare``: the cost table of μMoE decompositions against nn.Linear, MLP blocks and MoEs."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from mumoe_tn.cli.arguments import (
    add_layer_shape,
    add_output_formats,
    budget,
    check_names,
    check_plot,
    named_rank,
    positive,
)
from mumoe_tn.costs.display import DTYPE_BYTES, FOOTNOTE_MARKS, print_tables, rich_table, rich_tables
from mumoe_tn.costs.matching import TOLERANCE, MatchingWarning
from mumoe_tn.costs.table import CostTable, compare
from mumoe_tn.decompositions.registry import available

__all__ = ["DESCRIPTION", "HELP", "configure", "run"]

HELP = "cost table of μMoE decompositions against nn.Linear, MLP blocks and MoEs"
DESCRIPTION = (
    "Parameters, FMAs per token (1 FMA = 1 FLOP), the peak intermediate per batch and expert-rank "
    "bounds. Defaults: the paper's GPT-2 MLP layer, 768 -> 3072 with 256 experts, CP and TR "
    "parameter-matched to nn.Linear. The table fits the terminal: columns that do not fit are left "
    "out (named under the table); --wide shows them all."
)


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's arguments to ``parser``; returns it."""
    add_layer_shape(parser, experts_help="experts per mode, e.g. 256 or 32 32 32 32")
    parser.add_argument(
        "--decompositions", nargs="+", default=["cp", "tr"], help=f"any of {available()} (default cp tr)"
    )
    parser.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="SPEC",
        help="also a custom network, e.g. 'A: n1 a b, B: a i c, C: b c o', or named for its row and --rank: "
        "'mine=A: n1 a b, B: a i c, C: b c o' (repeatable; unnamed ones are 'custom 1', 'custom 2', …)",
    )
    parser.add_argument(
        "--rank",
        type=named_rank,
        action="append",
        default=[],
        help="explicit ranks of a row: cp=512, tr=4,4,128, one per bond in order (mine=8,8,8) or by bond "
        "(mine=a=8,b=16)",
    )
    parser.add_argument(
        "--match",
        type=budget,
        default="linear",
        help="parameter target for decompositions without --rank: linear (default), mlp (compare in->out->in blocks), "
        "a number of parameters, or a fraction of the reference's. TR/TT scale the input-output bond, Tucker all its "
        "bonds.",
    )
    parser.add_argument(
        "--rank-multiple",
        type=positive,
        default=1,
        help="matched ranks are multiples of this (e.g. 16: faster matrix multiplies; default 1)",
    )
    parser.add_argument("--no-bias", dest="bias", action="store_false", help="no folded bias (and no baseline bias)")
    parser.add_argument("--no-gating", dest="gate", action="store_false", help="do not count gating parameters/FMAs")
    parser.add_argument(
        "--batch", type=positive, default=1, help="tokens per forward, for the planned FMAs and the peak intermediate"
    )
    parser.add_argument(
        "--top-k",
        type=positive,
        default=None,
        help="K of the sparse MoE baseline (default 2; not applicable with fewer experts)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="float32", help="dtype of the memory column (default float32)"
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="show every column: in several tables of the same rows where the terminal is too narrow for one",
    )
    add_output_formats(parser, markdown="print a Markdown table (every column)")
    parser.add_argument("--plot", metavar="FILE.png", help="also save parameters vs number of experts (2 to 16,384)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Build the table, print it in the asked format (and save the plot)."""
    check_plot(args.plot, "plot")
    check_names(args.decompositions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MatchingWarning)
        table = _table(args)
    notes = _budget_misses(table, [w for w in caught if issubclass(w.category, MatchingWarning)])
    for warning in caught:  # the rest go to the entry point's one-line report
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


def _table(args: argparse.Namespace) -> CostTable:
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
