"""Upcycle a Hugging Face GPT-2's MLPs into μMoE blocks with a million experts each, then fine-tune.

Every MLP block (``c_fc`` → GELU → ``c_proj``, Hugging Face ``Conv1D`` layers) becomes a CP μMoE
block with 32×32×32×32 = 1,048,576 experts, each expert starting as the pretrained block
(``convert(..., upcycle=True)``): at ``--ranks match`` (the default) parameter-matched to the block
it replaces (the gate counted), each expert the best approximation of that rank; at ``exact`` the
smallest ranks at which every expert equals the pretrained block, so the converted model starts
computing what the dense one did. The table gives, per variant, the upcycle error, how far the
logits moved, and the validation loss before and after fine-tuning for the same steps on
Python's own ``pydoc_data`` text: the trade-off between parameters and a faithful start.

Without ``--weights`` the GPT-2 is built from a small config (byte tokens) and first trained
briefly as a stand-in for pretrained weights; with ``--weights DIR`` a local checkpoint (and its
tokenizer) is loaded from ``DIR`` — nothing is downloaded.

Run: ``python examples/gpt2_upcycle.py`` (several minutes on 2 CPU cores), ``--quick`` for a tiny
run (about 25 s of CPU time). Needs the ``hf`` extra (transformers). ``mumoe-tn explore
examples/gpt2_upcycle.py:explorer`` upcycles a small GPT-2 into hierarchical μMoE blocks and
writes the expert explorer's page for it.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from mumoe_tn.conversion.convert import convert
from mumoe_tn.conversion.fitting.upcycling import UpcycleWarning


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_model(args: argparse.Namespace):
    """The model and the text encoded as a 1-D tensor of token ids."""
    import transformers

    transformers.logging.set_verbosity_error()
    if args.weights:
        model = transformers.GPT2LMHeadModel.from_pretrained(args.weights, local_files_only=True)
        if any((Path(args.weights) / name).exists() for name in ("tokenizer.json", "vocab.json")):
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.weights, local_files_only=True)
            return model, torch.tensor(tokenizer(corpus())["input_ids"])
        if model.config.vocab_size < 256:  # no tokenizer saved: byte tokens, if the vocabulary holds them
            raise SystemExit(f"{args.weights} has no tokenizer and a vocabulary smaller than 256 bytes")
        return model, torch.tensor(list(corpus().encode()))
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=args.context,
        n_embd=args.width,
        n_layer=args.depth,
        n_head=args.heads,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config), torch.tensor(list(corpus().encode()))


def batches(data: torch.Tensor, context: int, batch: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - context, (batch,), generator=generator)
        yield torch.stack([data[s : s + context] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, data: torch.Tensor, args: argparse.Namespace) -> float:
    model.eval()
    stream = batches(data, args.context, args.batch, torch.Generator().manual_seed(1))
    losses = [
        model(x.to(args.device), labels=x.to(args.device)).loss.item()
        for x in itertools.islice(stream, args.eval_batches)
    ]
    model.train()
    return sum(losses) / len(losses)


def train(model, data: torch.Tensor, steps: int, args: argparse.Namespace, desc: str) -> float:
    """Train ``steps`` steps; returns tokens per second."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    stream = batches(data, args.context, args.batch, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for x in tqdm(itertools.islice(stream, steps), total=steps, desc=desc, leave=False, mininterval=0.5):
        x = x.to(args.device)
        loss = model(x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return steps * args.batch * args.context / max(time.perf_counter() - start, 1e-9)


def explorer(
    experts: tuple[int, ...] = (8, 8), decomposition: str = "cp", steps: int = 100, sequences: int = 64
) -> dict:
    """A small GPT-2 (byte tokens) trained ``steps`` steps, its MLPs upcycled into ``experts`` μMoE blocks and
    fine-tuned ``steps`` steps; returns the arguments of ``mumoe_tn.analysis.explore`` on validation windows.
    """
    args = argparse.Namespace(
        weights=None, width=64, depth=2, heads=2, context=64, batch=8, lr=3e-3, device="cpu", eval_batches=2
    )
    torch.manual_seed(0)
    model, tokens = load_model(args)
    split = int(0.9 * tokens.numel())
    train(model, tokens[:split], steps, args, "pretraining the dense GPT-2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UpcycleWarning)
        convert(model, expert_dims=list(experts), mlps=r"mlp$", decomposition=decomposition, rank="match", upcycle=True)
    train(model, tokens[:split], steps, args, "fine-tuning the μMoE GPT-2")
    windows = next(batches(tokens[split:], args.context, sequences, torch.Generator().manual_seed(3)))

    def byte(token: int) -> str:
        return bytes([token]).decode("latin-1")

    dims = "×".join(map(str, experts))
    return {"model": model.eval(), "data": windows, "vocabulary": byte, "title": f"GPT-2 upcycled to {dims} experts"}


def mlp_parameters(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if ".mlp." in name)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", help="directory of a local GPT-2 checkpoint (from save_pretrained)")
    parser.add_argument("--quick", action="store_true", help="a tiny run, well under a minute")
    parser.add_argument("--experts", type=int, nargs="+", default=[32, 32, 32, 32])
    parser.add_argument("--decomposition", default="cp")
    parser.add_argument(
        "--ranks", nargs="+", default=["match"], help="μMoE variants: 'match', 'exact' or an int rank (each one row)"
    )
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps")
    parser.add_argument("--pretrain-steps", type=int, default=200, help="dense steps before upcycling (no --weights)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=16, help="validation batches before and after")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.pretrain_steps = 15, 15
        args.width, args.depth, args.heads, args.context, args.batch = 64, 2, 2, 32, 8
        args.lr, args.eval_batches = 3e-3, 3
    torch.manual_seed(args.seed)
    model, tokens = load_model(args)
    model.to(args.device)
    split = int(0.9 * tokens.numel())
    train_data, val_data = tokens[:split], tokens[split:]
    if not args.weights:
        train(model, train_data, args.pretrain_steps, args, "pretraining the dense GPT-2")

    probe = next(batches(val_data, args.context, args.batch, torch.Generator().manual_seed(2))).to(args.device)
    with torch.no_grad():
        dense_logits = model.eval()(probe).logits
    rows = []
    for variant in ("dense", *args.ranks):
        candidate = copy.deepcopy(model)
        error = moved = None
        if variant != "dense":
            rank = int(variant) if variant.isdigit() else variant
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UpcycleWarning)  # the table reports every error
                report = convert(
                    candidate,
                    expert_dims=args.experts,
                    mlps=r"mlp$",
                    decomposition=args.decomposition,
                    rank=rank,
                    upcycle=True,
                )
            error = max(r.upcycle_error for r in report.replacements)
            with torch.no_grad():
                moved = float((candidate.eval()(probe).logits - dense_logits).norm() / dense_logits.norm())
        before = evaluate(candidate, val_data, args)
        speed = train(candidate, train_data, args.steps, args, f"fine-tuning {variant}")
        after = evaluate(candidate, val_data, args)
        rows.append(
            {
                "model": "dense" if variant == "dense" else f"μMoE rank={variant}",
                "experts": 1 if variant == "dense" else math.prod(args.experts),
                "params": sum(p.numel() for p in candidate.parameters()),
                "mlp_params": mlp_parameters(candidate),
                "upcycle_error": error,
                "logits_moved": moved,
                "loss_before": before,
                "loss_after": after,
                "tokens_per_s": speed,
            }
        )
    table = Table(title=f"GPT-2 MLPs upcycled into μMoE blocks ({args.steps} fine-tuning steps)")
    columns = ("model", "experts/MLP", "params", "MLP params", "upcycle err", "logits moved", "loss before")
    for column in (*columns, "loss after"):
        table.add_column(column, justify="left" if column == "model" else "right")
    table.add_column("tokens/s", justify="right")
    for row in rows:
        error = "" if row["upcycle_error"] is None else f"{row['upcycle_error']:.2g}"
        moved = "" if row["logits_moved"] is None else f"{row['logits_moved']:.2g}"
        table.add_row(
            row["model"],
            f"{row['experts']:,}",
            f"{row['params']:,}",
            f"{row['mlp_params']:,}",
            error,
            moved,
            f"{row['loss_before']:.3f}",
            f"{row['loss_after']:.3f}",
            f"{row['tokens_per_s']:,.0f}",
        )
    Console(width=120).print(table)
    return rows


if __name__ == "__main__":
    main()
