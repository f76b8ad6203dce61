"""Values derived from parameters, kept until one of the parameters changes.

Inference reuses what depends on the weights alone — padded cores, pre-contracted core-only
sub-networks, a gate's projection with its eval-mode norm folded in, the fused first product of a
layer — instead of recomputing it on every call. Every such value lives in one kind of holder, a
[`DerivedValues`][mumoe_tn.caching.DerivedValues], under one key,
[`module_state`][mumoe_tn.caching.module_state]: the identity, train/eval flag and forward hooks of
every submodule of the holder's root, and the identity, storage and version counter of every
parameter and buffer. A value is valid while the key is unchanged. That covers every route by
which a weight changes through PyTorch:

- optimizer steps, ``load_state_dict``, ``copy_``, ``mul_`` and other in-place operations on the
  parameter (each bumps its version counter);
- ``.to()``, ``.half()``, ``.cuda()``, assigning ``param.data`` or a new ``nn.Parameter`` (new
  storage or a new object); ``train()``/``eval()``, a hook added or removed, a submodule replaced;
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

A holder keeps the key's tensors (and their storages) alive while it holds values, so a new
tensor can never reuse the address of one it remembers. It is safe to share between threads, and
it is dropped when its module is pickled or deep-copied (the copy derives its own values).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["DerivedState", "DerivedValues", "ModuleState", "module_state", "optimiser_steps", "source_key"]

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
        The optimiser steps taken so far, then the object identity, storage address and version
        counter of every source, flat; None for inference tensors (made under
        ``torch.inference_mode``, they have no version counter).
    """
    key: list[Any] = [optimiser_steps()]
    return tuple(key) if _add_tensor_fields(key, sources) else None


def _add_tensor_fields(key: list[Any], tensors: Sequence[torch.Tensor]) -> bool:
    """Append the identity, storage address and version of every tensor to ``key``; False for an inference tensor."""
    add = key.append
    try:
        for t in tensors:
            add(id(t))
            add(t.data_ptr())
            add(t._version)
    except RuntimeError:  # an inference tensor: no version counter
        return False
    return True


class ModuleState(NamedTuple):
    """What identifies the current state of a module tree (see [`module_state`][mumoe_tn.caching.module_state]).

    Attributes
    ----------
    key : tuple or None
        Equal for two states exactly when no submodule, mode, hook, parameter, buffer or
        optimiser step differs; None where a tensor cannot be tracked (an inference tensor).
    hooked : bool
        Whether a submodule below the root has forward hooks or a ``forward`` set on the instance:
        a fused path that skips calling it would skip them.
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
        Every submodule by identity, train/eval flag, ``eps`` (a norm's, which an eval-mode norm
        folded into a projection reads), forward hooks (as the identities of the hook
        dictionaries' entries) and any ``forward`` set on the instance, every parameter and
        buffer by identity, storage and version, and the optimiser steps taken (as
        [`source_key`][mumoe_tn.caching.source_key]).
    """
    key, hooked, tensors = _state_parts(module)
    return ModuleState(key, hooked, tuple(tensors))


def _state_parts(module: nn.Module) -> tuple[tuple | None, bool, list[torch.Tensor]]:
    """`module_state`'s fields, the tensors as a list (a caller that holds an equal key needs no tuple)."""
    modules = [module]
    for current in modules:  # grows as it goes: every submodule, breadth first
        if current._modules:
            modules.extend([child for child in current._modules.values() if child is not None])
    # One flat tuple, compared in one pass: the optimiser steps, the number of submodules, then
    # (identity, mode, eps, hooks) of each submodule and (identity, storage, version) of each tensor.
    # The count fixes where each field sits, so two keys are equal only field by field.
    key: list[Any] = [0, len(modules)]
    add = key.append
    tensors: list[torch.Tensor] = []
    hooked = False
    for m in modules:
        add(id(m))
        add(m.training)
        found = m.__dict__  # (read from the instance's dict: the attribute lookups cost more than the reads)
        add(found.get("eps"))  # (a norm's: a plain attribute, read where the norm is folded into a projection)
        try:
            parameters, buffers = found["_parameters"], found["_buffers"]
            hooks, pre_hooks = found["_forward_hooks"], found["_forward_pre_hooks"]
        except KeyError:  # a module that keeps them elsewhere: read them as attributes
            parameters, buffers, hooks, pre_hooks = m._parameters, m._buffers, m._forward_hooks, m._forward_pre_hooks
        if parameters:
            tensors += [t for t in parameters.values() if t is not None]
        if buffers:
            tensors += [t for t in buffers.values() if t is not None]
        substituted = found.get("forward")  # a forward set on the instance: user code to be called
        if hooks or pre_hooks or substituted is not None:
            add((tuple(hooks), tuple(pre_hooks), id(substituted)))
            hooked = hooked or m is not module
        else:
            add(None)
    if not _add_tensor_fields(key, tensors):
        return None, hooked, tensors
    key[0] = optimiser_steps()
    return tuple(key), hooked, tensors


class DerivedState:
    """Base of the holders of derived values: a pickle or deep copy carries none (the copy derives its own)."""

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __deepcopy__(self, memo: dict) -> Any:
        return type(self)()


