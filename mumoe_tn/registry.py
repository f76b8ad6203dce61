"""One registration idiom for every extension point of the library (torch-free).

Formats, gate classes, gate activations, logit norms, layer adapters and gated-MLP layouts are
each held in a [`Registry`][mumoe_tn.registry.Registry]: a read-only mapping from a name to what
was registered, written only through [`register`][mumoe_tn.registry.Registry.register] (a call, or a
decorator) and [`unregister`][mumoe_tn.registry.Registry.unregister]. A look-up of an unknown name
([`lookup`][mumoe_tn.registry.Registry.lookup]) raises the library's ``ValueError`` listing the
registered names. A name already taken by another entry raises ``ValueError`` at every front door
unless it is given ``replace=True`` (a keyword of each registering function, and of the class
statement where subclassing registers). Each registry is reached by the package that owns it:

| what | registry | front door |
|---|---|---|
| decomposition formats | `mumoe_tn.decompositions.registry.FORMATS` | ``class F(Format, name=…)``, `register` |
| gate descriptor classes | `mumoe_tn.gates.registry.GATES` | ``@register_gate`` |
| gate activations φ | `mumoe_tn.gates.modules.ACTIVATIONS` | ``ACTIVATIONS.register(name, fn)`` |
| logit norms | `mumoe_tn.gates.modules.GATE_NORMS` | ``GATE_NORMS.register(name, factory)`` |
| layer adapters | `mumoe_tn.conversion.surgery.adapters.ADAPTERS` | `register_adapter` |
| gated-MLP child names | `mumoe_tn.conversion.surgery.blocks.GATED_LAYOUTS` | `register_gated_names` |
| distillation loss terms | `mumoe_tn.distillation.losses.LOSSES` | ``class L(Loss, name=…)``, `register_loss` |
| distillation metrics | `mumoe_tn.distillation.metrics.METRICS` | ``class M(Metric, name=…)``, `register_metric` |
| distillation methods | `mumoe_tn.distillation.methods.METHODS` | `register_method` |
| MLP block kinds (a format's ``mlp_block``) | `mumoe_tn.layers.mlp_blocks.MLP_BLOCKS` | `register_mlp_block` |
| replaced module kinds | `mumoe_tn.conversion.surgery.block_kinds.BLOCK_KINDS` | ``BLOCK_KINDS.register(name, kind)`` |

Examples
--------
>>> from mumoe_tn.registry import Registry
>>> colours = Registry("colour")
>>> @colours.register("red")
... def red():
...     return "#f00"
>>> colours["red"]()
'#f00'
>>> colours.lookup("blue")
Traceback (most recent call last):
...
ValueError: unknown colour 'blue'; registered: ['red']
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["Registry"]

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")

_UNSET: Any = object()


class Registry(Mapping[Key, Value], Generic[Key, Value]):
    """A named table of extensions: read like a mapping, written through `register`.

    Parameters
    ----------
    kind : str
        What the entries are, for messages (``"format"``, ``"gate activation"``).
    normalise : callable, optional
        Maps a key to its stored form (e.g. ``str.lower`` for case-insensitive names).
    check : callable, optional
        Called with ``(key, value)`` before an entry is stored; raises on a bad entry.
    entries : Mapping, optional
        The entries the library ships.
    """

    def __init__(
        self,
        kind: str,
        *,
        normalise: Callable[[Any], Key] | None = None,
        check: Callable[[Key, Value], None] | None = None,
        entries: Mapping[Key, Value] | None = None,
    ) -> None:
        self.kind = kind
        self._normalise = normalise
        self._check = check
        self._entries: dict[Key, Value] = {}
        for key, value in (entries or {}).items():
            self.register(key, value)

    def _key(self, key: Any) -> Key:
        return self._normalise(key) if self._normalise is not None else key

    def register(self, key: Any, value: Value = _UNSET, *, replace: bool = False) -> Any:
        """Store ``value`` under ``key``; without ``value``, a decorator that stores what it decorates.

        Parameters
        ----------
        key : hashable
            The name (normalised as the registry says).
        value : optional
            What to register; omit it to use ``register(key)`` as a decorator.
        replace : bool, optional
            Replace an entry already registered under ``key`` (default: raise).

        Returns
        -------
        object
            ``value`` (or the decorator).

        Raises
        ------
        ValueError
            If ``key`` is taken by another entry and ``replace`` is False.
        """
        if value is _UNSET:

            def decorate(target: Value) -> Value:
                self.register(key, target, replace=replace)
                return target

            return decorate
        stored = self._key(key)
        if self._check is not None:
            self._check(stored, value)
        known = self._entries.get(stored, _UNSET)
        if known is not _UNSET and known is not value and not replace:
            raise ValueError(f"a {self.kind} is already registered as {stored!r} ({known!r}); pass replace=True")
        self._entries[stored] = value
        return value

    def register_subclass(self, cls: Any, base: type, *, name: str | None = None, replace: bool = False) -> Any:
        """Register the subclass ``cls`` of ``base`` under ``name`` (default its ``name`` attribute).

        The idiom of classes that register themselves when subclassed with ``name=`` (losses,
        metrics): the name is checked, normalised and written back to ``cls.name``.

        Raises
        ------
        TypeError
            If ``cls`` is not a subclass of ``base``.
        ValueError
            If the name is empty, or taken and ``replace`` is False.
        """
        if not isinstance(cls, type) or not issubclass(cls, base):
            raise TypeError(f"register_{self.kind}() takes a subclass of {base.__name__}, got {cls!r}")
        given = getattr(cls, "name", None) if name is None else name
        if not isinstance(given, str) or not given.strip():
            raise ValueError(f"a {self.kind} needs a non-empty name, got {given!r}")
        self.register(given, cls, replace=replace)
        cls.name = self._key(given)
        return cls

    def unregister(self, key: Any) -> None:
        """Remove the entry under ``key``; a key never registered is ignored."""
        self._entries.pop(self._key(key), None)

    def lookup(self, key: Any) -> Value:
        """The entry under ``key``, or a ValueError naming the key and listing the registered names."""
        try:
            return self._entries[self._key(key)]
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f"unknown {self.kind} {key!r}; registered: {self.names()}") from None

    def names(self) -> list[Any]:
        """The registered keys, sorted where they sort (else in registration order)."""
        try:
            return sorted(self._entries)
        except TypeError:
            return list(self._entries)

    def __getitem__(self, key: Any) -> Value:
        return self._entries[self._key(key)]

    def __contains__(self, key: object) -> bool:
        try:
            return self._key(key) in self._entries
        except (TypeError, AttributeError):
            return False

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __setitem__(self, key: Any, value: Value) -> None:
        raise TypeError(
            f"the {self.kind} registry is written through register(): use .register({key!r}, value) "
            "(replace=True to replace an entry)"
        )

    def __repr__(self) -> str:
        return f"<{self.kind} registry: {self.names()}>"
