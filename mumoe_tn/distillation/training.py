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
[`Recipe`][mumoe_tn.distillation.training.Recipe]; parameters a replacement declares unit-norm
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
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from mumoe_tn.distillation.codes import code_module, recording_code, recording_preactivations
from mumoe_tn.distillation.interruption import DistillationStopped
from mumoe_tn.distillation.losses import L1, Loss, LossInputs, normalised_mse, resolve_losses
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
from mumoe_tn.distillation.streaming import (
    ActivationBuffer,
    Batch,
    BlockInfo,
    harvest,
    select_blocks,
)
from mumoe_tn.validation import check_positive_float, check_size

__all__ = [
    "CHECKPOINT_FORMAT",
    "LOSS_READ_EVERY",
    "RECIPES",
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


@dataclass(frozen=True)
class Recipe:
    """How [`distill`][mumoe_tn.distillation.training.distill] optimises every replacement.

    Attributes
    ----------
    name : str
        ``"mxd-paper"`` or ``"plain"`` (see ``RECIPES``).
    lr : float
        The learning rate (``distill(lr=...)`` overrides it).
    optimizer : {"adam", "adamw"}
        ``torch.optim.Adam`` or ``torch.optim.AdamW``.
    weight_decay : float
        AdamW's weight decay.
    warmup : float
        Linear warm-up over this fraction of the run's steps, then a constant learning rate.
    """

    name: str
    lr: float
    optimizer: str
    weight_decay: float
    warmup: float

    def build(self, parameters: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        """The optimiser of one replacement: torch's fused implementation where the parameters allow it.

        The fused kernel updates every parameter in one pass (a third of the for-loop's time on a
        small replacement); parameters it does not support (a device or dtype without the kernel)
        get the multi-tensor (``foreach``) one.
        """
        kind = torch.optim.AdamW if self.optimizer == "adamw" else torch.optim.Adam
        try:
            return kind(parameters, lr=lr, weight_decay=self.weight_decay, fused=True)
        except RuntimeError:
            return kind(parameters, lr=lr, weight_decay=self.weight_decay, foreach=True)


#: The training recipes by name. ``"mxd-paper"``: the Mixture of Decoders authors' (AdamW without
#: weight decay at 4e-4, constant after a warm-up of 5,000 of their 117,188 steps — 480 M tokens in
#: batches of 4,096 — the same fraction of this run's steps). ``"plain"``: Adam at 1e-3, no warm-up.
RECIPES = {
    "mxd-paper": Recipe("mxd-paper", lr=4e-4, optimizer="adamw", weight_decay=0.0, warmup=5_000 / (480e6 / 4096)),
    "plain": Recipe("plain", lr=1e-3, optimizer="adam", weight_decay=0.0, warmup=0.0),
}


def _warmup_factor(step: int, *, steps: int) -> float:
    return 1.0 if steps <= 0 else min(1.0, (step + 1) / steps)


def unit_norm_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter, int]]:
    """The parameters ``module`` declares unit-norm, with the dim along which each slice has norm 1.

    A replacement declares them in a ``unit_norm`` attribute: a mapping of its parameter names to
    a dim (``{"decoder.C_n1": 1}``: every row of ``C_n1`` — a Mixture of Decoders' expert vector
    ``c_n`` — has norm 1; see
    [`MixtureOfDecoders.expert_vectors`][mumoe_tn.layers.decoders.MixtureOfDecoders.expert_vectors]).

    Raises
    ------
    TypeError, ValueError
        If ``unit_norm`` is not such a mapping, names no parameter, or a dim is out of range.
    """
    declared = getattr(module, "unit_norm", None)
    if declared is None:
        return []
    if not isinstance(declared, Mapping):
        raise TypeError(f"unit_norm of {type(module).__name__} must map parameter names to dims, got {declared!r:.80}")
    parameters = dict(module.named_parameters())
    found = []
    for name, dim in declared.items():
        if name not in parameters:
            raise ValueError(
                f"unit_norm names {name!r}, not a parameter of {type(module).__name__}: {sorted(parameters)}"
            )
        parameter = parameters[name]
        if isinstance(dim, bool) or not isinstance(dim, int) or not -parameter.ndim <= dim < parameter.ndim:
            raise ValueError(
                f"unit_norm dim of {name!r} must be an int in [-{parameter.ndim}, {parameter.ndim}), got {dim!r}"
            )
        found.append((name, parameter, dim))
    return found


