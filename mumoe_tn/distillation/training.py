"""Distil the MLP blocks of a trained model into sparse replacements, and splice them in.

Each chosen block is a function ``x ↦ y`` of its input; a replacement — any module a factory
builds from the block: a μMoE block of any format, a transcoder, a user's own — is trained to
reproduce ``y`` from ``x`` on activations streamed from a text dataset, with the field's
normalised loss (Mixture of Decoders, Oldfield et al. 2025)::

    L = mean_{t,o} (ŷ_{t,o} − y_{t,o})² / ‖y_t‖₂

(the mean over tokens ``t`` and output features ``o``), plus ``λ·mean_t ‖z_t‖₁`` on the
replacement's sparse code ``z`` with an L1 penalty. Sparsity is the replacement's own (a top-k
gate, TopK latents) or that penalty.

Streaming: the model runs in eval mode without gradients over batches of the dataset; the
inputs and outputs of every chosen block at the real tokens (padding dropped by the batch's
mask) go into one [`ActivationBuffer`][mumoe_tn.distillation.streaming.ActivationBuffer] of fixed
capacity. When the next batch does not fit, the buffer is shuffled and drained to half its
capacity (or less, until the batch fits) in training steps of ``batch_size`` tokens; every
replacement of every block trains on the same tokens, with its own optimiser. A checkpoint (the
replacements, optimisers, the rows in the buffer, the generator and the position in the stream)
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from mumoe_tn.distillation.streaming import (
    ActivationBuffer,
    Batch,
    BlockInfo,
    capture_blocks,
    run_model,
    select_blocks,
    token_rows,
)
from mumoe_tn.layers.base import MuMoEBase
from mumoe_tn.validation import check_positive_float, check_size

__all__ = [
    "CHECKPOINT_FORMAT",
    "Distillation",
    "Factory",
    "code_module",
    "distill",
    "normalised_mse",
    "recording_code",
    "splice",
    "spliced",
]

#: Builds a replacement for a block: any module mapping the block's input ``(…, I)`` to ``(…, O)``.
Factory = Callable[[BlockInfo], nn.Module]

#: The version tag of a distillation checkpoint.
CHECKPOINT_FORMAT = "mumoe_tn.distill/1"


def normalised_mse(prediction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The distillation loss ``mean_{t,o} (ŷ_{t,o} − y_{t,o})² / ‖y_t‖₂`` over the real tokens.

    Parameters
    ----------
    prediction, target : torch.Tensor
        ``(…, O)`` each.
    mask : torch.Tensor, optional
        ``(…)`` booleans, True = real token; padding tokens do not enter the mean.

    Returns
    -------
    torch.Tensor
        A scalar. A token whose target is zero is divided by ``1e-8`` instead of 0.
    """
    if prediction.shape != target.shape:
        raise ValueError(
            f"prediction and target must have the same shape, got {tuple(prediction.shape)} and {tuple(target.shape)}"
        )
    error = (prediction - target).pow(2) / target.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    if mask is None:
        return error.mean()
    if mask.shape != target.shape[:-1]:
        raise ValueError(f"mask must have shape {tuple(target.shape[:-1])}, got {tuple(mask.shape)}")
    return error[mask.bool()].mean()


def code_module(replacement: nn.Module) -> nn.Module | None:
    """The submodule whose output is ``replacement``'s sparse code, or None if it names none.

    A module's ``code_module`` attribute if it has one; the ``gate`` of a μMoE block (its
    expert coefficients).
    """
    named = getattr(replacement, "code_module", None)
    if isinstance(named, nn.Module):
        return named
    if isinstance(replacement, MuMoEBase):
        return replacement.gate
    return None


@contextmanager
def recording_code(replacement: nn.Module) -> Iterator[list[tuple[torch.Tensor, ...]]]:
    """Record the sparse code of every forward pass of ``replacement`` inside the block (with gradients).

    Yields a list that receives, per forward pass, the code as a tuple of tensors ``(…, units)``
    (one per expert mode for a μMoE block).
    """
    module = code_module(replacement)
    if module is None:
        raise TypeError(
            f"{type(replacement).__name__} exposes no sparse code: give it a `code_module` attribute (the submodule "
            "whose output is the code) to use an L1 penalty or measure L0"
        )
    codes: list[tuple[torch.Tensor, ...]] = []

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        codes.append(tuple(output) if isinstance(output, (tuple, list)) else (output,))

    handle = module.register_forward_hook(hook)
    try:
        yield codes
    finally:
        handle.remove()


