"""``mumoe-tn demo``: expert polysemanticity against the number of experts, on real data.

A small classifier (a GELU layer, then a CP μMoE classification head with BatchNorm entmax
gates, as in the paper's fine-tuned final layers) is trained on scikit-learn's 8×8 digits for
each expert count; every expert of the head is then ablated in turn (batched) and the mean
class-level polysemanticity (as the paper defines it) of the experts whose ablation changes
some class is reported — the paper's Figure "polysemanticity" at small scale. Needs
scikit-learn (``pip install 'mumoe_tn[examples]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from mumoe_tn.analysis.polysemanticity import class_polysemanticity
from mumoe_tn.cli.arguments import UsageError, check_plot, positive
from mumoe_tn.layers import MuMoE

__all__ = ["DESCRIPTION", "HELP", "configure", "format_rows", "load_digits", "run", "run_demo"]

HELP = "mean expert polysemanticity vs number of experts on scikit-learn's digits"
DESCRIPTION = (
    "Trains a CP μMoE classification head per expert count on 8×8 digits, ablates every expert, "
    "and prints test accuracy and mean class-level polysemanticity (as the paper defines it). "
    "Writes no file unless --plot is given."
)


def load_digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as standardised 64-d vectors, split 80/20 (train, test)."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise ImportError("the demo needs scikit-learn: pip install 'mumoe_tn[examples]'") from error
    digits = sklearn_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    mean, std = x[:split].mean(0), x[:split].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return x[:split], y[:split], x[split:], y[split:]


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for k in range(0, len(order) - 1, 64):
            chosen = order[k : k + 64]
            loss = F.cross_entropy(model(x[chosen]), y[chosen])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def run_demo(
    expert_counts: Sequence[int] = (8, 16, 32, 64, 128, 256),
    *,
    epochs: int = 40,
    rank: int = 32,
    hidden: int = 64,
    seed: int = 0,
    plot: str | Path | None = None,
    progress: bool = True,
) -> list[dict]:
    """Train one head per expert count and measure mean expert polysemanticity.

    Parameters
    ----------
    expert_counts : Sequence of int
        Numbers of experts of the μMoE head.
    epochs : int, optional
        Training epochs per model.
    rank : int, optional
        CP rank of the head.
    hidden : int, optional
        Width of the GELU feature layer before the head.
    seed : int, optional
        Seed of the data split, initialisation and batching.
    plot : str or Path, optional
        Save mean polysemanticity against the number of experts here (PNG).
    progress : bool, optional
        Show a progress bar.

    Returns
    -------
    list of dict
        Per expert count: test accuracy, experts whose ablation changes some class, mean
        polysemanticity.

    Raises
    ------
    ValueError
        If ``epochs``, ``rank``, ``hidden`` or an expert count is not a positive integer (an
        untrained model would be reported as if trained), or ``plot``'s folder does not exist
        (checked before training).
    """
    from tqdm import tqdm

    for name, value in (("epochs", epochs), ("rank", rank), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    counts = list(expert_counts)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"expert_counts must be positive integers, got {counts!r}")
    if plot is not None and not Path(plot).resolve().parent.is_dir():
        raise ValueError(f"plot {str(plot)!r}: folder {str(Path(plot).resolve().parent)!r} does not exist")
    x_train, y_train, x_test, y_test = load_digits(seed)
    rows = []
    for n in tqdm(counts, desc="expert counts", disable=not progress):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), MuMoE(hidden, 10, n, "cp", rank))
        _train(model, x_train, y_train, epochs, seed)
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(-1) == y_test).float().mean())
        result = class_polysemanticity(model, model[2], x_test, y_test, n_classes=10)
        rows.append(
            {
                "experts": n,
                "test_accuracy": accuracy,
                "experts_changing_a_class": int(result.changed.sum()),
                "mean_polysemanticity": result.mean,
            }
        )
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(5.2, 3.6))
        axes.plot([r["experts"] for r in rows], [r["mean_polysemanticity"] for r in rows], marker="o")
        axes.set(xscale="log", xlabel="number of experts", ylabel="mean expert polysemanticity (↓)")
        axes.set_xscale("log", base=2)
        axes.set_title("CP μMoE heads on 8×8 digits", fontsize=9)
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figure.savefig(plot, dpi=120)
        plt.close(figure)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The demo's results as a Markdown table."""
    lines = ["| experts | test accuracy | experts changing a class | mean polysemanticity |", "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['experts']} | {r['test_accuracy']:.3f} | {r['experts_changing_a_class']} | "
            f"{r['mean_polysemanticity']:.3f} |"
        )
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's arguments to ``parser``; returns it."""
    parser.add_argument(
        "--experts",
        type=positive,
        nargs="+",
        default=[8, 16, 32, 64, 128, 256],
        help="expert counts, one head each (default 8 16 32 64 128 256)",
    )
    parser.add_argument("--epochs", type=positive, default=40, help="training epochs per head (default 40)")
    parser.add_argument("--rank", type=positive, default=32, help="CP rank of the head (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split and the training (default 0)")
    parser.add_argument("--plot", metavar="FILE.png", help="also save the curve to this file")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the demo for the parsed arguments and print its table (and save the curve)."""
    check_plot(args.plot, "examples")
    if importlib.util.find_spec("sklearn") is None:
        raise UsageError(
            "the demo needs scikit-learn's digits, which is not installed: pip install 'mumoe_tn[examples]'"
        )
    rows = run_demo(args.experts, epochs=args.epochs, rank=args.rank, seed=args.seed, plot=args.plot)
    print(format_rows(rows))
    if args.plot:
        print(f"saved {args.plot}", file=sys.stderr)
    return 0
