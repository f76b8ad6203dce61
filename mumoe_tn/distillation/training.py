"""Distil the MLP blocks of a trained model into sparse replacements (spliced in by ``splicing``).

Each chosen block is a function ``x ↦ y`` of its input; a replacement — any module a factory
builds from the block: a μMoE block of any format, a transcoder, a user's own — is trained to
reproduce ``y`` from ``x`` on activations streamed from a text dataset. The loss is a sum of
registered terms (see [`mumoe_tn.distillation.losses`][mumoe_tn.distillation.losses]), by default
the field's normalised loss (Mixture of Decoders, Oldfield et al. 2025)::

    L = mean_{t,o} (ŷ_{t,o} − y_{t,o})² / ‖y_t‖₂

(the mean over tokens ``t`` and output features ``o``), plus ``λ·mean_t ‖z_t‖₁`` on the
replacement's sparse code ``z`` with an L1 penalty, plus the terms a replacement adds itself (the
auxiliary-k loss on dead experts). Sparsity is the replacement's own (a top-k gate, TopK latents)
or that penalty. The optimiser, learning rate and warm-up are a named
[`Recipe`][mumoe_tn.distillation.trainer.Recipe]; parameters a replacement declares unit-norm
stay so (the Mixture of Decoders' expert vectors).

Streaming: the model runs in eval mode without gradients over batches of the dataset; the
inputs and outputs of every chosen block at the real tokens (padding dropped by the batch's
mask) go into one [`ActivationBuffer`][mumoe_tn.distillation.streaming.ActivationBuffer] of fixed
capacity. When the next batch does not fit, the buffer is shuffled and drained to half its
capacity (or less, until the batch fits) in training steps of ``batch_size`` tokens; every
replacement of every block trains on the same tokens, with its own optimiser. A checkpoint (the
replacements, optimisers, schedules, the loss terms' states, the rows in the buffer, the generator
and the position in the stream)
lets an interrupted run resume and end with the same weights as an uninterrupted one.

The sparse code of a replacement is the output of its ``code_module`` (a
[`Transcoder`][mumoe_tn.distillation.transcoders.Transcoder]'s latents), or of the ``gate`` of a μMoE
block (its expert coefficients, one tensor per expert mode).
"""

from __future__ import annotations

import math
import os
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from mumoe_tn.distillation.codes import code_module, recording_code
from mumoe_tn.distillation.distill_options import DistillOptions, distill_options
from mumoe_tn.distillation.interruption import DistillationStopped
from mumoe_tn.distillation.losses import L1, Loss, normalised_mse, resolve_losses
from mumoe_tn.distillation.process_shares import (
    BatchDigest,
    assign_replacements,
    check_resume_files,
    gather_replacements,
    outcomes_shared,
    process_checkpoint,
    process_world,
)
from mumoe_tn.distillation.replacement_files import load_replacements, save_replacements
from mumoe_tn.distillation.resume_checks import CHECKPOINT_FORMAT, read_checkpoint
from mumoe_tn.distillation.splicing import splice, spliced
from mumoe_tn.distillation.step_clock import StepClock
from mumoe_tn.distillation.streaming import (
    ActivationBuffer,
    Batch,
    BlockInfo,
    harvest,
    select_blocks,
)
from mumoe_tn.distillation.trainer import (
    RECIPES,
    Recipe,
    ReplacementTrainer,
    project_column_gradients,
    renormalise_columns,
    unit_norm_parameters,
)
from mumoe_tn.validation import check_positive_float, check_size

__all__ = [
    "CHECKPOINT_FORMAT",
    "LOSS_READ_EVERY",
    "RECIPES",
    "DistillOptions",
    "Distillation",
    "Factory",
    "Recipe",
    "ReplacementTrainer",
    "code_module",
    "distill",
    "load_replacements",
    "normalised_mse",
    "project_column_gradients",
    "recording_code",
    "renormalise_columns",
    "save_replacements",
    "splice",
    "spliced",
    "unit_norm_parameters",
]

