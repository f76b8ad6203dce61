"""The parts of a gate module that a μMoE layer's program composes: projection, norms, map, records.

A gate maps tokens ``z`` to one coefficient tensor per expert mode by four steps, each written
once and shared by its own ``forward`` and by the layer's fused inference:

1. the *projection*: one matrix ``(ΣN_e, I)`` and bias for every mode side by side, in the compute
   dtype, eval-mode norms folded in where they are affine maps;
2. the *normalisation* of those logits, where it was not folded in;
3. the *activation map*: a callable from logits to the coefficients of every mode, chosen once
   for logits of one shape, dtype and device (it picks the quickest form of each mode's φ);
4. the *records*: the auxiliary losses of the call, kept by the gate.

A gate module that implements [`ProgramGate`][mumoe_tn.gates.gate_protocol.ProgramGate] (the
shipped [`ExpertGate`][mumoe_tn.gates.modules.ExpertGate] and its subclasses, or a user's gate
registered with [`register_gate`][mumoe_tn.gates.registry.register_gate] and named nowhere in
the library) runs, in a plain inference call of a layer, as one matrix product shared with the
experts' first cores, followed by its own map and records: see
[`LayerProgram`][mumoe_tn.layers.program.LayerProgram]. Any other ``nn.Module`` gate is called
as a module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["CoefficientMap", "ModeLogits", "ProgramGate", "gate_coefficients", "mode_parts"]

#: Normalised logits of every mode: one ``(rows, ΣN_e)`` tensor, modes side by side, or one ``(rows, N_e)`` per mode.
ModeLogits = torch.Tensor | Sequence[torch.Tensor]

#: Normalised logits (either layout of ``ModeLogits``) → one ``(rows, N_e)`` coefficient tensor per mode.
CoefficientMap = Callable[[ModeLogits], list[torch.Tensor]]


@runtime_checkable
class ProgramGate(Protocol):
    """A gate module whose steps a layer's program may run itself (see the module notes).

    Attributes
    ----------
    expert_dims : tuple of int
        ``N_1 … N_E``; the layer's must be the same for the program to compose the gate.
    """

    expert_dims: tuple[int, ...]

    def projection_applies(self, z: torch.Tensor) -> bool:
        """Whether a call on ``z`` may use `projection` (eval mode, no gradient to any parameter, not traced).

        Read once per state of the gate (mode, hooks, parameters) and input signature: it must
        depend on nothing else that changes between calls.
        """
        ...

    def projection(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """``(weight, bias, folded)``: the stacked ``(ΣN_e, I)`` projection and ``(ΣN_e,)`` bias in ``compute``.

        The same tensors come back until a parameter or buffer of the gate changes (the program
        builds on them by identity). ``folded``: ``z @ weight.T + bias`` are already normalised;
        otherwise `normalise` still applies to them.
        """
        ...

    def normalise(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> ModeLogits:
        """The logits ``(rows, ΣN_e)`` through each mode's norm (``mask``: the real rows, for batch statistics)."""
        ...

    def activation_map(self, logits: torch.Tensor) -> CoefficientMap:
        """The map to the coefficients from normalised logits like ``logits`` ``(rows, ΣN_e)`` (shape, dtype, device).

        It takes either layout of [`ModeLogits`][mumoe_tn.gates.gate_protocol]; a caller keeps it
        for calls with such logits while the gate is unchanged.
        """
        ...

    def record(self, logits: ModeLogits, coefficients: list[torch.Tensor], mask: torch.Tensor | None) -> None:
        """Keep what the gate records of a call (its auxiliary losses) from its normalised logits and coefficients."""
        ...


def gate_coefficients(
    gate: ProgramGate,
    logits: torch.Tensor,
    folded: bool,
    mask: torch.Tensor | None = None,
    activate: CoefficientMap | None = None,
) -> list[torch.Tensor]:
    """The steps after the projection: normalise (unless ``folded``), map, record; the coefficients.

    Parameters
    ----------
    gate : ProgramGate
        The gate whose steps run.
    logits : torch.Tensor
        ``(rows, ΣN_e)``, the projection's product (a column slice of a larger product may be).
    folded : bool
        Whether the projection already normalised them.
    mask : torch.Tensor, optional
        ``(rows,)`` booleans, True = real token, for the norms' batch statistics and the records.
    activate : CoefficientMap, optional
        The gate's activation map for such logits, where the caller keeps one (made here otherwise).

    Returns
    -------
    list of torch.Tensor
        One ``(rows, N_e)`` tensor per expert mode.
    """
    normed = logits if folded else gate.normalise(logits, mask)
    coefficients = (gate.activation_map(logits) if activate is None else activate)(normed)
    gate.record(normed, coefficients, mask)
    return coefficients


def mode_parts(logits: ModeLogits, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """The ``(rows, N_e)`` logits of each mode from either layout of ``ModeLogits`` (views, no copy)."""
    if isinstance(logits, torch.Tensor):
        return [logits] if len(sizes) == 1 else list(logits.split(sizes, dim=-1))
    return list(logits)
