"""Zero-padding large bonds to an aligned size before a contraction (exact, often faster).

BLAS and cuBLAS kernels run matrix products whose sizes are multiples of 8 or 16 faster than their
neighbours: on the benchmarks' CPU a ``(1024 × 3072) @ (3072 × 529)`` product takes 1.2–1.5× the
time of the same product with 544 columns, though it does 3 % less arithmetic. The ranks that
parameter matching finds are rarely aligned (CP ``R = 529`` for ``nn.Linear(768, 3072)``), so a
layer may execute its contraction with each large bond zero-padded to the next multiple of 16.

This is exact: a bond joins only cores, every core that carries a padded bond gets zero slices
along it, and each padded index then contributes a product with a zero factor to every sum it
enters. The output has no bond dimension, so its shape and values are those of the unpadded
contraction; the cores' gradients are the padded gradients sliced back (``torch.nn.functional.pad``
differentiates to that slice).

Only bonds of at least [`MIN_PADDED_SIZE`][mumoe_tn.contractions.padding] are padded, so with the
default multiple of 16 the extra arithmetic stays below 15/256 ≈ 6 % (a multiple ``m`` adds up to
``(m − 1)/256``); small bonds (TR's ranks of 4, a d = 64 block's ``R = 38``) would grow by up to 4×
and are left alone. Whether it pays depends on the sizes and the BLAS: on the benchmarks' CPU an
exactly matched CP layer (529 → 544) ran in 0.90× the time, a hierarchical CP block (570 → 576) in
1.05× (neither by much more than the machine's noise; see the results page).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from mumoe_tn.network import ExpertNetwork

__all__ = ["MIN_PADDED_SIZE", "PAD_MULTIPLE", "bond_padding", "pad_cores"]

#: Smallest bond size that is padded.
MIN_PADDED_SIZE = 256
#: The multiple layers pad their large bonds to by default.
PAD_MULTIPLE = 16


def bond_padding(network: ExpertNetwork, multiple: int | None) -> dict[str, int]:
    """The padded size of every bond of ``network`` worth padding to a multiple of ``multiple``.

    Parameters
    ----------
    network : ExpertNetwork
        The decomposition.
    multiple : int or None
        Pad bonds of at least [`MIN_PADDED_SIZE`][mumoe_tn.contractions.padding] up to a multiple of
        this; None (or 1) pads nothing.

    Returns
    -------
    dict of str to int
        Bond label → padded size, for the bonds whose size changes.
    """
    if multiple is None:
        return {}
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_bonds must be a positive int or None, got {multiple!r}")
    padding = {}
    for bond in network.bonds:
        size = network.sizes[bond]
        aligned = -(-size // multiple) * multiple
        if size >= MIN_PADDED_SIZE and aligned != size:
            padding[bond] = aligned
    return padding


def pad_cores(
    cores: Sequence[torch.Tensor], labels: Sequence[Sequence[str]], padding: Mapping[str, int]
) -> list[torch.Tensor]:
    """``cores`` with zeros appended along every dimension whose label ``padding`` names.

    Parameters
    ----------
    cores : Sequence of torch.Tensor
        The cores, in the order of ``labels``.
    labels : Sequence of Sequence of str
        Each core's dimension labels.
    padding : Mapping of str to int
        Label → padded size (at least the label's size in every core that carries it).

    Returns
    -------
    list of torch.Tensor
        Padded copies of the cores that carry a padded label; the other cores as given.

    Raises
    ------
    ValueError
        If a core's dimensions disagree with its labels, or a padded size is below a dimension it pads.
    """
    if len(cores) != len(labels):
        raise ValueError(f"got {len(cores)} cores for {len(labels)} label tuples")
    padded = []
    for core, names in zip(cores, labels, strict=True):
        if core.ndim != len(names):
            raise ValueError(f"a core of shape {tuple(core.shape)} cannot carry the labels {tuple(names)}")
        widths: list[int] = []  # F.pad lists (before, after) from the last dimension backwards
        for name, size in zip(reversed(names), reversed(core.shape), strict=True):
            target = padding.get(name, size)
            if target < size:
                raise ValueError(f"bond {name!r} of size {size} cannot be padded to {target}")
            widths += [0, target - size]
        padded.append(F.pad(core, widths) if any(widths) else core)
    return padded
