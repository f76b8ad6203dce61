"""Conversion of expert tensors to and from tensorly-torch's ``FactorizedTensor`` classes.

A format that has a tensorly-torch counterpart names it ([`Format.tltorch_class`][mumoe_tn.decompositions.format]): CP,
TT and Tucker networks map to ``tltorch.CPTensor``, ``TTTensor`` and ``TuckerTensor`` of shape ``(N_1, …, N_E, I, O)``;
tltorch has no tensor-ring format, and a custom network has no counterpart. Cores are copied, not shared. tltorch sets
tensorly's global backend to pytorch when it is first imported; mumoe_tn imports it lazily and
restores the backend that was active, so reconstruct tltorch tensors inside
``tensorly.backend_context("pytorch")`` unless your code imports tltorch itself.
"""

from __future__ import annotations

from typing import Any

import torch

from mumoe_tn.decompositions.format import Format
from mumoe_tn.decompositions.registry import available, get_format
from mumoe_tn.layers import FactorizedExperts

__all__ = ["from_tltorch", "to_tltorch"]


def _tltorch_formats() -> dict[str, Format]:
    formats = (get_format(name) for name in available())
    return {fmt.tltorch_class: fmt for fmt in formats if fmt.tltorch_class is not None}


def to_tltorch(experts: FactorizedExperts) -> Any:
    """The expert tensor as a tltorch factorized tensor (a copy).

    Parameters
    ----------
    experts : FactorizedExperts
        Expert cores whose format has a tltorch counterpart (e.g. ``layer.experts`` of a CP, TT
        or Tucker layer).

    Returns
    -------
    tltorch.FactorizedTensor
    """
    if not isinstance(experts, FactorizedExperts):
        raise TypeError(f"to_tltorch needs FactorizedExperts (e.g. layer.experts), got {type(experts).__name__}")
    import tensorly as tl

    net = experts.network
    fmt = net.format
    if fmt is None or fmt.tltorch_class is None:
        raise ValueError(
            f"a {net.name!r} network has no tensorly-torch counterpart; formats that have one: "
            f"{sorted(f.name for f in _tltorch_formats().values())}"
        )
    with tl.backend_context("pytorch"):
        return fmt.to_tltorch(net, experts.cores)


@torch.no_grad()
def from_tltorch(tensor: Any) -> FactorizedExperts:
    """Expert cores from a tltorch factorized tensor (a copy).

    The tensor's shape is read as ``(N_1, …, N_E, I, O)``: its last two modes are the input
    and output legs, every earlier mode an expert mode.

    Parameters
    ----------
    tensor : tltorch.FactorizedTensor
        A factorized tensor of order 3 or more whose class a registered format converts from
        (``CPTensor``, ``TTTensor``, ``TuckerTensor``).

    Returns
    -------
    FactorizedExperts
    """
    kind = type(tensor).__name__
    formats = _tltorch_formats()
    if kind not in formats:
        raise ValueError(f"from_tltorch reads {sorted(formats)}, got {kind}")
    shape = tuple(tensor.shape)
    if len(shape) < 3:
        raise ValueError(f"an expert tensor has shape (N_1, …, N_E, I, O) with E >= 1; got {kind} of shape {shape}")
    network, values = formats[kind].from_tltorch(tensor)
    experts = FactorizedExperts(network, device=values[0].device, dtype=values[0].dtype)
    for name, value in zip(network.cores, values, strict=True):
        getattr(experts, name).copy_(value)
    return experts
