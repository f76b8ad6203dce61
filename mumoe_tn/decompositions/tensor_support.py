"""Tensor helpers for the formats' methods: lazy tensorly-torch access, padding (torch-free at import)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["load_tltorch", "parameter_copy", "zero_pad"]


def load_tltorch() -> ModuleType:
    """Import tltorch, restoring the tensorly backend its import sets globally."""
    import tensorly as tl

    previous = tl.get_backend()
    import tltorch

    tl.set_backend(previous)
    return tltorch


def parameter_copy(tensor: Any) -> Any:
    """A detached copy of ``tensor`` as a new ``torch.nn.Parameter``."""
    from torch import nn

    return nn.Parameter(tensor.detach().clone())


def zero_pad(tensor: Any, shape: tuple[int, ...]) -> Any:
    """``tensor`` placed in the leading corner of a new zero tensor of ``shape``.

    tensorly clips ranks to what a tensor's unfoldings allow; padding with zeros gives cores
    of the network's shape that represent the same tensor.
    """
    if len(shape) != tensor.ndim or any(have > want for have, want in zip(tensor.shape, shape, strict=True)):
        raise ValueError(f"cannot pad a tensor of shape {tuple(tensor.shape)} to {shape}")
    padded = tensor.new_zeros(shape)
    padded[tuple(slice(0, size) for size in tensor.shape)] = tensor
    return padded