@torch.no_grad()
def renormalise_columns(parameter: torch.Tensor, dim: int) -> None:
    """Scale every slice of ``parameter`` along ``dim`` to norm 1, in place (a zero slice stays zero)."""
    parameter.div_(parameter.norm(dim=dim, keepdim=True).clamp_min(1e-12))


@torch.no_grad()
def project_column_gradients(parameter: torch.Tensor, dim: int) -> None:
    """Remove from ``parameter.grad`` the component parallel to each slice along ``dim``, in place.

    For unit-norm slices ``c``: ``g ← g − (gᵀc) c``, the gradient in the tangent space of the
    sphere (the Mixture of Decoders authors' ``norm_dec``). Nothing happens without a gradient.
    """
    grad = parameter.grad
    if grad is None:
        return
    unit = parameter / parameter.norm(dim=dim, keepdim=True).clamp_min_(1e-12)
    grad.addcmul_(torch.linalg.vecdot(grad, unit, dim=dim).unsqueeze(dim), unit, value=-1)


class ReplacementTrainer:
    """One replacement's training step: its module, optimiser, warm-up, loss terms and their state.

    [`distill`][mumoe_tn.distillation.training.distill] keeps one per block and method; a step is
    forward, the summed loss terms, backward, the unit-norm projection, the optimiser and the
    warm-up schedule, and returns the loss without reading it on the host (no device sync).

    Parameters
    ----------
    module : nn.Module
        The replacement (put in training mode; its unit-norm parameters are renormalised).
    recipe : str or Recipe, optional
        The optimiser, learning rate and warm-up (default ``"mxd-paper"``, see ``RECIPES``).
    steps : int, optional
        The run's optimiser steps (the warm-up is a fraction of them; default 1).
    lr : float, optional
        The learning rate (default the recipe's).
    losses : str or Loss or Sequence, optional
        The run's loss terms (default ``"normalised-mse"``); the module's own
        ``distillation_losses`` are added.
    optimizer : Callable, optional
        ``optimizer(parameters)`` builds the optimiser instead of the recipe.
    name : str, optional
        How error messages name the replacement (default ``"the replacement"``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        recipe: str | Recipe = "mxd-paper",
        steps: int = 1,
        lr: float | None = None,
        losses: str | Loss | Sequence[str | Loss] = "normalised-mse",
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        name: str = "the replacement",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{name} must be an nn.Module, got {type(module).__name__}")
        if isinstance(recipe, str):
            if recipe not in RECIPES:
                raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
            recipe = RECIPES[recipe]
        parameters = [p for p in module.parameters() if p.requires_grad]
        if not parameters:
            raise ValueError(f"{name} has no trainable parameters")
        self.module = module.train()
        self.terms = _terms_of(module, resolve_losses(losses), name)
        self.loss_state: dict[str, dict[str, torch.Tensor]] = {term.name: {} for term in self.terms}
        self.unit_norm = unit_norm_parameters(module)
        for _, parameter, dim in self.unit_norm:
            renormalise_columns(parameter, dim)
        rate = recipe.lr if lr is None else lr
        self.optimizer = optimizer(parameters) if optimizer is not None else recipe.build(parameters, rate)
        warmup = partial(_warmup_factor, steps=round(recipe.warmup * steps))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup)
        self._records_code = any(term.needs_code for term in self.terms)
        self._records_preactivations = any(term.needs_preactivations for term in self.terms)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The summed loss terms on ``(x, y)`` (with gradients)."""
        module = self.module
        if not (self._records_code or self._records_preactivations):
            inputs = LossInputs(module, x, y, module(x))
            return self._summed(inputs)
        with ExitStack() as stack:
            codes = stack.enter_context(recording_code(module)) if self._records_code else None
            pre = stack.enter_context(recording_preactivations(module)) if self._records_preactivations else None
            prediction = module(x)
            inputs = LossInputs(module, x, y, prediction, codes[0] if codes else None, pre[0] if pre else None)
            return self._summed(inputs)

    def _summed(self, inputs: LossInputs) -> torch.Tensor:
        values = []
        for term in self.terms:
            inputs.state = self.loss_state[term.name]
            values.append(term(inputs))
        total = values[0]
        for value in values[1:]:  # in order: one addition per term where stack().sum() takes two passes
            total = total + value
        return total

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimiser step on ``(x, y)``; returns the loss before the step (detached, not synced)."""
        loss = self.loss(x, y)
        for group in self.optimizer.param_groups:  # zero_grad(set_to_none=True), without its profiling hooks
            for parameter in group["params"]:
                parameter.grad = None
        loss.backward()
        for _, parameter, dim in self.unit_norm:
            project_column_gradients(parameter, dim)
        self.optimizer.step()
        self.schedule.step()
        for _, parameter, dim in self.unit_norm:
            renormalise_columns(parameter, dim)
        return loss.detach()


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
        lr: float,
        recipe: Recipe,
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
                    module, recipe=recipe, steps=steps, lr=lr, losses=losses, optimizer=optimizer,
                    name=f"the replacement {method!r} of {block.name!r}",
                )  # fmt: skip
                self.modules[block.name][method] = module
        self.buffer = ActivationBuffer(capacity)
        self.generator = torch.Generator().manual_seed(seed)
        self.harvested = self.trained = self.steps = 0
        self.draining: int | None = None  # the rows a drain in progress stops at
        self.recent: dict[tuple[str, str], list[float]] = {}
        self.unread: list[torch.Tensor] = []  # one (replacements,) loss vector per step not yet read

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
        losses = [trainer.step(*rows[block]) for (block, _), trainer in self.trainers.items()]
        device = losses[0].device  # blocks on several devices: one vector (stack promotes mixed dtypes)
        self.unread.append(torch.stack([loss.to(device) for loss in losses]))
        self.steps += 1

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


def _terms_of(module: nn.Module, losses: tuple[Loss, ...], name: str) -> tuple[Loss, ...]:
    """The run's loss terms and the ones ``module`` adds in its ``distillation_losses`` attribute."""
    own = getattr(module, "distillation_losses", ())
    own = tuple(own) if isinstance(own, (tuple, list)) else own
    if not isinstance(own, tuple) or not all(isinstance(term, Loss) for term in own):
        raise TypeError(f"distillation_losses of {name} must be a tuple of Loss terms, got {own!r:.80}")
    names = [term.name for term in losses]
    terms = losses + tuple(term for term in own if term.name not in names)
    for term in terms:
        if (term.needs_code or term.needs_preactivations) and code_module(module) is None:
            raise TypeError(
                f"the loss term {term.name!r} needs the sparse code of {name} ({type(module).__name__}), which "
                "exposes none: give it a `code_module` attribute"
            )
    return terms


