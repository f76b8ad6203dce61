"""A small μMoE MLP-Mixer on scikit-learn's 8×8 handwritten digits.

The digits ship inside scikit-learn (nothing is downloaded). Images are cut into 2×2 patches
(16 tokens); every token-mixing and channel-mixing MLP is either a plain MLP or a μMoE block
with 16 experts, parameter-matched to it. Prints parameters and test accuracy per model.

``--seeds 0 1 2`` trains every model once per seed. A seed fixes the initialisation and the
order of the training batches; the train/test split is the same for every run, and the parts
every model shares (patch embedding, norms, head) start alike for one seed whatever the MLPs are.
``--json PATH`` writes every run; ``python -m benchmarks.quality`` runs this example over models
and seeds in parallel processes and reports means and intervals.

Each model's row prints as soon as it has trained. Run: ``python examples/mixer_digits.py``
(about a minute on 2 CPU cores); ``--quick`` for a run of seconds. ``mumoe-tn explore
examples/mixer_digits.py:explorer`` trains the CP variant and writes the expert explorer's page.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from mumoe_tn.layers import MuMoEMLP


def load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0  # (1797, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    images, labels = images[order], labels[order]
    split = int(0.8 * len(labels))
    return images[:split], labels[:split], images[split:], labels[split:]


def patches(images: torch.Tensor, size: int = 2) -> torch.Tensor:
    b = images.shape[0]
    x = images.reshape(b, 8 // size, size, 8 // size, size).permute(0, 1, 3, 2, 4)
    return x.reshape(b, (8 // size) ** 2, size * size)


def mlp(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class MixerLayer(nn.Module):
    def __init__(self, tokens: int, channels: int, make_mlp, seed: int = 0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
        # The MLPs draw from a stream of their own, so the shared parts start alike for every model.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.token_mlp = make_mlp(tokens, 4 * tokens)
            self.channel_mlp = make_mlp(channels, 4 * channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(
        self, make_mlp, tokens: int = 16, patch: int = 4, channels: int = 32, depth: int = 2, seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(patch, channels)
        layer_seeds = [1_000_003 * (seed + 1) + layer for layer in range(depth)]
        self.layers = nn.Sequential(*(MixerLayer(tokens, channels, make_mlp, s) for s in layer_seeds))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(x))).mean(1))


VARIANTS = {
    "MLP": mlp,
    "CP μMoE (16 experts)": lambda width, hidden: MuMoEMLP(width, hidden, width, 16, "cp", match="mlp"),
    "TR μMoE (16 experts)": lambda width, hidden: MuMoEMLP(width, hidden, width, 16, "tr", match="mlp"),
}


def run(name: str, make_mlp, data, args: argparse.Namespace, seed: int = 0) -> dict:
    x_train, y_train, x_test, y_test = data
    model = Mixer(make_mlp, seed=seed)
    shuffle = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, total_steps=args.epochs * ((len(y_train) + args.batch - 1) // args.batch)
    )
    start = time.perf_counter()
    epoch_losses = []
    step_seconds = []
    progress = tqdm(range(args.epochs), desc=f"{name} seed {seed}", leave=False)
    for _ in progress:
        order = torch.randperm(len(y_train), generator=shuffle)
        losses = []
        for k in range(0, len(order), args.batch):
            chosen = order[k : k + args.batch]
            if len(chosen) < 2:  # BatchNorm gates need two or more samples
                continue
            tic = time.perf_counter()
            loss = F.cross_entropy(model(patches(x_train[chosen])), y_train[chosen])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step_seconds.append(time.perf_counter() - tic)
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
        progress.set_postfix(loss=f"{epoch_losses[-1]:.3f}", refresh=False)  # shown with the epoch count
    model.eval()
    with torch.no_grad():
        accuracy = (model(patches(x_test)).argmax(-1) == y_test).float().mean().item()
    return {
        "model": name,
        "seed": seed,
        "params": sum(p.numel() for p in model.parameters()),
        "accuracy": accuracy,
        "epoch_losses": epoch_losses,
        "steps_per_s": 1.0 / statistics.median(step_seconds),
        "seconds": time.perf_counter() - start,
        "trained": model,
    }


def explorer(epochs: int = 10, variant: str = "CP μMoE (16 experts)") -> dict:
    """Train ``variant`` for ``epochs`` epochs; return ``mumoe_tn.analysis.explore``'s arguments on the test set."""
    data = load_digits()
    args = argparse.Namespace(epochs=epochs, batch=64, lr=1e-2)
    model = run(variant, VARIANTS[variant], data, args)["trained"].eval()
    images, labels = data[2], data[3]
    return {
        "model": model,
        "data": patches(images),
        "labels": labels,
        "images": images,
        "class_names": [str(digit) for digit in range(10)],
        "title": f"Mixer on 8×8 digits: {variant}",
    }


def seconds(value: float) -> str:
    """A duration with two significant digits below 10 s (a quick run is not 0 s), whole seconds above."""
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], metavar="SEED",
                        help="train every model once per seed (default 0)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every run here")
    parser.add_argument("--quick", action="store_true", help="3 epochs: a run of seconds")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    args = parser.parse_args(argv)
    for option in ("epochs", "batch", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1, got {getattr(args, option)}")
    if any(seed < 0 for seed in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    if args.quick:
        args.epochs = 3
    torch.set_num_threads(args.threads)
    data = load_digits()
    print(f"digits: {len(data[1])} train / {len(data[3])} test images, {args.epochs} epochs")
    print("\n| model | seed | params | test accuracy | time (s) |\n|---|---:|---:|---:|---:|", flush=True)
    rows = []
    for seed in args.seeds:
        for name in args.variants:
            row = run(name, VARIANTS[name], data, args, seed)
            print(
                f"| {row['model']} | {seed} | {row['params']:,} | {row['accuracy']:.3f} | {seconds(row['seconds'])} |",
                flush=True,
            )
            rows.append(row)
            if args.json is not None:  # every finished run is kept, even if a later one is interrupted
                settings = {"epochs": args.epochs, "batch": args.batch, "lr": args.lr}
                args.json.write_text(json.dumps({"config": settings, "runs": rows}, indent=1))
    if len(args.seeds) > 1:
        print("\n| model | seeds | test accuracy (mean ± std) |\n|---|---:|---:|")
        for name in args.variants:
            accuracies = [row["accuracy"] for row in rows if row["model"] == name]
            mean, spread = statistics.fmean(accuracies), statistics.stdev(accuracies)
            print(f"| {name} | {len(accuracies)} | {mean:.3f} ± {spread:.3f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
