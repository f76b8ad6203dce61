"""``mumoe-tn specialisation``: the specialisation study from the command line.

Parses the sizes, runs [`run_experiment`][mumoe_tn.analysis.specialisation_study.run_experiment] of
[`mumoe_tn.analysis.specialisation_study`][mumoe_tn.analysis.specialisation_study] (the experiment:
does expert class-polysemanticity fall with more experts?), and prints its table, as a rich table,
Markdown or JSON, and its figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from mumoe_tn.analysis.specialisation_study import (
    GATES,
    ExperimentConfig,
    plot_results,
    run_experiment,
    table,
    to_markdown,
)
from mumoe_tn.cli.arguments import add_output_formats

__all__ = ["DESCRIPTION", "HELP", "configure", "run"]

HELP = "does expert class-polysemanticity fall with more experts? (the paper's specialisation figure)"
DESCRIPTION = (
    "Trains CP μMoE final layers (N = 16 … 1,024; entmax15/softmax; BatchNorm/none; several "
    "seeds) on 100 generated classes, ablates every expert and reports mean class-level polysemanticity."
)


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's arguments to ``parser``; returns it."""
    defaults = ExperimentConfig()
    parser.add_argument("--quick", action="store_true", help="a run of seconds: 20 classes, N in 1 4 16, 2 seeds")
    parser.add_argument(
        "--experts", type=int, nargs="+", help=f"expert counts (default {list(defaults.expert_counts)})"
    )
    parser.add_argument("--gates", nargs="+", choices=list(GATES), help="gate settings (default all three)")
    parser.add_argument("--seeds", type=int, nargs="+", help=f"model seeds (default {list(defaults.seeds)})")
    parser.add_argument("--classes", type=int, help=f"generated classes (default {defaults.classes})")
    parser.add_argument("--superclasses", type=int, help=f"superclasses (default {defaults.superclasses})")
    parser.add_argument("--epochs", type=int, help=f"training epochs (default {defaults.epochs})")
    parser.add_argument("--rank", type=int, help=f"CP rank of the head (default {defaults.rank})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: fastest on a shared machine)")
    add_output_formats(
        parser, json="print the result as JSON (table, runs, config)", markdown="print the table as Markdown", csv=None
    )
    parser.add_argument("--plot", metavar="FILE.png", default="", help="save the figure here (default: no plot)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def _config_from(args: argparse.Namespace) -> ExperimentConfig:
    config = ExperimentConfig.quick() if args.quick else ExperimentConfig()
    changes = {
        "expert_counts": tuple(args.experts) if args.experts else None,
        "gates": tuple(args.gates) if args.gates else None,
        "seeds": tuple(args.seeds) if args.seeds else None,
        "classes": args.classes,
        "superclasses": args.superclasses,
        "epochs": args.epochs,
        "rank": args.rank,
    }
    values = {**asdict(config), **{k: v for k, v in changes.items() if v is not None}}
    return ExperimentConfig(**values)


def _check_plot_target(path: str) -> None:
    """Fail before any work if the figure could not be written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'mumoe_tn[examples]'") from None
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--plot {path!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--plot {path!r}: folder {str(folder)!r} is not writable")


def _print_rich(result: dict) -> None:
    """The table at the terminal's width: as many tables of the same rows as the columns need."""
    from rich.console import Console

    from mumoe_tn.costs.display import column_groups, print_tables

    seeds = len(result["config"]["seeds"])
    console = Console()  # sized by the terminal (or $COLUMNS)
    headers, rows = table(result)
    title = f"Expert class-polysemanticity (mean ± std over {seeds} seeds)"
    print_tables(console, column_groups(headers, rows, width=console.width, keep=2, title=title))
    probe = result["linear_probe_accuracy"]
    console.print(f"linear probe test accuracy: {sum(probe) / len(probe):.3f}; {result['seconds']} s")


def run(args: argparse.Namespace) -> int:
    """Run the experiment for the parsed arguments and print its table (and save the figure); returns 0."""
    if isinstance(args.threads, bool) or args.threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {args.threads!r}")
    config = _config_from(args)
    if args.plot:
        _check_plot_target(args.plot)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = run_experiment(config, progress=args.progress)
    finally:
        torch.set_num_threads(threads)
    result["machine"]["torch_threads"] = args.threads
    if args.json:
        print(json.dumps(result, indent=1, allow_nan=False))
    elif args.markdown:
        print(to_markdown(result))
    else:
        _print_rich(result)
    if args.plot:
        print(f"saved {plot_results(result, args.plot)}", file=sys.stderr)
    return 0
