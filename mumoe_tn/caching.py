"""Values derived from parameters, kept until one of the parameters changes.

Inference reuses what depends on the weights alone — padded cores, pre-contracted core-only
sub-networks, a gate's projection with its eval-mode norm folded in — instead of recomputing it
on every call. A [`DerivedCache`][mumoe_tn.caching.DerivedCache] holds one such value and the
identity of the tensors it was made from. It is valid while every source tensor is the same
object, at the same storage, with the same version counter. That covers every route by which a
weight changes through PyTorch:

- optimizer steps, ``load_state_dict``, ``copy_``, ``mul_`` and other in-place operations on the
  parameter (each bumps its version counter);
- ``.to()``, ``.half()``, ``.cuda()``, assigning ``param.data`` or a new ``nn.Parameter`` (new
  storage or a new object).

The one route PyTorch itself does not track is an in-place operation on ``param.data``
(``param.data.mul_(2)``): ``.data`` is a view with a version counter of its own, which is why
autograd does not see such edits either. Edit parameters in place under ``torch.no_grad()``
instead, or call ``clear()`` (every μMoE layer's ``clear_inference_cache()``) afterwards.

A cache keeps its source tensors (and their storages) alive while it holds a value, so a new
tensor can never reuse the address of one it remembers. It holds one value at a time, is safe to
share between threads, and is dropped when the module is pickled or deep-copied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

__all__ = ["DerivedCache", "source_key"]

T = TypeVar("T")


def source_key(sources: Sequence[torch.Tensor]) -> tuple | None:
    """What identifies the current values of ``sources``, or None where it cannot be tracked.

    Parameters
    ----------
    sources : Sequence of torch.Tensor
        The tensors a value is derived from.

    Returns
    -------
    tuple or None
        Object identity, storage address and version counter of every source; None for inference
        tensors (made under ``torch.inference_mode``, they have no version counter).
    """
    try:
        return tuple((id(t), t.data_ptr(), t._version) for t in sources)
    except RuntimeError:
        return None


class DerivedCache(Generic[T]):
    """One value derived from some tensors, recomputed only when one of them changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._alive: tuple[torch.Tensor, ...] = ()
        self._value: T | None = None

    def get(self, sources: Sequence[torch.Tensor], make: Callable[[], T]) -> T:
        """The value for the current ``sources``: the cached one, or ``make()`` stored in its place.

        Parameters
        ----------
        sources : Sequence of torch.Tensor
            The tensors the value is derived from.
        make : Callable
            Computes the value from the current sources.

        Returns
        -------
        object
            ``make()``'s result, computed now or on an earlier call with the same sources.
        """
        key = source_key(sources)
        if key is None:
            return make()
        with self._lock:
            if key == self._key:
                return self._value  # type: ignore[return-value]
        value = make()
        with self._lock:
            self._key = key
            # The sources and their storages stay alive: no new tensor can take an address in the key.
            self._alive = tuple(sources) + tuple(t.detach() for t in sources)
            self._value = value
        return value

    def peek(self, sources: Sequence[torch.Tensor]) -> T | None:
        """The cached value if it is valid for ``sources``, else None (computes nothing)."""
        key = source_key(sources)
        with self._lock:
            return self._value if key is not None and key == self._key else None

    def clear(self) -> None:
        """Forget the value (the next ``get`` recomputes it)."""
        with self._lock:
            self._key, self._alive, self._value = None, (), None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def __deepcopy__(self, memo: dict) -> DerivedCache[T]:
        return DerivedCache()
