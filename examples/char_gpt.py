"""A small character-level GPT whose MLP blocks are μMoE blocks.

The corpus is the English text of the Python standard library's ``pydoc_data.topics`` (it
ships with Python, nothing is downloaded). The same transformer is trained with plain MLP
blocks and with μMoE blocks parameter-matched to them (``match="mlp"``: the MLP block's
parameters, the gate counted): CP, TR, TT and Tucker with 64 experts, and a hierarchical CP
block of 32×32×32×32 = 1,048,576 experts. The model is causal, so every μMoE gate normalises its
logits per token (LayerNorm, not the paper's BatchNorm, whose training statistics would let a
position see later tokens). Each run prints its parameter count and train/validation loss.

``--seeds 0 1 2`` trains every variant once per seed. A seed fixes the initialisation and the
order of the training batches; the evaluation batches are the same for every run. The parts
every variant shares (embeddings, attention, norms, head) are initialised identically for one
seed whatever the MLP block is, so the runs of one seed differ only in their MLP blocks.

Each row prints as soon as its run has trained, with its median time per training step and that
time relative to the first variant of its seed (the MLP). ``--eval-every K`` records the
validation loss every K steps (the learning curve), ``--json PATH`` writes every run with its
curve. ``python -m benchmarks.quality`` runs this example over variants and seeds in parallel
processes and reports means, intervals and the curves.

Run: ``python examples/char_gpt.py`` (a few minutes on 2 CPU cores); ``--quick`` for a tiny run
of a few seconds. ``mumoe-tn explore examples/char_gpt.py:explorer`` trains the CP variant briefly
and writes the expert explorer's page for it.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from mumoe_tn.layers import MixtureOfDecoders, MuMoEMLP, parameter_groups


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int, make_mlp, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(context, width))
        mlps = []
        for layer in range(depth):
            # The MLP blocks draw from a stream of their own, so the shared parts start alike for every variant.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1_000_003 * (seed + 1) + layer)
                mlps.append(make_mlp())
        self.blocks = nn.Sequential(*(Block(width, heads, mlp) for mlp in mlps))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions[: idx.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def mlp_block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


#: A causal model needs token-wise gates: a BatchNorm gate's training statistics would span later positions.
CAUSAL_GATE = {"gate_norm": "layer"}


def mumoe(
    expert_dims: int | tuple[int, ...], decomposition: str, block: Callable[..., nn.Module] = MuMoEMLP
) -> Callable[..., nn.Module]:
    """A factory of parameter-matched μMoE blocks ``w → 4w → w`` (extra keywords reach ``block``)."""

    def make(width: int, **options) -> nn.Module:
        options = {**CAUSAL_GATE, "match": "mlp", **options}  # e.g. match=None, rank=28 for fixed ranks
        return block(width, 4 * width, width, expert_dims, decomposition, **options)

    return make


#: The variants: a name and a block factory ``(width, **block options)``. A format is one more line.
VARIANTS: dict[str, Callable[..., nn.Module]] = {
    "MLP": lambda w, **_: mlp_block(w),
    "CP μMoE (64 experts)": mumoe(64, "cp"),
    "TR μMoE (64 experts)": mumoe(64, "tr"),
    "TT μMoE (64 experts)": mumoe(64, "tt"),
    "Tucker μMoE (64 experts)": mumoe(64, "tucker"),
    "CP μMoE (32×32×32×32 experts)": mumoe((32, 32, 32, 32), "cp"),
    "MxD (64 experts)": mumoe(64, "mxd", block=MixtureOfDecoders),
}


def block_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--block-option`` (VALUE a Python literal, else a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"a block option is KEY=VALUE, e.g. gate_init=zeros; got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def batches(data: torch.Tensor, context: int, batch: int, generator: torch.Generator):
    while True:
        start = torch.randint(len(data) - context - 1, (batch,), generator=generator)
        x = torch.stack([data[s : s + context] for s in start.tolist()])
        y = torch.stack([data[s + 1 : s + context + 1] for s in start.tolist()])
        yield x, y


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, context: int, batches_: int = 20) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(1)
    stream = batches(data, context, 32, generator)
    losses = [
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in (next(stream) for _ in range(batches_))
    ]
    model.train()
    return sum(losses) / len(losses)


def train(name: str, make_mlp, data: dict, args: argparse.Namespace, seed: int = 0) -> dict:
    options = dict(args.block_option or []) if name != "MLP" else {}
    model = CharGPT(
        data["vocab"], args.context, args.width, args.depth, args.heads, lambda: make_mlp(args.width, **options), seed
    )
    mlp_params = sum(p.numel() for block in model.blocks for p in block.mlp.parameters())
    groups = parameter_groups(
        model,
        args.lr,
        gate_lr_scale=args.gate_lr,
        core_lr_scale=args.core_lr,
        weight_decay=args.weight_decay,
        core_weight_decay=args.core_weight_decay,
    )
    optimizer = torch.optim.AdamW(groups)
    stream = batches(data["train"], args.context, args.batch, torch.Generator().manual_seed(seed))
    warmup = max(1, min(50, args.steps // 10)) if args.warmup is None else max(1, args.warmup)
    start = time.perf_counter()
    step_seconds, first_loss, curve = [], None, []
    progress = tqdm(range(args.steps), desc=f"{name} seed {seed}", leave=False, mininterval=1.0)
    for step in progress:
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        x, y = next(stream)
        tic = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step_seconds.append(time.perf_counter() - tic)
        first_loss = loss.item() if first_loss is None else first_loss
        progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)  # shown with the step count, never before it
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            curve.append((step + 1, evaluate(model, data["val"], args.context)))
    val_loss = evaluate(model, data["val"], args.context)
    median = statistics.median(step_seconds[min(5, len(step_seconds) - 1) :])
    return {
        "model": name,
        "seed": seed,
        "params": sum(p.numel() for p in model.parameters()),
        "mlp_params": mlp_params,
        "first_loss": first_loss,
        "train_loss": evaluate(model, data["train"], args.context),
        "val_loss": val_loss,
        "curve": [*curve, (args.steps, val_loss)] if args.eval_every else [],
        "step_ms": 1e3 * median,
        "steps_per_s": 1.0 / median,
        "seconds": time.perf_counter() - start,
        "trained": model,
    }


def encoded_corpus() -> tuple[list[str], torch.Tensor]:
    """The corpus's characters and the text as indices into them."""
    text = corpus()
    chars = sorted(set(text))
    lookup = {c: k for k, c in enumerate(chars)}
    return chars, torch.tensor([lookup[c] for c in text], dtype=torch.long)


