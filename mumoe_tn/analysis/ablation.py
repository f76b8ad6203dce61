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

from mumoe_tn.analysis.layer_checks import check_layer
from mumoe_tn.layers import FactorizedExperts, MuMoEBase
from mumoe_tn.validation import check_int

__all__ = ["ExpertAblation", "ablate"]


def _is_index(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _multi_indices(experts: object, n_modes: int) -> list[tuple[int | None, ...]]:
    """Normalise ``experts`` (an index, a multi-index, a sequence of them or an integer tensor).

    A multi-index may hold ``None`` for "every index of this mode": ``(3, None)`` is the slice
    ``n_1 = 3``, every ``n_2``.
    """
    if isinstance(experts, torch.Tensor):
        if experts.dtype.is_floating_point or experts.dtype.is_complex or experts.dtype == torch.bool:
            raise TypeError(f"experts given as a tensor must have an integer dtype, got {experts.dtype}")
        experts = experts.tolist()
    if _is_index(experts) or (
        isinstance(experts, tuple) and experts and all(_is_index(k) or k is None for k in experts)
    ):
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
        if not all(_is_index(k) or k is None for k in index):
            raise TypeError(f"an expert's indices must be ints (or None for a whole mode), got {expert!r}")
        if len(index) != n_modes:
            raise ValueError(f"an expert of a layer with {n_modes} expert mode(s) is a {n_modes}-tuple, got {expert!r}")
        if all(k is None for k in index):
            raise ValueError(f"{expert!r} names no index: fix at least one mode (e.g. (3, None))")
        result.append(tuple(None if k is None else int(k) for k in index))
    return list(dict.fromkeys(result))  # an expert named twice is switched off once


def _fixed(index: tuple[int | None, ...]) -> list[tuple[int, int]]:
    """The ``(mode, index)`` pairs a multi-index or slice fixes."""
    return [(e, k) for e, k in enumerate(index) if k is not None]


def _overlap(first: tuple[int | None, ...], second: tuple[int | None, ...]) -> bool:
    return all(a is None or b is None or a == b for a, b in zip(first, second, strict=True))


def _check_disjoint(group: list[tuple[int | None, ...]]) -> None:
    """Slices fixing two or more modes are subtracted: they must not share an expert with another item."""
    subtracted = [index for index in group if len(_fixed(index)) > 1]
    for k, index in enumerate(subtracted):
        for other in subtracted[k + 1 :]:
            if _overlap(index, other):
                raise ValueError(
                    f"experts {index} and {other} share experts: an ablation switches each expert off once, "
                    "so name slices that do not overlap"
                )


class ExpertAblation:
    """Experts to switch off in one μMoE layer (set as ``layer.ablation``).

    Parameters
    ----------
    expert_dims : tuple of int
        The layer's expert dims.
    groups : Sequence of Sequence of multi-index
        One set of experts per group; each expert an int (one mode) or an ``E``-tuple, where
        ``None`` stands for every index of a mode: ``(3, None)`` switches off the whole slice
        ``n_1 = 3`` (its coefficient is masked), ``(3, None, 5)`` every ``(3, n_2, 5)``.
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
                    if k is not None and not 0 <= k < n:
                        raise ValueError(f"expert {index} is out of range for expert dims {self.expert_dims}")
            _check_disjoint(group)
        if group_size is None and len(self.groups) != 1:
            raise ValueError("several ablation groups need group_size (samples per group)")
        self.group_size = group_size
        self._masked = any(len(_fixed(index)) == 1 for group in self.groups for index in group)
        self._subtracted = any(len(_fixed(index)) > 1 for group in self.groups for index in group)

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
        """Coefficients with every expert or slice that fixes one mode zeroed in that mode."""
        if not self._masked:
            return tuple(coefficients)
        groups = self._rows(coefficients[0])
        result = list(coefficients)
        for mode, a in enumerate(coefficients):
            keep = torch.ones(groups, self.expert_dims[mode], dtype=a.dtype, device=a.device)
            hit = False
            for g, group in enumerate(self.groups):
                for index in group:
                    fixed = _fixed(index)
                    if len(fixed) == 1 and fixed[0][0] == mode:
                        keep[g, fixed[0][1]] = 0
                        hit = True
            if not hit:
                continue
            if self.group_size is not None:
                keep = keep.repeat_interleave(self.group_size, dim=0)
            result[mode] = a * keep.reshape(keep.shape[0], *([1] * (a.ndim - 2)), a.shape[-1])
        return tuple(result)

    def correct(
        self,
        experts: FactorizedExperts,
        z: torch.Tensor,
        coefficients: Sequence[torch.Tensor],
        y: torch.Tensor,
        *,
        append_one: bool,
    ) -> torch.Tensor:
        """Subtract the contributions of experts and slices that fix two or more modes (hierarchical layers).

        Runs after [`mask`][mumoe_tn.analysis.ablation.ExpertAblation.mask]: an expert inside a
        masked slice already weighs zero, so nothing is switched off twice.
        """
        if not self._subtracted:
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
        group: list[tuple[int | None, ...]],
        append_one: bool,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=z.dtype, device=z.device)
        for index in group:
            fixed = _fixed(index)
            if len(fixed) < 2:  # masked instead
                continue
            if len(fixed) == len(index):  # one expert: its matrix from the cores
                matrix = experts.expert(index).to(z.dtype)
                out = z @ matrix[: z.shape[-1]]
                if append_one:
                    out = out + matrix[-1]
                weight = coefficients[0][..., index[0]]
                for a, k in zip(coefficients[1:], index[1:], strict=True):
                    weight = weight * a[..., k]
                total = total + weight[..., None] * out
                continue
            # a slice: the layer's contraction with every fixed mode's coefficients kept at its index only
            sliced = []
            for a, k in zip(coefficients, index, strict=True):
                if k is None:
                    sliced.append(a)
                else:
                    only = torch.zeros_like(a)
                    only[..., k] = a[..., k]
                    sliced.append(only)
            total = total + experts(z, sliced, append_one=append_one)
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
        ``(n_1, …, n_E)`` for hierarchical layers, where ``None`` means every index of a mode:
        ``(3, None)`` is the whole slice ``n_1 = 3``). With ``group_size``: a sequence of such
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
    >>> hierarchical = MuMoE(8, 4, (4, 3), "cp", 4).eval()
    >>> with ablate(hierarchical, (2, None)):  # n1 = 2, every n2
    ...     y = hierarchical(torch.randn(2, 8))
    """
    layer = check_layer(layer)
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
