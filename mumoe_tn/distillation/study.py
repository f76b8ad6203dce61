"""``mumoe-tn distill``: the sparsity–accuracy frontier of a model's MLP blocks, μMoE against transcoders.

Every chosen MLP block of a causal language model is distilled (see
[`mumoe_tn.distillation.training`][mumoe_tn.distillation.training]) into each method at each sparsity
L0, all at one parameter budget and on the same tokens with the same optimiser, then measured
on held-out text (see [`mumoe_tn.distillation.faithfulness`][mumoe_tn.distillation.faithfulness]).

Methods, by name: ``transcoder`` (TopK) and ``skip-transcoder``; any registered format name
(``mxd``, ``cp``, ``tr``, ``tt``, ``tucker``, …) for a flat μMoE block of ``--experts`` experts —
the block the format converts an MLP to, a Mixture of Decoders for ``mxd`` — and
``<format>-hier`` for the same number of experts in two modes (``256`` → ``16×16``), top-k per
mode with ``∏ k_e = L0``. The budget is the parameter count of a transcoder with
``expansion × I`` latents (the Mixture of Decoders paper matches a 32× transcoder; 8× here by
default), or ``--budget`` parameters.

Without ``--model`` a GPT-2-shaped model (byte tokens) is built from a small config and first
trained on Python's own ``pydoc_data`` text — nothing is downloaded; with ``--model DIR`` a local
Hugging Face causal LM (and its tokenizer, if saved) is loaded from ``DIR``. Needs the ``hf``
extra (transformers).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mumoe_tn.costs.baselines import transcoder_parameters
from mumoe_tn.decompositions.registry import available
from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.frontier import FrontierTable, plot_frontier
from mumoe_tn.distillation.replacements import mode_split, mumoe_factory, top_k_gate_names, transcoder_factory
from mumoe_tn.distillation.streaming import TokenWindows, select_blocks
from mumoe_tn.distillation.training import Factory, distill

__all__ = ["FrontierConfig", "configure_parser", "method_factories", "run", "run_frontier"]

#: The methods of the default frontier.
DEFAULT_METHODS = ("transcoder", "skip-transcoder", "mxd", "mxd-hier", "cp", "cp-hier", "tr", "tr-hier")

_HIER = "-hier"


@dataclass(frozen=True)
class FrontierConfig:
    """Everything one frontier run depends on.

    Attributes
    ----------
    width, depth, heads, context : int
        The GPT-2-shaped model built when no ``model_dir`` is given (byte tokens).
    pretrain_steps, pretrain_batch : int
        Its training on the text before distillation.
    pretrain_lr : float
        Its AdamW learning rate.
    model_dir : str or None
        A local Hugging Face causal LM instead.
    mlps : str
        Regex of the blocks to distil.
    methods : tuple of str
        Method names (see the module's notes).
    l0s : tuple of int
        Sparsities: TopK latents, or active experts per token.
    experts : int
        Experts of every μMoE block (flat, or split into two modes for ``-hier``).
    expansion : int
        Budget: a transcoder with ``expansion × I`` latents (ignored with ``budget``).
    budget : int or None
        Parameters per replacement.
    tokens, batch_size, buffer_tokens : int
        Distillation tokens, tokens per step, activation buffer.
    lr : float
        Adam's learning rate for every replacement.
    eval_tokens : int
        Held-out tokens for the evaluation.
    seed : int
        Seeds the model, the data windows and the replacements.
    top_k : str
        The μMoE blocks' top-k gate: ``"auto"``, by format (ReLU for a Mixture of Decoders, the
        authors' gate; softmax otherwise), or any registered top-k gate's short name for all.
    """

    width: int = 64
    depth: int = 2
    heads: int = 4
    context: int = 64
    pretrain_steps: int = 1000
    pretrain_batch: int = 16
    pretrain_lr: float = 3e-3
    model_dir: str | None = None
    mlps: str = r"mlp$"
    methods: tuple[str, ...] = DEFAULT_METHODS
    l0s: tuple[int, ...] = (8, 16, 32, 64)
    experts: int = 256
    expansion: int = 8
    budget: int | None = None
    tokens: int = 200_000
    batch_size: int = 256
    buffer_tokens: int = 16_384
    lr: float = 1e-3
    eval_tokens: int = 16_384
    seed: int = 0
    top_k: str = "auto"

    @classmethod
    def quick(cls) -> FrontierConfig:
        """A run of well under a minute (a tiny model, L0 2 and 4, 16 experts)."""
        return cls(
            width=32, depth=2, heads=2, context=32, pretrain_steps=40, pretrain_batch=8, l0s=(2, 4), experts=16,
            expansion=4, tokens=4_096, batch_size=128, buffer_tokens=2_048, eval_tokens=1_024,
        )  # fmt: skip


def _check_methods(methods: Sequence[str]) -> None:
    formats = set(available())
    for method in methods:
        base = method[: -len(_HIER)] if method.endswith(_HIER) else method
        if method not in ("transcoder", "skip-transcoder") and base.lower() not in formats:
            raise ValueError(
                f"unknown method {method!r}: use 'transcoder', 'skip-transcoder', a format name of {sorted(formats)} "
                f"or a format name with {_HIER!r} (two expert modes)"
            )


def method_factories(
    methods: Sequence[str], l0s: Sequence[int], budget: int | float, experts: int, *, top_k: str = "auto"
) -> dict[str, Factory]:
    """The factories of a frontier, named ``"<method>@<L0>"`` (a μMoE with ``top_k`` set: ``"<method>:<top_k>@<L0>"``).

    Parameters
    ----------
    methods : Sequence[str]
        ``"transcoder"``, ``"skip-transcoder"``, a format name, or a format name with ``"-hier"``.
    l0s : Sequence[int]
        Sparsities.
    budget : int or float
        Parameters per replacement, or a multiple of the block's.
    experts : int
        Experts of a μMoE block (``-hier``: split into two modes).
    top_k : str, optional
        The μMoE blocks' top-k gate (see [`mumoe_factory`][mumoe_tn.distillation.replacements.mumoe_factory]).

    Returns
    -------
    dict of str to Factory
    """
    _check_methods(methods)
    factories: dict[str, Factory] = {}
    for method in methods:
        for l0 in l0s:
            if method in ("transcoder", "skip-transcoder"):
                factories[f"{method}@{l0}"] = transcoder_factory(l0, budget, skip=method == "skip-transcoder")
                continue
            name = f"{method}@{l0}" if top_k == "auto" else f"{method}:{top_k}@{l0}"
            if method.endswith(_HIER):
                dims: int | tuple[int, ...] = mode_split(experts, 2)
                factories[name] = mumoe_factory(method[: -len(_HIER)], dims, l0, budget, top_k=top_k)
            else:
                factories[name] = mumoe_factory(method, experts, l0, budget, top_k=top_k)
    return factories


def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_model(config: FrontierConfig) -> tuple[nn.Module, torch.Tensor, str]:
    """The model, the text as a 1-D tensor of token ids, and a description of the model."""
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("the frontier needs transformers: pip install 'mumoe_tn[hf]'") from error
    transformers.logging.set_verbosity_error()
    text = _corpus()
    if config.model_dir is not None:
        directory = Path(config.model_dir)
        if not directory.is_dir():
            raise ValueError(
                f"--model must be a directory holding a saved Hugging Face causal LM, got {str(directory)!r}"
            )
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        if any((directory / name).exists() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
            tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
            return model, torch.tensor(tokenizer(text)["input_ids"]), f"{type(model).__name__} from {directory}"
        if model.config.vocab_size < 256:
            raise ValueError(f"{directory} has no tokenizer and a vocabulary smaller than 256 bytes")
        return model, torch.tensor(list(text.encode())), f"{type(model).__name__} from {directory} (byte tokens)"
    gpt2 = transformers.GPT2Config(
        vocab_size=256, n_positions=config.context, n_embd=config.width, n_layer=config.depth, n_head=config.heads,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = transformers.GPT2LMHeadModel(gpt2)
    description = f"GPT-2 shape: {config.depth} layers, width {config.width}, {config.heads} heads, byte tokens"
    return model, torch.tensor(list(text.encode())), description


def pretrain(model: nn.Module, tokens: torch.Tensor, config: FrontierConfig, *, progress: bool) -> None:
    """Train ``model`` on windows of ``tokens`` (AdamW) — the stand-in for pretrained weights."""
    from tqdm.auto import tqdm

    data = TokenWindows(tokens, config.context, config.pretrain_batch, config.pretrain_steps, seed=config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.pretrain_lr)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        for x in tqdm(data, desc="training the model", disable=not progress, leave=False, mininterval=0.5):
            loss = model(input_ids=x, labels=x).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()


def run_frontier(config: FrontierConfig, *, progress: bool = True, checkpoint: str | None = None,
                 resume: bool = False) -> FrontierTable:  # fmt: skip
    """Build (or load) the model, distil every block into every method and L0, and measure them.

    Parameters
    ----------
    config : FrontierConfig
    progress : bool, optional
        Progress bars (tqdm) for the training, the distillation (tokens/s) and the evaluation.
    checkpoint : str, optional
        The distillation's checkpoint file.
    resume : bool, optional
        Resume the distillation from ``checkpoint``.

    Returns
    -------
    FrontierTable
    """
    _check_methods(config.methods)
    start = time.perf_counter()
    model, tokens, description = load_model(config)
    split = int(0.9 * tokens.numel())
    train, held_out = tokens[:split], tokens[split:]
    if config.model_dir is None:
        pretrain(model, train, config, progress=progress)
    model.eval()
    context = config.context if config.model_dir is None else min(config.context, model.config.n_positions)
    blocks = select_blocks(model, config.mlps)
    first = blocks[0]
    budget = config.budget or transcoder_parameters(first.in_features, config.expansion * first.in_features,
                                                    first.out_features)  # fmt: skip
    factories = method_factories(config.methods, config.l0s, budget, config.experts, top_k=config.top_k)
    windows = config.batch_size // context if config.batch_size >= context else 1
    steps = math.ceil(config.tokens / (windows * context)) * 2 + 8
    stream = TokenWindows(train, context, max(1, windows), steps, seed=config.seed + 1)
    result = distill(
        model, stream, factories, mlps=config.mlps, tokens=config.tokens, batch_size=config.batch_size,
        buffer_tokens=config.buffer_tokens, lr=config.lr, seed=config.seed, checkpoint=checkpoint, resume=resume,
        progress=progress,
    )  # fmt: skip
    trained = time.perf_counter() - start
    eval_windows = 8
    eval_batches = max(1, config.eval_tokens // (eval_windows * context))
    held = TokenWindows(held_out, context, eval_windows, eval_batches, seed=config.seed + 2)
    settings = dataclasses.asdict(config)
    table_config = {
        **settings, "model": description, "budget": budget, "eval_tokens": eval_batches * eval_windows * context,
        "trained_tokens": result.tokens, "peak_buffer_rows": result.peak_buffer_rows,
        "seconds_to_distil": round(trained, 1),
    }  # fmt: skip
    table = evaluate_replacements(model, held, result.replacements, config=table_config, progress=progress)
    seconds = round(time.perf_counter() - start, 1)
    return FrontierTable(table.rows, {**table.config, "seconds": seconds})


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's options to ``parser`` (used by ``mumoe-tn distill``)."""
    d = FrontierConfig()
    parser.add_argument("--quick", action="store_true", help="a tiny run of well under a minute")
    parser.add_argument("--model", dest="model_dir", metavar="DIR", help="a local Hugging Face causal LM (default: "
                        "build a GPT-2-shaped model and train it on pydoc_data)")  # fmt: skip
    parser.add_argument("--mlps", help=f"regex of the MLP blocks to distil (default {d.mlps!r})")
    parser.add_argument("--methods", nargs="+", help=f"methods (default {' '.join(d.methods)})")
    parser.add_argument("--l0", dest="l0s", type=int, nargs="+", help=f"sparsities (default {list(d.l0s)})")
    parser.add_argument("--experts", type=int, help=f"experts of every μMoE block (default {d.experts})")
    parser.add_argument(
        "--expansion", type=int, help=f"budget: a transcoder of expansion×I latents (default {d.expansion})"
    )
    parser.add_argument("--budget", type=int, help="budget: parameters per replacement (instead of --expansion)")
    parser.add_argument("--tokens", type=int, help=f"distillation tokens (default {d.tokens:,})")
    parser.add_argument("--eval-tokens", type=int, help=f"held-out evaluation tokens (default {d.eval_tokens:,})")
    parser.add_argument("--batch-size", type=int, help=f"tokens per optimiser step (default {d.batch_size})")
    parser.add_argument("--buffer-tokens", type=int, help=f"activation buffer capacity (default {d.buffer_tokens:,})")
    parser.add_argument("--lr", type=float, help=f"Adam learning rate (default {d.lr})")
    parser.add_argument(
        "--pretrain-steps", type=int, help=f"training steps of the built model (default {d.pretrain_steps})"
    )
    parser.add_argument("--width", type=int, help=f"width of the built model (default {d.width})")
    parser.add_argument("--depth", type=int, help=f"layers of the built model (default {d.depth})")
    parser.add_argument("--seed", type=int, help=f"seed (default {d.seed})")
    parser.add_argument("--top-k", choices=top_k_gate_names(), help="the μMoE blocks' top-k gate: 'auto' (default: "
                        "the format's, ReLU for MxD as its authors gate; softmax for the others) or any registered "
                        "top-k gate")  # fmt: skip
    parser.add_argument("--checkpoint", metavar="FILE", help="save the distillation's state here (and resume from it "
                        "with --resume)")  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="resume the distillation from --checkpoint")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the table as JSON")
    output.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    output.add_argument("--csv", action="store_true", help="print the table as CSV")
    parser.add_argument("--save", metavar="FILE.json", help="also write the table as JSON to this file")
    parser.add_argument("--plot", metavar="FILE.png", help="save the frontier plot (CE-loss score against L0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return parser


def config_from(args: argparse.Namespace) -> FrontierConfig:
    """The configuration the parsed arguments ask for."""
    config = FrontierConfig.quick() if args.quick else FrontierConfig()
    names = ("model_dir", "mlps", "methods", "l0s", "experts", "expansion", "budget", "tokens", "eval_tokens",
             "batch_size", "buffer_tokens", "lr", "pretrain_steps", "width", "depth", "seed", "top_k")  # fmt: skip
    changes = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    for name in ("methods", "l0s"):
        if name in changes:
            changes[name] = tuple(changes[name])
    for name in ("experts", "expansion", "budget", "tokens", "eval_tokens", "batch_size", "buffer_tokens",
                 "pretrain_steps", "width", "depth"):  # fmt: skip
        if name in changes and changes[name] <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {changes[name]}")
    if any(l0 <= 0 for l0 in changes.get("l0s", ())):
        raise ValueError(f"--l0 values must be positive ints, got {list(changes['l0s'])}")
    return dataclasses.replace(config, **changes)


def run(args: argparse.Namespace) -> int:
    """Run the frontier, print the table, and save the plot."""
    config = config_from(args)
    _check_methods(config.methods)
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint FILE")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        table = run_frontier(config, progress=args.progress, checkpoint=args.checkpoint, resume=args.resume)
    finally:
        torch.set_num_threads(threads)
    if args.save:
        Path(args.save).write_text(table.to_json() + "\n")
    if args.plot:
        plot_frontier(table, args.plot)
    if args.json:
        print(table.to_json())
    elif args.markdown:
        print(table.title() + "\n\n" + table.to_markdown())
    elif args.csv:
        sys.stdout.write(table.to_csv())
    else:
        from rich.console import Console

        Console().print(table.to_rich())
    return 0