@dataclass
class Distillation:
    """The result of [`distill`][mumoe_tn.distillation.training.distill].

    Attributes
    ----------
    blocks : list of BlockInfo
        The distilled blocks.
    replacements : dict
        ``block name -> method -> trained module`` (in eval mode).
    tokens : int
        Tokens every replacement trained on.
    steps : int
        Optimiser steps of every replacement.
    losses : dict
        ``block name -> method -> ``the mean loss of the last 50 steps.
    peak_buffer_rows : int
        The most tokens the activation buffer held.
    buffer_bytes : int
        Bytes of the buffer's storage.
    """

    blocks: list[BlockInfo]
    replacements: dict[str, dict[str, nn.Module]]
    tokens: int
    steps: int
    losses: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_buffer_rows: int = 0
    buffer_bytes: int = 0


def _seed(seed: int, *parts: str) -> int:
    """A seed for one replacement, stable across runs and independent of the other replacements."""
    return (seed * 1_000_003 + zlib.crc32("/".join(parts).encode())) % (2**63)


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


class _Run:
    """The state of one distillation: modules, optimisers, buffer, generator and counters."""

    def __init__(
        self,
        blocks: list[BlockInfo],
        methods: dict[str, Factory],
        *,
        seed: int,
        lr: float,
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None,
        capacity: int,
    ) -> None:
        self.modules: dict[str, dict[str, nn.Module]] = {}
        self.optimizers: dict[str, dict[str, torch.optim.Optimizer]] = {}
        for block in blocks:
            self.modules[block.name], self.optimizers[block.name] = {}, {}
            for method, factory in methods.items():
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_seed(seed, block.name, method))
                    module = factory(block)
                if not isinstance(module, nn.Module):
                    raise TypeError(f"the factory of {method!r} returned {type(module).__name__}, not an nn.Module")
                parameters = [p for p in module.parameters() if p.requires_grad]
                if not parameters:
                    raise ValueError(f"the replacement {method!r} of {block.name!r} has no trainable parameters")
                self.modules[block.name][method] = module.train()
                build = optimizer or (lambda params: torch.optim.Adam(params, lr=lr))
                self.optimizers[block.name][method] = build(parameters)
        self.buffer = ActivationBuffer(capacity)
        self.generator = torch.Generator().manual_seed(seed)
        self.harvested = self.trained = self.steps = 0
        self.draining: int | None = None  # the rows a drain in progress stops at
        self.recent: dict[tuple[str, str], list[float]] = {}

    def state_dict(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "config": dict(config),
            "modules": {f"{b}/{m}": mod.state_dict() for b, ms in self.modules.items() for m, mod in ms.items()},
            "optimizers": {f"{b}/{m}": o.state_dict() for b, os_ in self.optimizers.items() for m, o in os_.items()},
            "buffer": self.buffer.state_dict(),
            "generator": self.generator.get_state(),
            "counters": {"harvested": self.harvested, "trained": self.trained, "steps": self.steps},
            "draining": -1 if self.draining is None else self.draining,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for block, methods in self.modules.items():
            for method, module in methods.items():
                module.load_state_dict(state["modules"][f"{block}/{method}"])
                self.optimizers[block][method].load_state_dict(state["optimizers"][f"{block}/{method}"])
        self.buffer.load_state_dict(state["buffer"])
        self.generator.set_state(state["generator"])
        counters = state["counters"]
        self.harvested, self.trained, self.steps = (int(counters[k]) for k in ("harvested", "trained", "steps"))
        self.draining = None if int(state["draining"]) < 0 else int(state["draining"])

    def step(self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]], l1: float) -> float:
        """One optimiser step of every replacement on ``rows``; returns the mean loss."""
        losses = []
        for block, methods in self.modules.items():
            x, y = rows[block]
            for method, module in methods.items():
                if l1 > 0:
                    with recording_code(module) as codes:
                        loss = normalised_mse(module(x), y)
                    loss = loss + l1 * sum(part.abs().sum(-1).mean() for code in codes for part in code)
                else:
                    loss = normalised_mse(module(x), y)
                optimizer = self.optimizers[block][method]
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(
                        f"the distillation loss of {method!r} on {block!r} is {value} at step {self.steps}: lower lr"
                    )
                recent = self.recent.setdefault((block, method), [])
                recent.append(value)
                del recent[:-50]
                losses.append(value)
        self.steps += 1
        return sum(losses) / len(losses)


