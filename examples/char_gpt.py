"""A small character-level GPT whose MLP blocks are μMoE blocks.

The corpus is the English text of the Python standard library's ``pydoc_data.topics`` (it
ships with Python, nothing is downloaded). The same transformer is trained with plain MLP
blocks, with μMoE blocks (CP and TR, 64 experts) parameter-matched to them, and with a
hierarchical CP μMoE block of 32×32×32×32 = 1,048,576 experts at about the same parameter
count. The model is causal, so every μMoE gate normalises its logits per token (LayerNorm, not
the paper's BatchNorm, whose training statistics would let a position see later tokens). Each run
prints its parameter count and train/validation loss.

Each variant's row prints as soon as it has trained, with its median time per training step and
that time relative to the first variant (the MLP).

Run: ``python examples/char_gpt.py`` (a few minutes on 2 CPU cores); ``--quick`` for a tiny run
of a few seconds. ``mumoe-tn explore examples/char_gpt.py:explorer`` trains the CP variant briefly
and writes the expert explorer's page for it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from mumoe_tn.layers import MuMoEMLP


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
    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int, make_mlp) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*(Block(width, heads, make_mlp()) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions[: idx.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def mlp_block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


#: A causal model needs token-wise gates: a BatchNorm gate's training statistics would span later positions.
CAUSAL_GATE = {"gate_norm": "layer"}

VARIANTS = {
    "MLP": lambda w: mlp_block(w),
    "CP μMoE (64 experts)": lambda w: MuMoEMLP(w, 4 * w, w, 64, "cp", match="mlp", **CAUSAL_GATE),
    "TR μMoE (64 experts)": lambda w: MuMoEMLP(w, 4 * w, w, 64, "tr", match="mlp", **CAUSAL_GATE),
    "CP μMoE (32×32×32×32 experts)": lambda w: MuMoEMLP(
        w, 4 * w, w, (32, 32, 32, 32), "cp", match="mlp", **CAUSAL_GATE
    ),
}


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


def train(name: str, make_mlp, data: dict, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = CharGPT(data["vocab"], args.context, args.width, args.depth, args.heads, lambda: make_mlp(args.width))
    mlp_params = sum(p.numel() for block in model.blocks for p in block.mlp.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    stream = batches(data["train"], args.context, args.batch, torch.Generator().manual_seed(0))
    warmup = max(1, min(50, args.steps // 10))
    start = time.perf_counter()
    step_seconds, first_loss = [], None
    progress = tqdm(range(args.steps), desc=name, leave=False, mininterval=1.0)
    for step in progress:
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
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
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "mlp_params": mlp_params,
        "first_loss": first_loss,
        "train_loss": evaluate(model, data["train"], args.context),
        "val_loss": evaluate(model, data["val"], args.context),
        "step_ms": 1e3 * statistics.median(step_seconds[min(5, len(step_seconds) - 1) :]),
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
    args = argparse.Namespace(steps=steps, batch=32, context=64, width=width, depth=2, heads=4, lr=3e-3)
    model = train(variant, VARIANTS[variant], data, args)["trained"].eval()
    windows = next(batches(data["val"], args.context, sequences, torch.Generator().manual_seed(3)))[0]
    return {"model": model, "data": windows, "vocabulary": chars, "title": f"Char GPT on pydoc_data: {variant}"}


def seconds(value: float) -> str:
    """A duration with two significant digits below 10 s (a quick run is not 0 s), whole seconds above."""
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def print_row(row: dict, first: dict) -> None:
    """One markdown row, printed as soon as its variant has trained."""
    relative = row["step_ms"] / first["step_ms"]
    print(
        f"| {row['model']} | {row['params']:,} | {row['mlp_params']:,} | {row['train_loss']:.3f} | "
        f"{row['val_loss']:.3f} | {row['step_ms']:.1f} | {relative:.2f}× | {seconds(row['seconds'])} |",
        flush=True,
    )


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
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 40 steps: a run of seconds")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    args = parser.parse_args(argv)
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
        "\n| model | params | MLP-block params | train loss | val loss | ms/step | step ÷ first | time (s) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        flush=True,
    )
    rows = []
    for name in args.variants:
        rows.append(train(name, VARIANTS[name], data, args))
        print_row(rows[-1], rows[0])
    return rows


if __name__ == "__main__":
    main()
