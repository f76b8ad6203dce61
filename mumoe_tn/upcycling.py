"""Start μMoE experts from trained weights: upcycling a Linear and decomposing a dense expert tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.contractions.dense import materialize
from mumoe_tn.decompositions.registry import build
from mumoe_tn.layers import FactorizedExperts, MuMoE
from mumoe_tn.network import ExpertNetwork

__all__ = ["decompose_dense", "linear_matrix", "upcycle_experts", "upcycle_linear"]


# ----------------------------------------------------------------------------- upcycling
def linear_matrix(linear: nn.Linear) -> torch.Tensor:
    """``[Wᵀ; b]`` of shape ``(I + 1, O)`` (or ``(I, O)`` without bias), the μMoE's i × o layout.

    Parameters
    ----------
    linear : nn.Linear
        The layer.

    Returns
    -------
    torch.Tensor
        Detached, in the layer's dtype and device.
    """
    weight = linear.weight.detach().T
    if linear.bias is None:
        return weight
    return torch.cat([weight, linear.bias.detach()[None]], dim=0)


@torch.no_grad()
def _replicate(experts: FactorizedExperts, left: torch.Tensor, right: torch.Tensor) -> None:
    """Set the cores of a CP/TR/TT/Tucker network so that every expert equals ``left @ rightᵀ``.

    Expert cores pass one bond index (0) through unchanged — ones for CP, identity slices for
    TR/TT, the first Tucker component — so each expert's matrix is the contraction of the
    input and output cores, which hold the (padded) factors ``left (I, k)`` and ``right (O, k)``.
    """
    net = experts.network
    cores = experts.cores
    k = left.shape[1]
    for core in cores.values():
        core.zero_()

    def pad(factor: torch.Tensor, size: int) -> torch.Tensor:
        return torch.nn.functional.pad(factor, (0, size - k))

    if net.name == "cp":
        for leg in net.expert_legs:
            cores[f"U_{leg}"].fill_(1.0)
        cores["U_i"].copy_(pad(left, net.sizes["r"]))
        cores["U_o"].copy_(pad(right, net.sizes["r"]))
    elif net.name in ("tr", "tt"):
        for leg in net.expert_legs:
            labels = net.cores[f"G_{leg}"]
            core = cores[f"G_{leg}"]
            if len(labels) == 2:  # the first TT core (n1, r1)
                core[:, 0] = 1.0
            else:
                eye = torch.eye(core.shape[0], core.shape[2], dtype=core.dtype, device=core.device)
                core.copy_(eye[:, None, :].expand_as(core))
        g_i, g_o = cores["G_i"], cores["G_o"]
        g_i[0].copy_(pad(left, g_i.shape[-1]))
        if net.name == "tr":
            g_o[:, :, 0].copy_(pad(right, g_o.shape[0]).T)
        else:
            g_o.copy_(pad(right, g_o.shape[0]).T)
    elif net.name == "tucker":
        for leg in net.expert_legs:
            cores[f"U_{leg}"][:, 0] = 1.0
        core = cores["core"]
        head = core[(0,) * net.n_expert_modes]
        head.copy_(torch.eye(*head.shape, dtype=core.dtype, device=core.device))
        cores["U_i"].copy_(pad(left, core.shape[-2]))
        cores["U_o"].copy_(pad(right, core.shape[-1]))
    else:
        raise ValueError(f"upcycling builds cp, tr, tt and tucker networks in closed form; got a {net.name!r} network")


def _io_rank(network: ExpertNetwork) -> int:
    """How many components of the SVD the network's input/output cores can hold."""
    if network.name == "cp":
        return network.sizes["r"]
    if network.name == "tr":
        return network.sizes[f"r{network.n_expert_modes + 2}"]
    if network.name == "tt":
        return network.sizes[f"r{network.n_expert_modes + 1}"]
    return min(network.sizes["s_i"], network.sizes["s_o"])