def _save(state: Mapping[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` atomically (a crash leaves the previous checkpoint)."""
    temporary = path.with_name(path.name + ".tmp")
    torch.save(dict(state), temporary)
    os.replace(temporary, path)


def _load(path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """Read a checkpoint with torch's allow-list loader and check it belongs to this run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a corrupt or foreign file: say which
        raise ValueError(
            f"{path} is not a readable distillation checkpoint ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a distillation checkpoint ({CHECKPOINT_FORMAT})")
    saved = state["config"]
    different = {key: (saved.get(key), value) for key, value in config.items() if saved.get(key) != value}
    if different:
        listed = ", ".join(f"{key}: checkpoint {old!r}, now {new!r}" for key, (old, new) in sorted(different.items()))
        raise ValueError(f"the checkpoint {path} was written by a different distillation ({listed})")
    return state


def distill(
    model: nn.Module,
    batches: Iterable[Batch],
    replacements: Mapping[str, Factory],
    *,
    mlps: str | Callable[[str, nn.Module], bool] = r"mlp$",
    tokens: int,
    batch_size: int = 256,
    buffer_tokens: int = 16_384,
    lr: float = 1e-3,
    l1: float = 0.0,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    seed: int = 0,
    mask_argument: str | None = "attention_mask",
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 100,
    resume: bool = False,
    progress: bool = True,
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
    mlps : str or Callable, optional
        The blocks (see [`select_blocks`][mumoe_tn.distillation.streaming.select_blocks]).
    tokens : int
        Tokens to train on (whole steps of ``batch_size``).
    batch_size : int, optional
        Tokens per optimiser step (default 256).
    buffer_tokens : int, optional
        Capacity of the activation buffer in tokens (default 16,384); must hold one batch.
    lr : float, optional
        Adam's learning rate (default 1e-3).
    l1 : float, optional
        Weight ``λ`` of the L1 penalty on the sparse code (default 0: the replacement's own sparsity).
    optimizer : Callable, optional
        ``optimizer(parameters)`` builds the optimiser of each replacement (default Adam with ``lr``).
    seed : int, optional
        Seeds the replacements' initialisation (each from the seed and its block and method
        names) and the buffer's shuffling; the global RNG is left as it was.
    mask_argument : str or None, optional
        The key of a mapping batch that marks real tokens (default ``"attention_mask"``).
    checkpoint : path, optional
        Save the run's state here every ``checkpoint_every`` steps and at the end.
    checkpoint_every : int, optional
        Steps between checkpoints (default 100).
    resume : bool, optional
        Continue from ``checkpoint`` if it exists (its configuration must match this call's).
    progress : bool, optional
        Show a tqdm bar of trained tokens with tokens/s and the mean loss.

    Returns
    -------
    Distillation
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    methods = _check_methods(replacements)
    tokens, batch_size = check_size("tokens", tokens), check_size("batch_size", batch_size)
    capacity, checkpoint_every = (
        check_size("buffer_tokens", buffer_tokens),
        check_size("checkpoint_every", checkpoint_every),
    )
    if capacity < batch_size:
        raise ValueError(f"buffer_tokens must hold at least one step of batch_size={batch_size}, got {capacity}")
    lr, l1 = check_positive_float("lr", lr), check_positive_float("l1", l1, allow_zero=True)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    path = None if checkpoint is None else Path(checkpoint)
    if resume and path is None:
        raise ValueError("resume=True needs checkpoint= (the file to resume from)")
    if resume and iter(batches) is batches:
        raise TypeError("resume=True needs re-iterable batches (a list, TokenWindows), not a one-shot iterator")
    blocks = select_blocks(model, mlps)
    names = [block.name for block in blocks]
    config = {
        "blocks": names, "methods": sorted(methods), "batch_size": batch_size, "buffer_tokens": capacity,
        "seed": seed, "lr": lr, "l1": l1,
    }  # fmt: skip
    run = _Run(blocks, methods, seed=seed, lr=lr, optimizer=optimizer, capacity=capacity)
    if resume and path is not None and path.exists():
        run.load_state_dict(_load(path, config))
    was_training = model.training
    model.eval()
    bar = tqdm(total=tokens, initial=min(run.trained, tokens), unit="tok", unit_scale=True, desc="distilling",
               disable=not progress, mininterval=0.5)  # fmt: skip

    def train_until(rows_left: int) -> None:
        """Shuffle, then train while more than ``rows_left`` rows (and a whole batch) remain."""
        if run.buffer.rows >= batch_size and not run.buffer.shuffled:
            run.buffer.shuffle(run.generator)
        run.draining = rows_left
        while run.trained < tokens and run.buffer.rows >= batch_size and run.buffer.rows > rows_left:
            with torch.enable_grad():
                loss = run.step(run.buffer.take(batch_size), l1)
            run.trained += batch_size
            bar.update(batch_size)
            bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            if path is not None and run.steps % checkpoint_every == 0:
                _save(run.state_dict(config), path)
        run.draining = None

    try:
        stream = iter(batches)
        for _ in range(run.harvested):  # the batches already in the buffer or trained on
            next(stream, None)
        if run.draining is not None:  # resumed inside a drain: finish it as the interrupted run did
            train_until(run.draining)
        with capture_blocks(model, names) as captured, torch.no_grad():
            while run.trained < tokens:
                batch = next(stream, None)
                if batch is None:
                    break
                kwargs, mask = token_rows(batch, mask_argument)
                ids = next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                needed = int(mask.sum()) if mask is not None else ids.numel()
                if needed > capacity:
                    raise ValueError(
                        f"a batch of {needed} tokens does not fit the buffer of {capacity}: raise buffer_tokens"
                    )
                if run.buffer.rows + needed > capacity:
                    train_until(min(capacity // 2, capacity - needed))
                    if run.trained >= tokens:
                        break
                captured.clear()
                run_model(model, kwargs, mask)
                missing = [name for name in names if name not in captured]
                if missing:
                    raise ValueError(f"the blocks {missing} did not run in the model's forward pass")
                run.buffer.add({name: _real_rows(captured[name], mask) for name in names})
                run.harvested += 1
            train_until(0)
    finally:
        bar.close()
        model.train(was_training)
    if run.trained < tokens:
        warnings.warn(
            f"the data ended after {run.trained:,} of the {tokens:,} tokens asked for (whole steps of {batch_size})",
            UserWarning,
            stacklevel=2,
        )
    if path is not None:
        _save(run.state_dict(config), path)
    losses = {block: {method: _mean(run.recent.get((block, method), [])) for method in methods} for block in names}
    for methods_of_block in run.modules.values():
        for module in methods_of_block.values():
            module.eval()
    return Distillation(
        blocks, run.modules, run.trained, run.steps, losses, run.buffer.peak_rows, run.buffer.allocated_bytes
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _real_rows(pair: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` flattened to ``(tokens, features)`` rows, padding dropped."""
    x, y = pair
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    if mask is None:
        return x, y
    keep = mask.reshape(-1).to(x.device)
    if keep.numel() != x.shape[0]:
        raise ValueError(f"the token mask has {keep.numel()} entries but the block saw {x.shape[0]} tokens")
    return x[keep], y[keep]


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, child = name.rpartition(".")
    try:
        model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{name!r} is not a module of the model") from None
    return (model.get_submodule(parent) if parent else model), child


def splice(model: nn.Module, replacements: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """Put each replacement in place of the module of that name, in place; returns the replaced modules.

    Parameters
    ----------
    model : nn.Module
    replacements : Mapping[str, nn.Module]
        Qualified module name -> new module (e.g. ``Distillation.replacements[name][method]``).

    Returns
    -------
    dict of str to nn.Module
        The modules taken out, by name (``splice(model, old)`` puts them back).
    """
    if not isinstance(replacements, Mapping):
        raise TypeError(f"replacements must be a mapping of module name -> module, got {type(replacements).__name__}")
    for name, module in replacements.items():
        if not isinstance(module, nn.Module):
            raise TypeError(f"the replacement of {name!r} must be an nn.Module, got {type(module).__name__}")
    places = {name: _parent(model, name) for name in replacements}
    old = {}
    for name, module in replacements.items():
        parent, child = places[name]
        old[name] = getattr(parent, child)
        setattr(parent, child, module)
    return old


@contextmanager
def spliced(model: nn.Module, replacements: Mapping[str, nn.Module]) -> Iterator[nn.Module]:
    """[`splice`][mumoe_tn.distillation.training.splice] for the duration of the block, then put the originals back."""
    old = splice(model, replacements)
    try:
        yield model
    finally:
        splice(model, old)
