"""A μMoE layer's program: what it derives from its weights and options for its calls, under one key.

opt_einsum's ``ContractExpression`` holds a contraction's path and its constants in one object,
evaluated by the loop that runs the call. A layer's program does the same for a whole μMoE
layer, and it is the one place where what the layer derives from its weights lives: per input
signature (width, dtype, device, batch bucket) the fused first product of the gate and the input
layers (eval BatchNorm folded in) and the gate's activation map chosen for such calls; the gate's
folded projection; each expert layer's prepared cores (padded cores, pre-contracted core-only
intermediates, the plans bound to them). Everything it holds is valid for one state of the layer,
the [`module_state`][mumoe_tn.caching.module_state] key (submodules, modes, forward hooks,
parameters, buffers, optimiser steps): when the key changes, the program forgets every value at
once, so no value can outlive the weights it was made from. The plans themselves depend on shapes
and options only: they stay in each expert layer's plan table (one per batch bucket and kind),
and each plan carries its own executors (see
[`plan_executor`][mumoe_tn.contractions.executor.plan_executor]).

The layer's gating is one sequence of steps (checks, token mask, input norm, projection,
normalisation, activation map, records, ablation mask); the program's fused entry is only another
way to compute the projection step, for the calls that
[`fused_entry`][mumoe_tn.layers.program.LayerProgram.fused_entry] admits. Any gate that
implements [`ProgramGate`][mumoe_tn.gates.gate_protocol.ProgramGate] gets it. Without a fused
entry the gate and the experts run as modules; the program has adopted their holders (see
[`DerivedValues.adopt`][mumoe_tn.caching.DerivedValues.adopt]), so what they derive is kept here too.
Nothing here changes inside a call that ``torch.compile`` traces (compiled calls never reach the
program), so a captured graph replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks  # torch keeps the global hooks there, with no public reader

from mumoe_tn.caching import DerivedValues
from mumoe_tn.gates.gate_protocol import CoefficientMap, ProgramGate, gate_coefficients
from mumoe_tn.layers.experts import batch_bucket
from mumoe_tn.layers.fused import FusedProjection, fuse_projection
from mumoe_tn.masking import current_token_mask, resolve_token_mask

__all__ = ["MAX_CHECKED", "LayerProgram", "ProgramEntry"]

MAX_CHECKED = 256
"""Most input signatures a program remembers as validated (the set starts afresh beyond it)."""

#: Input dtypes the fused product computes in (narrower ones are gated in float32, apart from the experts).
_FUSED_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class ProgramEntry:
    """One input signature's fused projection and the gate steps that follow it.

    ``fused`` is ``[Gᵀ | M_1 | …]`` with its bias; its first ``n_logits`` columns are the gate's
    logits (normalised when ``folded``), which the gate's steps map with ``activate``, the gate's
    activation map chosen for this signature; ``identity`` says the input norm is the identity,
    so the fused product reads the input itself; ``device_type`` is the signature's device type.
    """

    fused: FusedProjection
    gate: ProgramGate
    n_logits: int
    folded: bool
    activate: CoefficientMap
    identity: bool
    device_type: str
    #: The widths of the product's parts, side by side: the logits, then each fused layer's columns.
    widths: tuple[int, ...] = field(init=False)
    #: ``(id(experts), plan, step)`` of each fused layer, in the order of its columns.
    readers: tuple[tuple[int, Any, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        heads = self.fused.heads
        widths = (self.n_logits, *(stop - start for _, _, _, start, stop in heads))
        object.__setattr__(self, "widths", widths)
        object.__setattr__(self, "readers", tuple((id(layer), plan, step) for layer, plan, step, _, _ in heads))

    def project(self, flat: torch.Tensor) -> torch.Tensor:
        """The projection step of the rows ``flat`` ``(rows, I)``: gate logits and input layers' products."""
        fused = self.fused
        return torch.mm(flat, fused.weight) if fused.bias is None else torch.addmm(fused.bias, flat, fused.weight)

    def run(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], dict[int, tuple]]:
        """The projection step and the gate's steps after it on the rows ``flat`` ``(rows, I)``.

        Returns
        -------
        coefficients : list of torch.Tensor
            One ``(rows, N_e)`` tensor per expert mode.
        heads : dict
            ``id(experts) → (plan, step, columns)``: each fused input layer's part of the product.
        """
        logits, *parts = self.project(flat).split_with_sizes(self.widths, 1)  # (one call for every part)
        coefficients = gate_coefficients(self.gate, logits, self.folded, None, self.activate)
        heads = {key: (plan, step, part) for (key, plan, step), part in zip(self.readers, parts, strict=True)}
        return coefficients, heads


