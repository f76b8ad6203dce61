"""The sparsity–accuracy frontier of a model's MLP blocks, μMoE against transcoders.

Every chosen MLP block of a causal language model is distilled (see
[`mumoe_tn.distillation.training`][mumoe_tn.distillation.training]) into each method at each sparsity
L0, all at one parameter budget and on the same tokens with the same optimiser, then measured
on held-out text (see [`mumoe_tn.distillation.faithfulness`][mumoe_tn.distillation.faithfulness]).

Methods, by name: ``transcoder`` (TopK) and ``skip-transcoder``; any registered format name
(``mxd``, ``cp``, ``tr``, ``tt``, ``tucker``, …) for a flat μMoE block of ``experts`` experts —
the block the format converts an MLP to, a Mixture of Decoders for ``mxd`` — and
``<format>-hier`` for the same number of experts in two modes (``256`` → ``16×16``), top-k per
mode with ``∏ k_e = L0``; and any method registered in
[`METHODS`][mumoe_tn.distillation.methods.METHODS] by its name. Each method's text form is parsed
once into a [`MethodSpec`][mumoe_tn.distillation.methods.MethodSpec]. The budget is the parameter
count of a transcoder with ``expansion × I`` latents (the Mixture of Decoders paper matches a 32×
transcoder; 8× here by default), or ``budget`` parameters.

Without ``model_dir`` a GPT-2-shaped model (byte tokens) is built from a small config and first
trained on the text — nothing is downloaded; with ``model_dir`` a local Hugging Face causal LM of
any family (GPT-2, Llama, GPT-NeoX, Gemma, …) is loaded from it, with its tokenizer if one is saved
beside it (else one token per byte). The text is Python's own ``pydoc_data`` topics, or the
UTF-8 files ``text`` names (see [`mumoe_tn.distillation.corpus`][mumoe_tn.distillation.corpus]);
its last 10 % is held out for the evaluation. Needs the ``hf`` extra (transformers). The ``mumoe-tn distill`` command
([`mumoe_tn.cli.distill_command`][mumoe_tn.cli.distill_command]) runs it from the command line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mumoe_tn.costs.baselines import transcoder_parameters
from mumoe_tn.distillation.causal_lm import context_length, saved_tokenizer
from mumoe_tn.distillation.corpus import encode_text, read_text, text_files
from mumoe_tn.distillation.distill_options import DistillOptions
from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.frontier import FrontierTable
from mumoe_tn.distillation.interruption import DistillationStopped
from mumoe_tn.distillation.method_recipes import check_method_recipes
from mumoe_tn.distillation.methods import (
    DEFAULT_METHODS,
    MethodSettings,
    MethodSpec,
    check_methods,
    method_factory,
    parse_method,
    parse_methods,
)
from mumoe_tn.distillation.process_shares import process_checkpoint, process_world
from mumoe_tn.distillation.run_files import load_frontier, save_frontier
from mumoe_tn.distillation.streaming import TokenWindows, select_blocks
from mumoe_tn.distillation.training import Distillation, Factory, distill
from mumoe_tn.validation import check_positive_float

__all__ = [
    "DEFAULT_METHODS",
    "THROUGHPUT_COLUMN",
    "FrontierConfig",
    "load_frontier",
    "method_factories",
    "run_frontier",
    "save_frontier",
    "with_throughput",
]


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
    text : tuple of str or None
        Text files and directories of ``.txt`` / ``.md`` files to train, distil and evaluate on
        (None: Python's ``pydoc_data`` topics).
    mlps : str
        Regex of the blocks to distil.
    methods : tuple of str
        Method names, each a registered method's text form (see the module's notes and
        [`parse_method`][mumoe_tn.distillation.methods.parse_method]).
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
    recipe : str
        The training recipe of every replacement (a name of
        [`RECIPES`][mumoe_tn.distillation.trainer.RECIPES]); a Mixture of Decoders is initialised
        by its authors' recipe but with ``"plain"``, a transcoder by Gao et al.'s with
        ``"topk-paper"``.
    method_recipes : tuple of (str, str)
        Methods with a recipe of their own instead of ``recipe``: (method name, recipe name) pairs;
        [`BEST_RECIPES`][mumoe_tn.distillation.methods.BEST_RECIPES] holds each method's
        best in the recipe sweep.
    lr : float or None
        The learning rate for every replacement (default the recipe's).
    eval_tokens : int
        Held-out tokens for the evaluation.
    seed : int
        Seeds the model, the data windows and the replacements.
    top_k : str
        The μMoE blocks' top-k gate: ``"auto"``, by format (ReLU for a Mixture of Decoders, the
        authors' gate; softmax otherwise), or any registered top-k gate's short name for all.
    aux_k : bool or None
        The auxiliary-k term on the μMoE blocks: None for the factory's default (see
        [`mumoe_factory`][mumoe_tn.distillation.replacements.mumoe_factory]), True or False for
        every one of them.
    balance : float or None
        The weight of the load-balancing term on the μMoE blocks' routing: None for the factory's
        default, a number (0: none) for every one of them.
    """

    width: int = 64
    depth: int = 2
    heads: int = 4
    context: int = 64
    pretrain_steps: int = 1000
    pretrain_batch: int = 16
    pretrain_lr: float = 3e-3
    model_dir: str | None = None
    text: tuple[str, ...] | None = None
    mlps: str = r"mlp$"
    methods: tuple[str, ...] = DEFAULT_METHODS
    l0s: tuple[int, ...] = (8, 16, 32, 64)
    experts: int = 256
    expansion: int = 8
    budget: int | None = None
    tokens: int = 200_000
    batch_size: int = 256
    buffer_tokens: int = 16_384
    recipe: str = "mxd-paper"
    method_recipes: tuple[tuple[str, str], ...] = ()
    lr: float | None = None
    eval_tokens: int = 16_384
    seed: int = 0
    top_k: str = "auto"
    aux_k: bool | None = None
    balance: float | None = None

    @classmethod
    def quick(cls) -> FrontierConfig:
        """A run of well under a minute (a tiny model, L0 2 and 4, 16 experts)."""
        return cls(
            width=32, depth=2, heads=2, context=32, pretrain_steps=40, pretrain_batch=8, l0s=(2, 4), experts=16,
            expansion=4, tokens=4_096, batch_size=128, buffer_tokens=2_048, eval_tokens=1_024,
        )  # fmt: skip