def explorer(steps: int = 300, variant: str = "CP μMoE (64 experts)", sequences: int = 128, width: int = 64) -> dict:
    """Train ``variant`` for ``steps`` steps; return the arguments of ``mumoe_tn.analysis.explore`` for it.

    The data are ``sequences`` validation windows of 64 characters (``mumoe-tn explore
    examples/char_gpt.py:explorer``).
    """
    chars, encoded = encoded_corpus()
    split = int(0.9 * len(encoded))
    data = {"vocab": len(chars), "train": encoded[:split], "val": encoded[split:]}
    args = argparse.Namespace(
        steps=steps, batch=32, context=64, width=width, depth=2, heads=4, lr=3e-3, weight_decay=0.01,
        warmup=None, gate_lr=1.0, core_lr=1.0, core_weight_decay=None, block_option=None, eval_every=0,
    )  # fmt: skip
    model = train(variant, VARIANTS[variant], data, args)["trained"].eval()
    windows = next(batches(data["val"], args.context, sequences, torch.Generator().manual_seed(3)))[0]
    return {"model": model, "data": windows, "vocabulary": chars, "title": f"Char GPT on pydoc_data: {variant}"}


def seconds(value: float) -> str:
    """A duration with two significant digits below 10 s (a quick run is not 0 s), whole seconds above."""
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def print_row(row: dict, first: dict) -> None:
    """One markdown row, printed as soon as its run has trained."""
    relative = row["step_ms"] / first["step_ms"]
    print(
        f"| {row['model']} | {row['seed']} | {row['params']:,} | {row['mlp_params']:,} | {row['train_loss']:.3f} | "
        f"{row['val_loss']:.3f} | {row['step_ms']:.1f} | {relative:.2f}× | {seconds(row['seconds'])} |",
        flush=True,
    )


