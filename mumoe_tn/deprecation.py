"""Old import paths kept for one release: modules and names that moved in the 0.3 layout.

A moved module leaves a stub at its old path whose attributes forward, with a
`DeprecationWarning` naming the new path, to the module that now holds them; a package that
re-exported a moved name does the same for that name. The table of old and new paths is in
``CHANGELOG.md``.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["callable_module", "moved_module", "moved_names"]

#: The release that removes the old paths.
REMOVED_IN = "0.4"


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn, at the user's line that asked for ``old``, that it moved to ``new``."""
    warnings.warn(
        f"{old} moved to {new}; the old path is removed in mumoe_tn {REMOVED_IN}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def moved_module(
    old: str, new: str, elsewhere: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a module that moved from ``old`` to ``new``.

    Parameters
    ----------
    old, new : str
        Dotted module paths.
    elsewhere : Mapping[str, str], optional
        Names of the old module that went to another module or took a new name, each with its new
        place as ``"module"`` or ``"module:new_name"``.

    Returns
    -------
    tuple
        ``(__getattr__, __dir__)`` to assign at the old module's top level.
    """
    elsewhere = dict(elsewhere or {})

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        if name in elsewhere:
            return _forward(old, name, elsewhere[name])
        value = getattr(importlib.import_module(new), name, _MISSING)
        if value is _MISSING:
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {new!r})")
        _warn(f"{old}.{name}", f"{new}.{name}")
        return value

    def __dir__() -> list[str]:
        return sorted({*getattr(importlib.import_module(new), "__all__", ()), *elsewhere})

    return __getattr__, __dir__


def moved_names(
    package: str, names: Mapping[str, str], fallback: Callable[[str], Any] | None = None
) -> Callable[[str], Any]:
    """``__getattr__`` for a module or package whose ``names`` moved to other modules or were renamed.

    Parameters
    ----------
    package : str
        The module's or package's dotted path.
    names : Mapping[str, str]
        Each moved or renamed name and its new place: ``"module"`` (same name) or
        ``"module:new_name"``.
    fallback : callable, optional
        The package's own ``__getattr__`` for every other name.

    Returns
    -------
    callable
        The package's ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            return _forward(package, name, names[name])
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def _forward(old: str, name: str, place: str) -> Any:
    """Warn that ``old.name`` moved to ``place`` (``"module"`` or ``"module:new_name"``) and return it there."""
    module, _, new_name = place.partition(":")
    _warn(f"{old}.{name}", f"{module}.{new_name or name}", stacklevel=4)
    return getattr(importlib.import_module(module), new_name or name)


_MISSING = object()


def callable_module(old: str, new: str, name: str) -> None:
    """Make the moved module ``old`` callable as the function ``new.name`` that shares its name.

    A package that re-exported a function of the same name as one of its modules (``distill`` of
    ``mumoe_tn.conversion``) loses the function to the module's stub once the stub is imported:
    ``from package import name`` then returns the stub. A callable stub keeps both spellings
    working for one release; a call warns and runs the function.

    Parameters
    ----------
    old : str
        The stub module's dotted path (its ``__name__``).
    new, name : str
        The module that holds the function now, and the function's name.
    """

    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            _warn(f"{old}(…)", f"{new}.{name}(…)")
            return getattr(importlib.import_module(new), name)(*args, **kwargs)

    sys.modules[old].__class__ = _CallableModule
