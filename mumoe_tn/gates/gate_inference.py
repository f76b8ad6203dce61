"""An expert gate's steps, as the layers' programs compose them: projection, norms, activation map.

[`GateSteps`][mumoe_tn.gates.gate_inference.GateSteps] is the part of
[`ExpertGate`][mumoe_tn.gates.modules.ExpertGate] that implements the
[`ProgramGate`][mumoe_tn.gates.gate_protocol.ProgramGate] protocol. In eval mode, without
gradients, a gate's per-mode projections and their norms are one affine map: ``norm(G_eᵀ z + b_e)``
is ``z @ weight.T + bias`` once each norm's running statistics (and affine parameters) are
folded into ``weight`` and ``bias``; `projection` builds that one matrix (kept in the gate's
[`DerivedValues`][mumoe_tn.caching.DerivedValues], which the layer holding the gate adopts).
`normalise` applies the norms where they are not folded (training, norms that are no affine
map, and norms with a forward hook or a ``forward`` set on them, which must be called), and
`activation_map` picks each mode's φ once for logits of one shape; the gate's ``forward`` and a
layer's fused inference both run them (see
[`gate_coefficients`][mumoe_tn.gates.gate_protocol.gate_coefficients]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mumoe_tn.caching import DerivedValues
from mumoe_tn.gates.choices import TOKEN_MIXING_NORMS
from mumoe_tn.gates.gate_protocol import CoefficientMap, ModeLogits, mode_parts

__all__ = ["GateSteps"]


class GateSteps:
    """The steps of an expert gate that a layer's program composes (a mixin of ``ExpertGate``).

    A subclass gives ``mode_map`` (each mode's φ) and sets ``shares_map`` False when the modes'
    maps differ.
    """

    projections: Any
    norms: Any
    norm: str
    expert_dims: tuple[int, ...]
    training: bool
    _derived: DerivedValues
    parameters: Any

    #: Whether every mode maps its logits by one function (modes of one size then run through it in one call).
    shares_map = True

    def _folded_weights(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The projections of every mode stacked, with the norms folded in where they are affine maps.

        Returns ``(weight, bias, folded)``: ``norm(G_eᵀ z + b_e)`` of every mode is ``z @ weight.T + bias``
        when ``folded``; otherwise the norms still have to be applied to ``z @ weight.T + bias``
        (``bias`` is None when there is nothing to add). Made once per state of the gate (its
        projections, the norms' statistics and modes; see [`mumoe_tn.caching`][mumoe_tn.caching])
        and compute dtype.
        """
        return self._derived.get(self, ("projection", compute), lambda: self._fold(compute))

    def _fold(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """`_folded_weights` computed afresh."""
        projections = [projection.weight for projection in self.projections.values()]
        offsets = [projection.bias for projection in self.projections.values()]
        norms = list(self.norms.values())
        affine = [None if isinstance(norm, nn.Identity) else _eval_affine(norm) for norm in norms]
        foldable = all(
            isinstance(norm, nn.Identity) or map_ is not None for norm, map_ in zip(norms, affine, strict=True)
        ) and not any(_intercepted(norm) for norm in norms)
        weights, biases = [], []
        for weight, offset, map_ in zip(projections, offsets, affine, strict=True):
            weight = weight.detach().to(compute)
            offset = weight.new_zeros(weight.shape[0]) if offset is None else offset.detach().to(compute)
            if foldable and map_ is not None:
                scale, shift = (t.detach().to(compute) for t in map_)
                weights.append(weight * scale[:, None])
                biases.append(offset * scale + shift)
            else:
                weights.append(weight)
                biases.append(offset)
        has_bias = any(b is not None for b in offsets) or (foldable and any(map_ is not None for map_ in affine))
        stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
        return stacked.contiguous(), torch.cat(biases) if has_bias else None, foldable

    def clear_inference_cache(self) -> None:
        """Forget the folded projections (needed only after in-place edits through ``.data``)."""
        self._derived.clear()

    def projection_applies(self, z: torch.Tensor) -> bool:
        """Whether a call on ``z`` may use `projection`: eval mode, no gradient to any parameter, not traced."""
        if self.training or torch.compiler.is_compiling():
            return False  # training-mode norms use (masked) batch statistics
        if torch.is_grad_enabled() and (z.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        return not torch._C._are_functorch_transforms_active()

    def projection(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The gate's one matrix product: ``(weight, bias, folded)`` in ``compute``, cached.

        ``weight`` is ``(ΣN_e, I)``, the projections of every mode stacked, with each eval-mode norm
        folded in where every norm is an affine map (``folded``; then ``z @ weight.T + bias`` are the
        normalised logits, else `normalise` still applies). The same tensors come back until a
        projection, a norm's parameter or a running statistic changes (see
        [`mumoe_tn.caching`][mumoe_tn.caching]), so a caller may build on them by identity. Only
        for calls where `projection_applies`.
        """
        return self._folded_weights(compute)

    def normalise(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> ModeLogits:
        """The logits ``(rows, ΣN_e)`` through each mode's norm: one tensor per mode (one tensor for one mode).

        With a token ``mask`` (``(rows,)`` booleans, True = real) a norm with batch statistics
        computes them from the real rows only.
        """
        norms = list(self.norms.values())
        masked = mask is not None and self.norm in TOKEN_MIXING_NORMS
        if len(norms) == 1:
            return norms[0](logits, mask) if masked else norms[0](logits)
        parts = logits.split(self.expert_dims, dim=-1)
        return [norm(part, mask) if masked else norm(part) for part, norm in zip(parts, norms, strict=True)]

    def mode_map(self, mode: int, logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """φ of expert mode ``mode`` for normalised logits like ``logits`` ``(…, N_e)``."""
        raise NotImplementedError

    def activation_map(self, logits: torch.Tensor) -> CoefficientMap:
        """The coefficients of every mode from normalised logits like ``logits`` ``(rows, ΣN_e)``.

        Decided here once for logits of that shape, dtype and device: each mode's form of φ
        (`mode_map`) and, without gradients, whether modes of one size go through one shared φ in
        one call on logits side by side (φ acts on each row of each mode alone).
        """
        sizes = self.expert_dims
        if len(sizes) == 1:
            phi = self.mode_map(0, logits)

            def one_mode(normed: ModeLogits) -> list[torch.Tensor]:
                if isinstance(normed, torch.Tensor):  # (the logits as they come: no split)
                    return [phi(normed)]
                return [phi(part) for _, part in zip(sizes, normed, strict=True)]

            return one_mode
        maps = [self.mode_map(mode, part) for mode, part in enumerate(mode_parts(logits, sizes))]
        if len(sizes) > 1 and self.shares_map and len(set(sizes)) == 1 and not logits.requires_grad:
            modes, size = len(sizes), sizes[0]
            stacked = self.mode_map(0, logits.view(logits.shape[0], modes, size))

            def side_by_side(normed: ModeLogits) -> list[torch.Tensor]:
                if isinstance(normed, torch.Tensor):
                    return list(stacked(normed.view(normed.shape[0], modes, size)).unbind(1))
                return [map_(part) for map_, part in zip(maps, normed, strict=True)]

            return side_by_side
        return lambda normed: [map_(part) for map_, part in zip(maps, mode_parts(normed, sizes), strict=True)]


def _eval_affine(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A norm's eval-mode map as ``(scale, shift)``, where it offers one (``eval_affine()``) and is in eval.

    The map stands for the ``forward`` of the class that defines ``eval_affine``: a subclass that
    overrides ``forward`` alone computes something else, so it is called, not folded.
    """
    method = getattr(norm, "eval_affine", None)
    if not callable(method):
        return None
    owner = next((cls for cls in type(norm).__mro__ if "eval_affine" in vars(cls)), None)
    if owner is not None and getattr(type(norm), "forward", None) is not getattr(owner, "forward", None):
        return None
    return method()


def _intercepted(norm: nn.Module) -> bool:
    """Whether user code runs when ``norm`` is called (a forward hook or pre-hook, or a ``forward`` set on it).

    Such a norm is not folded into the projection: folded, it would never be called.
    """
    return bool(norm._forward_hooks or norm._forward_pre_hooks or "forward" in norm.__dict__)
