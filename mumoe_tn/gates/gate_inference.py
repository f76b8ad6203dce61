"""What an expert gate computes for inference: its projection with eval-mode norms folded in.

In eval mode, without gradients, a gate's per-mode projections and their norms are one affine
map: ``norm(G_eᵀ z + b_e)`` is ``z @ weight.T + bias`` once each norm's running statistics (and
affine parameters) are folded into ``weight`` and ``bias``.
[`GateInference`][mumoe_tn.gates.gate_inference.GateInference] is the part of
[`ExpertGate`][mumoe_tn.gates.modules.ExpertGate] that builds that one matrix (kept under the
caching key of [`mumoe_tn.caching`][mumoe_tn.caching]) and maps its rows to the coefficients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GateInference"]


class GateInference:
    """The inference half of an expert gate (a mixin of ``ExpertGate``: it reads the gate's modules)."""

    projections: Any
    norms: Any
    expert_dims: tuple[int, ...]
    _inference_weights: Any
    _activate_modes: Any

    def _folded_weights(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The projections of every mode stacked, with the norms folded in where they are affine maps.

        Returns ``(weight, bias, folded)``: ``norm(G_eᵀ z + b_e)`` of every mode is ``z @ weight.T + bias``
        when ``folded``; otherwise the norms still have to be applied to ``z @ weight.T + bias``
        (``bias`` is None when there is nothing to add). Made once
        per change of the projections or the norms' statistics (see [`mumoe_tn.caching`][mumoe_tn.caching]).
        """
        projections = [projection.weight for projection in self.projections.values()]
        offsets = [projection.bias for projection in self.projections.values()]
        norms = list(self.norms.values())
        sources = [*projections, *(b for b in offsets if b is not None)]
        for norm in norms:  # the norms' own tensors (their running statistics included)
            sources += [t for t in norm._parameters.values() if t is not None]
            sources += [t for t in norm._buffers.values() if t is not None]

        modes = tuple(norm.training for norm in norms)  # a norm folds only in eval mode

        def make() -> tuple[torch.Tensor, torch.Tensor | None, bool, tuple]:
            affine = [None if isinstance(norm, nn.Identity) else _eval_affine(norm) for norm in norms]
            foldable = all(
                isinstance(norm, nn.Identity) or map_ is not None for norm, map_ in zip(norms, affine, strict=True)
            )
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
            return stacked.contiguous(), torch.cat(biases) if has_bias else None, foldable, modes

        made = self._inference_weights.get(sources, make)
        if made[3] != modes:  # a norm went to or from training mode since: its statistics fold differently
            self._inference_weights.clear()
            made = self._inference_weights.get(sources, make)
        return made[:3]

    def clear_inference_cache(self) -> None:
        """Forget the folded projections (needed only after in-place edits through ``.data``)."""
        self._inference_weights.clear()

    def inference_projection(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The inference gate's one matrix product: ``(weight, bias, folded)`` in ``compute``, cached.

        ``weight`` is ``(ΣN_e, I)``, the projections of every mode stacked, with each eval-mode norm
        folded in where every norm is an affine map (``folded``; then ``z @ weight.T + bias`` are the
        normalised logits, else the norms still apply, see
        [`coefficients_from_logits`][mumoe_tn.gates.gate_inference.GateInference.coefficients_from_logits]).
        The same tensors come back until a projection, a norm's parameter or a running statistic
        changes (see [`mumoe_tn.caching`][mumoe_tn.caching]), so a caller may build on them by identity.
        Only for calls that take the inference path (eval mode, no gradient, no losses).
        """
        return self._folded_weights(compute)

    def coefficients_from_logits(self, logits: torch.Tensor, folded: bool) -> list[torch.Tensor]:
        """Coefficients of every mode from the rows ``z @ weight.T + bias`` of `inference_projection`.

        Parameters
        ----------
        logits : torch.Tensor
            ``(rows, ΣN_e)``, modes side by side (it may be a column slice of a larger product).
        folded : bool
            As returned with the projection: whether the norms are already applied.

        Returns
        -------
        list of torch.Tensor
            One ``(rows, N_e)`` tensor per expert mode.
        """
        if not folded:
            norms = list(self.norms.values())
            if len(norms) == 1:
                logits = norms[0](logits)
            else:
                parts = logits.split(self.expert_dims, dim=-1)
                logits = torch.cat([norm(part) for part, norm in zip(parts, norms, strict=True)], dim=-1)
        return self._activate_modes(logits)

    def _infer(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Coefficients of the rows ``flat`` without gradients: one matrix product, norms folded in."""
        weight, bias, folded = self._folded_weights(flat.dtype)
        return self.coefficients_from_logits(F.linear(flat, weight, bias), folded)


def _eval_affine(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A norm's eval-mode map as ``(scale, shift)``, where it offers one (``eval_affine()``) and is in eval."""
    method = getattr(norm, "eval_affine", None)
    return method() if callable(method) else None