def print_summary(rows: list[dict]) -> None:
    """Mean ± standard deviation of the validation loss over the seeds, per variant."""
    print("\n| model | seeds | val loss (mean ± std) |\n|---|---:|---:|")
    for name in dict.fromkeys(row["model"] for row in rows):
        losses = [row["val_loss"] for row in rows if row["model"] == name]
        spread = statistics.stdev(losses) if len(losses) > 1 else float("nan")
        print(f"| {name} | {len(losses)} | {statistics.fmean(losses):.3f} ± {spread:.3f} |", flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], metavar="SEED",
                        help="train every variant once per seed (default 0)")  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=0, metavar="K",
                        help="record the validation loss every K steps (default 0: only at the end)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every run (and curve) here")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=None,
                        help="linear warm-up steps (default min(50, steps/10))")  # fmt: skip
    parser.add_argument("--gate-lr", type=float, default=1.0, metavar="X",
                        help="LR multiplier of the μMoE gates (mumoe_tn.parameter_groups)")  # fmt: skip
    parser.add_argument("--core-lr", type=float, default=1.0, metavar="X",
                        help="LR multiplier of the expert-mode cores; 3 lowered every format's loss in "
                        "docs/results.md's factor study")  # fmt: skip
    parser.add_argument("--core-weight-decay", type=float, default=None,
                        help="weight decay of the expert-mode cores (default --weight-decay)")  # fmt: skip
    parser.add_argument("--block-option", type=block_option, action="append", metavar="KEY=VALUE",
                        help="extra MuMoEMLP keyword for every μMoE block, e.g. gate_init=zeros, activation=1.3, "
                        "expert_noise=(1,1,1,1); repeatable")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 40 steps: a run of seconds")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    args = parser.parse_args(argv)
    for option in ("steps", "batch", "context", "width", "depth", "heads", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1, got {getattr(args, option)}")
    if args.eval_every < 0 or any(seed < 0 for seed in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--eval-every must be ≥ 0 and --seeds distinct non-negative integers, got {args.seeds}")
    if args.quick:
        args.steps, args.batch, args.context, args.width, args.depth = 40, 8, 16, 32, 1
    torch.set_num_threads(args.threads)
    chars, encoded = encoded_corpus()
    text = corpus()
    split = int(0.9 * len(encoded))
    data = {"vocab": len(chars), "train": encoded[:split], "val": encoded[split:]}
    print(
        f"pydoc_data topics: {len(text):,} characters, vocabulary {len(chars)}; {args.steps} steps of "
        f"{args.batch}×{args.context} tokens, width {args.width}, depth {args.depth}"
    )
    print(
        "\n| model | seed | params | MLP-block params | train loss | val loss | ms/step | step ÷ first | time (s) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        flush=True,
    )
    rows = []
    for seed in args.seeds:
        first = len(rows)
        for name in args.variants:
            rows.append(train(name, VARIANTS[name], data, args, seed))
            print_row(rows[-1], rows[first])
            if args.json is not None:  # every finished run is kept, even if a later one is interrupted
                runs = [{key: value for key, value in row.items() if key != "trained"} for row in rows]
                args.json.write_text(json.dumps({"config": config(args), "runs": runs}, indent=1))
    if len(args.seeds) > 1:
        print_summary(rows)
    return rows


def config(args: argparse.Namespace) -> dict:
    """The settings of a run (what makes two JSON files comparable)."""
    keys = ("steps", "batch", "context", "width", "depth", "heads", "lr", "weight_decay", "warmup", "gate_lr",
            "core_lr", "core_weight_decay", "eval_every")  # fmt: skip
    return {**{key: getattr(args, key) for key in keys}, "block_options": dict(args.block_option or [])}


if __name__ == "__main__":
    main()
