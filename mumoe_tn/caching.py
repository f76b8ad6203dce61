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

- a step of any ``torch.optim`` optimiser, fused ones included: torch's fused kernels
  (``AdamW(fused=True)``, ``SGD(fused=True)``, …) update parameters without bumping their version
  counters, so every key also holds the number of optimiser steps taken in the process (counted
  by a global post-step hook that the first key registers,
  [`optimiser_steps`][mumoe_tn.caching.optimiser_steps]).

The one route PyTorch itself does not track is an in-place operation on ``param.data``
(``param.data.mul_(2)``) outside an optimiser: ``.data`` is a view with a version counter of its
own, which is why autograd does not see such edits either. Edit parameters in place under
``torch.no_grad()`` instead, or call ``clear()`` (every μMoE layer's ``clear_inference_cache()``)
afterwards.

[`module_state`][mumoe_tn.caching.module_state] is the same key for a whole module tree: every
submodule by identity, train/eval flag and forward hooks, every parameter and buffer as above.

A cache keeps its source tensors (and their storages) alive while it holds a value, so a new
tensor can never reuse the address of one it remembers. It holds one value at a time, is safe to
share between threads, and is dropped when the module is pickled or deep-copied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["DerivedCache", "DerivedState", "ModuleState", "module_state", "optimiser_steps", "source_key"]

T = TypeVar("T")


class _StepCounter:
    """Steps of every ``torch.optim`` optimiser in the process, counted once the library first asks."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._handle: Any = None

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.count += 1

    def read(self) -> int:
        if self._handle is None:
            with self._lock:
                if self._handle is None:
                    self._handle = register_optimizer_step_post_hook(self)
        return self.count


_STEPS = _StepCounter()


def optimiser_steps() -> int:
    """Optimiser steps taken in this process since the library first needed to know.

    The first call registers a global ``torch.optim`` post-step hook (nothing is registered at
    import). A derived value made before a step is stale after it even where the step bumped no
    version counter, as torch's fused optimisers do not.

    Returns
    -------
    int
        A count that grows by one with every ``step()`` of any ``torch.optim.Optimizer``.
    """
    return _STEPS.read()


def source_key(sources: Sequence[torch.Tensor]) -> tuple | None:
    """What identifies the current values of ``sources``, or None where it cannot be tracked.

    Parameters
    ----------
    sources : Sequence of torch.Tensor
        The tensors a value is derived from.

    Returns
    -------
    tuple or None
        The optimiser steps taken so far, then object identity, storage address and version
        counter of every source; None for inference tensors (made under
        ``torch.inference_mode``, they have no version counter).
    """
    try:
        return (optimiser_steps(), *((id(t), t.data_ptr(), t._version) for t in sources))
    except RuntimeError:
        return None


class ModuleState(NamedTuple):
    """What identifies the current state of a module tree (see [`module_state`][mumoe_tn.caching.module_state]).

    Attributes
    ----------
    key : tuple or None
        Equal for two states exactly when no submodule, mode, hook, parameter, buffer or
        optimiser step differs; None where a tensor cannot be tracked (an inference tensor).
    hooked : bool
        Whether a submodule below the root has forward hooks: a fused path that skips calling
        it would skip them.
    tensors : tuple of torch.Tensor
        Every parameter and buffer the key names; a holder of the key keeps them alive, so no new
        tensor can take an address the key remembers.
    """

    key: tuple | None
    hooked: bool
    tensors: tuple[torch.Tensor, ...]


def module_state(module: nn.Module) -> ModuleState:
    """The one invalidation key of everything derived from ``module`` and its submodules.

    Parameters
    ----------
    module : nn.Module
        The root (a μMoE layer).

    Returns
    -------
    ModuleState
        Every submodule by identity, train/eval flag and forward hooks (as the identities of the
        hook dictionaries' entries), every parameter and buffer by identity, storage and version,
        and the optimiser steps taken (as [`source_key`][mumoe_tn.caching.source_key]).
    """
    modules = [module]
    for current in modules:  # grows as it goes: every submodule, breadth first
        modules.extend(child for child in current._modules.values() if child is not None)
    tensors = tuple(
        t for m in modules for group in (m._parameters, m._buffers) for t in group.values() if t is not None
    )
    hooks = tuple(
        (tuple(m._forward_hooks), tuple(m._forward_pre_hooks)) if m._forward_hooks or m._forward_pre_hooks else ()
        for m in modules
    )
    hooked = any(hooks[1:])
    values = source_key(tensors)
    if values is None:
        return ModuleState(None, hooked, tensors)
    return ModuleState((tuple(map(id, modules)), tuple(m.training for m in modules), hooks, values), hooked, tensors)


class DerivedState:
    """Base of the holders of derived values: a pickle or deep copy carries none (the copy derives its own)."""

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __deepcopy__(self, memo: dict) -> Any:
        return type(self)()


class DerivedCache(DerivedState, Generic[T]):
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
