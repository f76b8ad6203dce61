"""Argument checks shared by every module (torch-free).

Each check raises the library's own ``TypeError`` or ``ValueError`` naming the argument and
quoting the value, before any work is done.
"""

from __future__ import annotations

import math

__all__ = ["check_bool", "check_positive_float", "check_size"]


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
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a positive int, got {value!r} ({type(value).__name__})")
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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite number {bound}, got {value!r}")
    return value
