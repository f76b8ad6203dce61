"""A μMoE layer's program: what it derives from its weights and options for its calls, under one key.

opt_einsum's ``ContractExpression`` holds a contraction's path and its constants in one object,
evaluated by the loop that runs the call. A layer's program does the same for a whole μMoE
layer: per input signature (width, dtype, device, batch bucket) the fused first product of the
gate and the input layers (eval BatchNorm folded in), the gate's map from logits to
coefficients and the experts' prepared plans it runs, and the signatures whose inputs have been
checked. Everything it holds is valid for one state of the layer, the
[`module_state`][mumoe_tn.caching.module_state] key (submodules, modes, forward hooks,
parameters, buffers, optimiser steps): when the key changes, the program forgets every entry at
once, so no entry can outlive the weights it was made from.

The layer's general path is the same program without its fused entries: the gate and the experts
run as modules, which keep their own parameter-derived values under the same key
([`source_key`][mumoe_tn.caching.source_key]). Nothing here changes inside a call that
``torch.compile`` traces (compiled calls never reach the program), so a captured graph replays.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mumoe_tn.caching import DerivedState, ModuleState, module_state
from mumoe_tn.layers.fused import FusedProjection, FusedProjections

__all__ = ["MAX_CHECKED", "MAX_SIGNATURES", "LayerProgram", "ProgramEntry"]

MAX_SIGNATURES = 64
"""Most input signatures (width, dtype, device, batch bucket) a program keeps fused entries for."""

MAX_CHECKED = 256
"""Most input signatures a program remembers as validated (the set starts afresh beyond it)."""


@dataclass(frozen=True)
class ProgramEntry:
    """One input signature's fused inference.

    ``fused`` is ``[Gᵀ | M_1 | …]`` with its bias; its first ``n_logits`` columns are the gate's,
    which ``coefficients`` maps to one coefficient tensor per expert mode; ``identity`` says the
    input norm is the identity, so the fused product reads the input itself.
    """

    fused: FusedProjection
    n_logits: int
    coefficients: Callable[[torch.Tensor], list[torch.Tensor]]
    identity: bool


class LayerProgram(DerivedState):
    """What one μMoE layer derives for its calls, valid for one state of the layer.

    Dropped on pickling and deep copies (a copy derives its own). Thread-safe: concurrent calls
    may build the same entry twice, never a stale one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._state: ModuleState | None = None  # keeps the key's tensors alive: no address is reused
        self._entries: dict[tuple, ProgramEntry] = {}
        self.fused = FusedProjections()
        self.checked: set[tuple] = set()

    def current(self, layer: torch.nn.Module) -> ModuleState:
        """The layer's state now; every entry made for another state is forgotten."""
        state = module_state(layer)
        if state.key != self._key or state.key is None:
            with self._lock:
                self._key, self._state, self._entries = state.key, state, {}
        return state

    def entry(self, signature: tuple, make: Callable[[], ProgramEntry | None]) -> ProgramEntry | None:
        """The fused entry of ``signature`` for the state last passed to ``current``, made on a miss.

        ``make`` returns None where the fused path does not apply (nothing is kept then).
        """
        found = self._entries.get(signature)
        if found is not None:
            return found
        made = make()
        if made is not None and self._key is not None:
            with self._lock:
                if len(self._entries) >= MAX_SIGNATURES:
                    self._entries = {}
                self._entries[signature] = made
        return made

    def remember_checked(self, signature: tuple) -> None:
        """Record that inputs of ``signature`` passed the layer's checks."""
        if len(self.checked) >= MAX_CHECKED:
            self.checked.clear()
        self.checked.add(signature)

    def clear(self) -> None:
        """Forget everything (the next call derives afresh)."""
        with self._lock:
            self._key, self._state, self._entries = None, None, {}
        self.fused.clear()
        self.checked = set()