class DerivedValues(DerivedState):
    """Every value derived from one module tree, valid for one state of it: the one holder of derived state.

    A value is found by a name (a hashable: what it is and the options it depends on, e.g.
    ``("projection", torch.float32)``) and is valid while the
    [`module_state`][mumoe_tn.caching.module_state] of the root it was made for is unchanged:
    when that key changes every value is forgotten at once. A μMoE layer's program is one
    (see [`LayerProgram`][mumoe_tn.layers.program.LayerProgram]); a gate or an expert layer has one
    of its own, which the layer holding it *adopts*: the module's values then live in the layer's
    holder, as long as the layer holds the module as a direct child, each valid for the module's
    part of the layer's key (its own ``module_state``, so a call validates that part alone) and
    forgotten with everything else when the layer's key changes. A module used on its own, or
    moved out of its layer, keeps its values in its own holder under its own state.
    Thread-safe (two threads may make one value twice, never keep a stale one); a pickle or deep
    copy carries no value and no adoption.
    """

    #: Most values kept for one state (the holder starts afresh beyond it).
    MAX_VALUES = 512

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._state: ModuleState | None = None  # keeps the key's tensors alive: no address is reused
        self._values: dict[Hashable, Any] = {}
        self._owner: tuple[weakref.ref, weakref.ref] | None = None

    def state(self, root: nn.Module) -> ModuleState:
        """``root``'s state now; every value made for another state is forgotten."""
        key, hooked, tensors = _state_parts(root)
        kept = self._state
        if kept is not None and key is not None and kept.key == key:
            return kept  # (an equal key names the same tensors and hooks: the kept state is this one)
        state = ModuleState(key, hooked, tuple(tensors))
        with self._lock:
            self._key, self._state, self._values = key, state, {}
        return state

    def get(self, root: nn.Module, name: Hashable, make: Callable[[], T]) -> T:
        """The value ``name`` of ``root`` as it is now: the kept one, or ``make()`` kept in its place.

        Parameters
        ----------
        root : nn.Module
            The module whose state the value is derived from (the module that owns this holder).
        name : Hashable
            What the value is, with every option it depends on that is not in the module's state.
        make : Callable
            Computes the value from the module as it is now.

        Returns
        -------
        object
            ``make()``'s result, computed now or on an earlier call in the same state. Where the
            state cannot be tracked (inference tensors) nothing is kept.
        """
        owner = self.owner(root)
        if owner is not None:
            return owner[1].get_adopted(root, (id(root), name), make)
        state = self.state(root)
        if state.key is None:
            return make()
        found = self._values.get(name, _MISSING)
        if found is not _MISSING:
            return found
        made = make()
        with self._lock:
            if self._key == state.key:
                if len(self._values) >= self.MAX_VALUES:
                    self._values = {}
                self._values[name] = made
        return made

    def get_adopted(self, module: nn.Module, name: Hashable, make: Callable[[], T]) -> T:
        """The value ``name`` derived from ``module`` (a child whose holder this one adopted), kept here.

        It is valid for the [`module_state`][mumoe_tn.caching.module_state] of ``module``, a part of
        the adopting root's key: the value goes when the module changes, and with every other value
        when the root does. A call validates the module's part alone, not the whole root again.
        """
        state = module_state(module)
        if state.key is None:
            return make()
        found = self._values.get(name)
        if type(found) is _Adopted and found.key == state.key:
            return found.value
        made = make()
        with self._lock:
            if len(self._values) >= self.MAX_VALUES:
                self._values = {}
            self._values[name] = _Adopted(state.key, state.tensors, made)
        return made

    def adopt(self, parent: nn.Module, holder: DerivedValues) -> None:
        """Keep this holder's values in ``holder`` (see `get_adopted`) while ``parent`` holds the module.

        Parameters
        ----------
        parent : nn.Module
            The module (a μMoE layer) that holds this holder's module as a direct child.
        holder : DerivedValues
            ``parent``'s holder.
        """
        with self._lock:
            self._owner = (weakref.ref(parent), weakref.ref(holder))
            self._key, self._state, self._values = None, None, {}

    def adopted_by(self, holder: DerivedValues) -> bool:
        """Whether this holder's values are kept in ``holder`` (see `adopt`)."""
        owner = self._owner
        return owner is not None and owner[1]() is holder

    def owner(self, root: nn.Module) -> tuple[nn.Module, DerivedValues] | None:
        """The adopting module and its holder, while that module still holds ``root`` as a child; else None."""
        owner = self._owner
        if owner is None:
            return None
        parent, holder = owner[0](), owner[1]()
        if parent is None or holder is None or root not in parent._modules.values():  # (modules compare by identity)
            return None
        return parent, holder

    def clear(self) -> None:
        """Forget every value (an adopting holder's too: the next call derives afresh)."""
        with self._lock:
            self._key, self._state, self._values = None, None, {}
            owner = self._owner
        holder = None if owner is None else owner[1]()
        if holder is not None:
            holder.clear()


_MISSING = object()


class _Adopted(NamedTuple):
    """An adopted module's value, with the key it is valid for and the tensors that key names (kept alive)."""

    key: tuple
    tensors: tuple[torch.Tensor, ...]
    value: Any


#: The name 0.3 pickled its holders under: they load as empty holders (their owners replace them).
DerivedCache = DerivedValues
