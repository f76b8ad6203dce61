"""Conversion of expert tensors to and from tensorly-torch's ``FactorizedTensor`` classes.

CP, TT and Tucker expert networks map to ``tltorch.CPTensor``, ``TTTensor`` and
``TuckerTensor`` of shape ``(N_1, …, N_E, I, O)``; tltorch has no tensor-ring format. Cores are
copied, not shared. tltorch sets tensorly's global backend to pytorch when it is first
imported; mumoe_tn imports it lazily and restores the backend that was active, so reconstruct
tltorch tensors inside ``tensorly.backend_context("pytorch")`` unless your code imports tltorch
itself.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from mumoe_tn.decompositions.registry import build
from mumoe_tn.layers import FactorizedExperts

__all__ = ["from_tltorch", "to_tltorch"]


def _tltorch() -> ModuleType:
    import tensorly as tl

    previous = tl.get_backend()
    import tltorch

    tl.set_backend(previous)
    return tltorch


def _copy(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone())


def to_tltorch(experts: FactorizedExperts) -> Any:
    """The expert tensor as a tltorch ``CPTensor``, ``TTTensor`` or ``TuckerTensor`` (a copy).

    Parameters
    ----------
    experts : FactorizedExperts
        CP, TT or Tucker expert cores (e.g. ``layer.experts``).

    Returns
    -------
    tltorch.FactorizedTensor
    """
    import tensorly as tl

    tltorch = _tltorch()
    net, cores = experts.network, experts.cores
    legs = [*net.expert_legs, "i", "o"]
    with tl.backend_context("pytorch"):
        if net.name == "cp":
            weights = torch.ones(net.sizes["r"], dtype=cores["U_i"].dtype, device=cores["U_i"].device)
            return tltorch.CPTensor(_copy(weights), [_copy(cores[f"U_{leg}"]) for leg in legs])
        if net.name == "tt":
            factors = [cores[f"G_{leg}"] for leg in legs]
            factors[0], factors[-1] = factors[0][None], factors[-1][..., None]
            return tltorch.TTTensor([_copy(f) for f in factors])
        if net.name == "tucker":
            return tltorch.TuckerTensor(_copy(cores["core"]), [_copy(cores[f"U_{leg}"]) for leg in legs])
    raise ValueError(f"tltorch has CP, TT and Tucker tensors; a {net.name!r} network has no tltorch counterpart")


@torch.no_grad()
def from_tltorch(tensor: Any) -> FactorizedExperts:
    """Expert cores from a tltorch ``CPTensor``, ``TTTensor`` or ``TuckerTensor`` (a copy).

    The tensor's shape is read as ``(N_1, …, N_E, I, O)``: its last two modes are the input
    and output legs, every earlier mode an expert mode.

    Parameters
    ----------
    tensor : tltorch.FactorizedTensor
        A CP, TT or Tucker factorized tensor of order 3 or more.

    Returns
    -------
    FactorizedExperts
    """
    kind = type(tensor).__name__
    shape = tuple(tensor.shape)
    if len(shape) < 3:
        raise ValueError(f"an expert tensor has shape (N_1, …, N_E, I, O) with E >= 1; got {kind} of shape {shape}")
    *dims, in_features, out_features = shape
    factors = [f.detach() for f in tensor.factors]
    if kind == "CPTensor":
        rank = factors[0].shape[1]
        network = build("cp", dims, in_features, out_features, rank)
        values = [factors[0] * tensor.weights.detach()[None], *factors[1:]]
    elif kind == "TTTensor":
        ranks = [f.shape[-1] for f in factors[:-1]]
        network = build("tt", dims, in_features, out_features, ranks)
        values = [factors[0][0], *factors[1:-1], factors[-1][..., 0]]
    elif kind == "TuckerTensor":
        network = build("tucker", dims, in_features, out_features, list(tensor.core.shape))
        values = [tensor.core.detach(), *factors]
    else:
        raise ValueError(f"from_tltorch reads CPTensor, TTTensor and TuckerTensor, got {kind}")
    experts = FactorizedExperts(network, device=values[0].device, dtype=values[0].dtype)
    for name, value in zip(network.cores, values, strict=True):
        getattr(experts, name).copy_(value)
    return experts
