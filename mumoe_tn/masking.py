"""Which tokens of a batch are real: the mask that keeps padding out of gate statistics, losses and records.

The convention is Hugging Face's ``attention_mask``: ``True`` (or 1) marks a real token, ``False``
(or 0) padding, with one entry per token — the input's shape without its feature dimension. A
layer takes it directly (``layer(x, mask=mask)``), or from the enclosing context::

    with token_mask(attention_mask):
        loss = model(input_ids, attention_mask=attention_mask).loss

and a model converted by [`convert`][mumoe_tn.conversion.convert.convert] whose ``forward`` takes an
``attention_mask`` sets that context itself on every call. With a mask, BatchNorm gate statistics
(and their running averages), the balance and z losses, the coefficient records and the analysis
tools use the real tokens only; outputs at padding positions are finite but otherwise arbitrary.
A mask in which every token is real changes nothing (the unmasked path runs).

Under ``torch.compile`` only an explicit ``mask=`` reaches a layer: compiled code cannot read the
context, so a compiled model trained on padded batches passes the mask to its μMoE layers itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any

import torch
from torch import nn

__all__ = ["accepts_argument", "current_token_mask", "install_mask_hook", "resolve_token_mask", "token_mask"]

_CURRENT: ContextVar[torch.Tensor | None] = ContextVar("mumoe_token_mask", default=None)

#: Where a model with a mask hook keeps the context tokens of its calls in progress (re-entrant calls nest).
_TOKENS = "_mumoe_token_mask_tokens"


def _checked(mask: object) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return mask if mask.dtype == torch.bool else mask != 0  # checked values need data: checked eagerly
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"a token mask must be a tensor (True/1 = real token, as Hugging Face's attention_mask), got "
            f"{type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            bad = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
            raise ValueError(f"a token mask holds True/False or 1/0 (1 = real token), got values such as {bad}")
        mask = mask != 0
    return mask


@contextmanager
def token_mask(mask: torch.Tensor | None) -> Iterator[None]:
    """Hand ``mask`` to every μMoE layer called inside the block (this thread or task only).

    Parameters
    ----------
    mask : torch.Tensor or None
        ``True``/1 = real token, one entry per token (e.g. ``attention_mask``); None clears an
        enclosing mask.
    """
    token = _CURRENT.set(None if mask is None else _checked(mask))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_token_mask() -> torch.Tensor | None:
    """The mask of the innermost [`token_mask`][mumoe_tn.masking.token_mask] context, or None."""
    return _CURRENT.get()


def resolve_token_mask(mask: torch.Tensor | None, lead: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The mask for a layer input with token dimensions ``lead``: flat ``(∏lead,)`` booleans, or None.

    An explicit ``mask`` must have shape ``lead``. Without one, the context's mask is used: of
    shape ``lead``, or — for cached generation, where a model's ``attention_mask`` spans the past
    tokens too — its last ``lead[-1]`` columns. None when every token is real.

    Raises
    ------
    ValueError
        If the mask's shape does not match the tokens.
    """
    explicit = mask is not None
    compiling = torch.compiler.is_compiling()
    if compiling and not explicit:
        return None  # torch.compile cannot read a context variable: compiled code takes mask= only
    mask = _checked(mask) if explicit else _CURRENT.get()
    if mask is None:
        return None
    shape = tuple(mask.shape)
    if shape != lead:
        trailing = not explicit and len(shape) == len(lead) >= 2 and shape[:-1] == lead[:-1] and shape[-1] > lead[-1]
        if not trailing:
            where = "" if explicit else " (from the token_mask context or the model's attention_mask)"
            raise ValueError(
                f"the token mask{where} has shape {shape}, but the input has tokens of shape {lead}: give one "
                "entry per token (True/1 = real token)"
            )
        mask = mask[..., -lead[-1] :]
    flat = mask.reshape(-1).to(device)
    return flat if compiling or not bool(flat.all()) else None


def _enter(module: nn.Module, args: tuple, kwargs: dict, *, argument: str) -> None:
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError:
        bound = None
    mask = None if bound is None else bound.arguments.get(argument)
    if mask is not None and not isinstance(mask, torch.Tensor):
        mask = None  # not a per-token mask (e.g. a model that takes its own mask object): leave it
    module.__dict__.setdefault(_TOKENS, []).append(_CURRENT.set(None if mask is None else _checked(mask)))


def _exit(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    tokens: list[Token] = module.__dict__.get(_TOKENS, [])
    if tokens:
        _CURRENT.reset(tokens.pop())


def accepts_argument(model: nn.Module, argument: str) -> bool:
    """Whether ``model.forward`` takes a parameter named ``argument``."""
    try:
        return argument in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def install_mask_hook(model: nn.Module, argument: str) -> None:
    """Make every call of ``model`` hand its ``argument`` (e.g. ``attention_mask``) to the μMoE layers inside.

    A forward pre-hook opens a [`token_mask`][mumoe_tn.masking.token_mask] context with the
    call's argument (positional or keyword) and a forward hook that always runs closes it. Installed
    once per model; the hooks are module-level functions, so the model still pickles and deep-copies.
    """
    from functools import partial

    if model.__dict__.get("_mumoe_mask_argument") == argument:
        return
    model.register_forward_pre_hook(partial(_enter, argument=argument), with_kwargs=True)
    model.register_forward_hook(_exit, with_kwargs=True, always_call=True)
    model.__dict__["_mumoe_mask_argument"] = argument