@torch.no_grad()
def upcycle_linear(
    linear: nn.Linear,
    expert_dims: int | Sequence[int],
    decomposition: str = "cp",
    rank: int | Sequence[int] | str | None = None,
    **layer_options: Any,
) -> tuple[MuMoE, float]:
    """A μMoE layer whose every expert starts as the trained ``linear``.

    ``W = [Wᵀ; b]`` is split by an SVD, ``W = (U√S)(V√S)ᵀ``, into the input and output cores,
    and the expert cores pass it through unchanged, so every expert equals ``W``: since each row
    of coefficients sums to one, the layer computes ``linear(x)`` exactly for any gate output
    when the rank holds all of ``W``'s singular values, and the best approximation of that rank
    otherwise (the relative error is returned).

    Parameters
    ----------
    linear : nn.Linear
        The trained layer.
    expert_dims : int or Sequence[int]
        ``N`` or ``(N_1, …, N_E)``.
    decomposition : {"cp", "tr", "tt", "tucker"}, optional
        The μMoE's decomposition.
    rank : int or Sequence[int] or "linear", optional
        Ranks as for [`MuMoE`][mumoe_tn.layers.MuMoE]; by default the smallest that represents
        ``W`` exactly (``min(I + 1, O)`` on the input–output bond).
    **layer_options
        Further [`MuMoE`][mumoe_tn.layers.MuMoE] arguments (activation, gate_norm, …).

    Returns
    -------
    layer : MuMoE
    relative_error : float
        ``‖W − Ŵ‖_F / ‖W‖_F`` of the expert matrix.
    """
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"upcycle_linear needs an nn.Linear, got {type(linear).__name__}")
    matrix = linear_matrix(linear)
    if rank is None:
        rank = min(matrix.shape)
    factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
    layer = MuMoE(
        linear.in_features,
        linear.out_features,
        expert_dims,
        decomposition,
        rank,
        bias=linear.bias is not None,
        **factory,
        **layer_options,
    )
    return layer, upcycle_experts(layer.experts, matrix)


