"""Names a module serves on first access: its ``__getattr__`` imports each from its home then.

A module whose names must not load with it — the torch names of ``mumoe_tn``, ``mumoe_tn.gates``
and ``mumoe_tn.contractions``, the Triton maps of ``mumoe_tn.gates.kernels`` — lists those names
with the module that defines each and sets ``__getattr__ = lazy_getattr(__name__, homes)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each name of ``homes`` from its module.

    Parameters
    ----------
    package : str
        The dotted name of the module served, quoted when a name it does not have is asked for.
    homes : Mapping[str, str]
        The dotted name of the module that defines each lazy name, by name.

    Returns
    -------
    Callable[[str], Any]
        The attribute of that name in its module; an ``AttributeError`` for a name not in
        ``homes``, as for any attribute a module lacks.
    """

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__