def method_factories(
    methods: Sequence[str | MethodSpec],
    l0s: Sequence[int],
    budget: int | float,
    experts: int,
    *,
    top_k: str = "auto",
    recipe: str = "mxd-paper",
    aux_k: bool | None = None,
    balance: float | None = None,
) -> dict[str, Factory]:
    """The factories of a frontier, named ``"<method>@<L0>"`` (a μMoE with ``top_k`` set: ``"<method>:<top_k>@<L0>"``).

    Parameters
    ----------
    methods : Sequence of str or MethodSpec
        Registered methods (see [`parse_method`][mumoe_tn.distillation.methods.parse_method]):
        ``"transcoder"``, ``"skip-transcoder"``, a format name, a format name with ``"-hier"``, or
        their specs; each is parsed once.
    l0s : Sequence[int]
        Sparsities.
    budget : int or float
        Parameters per replacement, or a multiple of the block's (a spec's own budget wins).
    experts : int
        Experts of a μMoE block (``-hier``: split into two modes).
    top_k : str, optional
        The μMoE blocks' top-k gate (see [`mumoe_factory`][mumoe_tn.distillation.replacements.mumoe_factory]).
    recipe : str, optional
        The run's recipe: ``"plain"`` builds every Mixture of Decoders with its own init instead of
        its authors', ``"topk-paper"`` and ``"topk-transcoder"`` every transcoder with theirs (see
        ``recipe=`` of [`transcoder_factory`][mumoe_tn.distillation.replacements.transcoder_factory];
        a spec's own recipe wins).
    aux_k : bool or None, optional
        The auxiliary-k term on every μMoE block (None: the factory's default).
    balance : float or None, optional
        The weight of the load-balancing term on every μMoE block (None: the factory's default).

    Returns
    -------
    dict of str to Factory
    """
    specs = parse_methods(methods)
    _check_aux_k(aux_k)
    if balance is not None:
        check_positive_float("balance", balance, allow_zero=True)
    settings = MethodSettings(experts, top_k, recipe, aux_k, balance)
    check_methods(specs, l0s, settings)
    factories: dict[str, Factory] = {}
    for spec in specs:
        for l0 in l0s:
            sized = dataclasses.replace(spec, k=l0, budget=budget if spec.budget is None else spec.budget)
            name, factory = method_factory(sized, settings)
            factories[name] = factory
    return factories


def _check_aux_k(aux_k: object) -> None:
    if aux_k is not None and not isinstance(aux_k, bool):
        raise TypeError(f"aux_k must be None (the factory's default), True or False, got {aux_k!r:.80}")


def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _check_model_dir(config: FrontierConfig) -> None:
    if config.model_dir is not None and not Path(config.model_dir).is_dir():
        raise ValueError(
            f"--model must be a directory holding a saved Hugging Face causal LM, got {str(config.model_dir)!r}"
        )


