"""The options of one distillation run, as one documented object.

[`distill`][mumoe_tn.distillation.training.distill] takes them as
``options=DistillOptions(...)`` or as keywords (``tokens=…, batch_size=…``), the same names,
one form or the other: keywords given beside ``options=`` are refused with a ``TypeError`` that
names them (change an options object with ``dataclasses.replace(options, batch_size=512)``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mumoe_tn.distillation.losses import Loss

__all__ = ["DistillOptions", "distill_options"]


@dataclass(frozen=True)
class DistillOptions:
    """How [`distill`][mumoe_tn.distillation.training.distill] trains: every option but the model, text and factories.

    Each is checked by ``distill`` before any work, with an error naming it.

    Attributes
    ----------
    tokens : int
        Tokens to train on (whole steps of ``batch_size``); the one option without a default.
    mlps : str or Callable
        The blocks (see [`select_blocks`][mumoe_tn.distillation.streaming.select_blocks]; default
        ``r"mlp$"``).
    batch_size : int
        Tokens per optimiser step (default 256).
    buffer_tokens : int
        Capacity of the activation buffer in tokens (default 16,384); must hold one batch.
    recipe : str or Mapping[str, str]
        How every replacement is optimised, a name of
        [`RECIPES`][mumoe_tn.distillation.trainer.RECIPES]: ``"mxd-paper"`` (default), the Mixture
        of Decoders authors' — AdamW without weight decay at 4e-4, constant after a linear warm-up
        over the first 4.27 % of the steps (their 5,000 of 117,188) — ``"plain"``, Adam at 1e-3
        without warm-up, or another; or a mapping of every method name to its recipe's name. The
        replacements' own initialisation is their factory's (see ``recipe=`` of
        [`mumoe_factory`][mumoe_tn.distillation.replacements.mumoe_factory] and
        [`transcoder_factory`][mumoe_tn.distillation.replacements.transcoder_factory]).
    lr : float or None
        The learning rate (default the recipe's).
    loss : str or Loss or Sequence
        The loss terms, summed: registered names or [`Loss`][mumoe_tn.distillation.losses.Loss]
        instances (see [`mumoe_tn.distillation.losses`][mumoe_tn.distillation.losses]; default
        ``"normalised-mse"``, the paper's). A replacement adds its own terms in a
        ``distillation_losses`` attribute (the auxiliary-k term of a μMoE block with a top-k gate).
    l1 : float
        Weight ``λ`` of the L1 penalty on the sparse code, the ``"l1"`` term (default 0: the
        replacement's own sparsity).
    optimizer : Callable or None
        ``optimizer(parameters)`` builds the optimiser of each replacement (default the recipe's
        with ``lr``); the recipe's warm-up still applies.
    seed : int
        Seeds the replacements' initialisation (each from the seed and its block and method
        names) and the buffer's shuffling; the global RNG is left as it was (default 0).
    mask_argument : str or None
        The key of a mapping batch that marks real tokens (default ``"attention_mask"``).
    checkpoint : path or None
        Save the run's state here every ``checkpoint_every`` steps and at the end.
    checkpoint_every : int
        Steps between checkpoints (default 100).
    resume : bool
        Continue from ``checkpoint`` if it exists. Its configuration must match this run's — the
        blocks, methods, ``tokens``, ``batch_size``, ``buffer_tokens``, ``seed``, ``recipe``,
        ``lr``, the loss terms, ``run_config`` and the shapes of every replacement's tensors — or a
        ValueError names the fields that differ.
    run_config : Mapping or None
        Plain data (JSON-like) on what else the run depends on — the model, the factories'
        settings — stored in the checkpoint and compared on resume.
    progress : bool
        Show a tqdm bar of trained tokens with tokens/s and each method's loss (mean over blocks;
        read every ``LOSS_READ_EVERY`` steps; default True).
    stop : Callable or None
        Asked after every optimiser step and before every batch is read: once it returns True the
        run writes ``checkpoint`` (if given) and raises
        [`DistillationStopped`][mumoe_tn.distillation.interruption.DistillationStopped]; resume from
        it with ``resume=True``. [`StopOnSignals`][mumoe_tn.distillation.interruption.StopOnSignals]
        stops on SIGINT / SIGTERM.

    Examples
    --------
    >>> import dataclasses
    >>> options = DistillOptions(tokens=4096, batch_size=128, progress=False)
    >>> dataclasses.replace(options, seed=1).seed
    1
    """

    tokens: int
    mlps: str | Callable[[str, nn.Module], bool] = r"mlp$"
    batch_size: int = 256
    buffer_tokens: int = 16_384
    recipe: str | Mapping[str, str] = "mxd-paper"
    lr: float | None = None
    loss: str | Loss | Sequence[str | Loss] = "normalised-mse"
    l1: float = 0.0
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    seed: int = 0
    mask_argument: str | None = "attention_mask"
    checkpoint: str | os.PathLike | None = None
    checkpoint_every: int = 100
    resume: bool = False
    run_config: Mapping[str, Any] | None = None
    progress: bool = True
    stop: Callable[[], bool] | None = None


_NAMES = tuple(field.name for field in dataclasses.fields(DistillOptions))


def distill_options(options: DistillOptions | None, keywords: Mapping[str, Any]) -> DistillOptions:
    """The options of a ``distill`` call given as ``options=`` or as keywords, never both.

    Parameters
    ----------
    options : DistillOptions or None
        The object form.
    keywords : Mapping
        The keyword form (the names of ``DistillOptions``' attributes).

    Returns
    -------
    DistillOptions

    Raises
    ------
    TypeError
        ``options`` of another type, an unknown keyword, keywords beside ``options=``, or no
        ``tokens`` (each named).
    """
    unknown = sorted(name for name in keywords if name not in _NAMES)
    if unknown:
        raise TypeError(f"distill() got unknown options {unknown}; its options are {list(_NAMES)}")
    if options is not None:
        if not isinstance(options, DistillOptions):
            raise TypeError(f"options must be a DistillOptions, got {type(options).__name__}")
        if keywords:
            raise TypeError(
                f"distill() takes its options as options= or as keywords, not both: got options= and "
                f"{sorted(keywords)}; set them in the options (dataclasses.replace(options, ...))"
            )
        return options
    if "tokens" not in keywords:
        raise TypeError("distill() needs tokens= (the tokens to train on), or options=DistillOptions(tokens=...)")
    return DistillOptions(**keywords)
