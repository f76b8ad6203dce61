"""Inference's fused first product: the gate's projection and the input layers' first cores in one matrix.

A layer's gate and the expert layers that read its input ``z`` all start by multiplying ``z`` by
a matrix: the gate by its projection ``Gᵀ`` (``I × ΣN_e``, eval-mode norms folded in), each
expert layer by the core (or pre-contracted core-only intermediate) its prepared plan meets
``z`` with first (``I × K``, see
[`PreparedPlan.input_projection`][mumoe_tn.contractions.prepared.PreparedPlan]). Which core
that is comes from the layer's plan for its network, not from the format: CP's input factor,
TR's and TT's input core viewed as ``I × (r_a·r_b)``, Tucker's input factor, MxD's decoder.
`fuse_projection` makes ``[Gᵀ | M_1 | …]`` and the
stacked biases, so one ``addmm`` replaces one product per matrix; the layer's program keeps it
with its other derived values (see [`mumoe_tn.layers.program`][mumoe_tn.layers.program]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mumoe_tn.caching import DerivedValues
from mumoe_tn.contractions.prepared import PreparedPlan

__all__ = ["FusedProjection", "LeanCoefficients", "fuse_projection"]


@dataclass(frozen=True)
class FusedProjection:
    """``[Gᵀ | M_1 | …]`` and its bias, and where each expert layer's columns are.

    Attributes
    ----------
    weight : torch.Tensor
        ``(I, ΣN_e + ΣK)``, contiguous; the gate's columns first.
    bias : torch.Tensor or None
        ``(ΣN_e + ΣK,)``, zeros where a part has none; None when no part has one.
    heads : tuple
        ``(experts, executor, position, start, stop)`` per fused expert layer: its prepared plan,
        the plan's step the columns ``start:stop`` compute.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    heads: tuple[tuple[Any, PreparedPlan, int, int, int], ...]


def fuse_projection(
    weight: torch.Tensor, bias: torch.Tensor | None, executors: Sequence[tuple[Any, PreparedPlan | None]]
) -> FusedProjection:
    """The fused matrix of the gate's ``weight`` (``(ΣN_e, I)``) and ``bias`` with the plans' input steps."""
    matrices, biases, heads = [weight.t()], [bias], []
    start = weight.shape[0]
    for experts, executor in executors:
        projection = None if executor is None else executor.input_projection
        if projection is None:
            continue
        matrix = projection.matrix
        if matrix.shape[0] != weight.shape[1] or matrix.dtype != weight.dtype or matrix.device != weight.device:
            continue
        stop = start + matrix.shape[1]
        matrices.append(matrix)
        biases.append(projection.bias)
        heads.append((experts, executor, projection.position, start, stop))
        start = stop
    fused_bias = None
    if any(b is not None for b in biases):
        widths = [m.shape[1] for m in matrices]
        fused_bias = torch.cat(
            [weight.new_zeros(w) if b is None else b.reshape(w) for b, w in zip(biases, widths, strict=True)]
        )
    return FusedProjection(torch.cat(matrices, dim=1).contiguous(), fused_bias, tuple(heads))


class LeanCoefficients(tuple):
    """A layer's coefficients (one tensor per mode) with what the fused inference product computed alongside.

    Behaves as the plain tuple of coefficients; a layer's contraction of the same ``z`` reads
    ``projected`` (``id(experts) → (plan, step, result)``) instead of repeating that product.
    """

    z: torch.Tensor
    flat: torch.Tensor
    rows: tuple[torch.Tensor, ...]
    projected: dict[int, tuple[PreparedPlan, int, torch.Tensor]]

    def __new__(
        cls,
        values: tuple[torch.Tensor, ...],
        z: torch.Tensor,
        flat: torch.Tensor,
        rows: tuple[torch.Tensor, ...],
        projected: dict[int, tuple[PreparedPlan, int, torch.Tensor]],
    ) -> LeanCoefficients:
        made = super().__new__(cls, values)
        made.z, made.flat, made.rows, made.projected = z, flat, rows, projected
        return made


#: The name 0.3 pickled a layer's fused matrices under: it loads as an empty holder (the layer drops it).
FusedProjections = DerivedValues
