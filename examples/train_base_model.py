"""Train the small GPT-2 that ``mumoe-tn distill`` distils, and save it for ``distill --model``.

``mumoe-tn distill`` without ``--model`` builds this model and trains it before distilling it;
this example is that recipe written out, to change (a wider or deeper model, more steps, your
own text) and to save, so the distillation can run on it again and again:

- text: the English text of Python's own ``pydoc_data.topics`` (it ships with Python, nothing is
  downloaded), every topic in key order joined by blank lines, as **bytes** (token ids 0–255, no
  tokeniser); the first 90 % to train on, the last 10 % held out (``distill`` measures there);
- model: ``transformers.GPT2LMHeadModel`` with a vocabulary of 256, context 64, width 64,
  2 layers, 4 heads, initialised under ``torch.manual_seed(seed)``;
- training: 1,000 AdamW steps at 3e-3 of 16 random windows of 64 bytes
  ([`TokenWindows`][mumoe_tn.distillation.streaming.TokenWindows] with ``seed``), next-byte loss.

With the defaults the saved model is, weight for weight, the one ``mumoe-tn distill`` builds::

    python examples/train_base_model.py --out base-model          # about a minute on 2 CPU cores
    mumoe-tn distill --model base-model --save run                 # text read as bytes again

A saved model with no tokeniser is read as bytes by ``distill --model``; save a tokeniser next to
your own model (``tokenizer.save_pretrained``) and ``distill`` tokenises the same text with it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import transformers

from mumoe_tn.distillation.streaming import TokenWindows


def corpus() -> bytes:
    """The text: every ``pydoc_data`` topic in key order, joined by blank lines, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode()


def held_out_loss(model: torch.nn.Module, tokens: torch.Tensor, context: int, windows: int = 32) -> float:
    """Mean next-byte cross-entropy (nats) on ``windows`` fixed windows of ``tokens``."""
    batch = next(iter(TokenWindows(tokens, context, windows, 1, seed=123)))
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def main(argv: list[str] | None = None) -> dict:
    """Train, report the held-out loss before and after, and save; returns the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="save the model here (save_pretrained)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16, help="windows per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny model and 40 steps: seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.heads, args.context, args.steps, args.batch = 32, 2, 32, 40, 8
    transformers.logging.set_verbosity_error()
    text = torch.tensor(list(corpus()))
    split = int(0.9 * text.numel())
    train, held_out = text[:split], text[split:]
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=args.context, n_embd=args.width, n_layer=args.depth, n_head=args.heads,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = transformers.GPT2LMHeadModel(config)
    before = held_out_loss(model.eval(), held_out, args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)  # dropout
        for windows in TokenWindows(train, args.context, args.batch, args.steps, seed=args.seed):
            loss = model(input_ids=windows, labels=windows).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()
    after = held_out_loss(model, held_out, args.context)
    print(f"held-out loss {before:.3f} → {after:.3f} nats per byte (uniform: {math.log(256):.3f})")
    if args.out is not None:
        model.save_pretrained(args.out)
        print(f"saved to {args.out}: mumoe-tn distill --model {args.out}")
    return {"model": model, "before": before, "after": after}


if __name__ == "__main__":
    main()