class LayerProgram(DerivedValues):
    """What one μMoE layer derives for its calls, valid for one state of the layer: its one holder of derived state.

    A [`DerivedValues`][mumoe_tn.caching.DerivedValues] keyed by the layer's
    [`module_state`][mumoe_tn.caching.module_state]. It holds, by name: the fused entry of each
    input signature (``("entry", signature)``), the fused matrices (``("fused", …)``), and,
    for each gate and expert layer it has adopted (its direct children), their values under
    ``(id(child), name)``, each checked against the child's part of the key: the gate's folded
    projection per compute dtype, each expert layer's prepared cores per ``pad_bonds`` (padded
    cores, core-only intermediates, bound plans). Besides
    them it remembers the input signatures that passed the layer's checks (``checked``, which do
    not depend on the weights). Dropped on pickling and deep copies (a copy derives its own).
    Thread-safe: concurrent calls may build the same entry twice, never a stale one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.checked: set[tuple] = set()

    def adopt_children(self, layer: nn.Module) -> None:
        """Keep the derived values of ``layer``'s direct children (gate, expert layers) here, under the layer's key."""
        for child in layer._modules.values():
            holder = None if child is None else child.__dict__.get("_derived")
            if isinstance(holder, DerivedValues) and not holder.adopted_by(self):
                holder.adopt(layer, self)

    def fused_entry(self, layer: Any, x: Any, mask: torch.Tensor | None) -> ProgramEntry | None:
        """The fused entry that computes the projection step of the call ``layer(x, mask)``, or None.

        The one predicate of the fused projection: it serves a call with no gradient, no token
        mask (given or current), no ablation, no forward hook (global, or on the layer's
        submodules) and no ``forward`` set on a submodule's instance, no autocast, no trace or
        functional transform, on a plain tensor; and, per input signature,
        a gate implementing [`ProgramGate`][mumoe_tn.gates.gate_protocol.ProgramGate] whose
        `projection_applies`, the layer's expert dims, a float32 or float64 input and an input
        norm the gate reads through (see `_make_entry`). Made on the first call of a signature
        (which validates ``x`` and adopts the layer's children's holders, see `adopt_children`)
        and kept while the layer's state is unchanged.
        """
        if mask is not None or layer.ablation is not None or torch.is_grad_enabled() or type(x) is not torch.Tensor:
            return None
        if x.ndim < 1 or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return None
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        state = self.state(layer)
        if state.hooked or module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
            return None  # (the fused product calls neither the gate nor the experts: their hooks need them called)
        name = ("entry", (width, x.dtype, x.device, batch_bucket(rows)))
        found = self._values.get(name)
        if found is None:
            self.adopt_children(layer)
            found = self._make_entry(layer, x, rows)
            if found is not None:  # (nothing is kept where the fused path does not apply)
                self.get(layer, name, lambda: found)
        if found is None or torch.is_autocast_enabled(found.device_type):  # (after the entry's checks: devices)
            return None
        if current_token_mask() is not None and resolve_token_mask(None, tuple(x.shape[:-1]), x.device) is not None:
            return None
        return found

    def _make_entry(self, layer: Any, x: torch.Tensor, rows: int) -> ProgramEntry | None:
        """The fused entry for inputs like ``x`` (validated here), or None where the signature does not admit one."""
        layer._check_input(x)
        gate = layer.gate
        if rows == 0 or x.dtype not in _FUSED_DTYPES or not isinstance(gate, ProgramGate):
            return None
        if tuple(gate.expert_dims) != tuple(layer.expert_dims) or not gate.projection_applies(x):
            return None
        identity = type(layer.input_norm) is nn.Identity
        if layer.gate_input == "raw" and not identity:
            return None
        weight, bias, folded = gate.projection(x.dtype)
        _check_projection(gate, weight, bias, x)
        executors = [(experts, experts.inference_executor(rows, layer.bias)) for experts in layer._input_layers()]
        fused = self._fused(layer, weight, bias, executors)
        logits = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
        activate = gate.activation_map(logits)
        return ProgramEntry(fused, gate, weight.shape[0], bool(folded), activate, identity, x.device.type)

    def _fused(self, layer: Any, weight: torch.Tensor, bias: torch.Tensor | None, executors: list) -> FusedProjection:
        """The fused matrix of ``weight``, ``bias`` and ``executors``, shared by the signatures that use the same ones.

        Found by the identity of its parts, which the kept value holds alive (no identity is reused).
        """
        parts = (weight, bias, *(executor for _, executor in executors))
        made = self.get(layer, ("fused", *map(id, parts)), lambda: (parts, fuse_projection(weight, bias, executors)))
        if all(a is b for a, b in zip(made[0], parts, strict=True)):
            return made[1]
        return fuse_projection(weight, bias, executors)

    def remember_checked(self, signature: tuple) -> None:
        """Record that inputs of ``signature`` passed the layer's checks."""
        if len(self.checked) >= MAX_CHECKED:
            self.checked.clear()
        self.checked.add(signature)

    def clear(self) -> None:
        """Forget everything (the next call derives afresh)."""
        super().clear()
        self.checked = set()


def _check_projection(gate: Any, weight: Any, bias: Any, x: torch.Tensor) -> None:
    """A gate's `projection` must be ``(ΣN_e, I)`` (and ``(ΣN_e,)``) tensors in the input's dtype and device."""
    rows, width = sum(gate.expert_dims), x.shape[-1]
    for name, value, shape in (("weight", weight, (rows, width)), ("bias", bias, (rows,))):
        if value is None and name == "bias":
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != x.dtype:
            if isinstance(value, torch.Tensor):
                described = f"of shape {tuple(value.shape)} and dtype {value.dtype}"
            else:
                described = f"of type {type(value).__name__}"
            raise ValueError(
                f"the gate {type(gate).__name__}'s projection({x.dtype}) returned a {name} {described}: "
                f"it must be a {x.dtype} tensor of shape {shape} (ΣN_e = {rows} rows, I = {width})"
            )
        if value.device != x.device:
            raise ValueError(
                f"the gate {type(gate).__name__}'s projection {name} is on {value.device}, the input on {x.device}"
            )