def load_model(config: FrontierConfig) -> tuple[nn.Module, torch.Tensor, str]:
    """The model, the text as a 1-D tensor of token ids, and a description of the model."""
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("the frontier needs transformers: pip install 'mumoe_tn[hf]'") from error
    transformers.logging.set_verbosity_error()
    _check_model_dir(config)
    text = _corpus() if config.text is None else read_text(config.text)
    if config.model_dir is not None:
        directory = Path(config.model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        tokenizer = saved_tokenizer(directory)
        vocabulary = model.get_input_embeddings().num_embeddings
        tokens = encode_text(text, tokenizer, vocab_size=vocabulary)
        description = f"{type(model).__name__} from {directory}" + (" (byte tokens)" if tokenizer is None else "")
        return model, tokens, description
    gpt2 = transformers.GPT2Config(
        vocab_size=256, n_positions=config.context, n_embd=config.width, n_layer=config.depth, n_head=config.heads,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = transformers.GPT2LMHeadModel(gpt2)
    description = f"GPT-2 shape: {config.depth} layers, width {config.width}, {config.heads} heads, byte tokens"
    return model, encode_text(text), description


def pretrain(
    model: nn.Module,
    tokens: torch.Tensor,
    config: FrontierConfig,
    *,
    progress: bool,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Train ``model`` on windows of ``tokens`` (AdamW) — the stand-in for pretrained weights.

    ``stop`` is asked before every step: once it returns True,
    [`DistillationStopped`][mumoe_tn.distillation.interruption.DistillationStopped] is raised.
    """
    from tqdm.auto import tqdm

    data = TokenWindows(tokens, config.context, config.pretrain_batch, config.pretrain_steps, seed=config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.pretrain_lr)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        for x in tqdm(data, desc="training the model", disable=not progress, leave=False, mininterval=0.5):
            if stop is not None and stop():
                raise DistillationStopped(None, 0, config.tokens)
            loss = model(input_ids=x, labels=x).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()


def run_frontier(
    config: FrontierConfig,
    *,
    progress: bool = True,
    checkpoint: str | os.PathLike | None = None,
    resume: bool = False,
    save: str | Path | None = None,
    checkpoint_every: int = 100,
    stop: Callable[[], bool] | None = None,
) -> FrontierTable | None:
    """Build (or load) the model, distil every block into every method and L0, and measure them.

    In a process group of several processes (``torchrun``) every process builds the model and
    trains its share of the replacements (see
    [`mumoe_tn.distillation.process_shares`][mumoe_tn.distillation.process_shares]); rank 0
    evaluates them all, saves and returns the table, the other ranks return None.

    Parameters
    ----------
    config : FrontierConfig
    progress : bool, optional
        Progress bars (tqdm) for the training, the distillation (tokens/s) and the evaluation.
    checkpoint : str or PathLike, optional
        The distillation's checkpoint file, written every ``checkpoint_every`` steps and at the end.
    resume : bool, optional
        Resume the distillation from ``checkpoint``, which must exist.
    save : str or Path, optional
        A new or empty directory to write the run into (see
        [`save_frontier`][mumoe_tn.distillation.run_files.save_frontier]).
    checkpoint_every : int, optional
        Optimiser steps between checkpoints (default 100).
    stop : Callable[[], bool], optional
        Asked before every training step of the built model, every distillation step (see
        ``stop`` of [`distill`][mumoe_tn.distillation.training.distill]) and every evaluation
        batch; once it returns True the run stops (a stop during the evaluation leaves the
        checkpoint of the finished distillation, from which a resume goes on to the evaluation).

    Returns
    -------
    FrontierTable or None
        None in the processes of rank above 0.

    Raises
    ------
    DistillationStopped
        When ``stop()`` returned True (with the checkpoint written, if any).
    """
    specs = parse_methods(config.methods)
    _check_aux_k(config.aux_k)
    if config.balance is not None:
        check_positive_float("balance", config.balance, allow_zero=True)
    check_methods(specs, config.l0s, MethodSettings(config.experts, config.top_k, config.recipe))
    method_recipes = {
        parse_method(method).text: recipe for method, recipe in check_method_recipes(config.method_recipes).items()
    }
    if resume and checkpoint is None:
        raise ValueError("resume=True needs checkpoint= (the file to resume from)")
    if resume and not process_checkpoint(checkpoint).is_file():
        raise ValueError(f"there is no checkpoint to resume from at {str(process_checkpoint(checkpoint))!r}")
    _check_model_dir(config)
    if config.text is not None:
        text_files(config.text)  # a missing file is named before any model is built
    directory = None if save is None else _save_directory(save)
    start = time.perf_counter()
    model, tokens, description = load_model(config)
    split = int(0.9 * tokens.numel())
    train, held_out = tokens[:split], tokens[split:]
    context = config.context if config.model_dir is None else min(config.context, context_length(model.config))
    if held_out.numel() <= context:
        raise ValueError(
            f"the text is {tokens.numel():,} tokens long: its held-out last 10 % must be longer than one window of "
            f"{context} tokens, so give at least {10 * (context + 1):,} tokens of text"
        )
    if config.model_dir is None:
        pretrain(model, train, config, progress=progress, stop=stop)
    model.eval()
    blocks = select_blocks(model, config.mlps)
    first = blocks[0]
    budget = config.budget or transcoder_parameters(first.in_features, config.expansion * first.in_features,
                                                    first.out_features)  # fmt: skip
    factories: dict[str, Factory] = {}
    recipes: dict[str, str] = {}
    for spec in specs:  # each method at its own recipe: the run's, unless method_recipes names one
        own = method_recipes.get(spec.text, config.recipe)
        built = method_factories(
            (spec,), config.l0s, budget, config.experts, top_k=config.top_k, recipe=own,
            aux_k=config.aux_k, balance=config.balance,
        )  # fmt: skip
        factories.update(built)
        recipes.update(dict.fromkeys(built, own))
    windows = config.batch_size // context if config.batch_size >= context else 1
    steps = math.ceil(config.tokens / (windows * context)) * 2 + 8
    stream = TokenWindows(train, context, max(1, windows), steps, seed=config.seed + 1)
    options = DistillOptions(
        tokens=config.tokens, mlps=config.mlps, batch_size=config.batch_size, buffer_tokens=config.buffer_tokens,
        recipe=recipes if method_recipes else config.recipe, lr=config.lr, seed=config.seed, checkpoint=checkpoint,
        checkpoint_every=checkpoint_every, resume=resume, progress=progress, stop=stop,
        run_config={"model": description, "text_digest": _digest(tokens), **dataclasses.asdict(config)},
    )  # fmt: skip
    result = distill(model, stream, factories, options=options)
    trained = time.perf_counter() - start
    world = process_world()
    if world is not None and world[0] != 0:
        return None
    eval_windows = 8
    eval_batches = max(1, config.eval_tokens // (eval_windows * context))
    held = TokenWindows(held_out, context, eval_windows, eval_batches, seed=config.seed + 2)
    settings = dataclasses.asdict(config)
    table_config = {
        **settings, "model": description, "budget": budget, "eval_tokens": eval_batches * eval_windows * context,
        "trained_tokens": result.tokens, "peak_buffer_rows": result.peak_buffer_rows,
        "seconds_to_distil": round(trained, 1),
    }  # fmt: skip
    if stop is not None:  # the checkpoint holds the finished distillation: a resume goes on to the evaluation
        kept = None if checkpoint is None else process_checkpoint(checkpoint)
        stopped = DistillationStopped(kept, result.tokens, config.tokens)
        held = _AskingBatches(held, stop, stopped)
    table = evaluate_replacements(model, held, result.replacements, config=table_config, progress=progress)
    seconds = round(time.perf_counter() - start, 1)
    table = with_throughput(dataclasses.replace(table, config={**table.config, "seconds": seconds}), result)
    if directory is not None:
        save_frontier(directory, table, result.replacements, model, save_model=config.model_dir is None)
    return table


#: The extra column of a frontier table that holds each replacement's training throughput.
THROUGHPUT_COLUMN = "train_tokens_per_s"


def with_throughput(table: FrontierTable, result: Distillation) -> FrontierTable:
    """``table`` with each row's training throughput (tokens per second of its own steps) as a column.

    Parameters
    ----------
    table : FrontierTable
        The evaluation of ``result``'s replacements.
    result : Distillation
        The run that trained them (its ``throughput``).

    Returns
    -------
    FrontierTable
        Rows with ``extra["train_tokens_per_s"]`` (NaN where the run did not time the pair), headed
        ``train tokens/s``.
    """
    rows = tuple(
        dataclasses.replace(
            row,
            extra={**row.extra, THROUGHPUT_COLUMN: result.throughput.get(row.block, {}).get(row.method, math.nan)},
        )
        for row in table.rows
    )
    return dataclasses.replace(table, rows=rows, headers={**table.headers, THROUGHPUT_COLUMN: "train tokens/s"})


class _AskingBatches:
    """``batches`` that ask ``stop`` before each one and raise ``stopped`` once it says so."""

    def __init__(self, batches: TokenWindows, stop: Callable[[], bool], stopped: DistillationStopped) -> None:
        self.batches, self.stop, self.stopped = batches, stop, stopped

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self.batches:
            if self.stop():
                raise self.stopped
            yield batch


def _digest(tokens: torch.Tensor) -> str:
    """The token count and a SHA-256 of the token ids: a resumed run must read the same text."""
    ids = tokens.to(torch.int64).contiguous().numpy().tobytes()
    return f"{tokens.numel()} tokens, sha256 {hashlib.sha256(ids).hexdigest()}"


def _save_directory(path: str | Path) -> Path:
    """``path`` as a directory to write a run into: new or empty, checked before any work."""
    directory = Path(path)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(f"save= must be a new or empty directory, got {str(directory)!r}")
    return directory