#: Builds a replacement for a block: any module mapping the block's input ``(…, I)`` to ``(…, O)``.
Factory = Callable[[BlockInfo], nn.Module]


@dataclass
class Distillation:
    """The result of [`distill`][mumoe_tn.distillation.training.distill].

    Attributes
    ----------
    blocks : list of BlockInfo
        The distilled blocks.
    replacements : dict
        ``block name -> method -> trained module`` (in eval mode); in a process group, every one
        on rank 0 and each other rank's own share there.
    tokens : int
        Tokens every replacement trained on.
    steps : int
        Optimiser steps of every replacement.
    losses : dict
        ``block name -> method -> ``the mean loss of the last 50 steps.
    peak_buffer_rows : int
        The most tokens the activation buffer held.
    buffer_bytes : int
        Bytes of the buffer's storage (on rank 0 of a process group: of every process's buffer).
    throughput : dict
        ``block name -> method -> ``tokens trained per second of that replacement's own steps
        (forward, loss terms, backward, optimiser; since the run's start or its resume).
    """

    blocks: list[BlockInfo]
    replacements: dict[str, dict[str, nn.Module]]
    tokens: int
    steps: int
    losses: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_buffer_rows: int = 0
    buffer_bytes: int = 0
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)


def _seed(seed: int, *parts: str) -> int:
    """A seed for one replacement, stable across runs and independent of the other replacements."""
    return (seed * 1_000_003 + zlib.crc32("/".join(parts).encode())) % (2**63)


