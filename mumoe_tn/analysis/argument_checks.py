"""Argument checks shared by the analysis tools: each raises the library's own error naming the argument.

Every public analysis function validates its arguments with these before it runs a model,
registers a hook or allocates statistics, so bad input never surfaces as a traceback from
inside torch (an ``IndexError`` in a hook, a ``NaN`` result, a forward pass that fails later).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import nn

from mumoe_tn.layers import MuMoEBase

__all__ = [
    "check_callable",
    "check_inside",
    "check_int",
    "check_layer",
    "check_model",
    "check_real",
    "check_tensor",
]


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as an int: an integral number (not a bool) of at least ``minimum``.

    Raises
    ------
    TypeError
        If ``value`` is a bool or not an integral number.
    ValueError
        If ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_real(name: str, value: object, *, minimum: float | None = None) -> float:
    """``value`` as a finite float (an int or float, not a bool), at least ``minimum``.

    Raises
    ------
    TypeError
        If ``value`` is a bool or not a real number.
    ValueError
        If ``value`` is NaN or infinite, or below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int | None = None,
    kind: str | None = None,
    finite: bool = False,
    non_empty: bool = False,
) -> torch.Tensor:
    """``value`` as a tensor with ``ndim`` dims and dtype ``kind`` (``"float"`` real floating, ``"int"`` integer).

    Raises
    ------
    TypeError
        If ``value`` is not a tensor or has the wrong kind of dtype.
    ValueError
        If it has the wrong number of dims, is empty (``non_empty``) or holds NaN/inf (``finite``).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if kind == "float" and not (value.dtype.is_floating_point and not value.dtype.is_complex):
        raise TypeError(f"{name} must have a real floating dtype, got {value.dtype}")
    if kind == "int" and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if non_empty and value.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(value.shape)})")
    if finite and value.device.type != "meta" and not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} holds NaN or infinite values")
    return value


def check_model(name: str, value: object) -> nn.Module:
    """``value`` as an ``nn.Module`` (TypeError otherwise)."""
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def check_layer(name: str, value: object) -> MuMoEBase:
    """``value`` as a μMoE layer (TypeError otherwise)."""
    if not isinstance(value, MuMoEBase):
        raise TypeError(f"{name} must be a μMoE layer (MuMoE, MuMoEMLP, MuMoEGatedMLP), got {type(value).__name__}")
    return value


def check_inside(model: nn.Module, layer: nn.Module) -> None:
    """Require ``layer`` to be ``model`` or one of its submodules (else its hooks never fire)."""
    if not any(module is layer for module in model.modules()):
        raise ValueError(
            f"layer {type(layer).__name__} is not inside model {type(model).__name__}: pass a layer from "
            "model.modules() (a copy or another model's layer never runs)"
        )


def check_callable(name: str, value: object) -> Callable | None:
    """``value`` as a callable or None (TypeError otherwise)."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    return value
