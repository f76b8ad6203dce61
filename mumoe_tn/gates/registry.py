"""The allow-list of gate descriptor classes a saved conversion may name (torch-free).

A checkpoint records a layer's gate as data: the descriptor class's qualified name and its
dataclass fields (see [`mumoe_tn.conversion.persistence.record`][mumoe_tn.conversion.persistence.record]). Loading
rebuilds it only from a class registered here, looked up by that name in this table — never by importing
a module or reading an attribute — so a checkpoint cannot make the loader import, construct or run
anything else. The shipped descriptors register themselves where they are defined; a user's own
descriptor registers like a format does:

```python
@register_gate
@dataclass(frozen=True)
class MyGate:
    ...
```

The registry is the only place that maps a recorded class name to a class. It also tells which
registered gates keep a fixed number ``k`` of experts per token ([`top_k_gates`][mumoe_tn.gates.registry.top_k_gates]),
the gates distillation offers: a user's registered top-k gate is offered with the shipped ones.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from mumoe_tn.registry import Registry

__all__ = [
    "GATES",
    "gate_class",
    "gate_class_name",
    "gate_short_name",
    "register_gate",
    "registered_gates",
    "top_k_gates",
    "unregister_gate",
]

#: The registered gate descriptor classes by ``module.QualifiedName`` (a [`Registry`][mumoe_tn.registry.Registry]).
GATES: Registry[str, type] = Registry("gate class")

_Class = TypeVar("_Class", bound=type)

#: What a gate descriptor class provides (see [`GateSpec`][mumoe_tn.gates.specs.GateSpec]).
_METHODS = ("build", "parameter_count", "fma_per_token")


def gate_class_name(cls: type) -> str:
    """The name a record stores for ``cls``: ``module.QualifiedName``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_gate(cls: _Class, *, replace: bool = False) -> _Class:
    """Allow checkpoints to name the gate descriptor class ``cls`` (usable as a class decorator).

    Parameters
    ----------
    cls : type
        A dataclass with ``build``, ``parameter_count`` and ``fma_per_token`` (the
        [`GateSpec`][mumoe_tn.gates.specs.GateSpec] protocol) whose ``__init__`` (and
        ``__post_init__``) only validate and store its fields: a checkpoint may call it with any
        JSON values of those fields.
    replace : bool, optional
        Replace another class registered under the same qualified name (default: raise).

    Returns
    -------
    type
        ``cls``, for use as a decorator.

    Raises
    ------
    TypeError
        If ``cls`` is not a dataclass type with the three methods.
    ValueError
        If another class is registered under its name and ``replace`` is False.
    """
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_gate() takes a dataclass type (a gate descriptor class), got {cls!r}")
    missing = [method for method in _METHODS if not callable(getattr(cls, method, None))]
    if missing:
        raise TypeError(f"the gate descriptor class {cls.__qualname__} lacks {missing} (see mumoe_tn.gates.GateSpec)")
    name = gate_class_name(cls)
    known = GATES.get(name)
    if known is not None and known is not cls and not replace:
        raise ValueError(f"another gate class is registered as {name!r} ({known!r}); pass replace=True")
    return GATES.register(name, cls, replace=True)


def unregister_gate(cls: type) -> None:
    """Remove ``cls`` from the allow-list (e.g. at the end of a test); a class never registered is ignored."""
    name = gate_class_name(cls)
    if GATES.get(name) is cls:
        GATES.unregister(name)


def gate_class(name: str) -> type | None:
    """The registered gate descriptor class recorded as ``name``, or None (nothing is imported)."""
    return GATES.get(name) if isinstance(name, str) else None


def registered_gates() -> list[str]:
    """Sorted qualified names of the registered gate descriptor classes."""
    return GATES.names()


def gate_short_name(cls: type) -> str:
    """A gate class's short name: the ``short_name`` it defines itself, or its class name lower-cased.

    Only the class's own attribute counts: a subclass of ``TopKGate`` is not ``"softmax"`` unless
    it says so.
    """
    short = cls.__dict__.get("short_name")
    return short if isinstance(short, str) and short else cls.__name__.lower()


def top_k_gates() -> dict[str, type]:
    """The registered gate classes that keep ``k`` experts per token, by short name.

    A gate class is a top-k gate when it has a dataclass field ``k`` (experts kept per token, one
    int or one per mode); it is built as ``cls(k=k)``. ``TopKGate`` is ``"softmax"`` and
    ``ReLUTopKGate`` ``"relu"``. Where two classes share a short name, the one registered first
    keeps it (the shipped gates are registered first).

    Returns
    -------
    dict
        Short name → class, sorted by name.
    """
    found: dict[str, type] = {}
    for cls in GATES.values():
        if any(f.name == "k" for f in dataclasses.fields(cls)):
            found.setdefault(gate_short_name(cls), cls)
    return dict(sorted(found.items()))
