"""Argument checks shared by every module of the library (torch-free).

Each check raises the library's own ``TypeError`` (the value is of the wrong kind) or
``ValueError`` (the right kind, a bad value) naming the argument and quoting the value, before
any work is done: bad input never surfaces as a traceback from inside torch (an ``IndexError``
in a hook, a ``NaN`` result, a forward pass that fails later). This module is the library's one
home for such checks. It never imports torch: a tensor or module can only have been made by a
torch already imported, so the checks read torch from ``sys.modules``.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "check_bool",
    "check_callable",
    "check_inside",
    "check_instance",
    "check_int",
    "check_model",
    "check_positive_float",
    "check_real",
    "check_size",
    "check_tensor",
]


def _number(name: str, value: object, kind: type | tuple[type, ...], described: str) -> Any:
    """``value`` if it is a ``kind`` other than a bool; a TypeError saying it must be ``described`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {described}, got {value!r} ({type(value).__name__})")
    return value


def _at_least(name: str, value: float, minimum: float | None) -> Any:
    """``value`` unless it is below ``minimum`` (a ValueError then; None: no bound)."""
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_size(what: str, value: object) -> int:
    """Return ``value`` if it is a positive int (not a bool).

    Parameters
    ----------
    what : str
        The argument's name, quoted in the error.
    value : object
        The value to check.

    Returns
    -------
    int

    Raises
    ------
    TypeError
        If ``value`` is not an int, or is a bool.
    ValueError
        If ``value`` is not positive.
    """
    value = _number(what, value, int, "a positive int")
    if value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value}")
    return value


def check_bool(what: str, value: object) -> bool:
    """Return ``value`` if it is a bool; raise ``TypeError`` naming ``what`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_positive_float(what: str, value: object, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float if it is a finite real number above 0 (or 0 with ``allow_zero``).

    Parameters
    ----------
    what : str
        The argument's name, quoted in the error.
    value : object
        The value to check.
    allow_zero : bool, optional
        Accept 0.

    Returns
    -------
    float
    """
    value = float(_number(what, value, (int, float), "a real number"))
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite number {bound}, got {value!r}")
    return value


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as an int: an integral number (not a bool) of at least ``minimum``.

    Raises
    ------
    TypeError
        If ``value`` is a bool or not an integral number.
    ValueError
        If ``value < minimum``.
    """
    return _at_least(name, int(_number(name, value, numbers.Integral, "an int")), minimum)


def check_real(name: str, value: object, *, minimum: float | None = None) -> float:
    """``value`` as a finite float (an int or float, not a bool), at least ``minimum``.

    Raises
    ------
    TypeError
        If ``value`` is a bool or not a real number.
    ValueError
        If ``value`` is NaN or infinite, or below ``minimum``.
    """
    value = float(_number(name, value, numbers.Real, "a real number"))
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return _at_least(name, value, minimum)


def check_callable(name: str, value: object) -> Callable | None:
    """``value`` as a callable or None (TypeError otherwise)."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    return value


def check_instance(name: str, value: object, cls: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is an instance of ``cls``; a TypeError saying it must be ``what`` otherwise."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def _torch() -> Any:
    return sys.modules.get("torch")


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int | None = None,
    kind: str | None = None,
    finite: bool = False,
    non_empty: bool = False,
) -> Any:
    """``value`` as a tensor with ``ndim`` dims and dtype ``kind`` (``"float"`` real floating, ``"int"`` integer).

    Raises
    ------
    TypeError
        If ``value`` is not a tensor or has the wrong kind of dtype.
    ValueError
        If it has the wrong number of dims, is empty (``non_empty``) or holds NaN/inf (``finite``).
    """
    torch = _torch()
    if torch is None or not isinstance(value, torch.Tensor):
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


def check_model(name: str, value: object) -> Any:
    """``value`` as an ``nn.Module`` (TypeError otherwise)."""
    torch = _torch()
    if torch is None or not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def check_inside(model: Any, layer: Any) -> None:
    """Require ``layer`` to be ``model`` or one of its submodules (else its hooks never fire)."""
    if not any(module is layer for module in model.modules()):
        raise ValueError(
            f"layer {type(layer).__name__} is not inside model {type(model).__name__}: pass a layer from "
            "model.modules() (a copy or another model's layer never runs)"
        )
