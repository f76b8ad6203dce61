"""A conversion record held against what it is replayed on: the model's paths and forward, the checkpoint's shapes.

[`replay_conversion`][mumoe_tn.conversion.persistence.replay.replay_conversion] calls these before anything
is built:

- [`check_nested_paths`][mumoe_tn.conversion.persistence.record_checks.check_nested_paths]: no recorded path
  lies inside another (a record replacing ``0`` and ``0.fc1`` would replace a module it has
  already removed);
- [`check_mask_argument`][mumoe_tn.conversion.persistence.record_checks.check_mask_argument]: the recorded
  mask argument is an optional argument of ``forward`` (as ``attention_mask`` is), so it is never
  the model's input;
- [`checkpoint_shapes`][mumoe_tn.conversion.persistence.record_checks.checkpoint_shapes]: the ``shapes=``
  a record is held against are dense tensors that store their elements, or shapes of
  non-negative ints, at most [`MAX_CHECKPOINT_TENSORS`][mumoe_tn.conversion.persistence.bounds.MAX_CHECKPOINT_TENSORS].

Each refusal is a ``ValueError`` (a ``TypeError`` for an argument of the wrong type) naming the
field and quoting the value, shortened.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.persistence.storage import check_stored, check_tensor_count

__all__ = ["check_mask_argument", "check_nested_paths", "checkpoint_shapes"]


def check_nested_paths(paths: Iterable[tuple[str, int]]) -> None:
    """Refuse a record whose recorded paths nest: ``(path, module number)`` pairs, every path once.

    Raises
    ------
    ValueError
        If a path lies inside another (``0.fc1`` inside ``0``), naming both modules.
    """
    owners = dict(paths)
    for path, number in owners.items():
        parts = path.split(".")
        for depth in range(1, len(parts)):
            outer = ".".join(parts[:depth])
            if outer in owners:
                raise ValueError(
                    f"conversion record: record.modules[{number}].paths = {path!r:.200} is invalid: it lies inside "
                    f"{outer!r:.200}, which record.modules[{owners[outer]}] replaces (a record replaces modules "
                    "that do not contain one another)"
                )


def check_mask_argument(model: nn.Module, argument: str | None) -> None:
    """Refuse a recorded mask argument that is not an optional argument of ``model.forward``.

    The mask hook hands that argument to the μMoE layers on every call: the model's input (a
    required argument) would be read as a token mask, and every forward would fail.

    Raises
    ------
    ValueError
        If ``forward`` has no such argument, or it has no default.
    """
    if argument is None:
        return
    try:
        parameter = inspect.signature(model.forward).parameters.get(argument)
    except (TypeError, ValueError):
        parameter = None
    name = type(model).__name__
    if parameter is None:
        raise ValueError(
            f"the conversion record hands the argument {argument!r:.80} of forward to the μMoE layers, but "
            f"{name}.forward has none"
        )
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if parameter.default is inspect.Parameter.empty or parameter.kind not in named:
        raise ValueError(
            f"conversion record: record.mask_argument = {argument!r:.80} is invalid: {name}.forward's {argument!r:.80} "
            "is not an optional argument (a token mask is one, as attention_mask is; a required argument is the "
            "model's input)"
        )


def checkpoint_shapes(shapes: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of ``shapes`` (tensors, or shapes as sequences of ints), each checked.

    Raises
    ------
    TypeError
        If ``shapes`` is not a mapping.
    ValueError
        If it has more than ``MAX_CHECKPOINT_TENSORS`` entries, a tensor is not dense or does not
        store its elements (see [`check_stored`][mumoe_tn.conversion.persistence.storage.check_stored]), or a
        value is neither a tensor nor a shape of non-negative ints.
    """
    if not isinstance(shapes, Mapping):
        raise TypeError(f"shapes must be a mapping of state-dict key -> tensor or shape, got {type(shapes).__name__}")
    check_tensor_count(len(shapes), "shapes")
    sized = {}
    for key, value in shapes.items():
        if isinstance(value, torch.Tensor):
            check_stored(str(key), value, "shapes")
            sized[key] = tuple(value.shape)
            continue
        sized[key] = _shape(key, value)
    return sized


def _shape(key: object, value: object) -> tuple[int, ...]:
    shape = getattr(value, "shape", value)
    if isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
        try:
            sizes = tuple(operator.index(size) for size in shape if not isinstance(size, bool))
        except TypeError:
            sizes = None
        if sizes is not None and len(sizes) == len(shape) and all(size >= 0 for size in sizes):
            return sizes
    raise ValueError(
        f"shapes[{str(key)[:200]!r}] = {value!r:.80} is invalid: give a tensor or a shape (a sequence of "
        "non-negative ints)"
    )