def _built(factory: Factory, block: BlockInfo, method: str, seed: int) -> nn.Module:
    """``factory(block)`` under the replacement's own seed (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(seed, block.name, method))
        module = factory(block)
    if not isinstance(module, nn.Module):
        raise TypeError(f"the factory of {method!r} returned {type(module).__name__}, not an nn.Module")
    return module


def _check_methods(methods: object) -> dict[str, Factory]:
    if not isinstance(methods, Mapping) or not methods:
        raise TypeError(
            f"replacements must be a non-empty mapping of method name -> factory(block), got {methods!r:.80}"
        )
    for name, factory in methods.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"a method name must be a non-empty string without '/', got {name!r}")
        if not callable(factory):
            raise TypeError(f"the factory of method {name!r} must be callable (block -> module), got {factory!r:.80}")
    return dict(methods)


#: Steps between reads of the losses on the host (the finiteness check, the progress display): the
#: losses of a step stay on the device until then, so a step never waits for the device to finish.
LOSS_READ_EVERY = 16


class _Run:
    """The state of one distillation: trainers, buffer, generator, counters, the losses not yet read."""

    def __init__(
        self,
        blocks: list[BlockInfo],
        methods: dict[str, Factory],
        *,
        seed: int,
        lr: float | None,
        recipes: Mapping[str, Recipe],
        steps: int,
        losses: tuple[Loss, ...],
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None,
        capacity: int,
        pairs: Sequence[tuple[str, str]],
    ) -> None:
        pairs = set(pairs)
        self.modules: dict[str, dict[str, nn.Module]] = {}
        self.trainers: dict[tuple[str, str], ReplacementTrainer] = {}
        for block in blocks:
            self.modules[block.name] = {}
            for method, factory in methods.items():
                if (block.name, method) not in pairs:  # another process trains it
                    continue
                module = _built(factory, block, method, seed)
                self.trainers[block.name, method] = ReplacementTrainer(
                    module, recipe=recipes[method], steps=steps, lr=lr, losses=losses, optimizer=optimizer,
                    name=f"the replacement {method!r} of {block.name!r}",
                )  # fmt: skip
                self.modules[block.name][method] = module
        self.buffer = ActivationBuffer(capacity)
        self.generator = torch.Generator().manual_seed(seed)
        self.harvested = self.trained = self.steps = 0
        self.draining: int | None = None  # the rows a drain in progress stops at
        self.recent: dict[tuple[str, str], list[float]] = {}
        self.unread: list[torch.Tensor] = []  # one (replacements,) loss vector per step not yet read
        self.clock = StepClock()

    def state_dict(self, config: Mapping[str, Any]) -> dict[str, Any]:
        trainers = {f"{b}/{m}": trainer for (b, m), trainer in self.trainers.items()}
        return {
            "format": CHECKPOINT_FORMAT,
            "config": dict(config),
            "modules": {key: trainer.module.state_dict() for key, trainer in trainers.items()},
            "optimizers": {key: trainer.optimizer.state_dict() for key, trainer in trainers.items()},
            "schedules": {key: trainer.schedule.state_dict() for key, trainer in trainers.items()},
            "losses": {key: trainer.loss_state for key, trainer in trainers.items()},
            "buffer": self.buffer.state_dict(),
            "generator": self.generator.get_state(),
            "counters": {"harvested": self.harvested, "trained": self.trained, "steps": self.steps},
            "draining": -1 if self.draining is None else self.draining,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Hold a checkpoint's state (checked against this run by ``read_checkpoint``)."""
        for (block, method), trainer in self.trainers.items():
            key = f"{block}/{method}"
            trainer.module.load_state_dict(state["modules"][key])
            trainer.optimizer.load_state_dict(state["optimizers"][key])
            trainer.schedule.load_state_dict(state["schedules"][key])
            trainer.loss_state = {name: dict(values) for name, values in state["losses"][key].items()}
        self.buffer.load_state_dict(state["buffer"])
        self.generator.set_state(state["generator"])
        counters = state["counters"]
        self.harvested, self.trained, self.steps = (int(counters[k]) for k in ("harvested", "trained", "steps"))
        self.draining = None if int(state["draining"]) < 0 else int(state["draining"])

    def count_batch(self) -> None:
        """One more batch read from the stream into the buffer."""
        self.harvested += 1

    def step(self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One optimiser step of every replacement on ``rows``; the losses are read later (``read_losses``)."""
        losses = []
        for key, trainer in self.trainers.items():
            x, y = rows[key[0]]
            with self.clock.timing(key, y.device, y.shape[0]):
                losses.append(trainer.step(x, y))
        device = losses[0].device  # blocks on several devices: one vector (stack promotes mixed dtypes)
        self.unread.append(torch.stack([loss.to(device) for loss in losses]))
        self.steps += 1

    def method_throughput(self) -> dict[str, float]:
        """Tokens per second of each method's own steps, over the blocks (total tokens ÷ total seconds)."""
        self.clock.settle()
        tokens: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for key in self.trainers:
            tokens[key[1]] = tokens.get(key[1], 0) + self.clock.tokens.get(key, 0)
            seconds[key[1]] = seconds.get(key[1], 0.0) + self.clock.seconds.get(key, 0.0)
        return {m: tokens[m] / seconds[m] if seconds[m] > 0 else math.nan for m in tokens}

    def read_losses(self) -> dict[str, float]:
        """Read the unread steps' losses on the host (one sync); each method's loss of the last (mean over blocks).

        Raises
        ------
        FloatingPointError
            At the first step and replacement whose loss is not finite.
        """
        if not self.unread:
            return {}
        values = torch.stack(self.unread).tolist()
        self.clock.settle()  # the device is idle now: its timing events read without a wait
        first = self.steps - len(values)
        self.unread = []
        keys = list(self.trainers)
        for offset, row in enumerate(values):
            for (block, method), value in zip(keys, row, strict=True):
                if not math.isfinite(value):
                    raise FloatingPointError(
                        f"the distillation loss of {method!r} on {block!r} is {value} at step {first + offset}: "
                        "lower lr"
                    )
        for index, key in enumerate(keys):
            recent = self.recent.setdefault(key, [])
            recent.extend(row[index] for row in values[-50:])
            del recent[:-50]
        losses: dict[str, list[float]] = {}
        for (_, method), value in zip(keys, values[-1], strict=True):
            losses.setdefault(method, []).append(value)
        return {method: sum(values) / len(values) for method, values in losses.items()}


def _save(state: Mapping[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` atomically (a crash leaves the previous checkpoint)."""
    temporary = path.with_name(path.name + ".tmp")
    torch.save(dict(state), temporary)
    os.replace(temporary, path)


def _recipes_of(recipe: object, methods: Mapping[str, Factory]) -> dict[str, Recipe]:
    """Every method's recipe: ``recipe`` a name of ``RECIPES`` for all, or a mapping of every method to one."""
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
        return dict.fromkeys(methods, RECIPES[recipe])
    if not isinstance(recipe, Mapping):
        raise TypeError(f"recipe must be a recipe's name or a mapping of method names to them, got {recipe!r:.80}")
    missing, unknown = sorted(set(methods) - set(recipe)), sorted(set(recipe) - set(methods), key=str)
    if missing or unknown:
        raise ValueError(
            f"recipe= must name a recipe for every method and for no other: missing {missing}, not methods {unknown}"
        )
    for method, name in recipe.items():
        if not isinstance(name, str) or name not in RECIPES:
            raise ValueError(f"recipe of {method!r} must be one of {sorted(RECIPES)}, got {name!r:.80}")
    return {method: RECIPES[recipe[method]] for method in methods}


def distill(
    model: nn.Module,
    batches: Iterable[Batch],
    replacements: Mapping[str, Factory],
    *,
    options: DistillOptions | None = None,
    **keywords: Any,
) -> Distillation:
    """Train a replacement of each chosen MLP block of ``model`` on the block's streamed activations.

    Parameters
    ----------
    model : nn.Module
        The trained model (left unchanged; it runs in eval mode without gradients).
    batches : Iterable
        The text: batches of token ids ``(B, T)``, or mappings of the model's keyword arguments
        (``input_ids``, ``attention_mask``, …). With ``resume=True`` it must be re-iterable and
        give the same batches each time (a list, a
        [`TokenWindows`][mumoe_tn.distillation.streaming.TokenWindows]).
    replacements : Mapping[str, Factory]
        Method name -> factory: ``factory(block)`` builds a module from a
        [`BlockInfo`][mumoe_tn.distillation.streaming.BlockInfo], e.g. a μMoE block or a transcoder.
        Every method is trained for every block on the same tokens, each with its own optimiser.
    options : DistillOptions, optional
        How to train (see [`DistillOptions`][mumoe_tn.distillation.distill_options.DistillOptions]:
        ``tokens``, ``mlps``, ``batch_size``, ``buffer_tokens``, ``recipe``, ``lr``, ``loss``,
        ``l1``, ``optimizer``, ``seed``, ``mask_argument``, ``checkpoint``, ``checkpoint_every``,
        ``resume``, ``run_config``, ``progress``, ``stop``).
    **keywords
        The same options as keywords (``tokens=2048, batch_size=128``), instead of ``options=``:
        the two forms are mutually exclusive (a ``TypeError`` names the keywords given beside
        ``options=``).

    Returns
    -------
    Distillation

    Raises
    ------
    DistillationStopped
        When ``stop()`` returned True.

    Notes
    -----
    Unit-norm parameters: a replacement may declare parameters whose slices along a dim keep norm 1
    in a ``unit_norm`` attribute (see
    [`unit_norm_parameters`][mumoe_tn.distillation.trainer.unit_norm_parameters]): they are
    renormalised when built and after every step, and the gradient component parallel to each
    slice is removed before every optimiser step (the Mixture of Decoders' expert vectors).

    Across processes: in an initialised process group of several processes (``torchrun``) each
    process trains its share of the ``(block, method)`` pairs (round-robin), on the same
    ``batches``, into its own checkpoint file; rank 0 returns every replacement, equal to a
    one-process run's, the other ranks their own share (see
    [`mumoe_tn.distillation.process_shares`][mumoe_tn.distillation.process_shares]).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    given = distill_options(options, keywords)
    mlps, tokens, batch_size, buffer_tokens, recipe, lr, loss, l1 = (
        given.mlps, given.tokens, given.batch_size, given.buffer_tokens, given.recipe, given.lr, given.loss, given.l1
    )  # fmt: skip
    optimizer, seed, mask_argument, checkpoint, checkpoint_every, resume, run_config, progress, stop = (
        given.optimizer, given.seed, given.mask_argument, given.checkpoint, given.checkpoint_every, given.resume,
        given.run_config, given.progress, given.stop,
    )  # fmt: skip
    methods = _check_methods(replacements)
    tokens, batch_size = check_size("tokens", tokens), check_size("batch_size", batch_size)
    capacity, checkpoint_every = (
        check_size("buffer_tokens", buffer_tokens),
        check_size("checkpoint_every", checkpoint_every),
    )
    if capacity < batch_size:
        raise ValueError(f"buffer_tokens must hold at least one step of batch_size={batch_size}, got {capacity}")
    recipes = _recipes_of(recipe, methods)
    if lr is not None:
        lr = check_positive_float("lr", lr)
    elif isinstance(recipe, str):
        lr = RECIPES[recipe].lr
    recorded = recipe if isinstance(recipe, str) else dict(sorted(recipe.items()))
    l1 = check_positive_float("l1", l1, allow_zero=True)
    terms = resolve_losses(loss)
    if l1 > 0:
        if any(term.name == L1.name for term in terms):
            raise ValueError(f"give the L1 penalty once: l1={l1} or an {L1.name!r} term in loss=, not both")
        terms = (*terms, L1(weight=l1))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    path = None if checkpoint is None else Path(checkpoint)
    if resume and path is None:
        raise ValueError("resume=True needs checkpoint= (the file to resume from)")
    if stop is not None and not callable(stop):
        raise TypeError(f"stop must be a callable () -> bool, got {stop!r:.80}")
    if resume and iter(batches) is batches:
        raise TypeError("resume=True needs re-iterable batches (a list, TokenWindows), not a one-shot iterator")
    blocks = select_blocks(model, mlps)
    world = process_world()
    pairs = [(block.name, method) for block in blocks for method in methods]
    share = pairs if world is None else assign_replacements(pairs, world[1])[world[0]]
    own = [block for block in blocks if any(name == block.name for name, _ in share)]  # the blocks to stream
    names = [block.name for block in own]
    config = {
        **dict(run_config or {}), "blocks": [block.name for block in blocks], "methods": sorted(methods),
        "tokens": tokens, "batch_size": batch_size, "buffer_tokens": capacity, "seed": seed, "recipe": recorded,
        "lr": lr, "loss": [term.config() for term in terms],
    }  # fmt: skip
    if world is not None:
        config["processes"] = {"rank": world[0], "world_size": world[1]}
        path = None if path is None else process_checkpoint(path, world)
    with outcomes_shared(world, checkpoint=path, tokens=tokens, trained=lambda: 0):  # no process left waiting
        run = _Run(own, methods, seed=seed, lr=lr, recipes=recipes, steps=tokens // batch_size, losses=terms,
                   optimizer=optimizer, capacity=capacity, pairs=share)  # fmt: skip
        if resume and checkpoint is not None:
            check_resume_files(checkpoint, world)
        if resume and path is not None and path.exists():
            run.load_state_dict(read_checkpoint(path, config, run.trainers, own))
    was_training = model.training
    model.eval()
    bar = tqdm(total=tokens, initial=min(run.trained, tokens), unit="tok", unit_scale=True, desc="distilling",
               disable=not progress or (world is not None and world[0] != 0), mininterval=0.5)  # fmt: skip

    def train_until(rows_left: int) -> None:
        """Shuffle, then train while more than ``rows_left`` rows (and a whole batch) remain."""
        if run.buffer.rows >= batch_size and not run.buffer.shuffled:
            run.buffer.shuffle(run.generator)
        run.draining = rows_left
        while run.trained < tokens and run.buffer.rows >= batch_size and run.buffer.rows > rows_left:
            with torch.enable_grad():
                run.step(run.buffer.take(batch_size))
            run.trained += batch_size
            bar.update(batch_size)
            checkpoint_now = path is not None and run.steps % checkpoint_every == 0
            if checkpoint_now or run.steps % LOSS_READ_EVERY == 0 or run.trained >= tokens:
                loss = run.read_losses()  # raises on a non-finite loss before a checkpoint could keep it
                speeds = run.method_throughput()
                bar.set_postfix({m: f"{v:.3g} ({speeds.get(m, math.nan):,.0f} tok/s)" for m, v in loss.items()},
                                refresh=False)  # fmt: skip
            if checkpoint_now:
                _save(run.state_dict(config), path)
            stop_if_asked()
        run.draining = None

    def stop_if_asked() -> None:
        """Once ``stop()`` says so: read the losses, write the checkpoint and raise DistillationStopped."""
        if stop is not None and stop():
            run.read_losses()
            if path is not None:
                _save(run.state_dict(config), path)
            raise DistillationStopped(path, run.trained, tokens)

    def added(batch: Batch) -> None:
        run.count_batch()
        digest.update(batch)

    try:
        with outcomes_shared(world, checkpoint=path, tokens=tokens, trained=lambda: run.trained):
            stream, digest = iter(batches), BatchDigest(enabled=world is not None)
            for _ in range(run.harvested):  # the batches already in the buffer or trained on
                digest.update(next(stream, None))
            if run.draining is not None:  # resumed inside a drain: finish it as the interrupted run did
                train_until(run.draining)
            harvest(model, stream, names, run.buffer, mask_argument=mask_argument, make_room=train_until,
                    done=lambda: run.trained >= tokens, before_batch=stop_if_asked, added=added)  # fmt: skip
            train_until(0)
            bar.close()
            if run.trained < tokens:
                warnings.warn(
                    f"the data ended after {run.trained:,} of the {tokens:,} tokens asked for (whole steps of "
                    f"{batch_size})", UserWarning, stacklevel=2,
                )  # fmt: skip
            run.read_losses()
            if path is not None:
                _save(run.state_dict(config), path)
    finally:
        bar.close()
        model.train(was_training)
    modules = {(block, method): run.modules[block][method] for block, method in share}
    losses = {pair: _mean(run.recent.get(pair, [])) for pair in share}
    speeds = {f"{block}/{method}": run.clock.tokens_per_second((block, method)) for block, method in share}
    counters = [{"tokens": run.trained, "steps": run.steps, "peak_buffer_rows": run.buffer.peak_rows,
                 "buffer_bytes": run.buffer.allocated_bytes, "batches": digest.value,
                 "throughput": speeds}]  # fmt: skip
    if world is not None:
        by_name = {block.name: block for block in blocks}

        def build(block: str, method: str) -> nn.Module:
            return _built(methods[method], by_name[block], method, seed)

        gathered = gather_replacements(world, modules, losses, counters[0], build)
        if gathered is not None:
            modules, losses, counters = gathered
    replacements: dict[str, dict[str, nn.Module]] = {}
    losses_of: dict[str, dict[str, float]] = {}
    for block, method in pairs:
        if (block, method) in modules:
            replacements.setdefault(block, {})[method] = modules[block, method].eval()
            losses_of.setdefault(block, {})[method] = losses[block, method]
    peak, allocated = max(c["peak_buffer_rows"] for c in counters), sum(c["buffer_bytes"] for c in counters)
    measured = {key: value for c in counters for key, value in c.get("throughput", {}).items()}
    throughput = {b: {m: measured.get(f"{b}/{m}", math.nan) for m in ms} for b, ms in replacements.items()}
    return Distillation(blocks, replacements, run.trained, run.steps, losses_of, peak, allocated, throughput)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