@torch.no_grad()
def upcycle_experts(experts: FactorizedExperts, matrix: torch.Tensor) -> float:
    """Set ``experts``' cores so that every expert's matrix equals ``matrix``.

    Parameters
    ----------
    experts : FactorizedExperts
        The expert cores to overwrite (e.g. ``layer.experts``).
    matrix : torch.Tensor
        Shape ``(I, O)`` in the μMoE's layout, leg ``i`` first: ``[Wᵀ; b]`` for a Linear with a
        folded bias (see [`linear_matrix`][mumoe_tn.upcycling.linear_matrix]).

    Returns
    -------
    float
        ``‖M − Ŵ_n‖_F / ‖M‖_F`` for an expert ``n``: 0 up to rounding when the network can hold
        ``matrix`` exactly, else the error of the best fit found.
    """
    net = experts.network
    expected = (net.in_features, net.out_features)
    if not isinstance(matrix, torch.Tensor) or tuple(matrix.shape) != expected:
        raise ValueError(
            f"matrix must be a tensor of shape {expected} (legs i, o of the network), got "
            f"{tuple(getattr(matrix, 'shape', ())) or type(matrix).__name__}"
        )
    first = next(iter(experts.cores.values()))
    matrix = matrix.detach().to(device=first.device, dtype=torch.promote_types(first.dtype, torch.float32))
    left, singular, right_t = torch.linalg.svd(matrix, full_matrices=False)
    k = min(_io_rank(net), singular.numel())
    root = singular[:k].sqrt()
    factory = {"device": first.device, "dtype": first.dtype}
    _replicate(experts, (left[:, :k] * root).to(**factory), (right_t[:k].T * root).to(**factory))
    approx = experts.expert((0,) * net.n_expert_modes).to(matrix.dtype)
    return float((approx - matrix).norm() / matrix.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- dense tensors
@torch.no_grad()
def decompose_dense(
    weight: torch.Tensor,
    decomposition: str,
    rank: int | Sequence[int],
    *,
    n_iter_max: int = 100,
    random_state: int | None = 0,
    tr_method: str = "svd",
) -> tuple[FactorizedExperts, float]:
    """Decompose a dense expert tensor ``W (N_1, …, N_E, I, O)`` into a μMoE expert network.

    Uses tensorly's algorithms (``parafac`` for CP, ``tensor_ring`` (TR-SVD) for TR,
    ``tensor_train`` for TT, ``tucker`` for Tucker) in a pytorch backend context, and returns
    the cores as a [`FactorizedExperts`][mumoe_tn.layers.FactorizedExperts] on ``weight``'s device.

    Parameters
    ----------
    weight : torch.Tensor
        Dense expert tensor, e.g. a trained dense MoE's stacked ``[W_nᵀ; b_n]``.
    decomposition : {"cp", "tr", "tt", "tucker"}
        Target decomposition.
    rank : int or Sequence[int]
        Ranks as for the named builders (TR: ``E + 2`` ranks, or one int for the input–output
        bond with the others 4).
    n_iter_max : int, optional
        Iterations of the iterative algorithms (CP, Tucker).
    random_state : int, optional
        Seed of the iterative algorithms.
    tr_method : {"svd", "als"}, optional
        tensorly's ``tensor_ring`` (TR-SVD, sequential and quasi-optimal) or
        ``tensor_ring_als``. Neither is guaranteed to find an exact tensor ring of the given
        ranks; the returned error says how close it got.

    Returns
    -------
    experts : FactorizedExperts
    relative_error : float
        ``‖W − Ŵ‖_F / ‖W‖_F``.
    """
    import tensorly as tl

    if not isinstance(weight, torch.Tensor) or weight.ndim < 3:
        raise ValueError(
            f"weight must be a tensor (N_1, …, N_E, I, O) with at least one expert mode, got "
            f"{getattr(weight, 'shape', type(weight).__name__)}"
        )
    *dims, in_features, out_features = weight.shape
    network = build(decomposition, tuple(dims), in_features, out_features, rank)
    ranks = [network.sizes[bond] for bond in network.bonds]
    data = weight.detach().to(torch.promote_types(weight.dtype, torch.float32))
    if tr_method not in ("svd", "als"):
        raise ValueError(f"tr_method must be 'svd' or 'als', got {tr_method!r}")
    with tl.backend_context("pytorch"):
        if network.name == "cp":
            weights, factors = tl.decomposition.parafac(
                data, network.sizes["r"], n_iter_max=n_iter_max, init="random", random_state=random_state
            )
            factors = [factors[0] * weights[None], *factors[1:]]
        elif network.name == "tr" and tr_method == "als":
            factors = list(
                tl.decomposition.tensor_ring_als(
                    data, rank=[*ranks, ranks[0]], n_iter_max=n_iter_max, random_state=random_state
                )
            )
        elif network.name == "tr":
            if ranks[0] * ranks[1] > dims[0]:
                raise ValueError(
                    f"TR-SVD needs R1·R2 <= N1, got {ranks[0]}·{ranks[1]} > {dims[0]}; lower the expert ranks "
                    "or use tr_method='als'"
                )
            factors = list(tl.decomposition.tensor_ring(data, rank=[*ranks, ranks[0]]))
        elif network.name == "tt":
            factors = list(tl.decomposition.tensor_train(data, rank=[1, *ranks, 1]))
            factors[0], factors[-1] = factors[0][0], factors[-1][..., 0]
        elif network.name == "tucker":
            core, factors = tl.decomposition.tucker(
                data, rank=ranks, n_iter_max=n_iter_max, init="random", random_state=random_state
            )
            factors = [core, *factors]
        else:
            raise ValueError(f"decompose_dense supports cp, tr, tt and tucker, got {decomposition!r}")
    experts = FactorizedExperts(network, device=weight.device, dtype=weight.dtype)
    for name, factor in zip(network.cores, factors, strict=True):
        getattr(experts, name).copy_(factor.reshape(network.core_shape(name)))
    error = (materialize(network, experts.cores).to(data.dtype) - data).norm() / data.norm().clamp_min(1e-30)
    return experts, float(error)
