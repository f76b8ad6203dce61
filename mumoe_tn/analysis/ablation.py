"""Counterfactual expert ablation: switch experts off inside the contraction, weights untouched.

The μMoE output is linear in every coefficient vector, so zeroing coefficient ``a_{e,n}`` equals
zeroing the slice ``W[…, n, …]`` of the dense tensor along mode ``e``. For one expert mode that
*is* switching expert ``n`` off. In a hierarchical layer a single expert is a multi-index
``(n_1, …, n_E)``; its contribution ``a_{1,n_1}⋯a_{E,n_E}·W_{n_1…n_E}ᵀ z`` is subtracted, with
its matrix computed from the cores
([`FactorizedExperts.expert`][mumoe_tn.layers.experts.FactorizedExperts.expert]), never from
``W``.

Ablations can differ per group of samples: with ``group_size=B`` the first input dimension
holds ``K·B`` samples and group ``k`` ablates the ``k``-th expert set — so ``K`` counterfactual
forward passes run as one batch.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from mumoe_tn.analysis.validation import check_int, check_layer
from mumoe_tn.layers import FactorizedExperts, MuMoEBase

__all__ = ["ExpertAblation", "ablate"]


def _is_index(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _multi_indices(experts: object, n_modes: int) -> list[tuple[int, ...]]:
    """Normalise ``experts`` (an index, a multi-index, a sequence of them or an integer tensor)."""
    if isinstance(experts, torch.Tensor):
        if experts.dtype.is_floating_point or experts.dtype.is_complex or experts.dtype == torch.bool:
            raise TypeError(f"experts given as a tensor must have an integer dtype, got {experts.dtype}")
        experts = experts.tolist()
    if _is_index(experts) or (isinstance(experts, tuple) and experts and all(_is_index(k) for k in experts)):
        experts = [experts]
    if isinstance(experts, (str, bytes)) or not isinstance(experts, Iterable):
        raise TypeError(
            f"experts must be an int, a tuple of ints (one per expert mode) or a sequence of them, got {experts!r}"
        )
    result = []
    for expert in experts:
        if _is_index(expert):
            index: tuple = (expert,)
        elif isinstance(expert, Iterable) and not isinstance(expert, (str, bytes, Mapping)):
            index = tuple(expert.tolist() if isinstance(expert, torch.Tensor) else expert)
        else:
            raise TypeError(f"an expert is an int or a tuple of ints, got {expert!r} ({type(expert).__name__})")
        if not all(_is_index(k) for k in index):
            raise TypeError(f"an expert's indices must be ints, got {expert!r}")
        if len(index) != n_modes:
            raise ValueError(f"an expert of a layer with {n_modes} expert mode(s) is a {n_modes}-tuple, got {expert!r}")
        result.append(tuple(int(k) for k in index))
    return list(dict.fromkeys(result))  # an expert named twice is switched off once


class ExpertAblation:
    """Experts to switch off in one μMoE layer (set as ``layer.ablation``).

    Parameters
    ----------
    expert_dims : tuple of int
        The layer's expert dims.
    groups : Sequence of Sequence of multi-index
        One set of experts per group; each expert an int (one mode) or an ``E``-tuple.
    group_size : int, optional
        Samples per group along the input's first dimension; None applies the first (only)
        set to every sample.
    """

    def __init__(self, expert_dims: tuple[int, ...], groups: Sequence[object], group_size: int | None = None) -> None:
        if isinstance(expert_dims, (str, bytes)) or not isinstance(expert_dims, Sequence) or not expert_dims:
            raise TypeError(f"expert_dims must be a non-empty tuple of ints, got {expert_dims!r}")
        self.expert_dims = tuple(check_int("expert_dims entry", n, minimum=1) for n in expert_dims)
        if group_size is not None:
            group_size = check_int("group_size", group_size, minimum=1)
        if isinstance(groups, (str, bytes, torch.Tensor)) or not isinstance(groups, Sequence):
            raise TypeError(f"groups must be a sequence of expert sets (one per group), got {groups!r}")
        if not groups:
            raise ValueError("groups is empty: give at least one set of experts to switch off")
        self.groups = [_multi_indices(group, len(self.expert_dims)) for group in groups]
        for group in self.groups:
            for index in group:
                for k, n in zip(index, self.expert_dims, strict=True):
                    if not 0 <= k < n:
                        raise ValueError(f"expert {index} is out of range for expert dims {self.expert_dims}")
        if group_size is None and len(self.groups) != 1:
            raise ValueError("several ablation groups need group_size (samples per group)")
        self.group_size = group_size
        self._single_mode = len(self.expert_dims) == 1

    def _rows(self, tensor: torch.Tensor) -> int:
        if self.group_size is None:
            return 1
        expected = len(self.groups) * self.group_size
        if tensor.shape[0] != expected:
            raise ValueError(
                f"the ablation has {len(self.groups)} groups of {self.group_size} samples: the input's first "
                f"dimension must be {expected}, got {tensor.shape[0]}"
            )
        return len(self.groups)

    def gate(self, gate: nn.Module, z: torch.Tensor, **options: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run ``gate`` on ``z``, once per distinct group.

        Batched ablations replicate the same samples in every group; the coefficients are then
        computed on the first group and repeated (checked exactly with ``torch.equal``, so a
        different input in any group falls back to gating every row).
        """
        if self.group_size is None or len(self.groups) == 1 or options:  # a token mask: gate every row
            return gate(z, **options)
        groups = len(self.groups)
        self._rows(z)
        first = z[: self.group_size]
        if not torch.equal(z.reshape(groups, self.group_size, *z.shape[1:]), first.expand(groups, *first.shape)):
            return gate(z, **options)
        return tuple(a.repeat(groups, *([1] * (a.ndim - 1))) for a in gate(first))

    def mask(self, coefficients: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Coefficients with single-mode experts zeroed (one expert mode only)."""
        if not self._single_mode:
            return tuple(coefficients)
        (a,) = coefficients
        groups = self._rows(a)
        keep = torch.ones(groups, self.expert_dims[0], dtype=a.dtype, device=a.device)
        for g, group in enumerate(self.groups):
            keep[g, [index[0] for index in group]] = 0
        if self.group_size is not None:
            keep = keep.repeat_interleave(self.group_size, dim=0)
        return (a * keep.reshape(keep.shape[0], *([1] * (a.ndim - 2)), a.shape[-1]),)

    def correct(
        self,
        experts: FactorizedExperts,
        z: torch.Tensor,
        coefficients: Sequence[torch.Tensor],
        y: torch.Tensor,
        *,
        append_one: bool,
    ) -> torch.Tensor:
        """Subtract the contributions of multi-index experts (hierarchical layers)."""
        if self._single_mode:
            return y
        if self.group_size is None:
            return y - self._contribution(experts, z, coefficients, self.groups[0], append_one)
        self._rows(z)
        parts = []
        for g, group in enumerate(self.groups):
            rows = slice(g * self.group_size, (g + 1) * self.group_size)
            chunk = [a[rows] for a in coefficients]
            parts.append(y[rows] - self._contribution(experts, z[rows], chunk, group, append_one))
        return torch.cat(parts, dim=0)

    @staticmethod
    def _contribution(
        experts: FactorizedExperts,
        z: torch.Tensor,
        coefficients: Sequence[torch.Tensor],
        group: list[tuple[int, ...]],
        append_one: bool,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=z.dtype, device=z.device)
        for index in group:
            matrix = experts.expert(index).to(z.dtype)
            out = z @ matrix[: z.shape[-1]]
            if append_one:
                out = out + matrix[-1]
            weight = coefficients[0][..., index[0]]
            for a, k in zip(coefficients[1:], index[1:], strict=True):
                weight = weight * a[..., k]
            total = total + weight[..., None] * out
        return total


@contextmanager
def ablate(layer: MuMoEBase, experts: object, *, group_size: int | None = None) -> Iterator[ExpertAblation]:
    """Switch experts off inside ``layer`` for the duration of a ``with`` block.

    Parameters
    ----------
    layer : MuMoEBase
        The layer (weights are never modified).
    experts : int, tuple, or sequence of them
        Without ``group_size``: the experts to switch off (ints for one expert mode, tuples
        ``(n_1, …, n_E)`` for hierarchical layers). With ``group_size``: a sequence of such
        sets, one per group of ``group_size`` samples.
    group_size : int, optional
        Samples per group along the input's first dimension (batched ablations).

    Yields
    ------
    ExpertAblation

    Examples
    --------
    >>> import torch
    >>> from mumoe_tn import MuMoE
    >>> layer = MuMoE(8, 4, 16, "cp", 4).eval()
    >>> with ablate(layer, [3, 5]):
    ...     y = layer(torch.randn(2, 8))
    """
    layer = check_layer("layer", layer)
    if layer.ablation is not None:
        raise ValueError("this layer already has an active ablation; nest ablations on different layers only")
    if group_size is not None and (
        isinstance(experts, (str, bytes, torch.Tensor)) or not isinstance(experts, Sequence)
    ):
        raise TypeError(f"with group_size, experts must be a sequence of expert sets (one per group), got {experts!r}")
    groups = experts if group_size is not None else [experts]
    ablation = ExpertAblation(layer.expert_dims, groups, group_size)
    layer.ablation = ablation
    try:
        yield ablation
    finally:
        layer.ablation = None