def _save(state: Mapping[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` atomically (a crash leaves the previous checkpoint)."""
    temporary = path.with_name(path.name + ".tmp")
    torch.save(dict(state), temporary)
    os.replace(temporary, path)


def distill(
    model: nn.Module,
    batches: Iterable[Batch],
    replacements: Mapping[str, Factory],
    *,
    mlps: str | Callable[[str, nn.Module], bool] = r"mlp$",
    tokens: int,
    batch_size: int = 256,
    buffer_tokens: int = 16_384,
    recipe: str = "mxd-paper",
    lr: float | None = None,
    loss: str | Loss | Sequence[str | Loss] = "normalised-mse",
    l1: float = 0.0,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    seed: int = 0,
    mask_argument: str | None = "attention_mask",
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 100,
    resume: bool = False,
    run_config: Mapping[str, Any] | None = None,
    progress: bool = True,
    stop: Callable[[], bool] | None = None,
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
    recipe : {"mxd-paper", "plain"}, optional
        How every replacement is optimised (see [`RECIPES`][mumoe_tn.distillation.training]):
        ``"mxd-paper"`` (default), the Mixture of Decoders authors' — AdamW without weight decay at
        4e-4, constant after a linear warm-up over the first 4.27 % of the steps (their 5,000 of
        117,188) — or ``"plain"``, Adam at 1e-3 without warm-up. The replacements' own
        initialisation is their factory's (see ``recipe=`` of
        [`mumoe_factory`][mumoe_tn.distillation.replacements.mumoe_factory]).
    lr : float, optional
        The learning rate (default the recipe's).
    loss : str or Loss or Sequence, optional
        The loss terms, summed: registered names or [`Loss`][mumoe_tn.distillation.losses.Loss]
        instances (see [`mumoe_tn.distillation.losses`][mumoe_tn.distillation.losses]; default
        ``"normalised-mse"``, the paper's). A replacement adds its own terms in a
        ``distillation_losses`` attribute (the auxiliary-k term of a μMoE block with a top-k gate).
    l1 : float, optional
        Weight ``λ`` of the L1 penalty on the sparse code, the ``"l1"`` term (default 0: the
        replacement's own sparsity).
    optimizer : Callable, optional
        ``optimizer(parameters)`` builds the optimiser of each replacement (default the recipe's
        with ``lr``); the recipe's warm-up still applies.
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
        Continue from ``checkpoint`` if it exists. Its configuration must match this call's — the
        blocks, methods, ``tokens``, ``batch_size``, ``buffer_tokens``, ``seed``, ``recipe``,
        ``lr``, the loss terms, ``run_config`` and the shapes of every replacement's tensors — or a
        ValueError names the fields that differ.
    run_config : Mapping, optional
        Plain data (JSON-like) on what else the run depends on — the model, the factories'
        settings — stored in the checkpoint and compared on resume.
    progress : bool, optional
        Show a tqdm bar of trained tokens with tokens/s and each method's loss (mean over blocks; read
        every ``LOSS_READ_EVERY`` steps).
    stop : Callable[[], bool], optional
        Asked after every optimiser step and before every batch is read: once it returns True the
        run writes ``checkpoint`` (if given) and raises
        [`DistillationStopped`][mumoe_tn.distillation.interruption.DistillationStopped]; resume from
        it with ``resume=True``. [`StopOnSignals`][mumoe_tn.distillation.interruption.StopOnSignals]
        stops on SIGINT / SIGTERM.

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
    [`unit_norm_parameters`][mumoe_tn.distillation.training.unit_norm_parameters]): they are
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
    methods = _check_methods(replacements)
    tokens, batch_size = check_size("tokens", tokens), check_size("batch_size", batch_size)
    capacity, checkpoint_every = (
        check_size("buffer_tokens", buffer_tokens),
        check_size("checkpoint_every", checkpoint_every),
    )
    if capacity < batch_size:
        raise ValueError(f"buffer_tokens must hold at least one step of batch_size={batch_size}, got {capacity}")
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    training = RECIPES[recipe]
    lr = training.lr if lr is None else check_positive_float("lr", lr)
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
        "tokens": tokens, "batch_size": batch_size, "buffer_tokens": capacity, "seed": seed, "recipe": recipe,
        "lr": lr, "loss": [term.config() for term in terms],
    }  # fmt: skip
    if world is not None:
        config["processes"] = {"rank": world[0], "world_size": world[1]}
        path = None if path is None else process_checkpoint(path, world)
    with outcomes_shared(world, checkpoint=path, tokens=tokens, trained=lambda: 0):  # no process left waiting
        run = _Run(own, methods, seed=seed, lr=lr, recipe=training, steps=tokens // batch_size, losses=terms,
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
                bar.set_postfix({method: f"{value:.3g}" for method, value in loss.items()}, refresh=False)
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
    counters = [{"tokens": run.trained, "steps": run.steps, "peak_buffer_rows": run.buffer.peak_rows,
                 "buffer_bytes": run.buffer.allocated_bytes, "batches": digest.value}]  # fmt: skip
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
    return Distillation(blocks, replacements, run.trained, run.steps, losses_of, peak, allocated)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
