"""Start μMoE experts from trained weights: upcycling a Linear and decomposing a dense expert tensor.

Both ask the network's format first (closed-form SVD upcycling and tensorly's decompositions
for CP, TR, TT and Tucker) and otherwise take the generic path, alternating least squares
over the labelled network ([`mumoe_tn.conversion.fitting.als.als_fit`][mumoe_tn.conversion.fitting.als.als_fit]), which
works for any network and
reports the error it reaches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.contractions.dense import materialise
from mumoe_tn.conversion.fitting.als import als_fit
from mumoe_tn.costs.matching import bond_cap, match_exact
from mumoe_tn.decompositions.resolve import Decomposition, Rank, resolve_network
from mumoe_tn.layers import FactorizedExperts, MuMoE
from mumoe_tn.network import ExpertNetwork, is_expert_leg

__all__ = [
    "UpcycleWarning",
    "decompose_dense",
    "exact_rank_hint",
    "linear_matrix",
    "upcycle_experts",
    "upcycle_linear",
    "upcycle_threshold",
    "warn_if_inexact",
]

#: Relative upcycle error above which the layer no longer computes what the pretrained one did and a
#: [`UpcycleWarning`][mumoe_tn.conversion.fitting.upcycling.UpcycleWarning] is given (raised to ``8 · eps`` for half
#: precision).
UPCYCLE_TOLERANCE = 1e-3


class UpcycleWarning(UserWarning):
    """Upcycled experts that differ from the pretrained layer by more than rounding."""


def upcycle_threshold(dtype: torch.dtype) -> float:
    """The relative error above which upcycling in ``dtype`` is reported: ``max(1e-3, 8 · eps(dtype))``."""
    return max(UPCYCLE_TOLERANCE, 8 * torch.finfo(dtype).eps)


def exact_rank_hint(networks: Sequence[ExpertNetwork]) -> str:
    """Where upcycling of these layers becomes exact: the bonds and rank of ``rank="exact"``, with parameters."""
    try:
        exact = match_exact(networks)[1]
    except ValueError as error:
        return f"no rank of the scaled bonds makes it exact ({error})"
    bonds = ", ".join(f"{bond}={exact[0].sizes[bond]}" for bond in exact[0].bonds)
    params = sum(net.n_params for net in exact)
    return f"rank='exact' ({bonds}; {params:,} expert parameters) makes every expert equal the pretrained layer"


def warn_if_inexact(error: float, networks: Sequence[ExpertNetwork], dtype: torch.dtype, what: str) -> None:
    """Warn ([`UpcycleWarning`][mumoe_tn.conversion.fitting.upcycling.UpcycleWarning]) if ``error`` is above threshold.

    Parameters
    ----------
    error : float
        The largest relative upcycle error of the layers.
    networks : Sequence of ExpertNetwork
        The upcycled layers' networks (one block's).
    dtype : torch.dtype
        Their parameters' dtype.
    what : str
        The upcycled module, for the message.
    """
    threshold = upcycle_threshold(dtype)
    if error > threshold:
        bonds = ", ".join(f"{bond}={networks[0].sizes[bond]}" for bond in networks[0].bonds)
        warnings.warn(
            f"upcycling {what} at {bonds} leaves a relative error of {error:.3g} (above {threshold:.0e}): the μMoE "
            f"does not compute what the pretrained layer did; {exact_rank_hint(networks)}",
            UpcycleWarning,
            stacklevel=4,  # the caller of convert / upcycle_linear
        )


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
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear_matrix needs an nn.Linear, got {type(linear).__name__}")
    weight = linear.weight.detach().T
    if linear.bias is None:
        return weight
    return torch.cat([weight, linear.bias.detach()[None]], dim=0)


@torch.no_grad()
def upcycle_linear(
    linear: nn.Linear,
    expert_dims: int | Sequence[int],
    decomposition: Decomposition = "cp",
    rank: Rank | str | None = "exact",
    *,
    match: Any = None,
    max_iter: int = 200,
    tol: float = 1e-10,
    progress: bool | None = None,
    **layer_options: Any,
) -> tuple[MuMoE, float]:
    """A μMoE layer whose every expert starts as the trained ``linear``.

    Every expert's matrix is set to ``W = [Wᵀ; b]``; since each row of coefficients sums to one,
    the layer then computes ``linear(x)`` for any gate output, exactly when the network can hold
    ``W`` (for CP/TR/TT/Tucker: the input–output bond at least ``rank(W)``) and as the best fit
    found otherwise (the relative error is returned). See
    [`upcycle_experts`][mumoe_tn.conversion.fitting.upcycling.upcycle_experts].

    Parameters
    ----------
    linear : nn.Linear
        The trained layer.
    expert_dims : int or Sequence[int]
        ``N`` or ``(N_1, …, N_E)``.
    decomposition : str or Format or ExpertNetwork or Callable, optional
        The μMoE's decomposition, as for [`MuMoE`][mumoe_tn.layers.moe.MuMoE] (any network works).
    rank : int or Sequence[int] or Mapping[str, int] or "exact" or None, optional
        Ranks. ``"exact"`` (the default; None means the same) gives the bonds parameter matching
        scales the smallest rank at which every expert equals ``W`` (see
        [`mumoe_tn.costs.match_exact`][mumoe_tn.costs.matching.match_exact]); ignored for a ready
        network.
    match : "linear" or int or float, optional
        Parameter-match instead of giving ranks (see [`MuMoE`][mumoe_tn.layers.moe.MuMoE]): fewer
        parameters, and an upcycle error that an
        [`UpcycleWarning`][mumoe_tn.conversion.fitting.upcycling.UpcycleWarning] reports
        when it exceeds [`upcycle_threshold`][mumoe_tn.conversion.fitting.upcycling.upcycle_threshold].
    max_iter, tol, progress : optional
        Bounds and progress bar of the generic fit (see
        [`upcycle_experts`][mumoe_tn.conversion.fitting.upcycling.upcycle_experts]).
    **layer_options
        Further [`MuMoE`][mumoe_tn.layers.moe.MuMoE] arguments (activation, gate_norm, …).

    Returns
    -------
    layer : MuMoE
    relative_error : float
        ``‖W − Ŵ‖_F / ‖W‖_F`` of every expert matrix.
    """
    matrix = linear_matrix(linear)
    if match is not None and rank == "exact":
        rank = None
    if isinstance(decomposition, ExpertNetwork) and match is None and rank in (None, "exact"):
        rank = None  # a ready network brings its own ranks
    elif rank is None and match is None:
        rank = "exact"
    factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
    layer = MuMoE(
        linear.in_features,
        linear.out_features,
        expert_dims,
        decomposition,
        rank,
        match=match,
        bias=linear.bias is not None,
        **factory,
        **layer_options,
    )
    error = upcycle_experts(layer.experts, matrix, max_iter=max_iter, tol=tol, progress=progress)
    what = f"an nn.Linear({linear.in_features}, {linear.out_features}) into {layer.network.name!r}"
    warn_if_inexact(error, [layer.network], linear.weight.dtype, what)
    return layer, error


@torch.no_grad()
def upcycle_experts(
    experts: FactorizedExperts,
    matrix: torch.Tensor,
    *,
    max_iter: int = 200,
    tol: float = 1e-10,
    progress: bool | None = None,
) -> float:
    """Set ``experts``' cores so that every expert's matrix equals ``matrix``.

    A format with a closed form (CP, TR, TT, Tucker) splits ``matrix`` by an SVD into its
    input and output cores and makes the expert cores pass it through. Any other network is
    fitted generically: every core is made constant along its expert legs, so every expert is
    the same matrix, the network without its expert legs, whose cores are fitted to ``matrix``
    by alternating least squares (exact, up to rounding, when the network can hold it).

    Parameters
    ----------
    experts : FactorizedExperts
        The expert cores to overwrite (e.g. ``layer.experts``).
    matrix : torch.Tensor
        Shape ``(I, O)`` in the μMoE's layout, leg ``i`` first: ``[Wᵀ; b]`` for a Linear with a
        folded bias (see [`linear_matrix`][mumoe_tn.conversion.fitting.upcycling.linear_matrix]).
    max_iter : int, optional
        Most sweeps of the generic solver (alternating least squares).
    tol : float, optional
        The generic solver stops once the relative error is below this.
    progress : bool, optional
        Show the generic solver's progress bar (default: when standard error is a terminal).

    Returns
    -------
    float
        ``‖M − Ŵ_n‖_F / ‖M‖_F`` for every expert ``n``: 0 up to rounding when the network holds
        ``matrix`` exactly, else the error of the best fit found. The closed forms are optimal: at
        ``k`` held components the error is the Eckart–Young bound
        ``sqrt(Σ_{j>k} σ_j²) / ‖M‖_F``. This function does not warn; the callers that choose ranks
        ([`upcycle_linear`][mumoe_tn.conversion.fitting.upcycling.upcycle_linear],
        [`convert`][mumoe_tn.conversion.convert.convert]) do.
    """
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int (sweeps of the generic fit), got {max_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol must be a non-negative number (relative error), got {tol!r}")
    if not isinstance(experts, FactorizedExperts):
        raise TypeError(f"upcycle_experts needs FactorizedExperts (e.g. layer.experts), got {type(experts).__name__}")
    net = experts.network
    expected = (net.in_features, net.out_features)
    if not isinstance(matrix, torch.Tensor) or tuple(matrix.shape) != expected:
        raise ValueError(
            f"matrix must be a tensor of shape {expected} (legs i, o of the network), got "
            f"{tuple(getattr(matrix, 'shape', ())) or type(matrix).__name__}"
        )
    _check_values("matrix", matrix)
    cores = experts.cores
    first = next(iter(cores.values()))
    compute = matrix.detach().to(device=first.device, dtype=torch.promote_types(first.dtype, torch.float32))
    factory = {"device": first.device, "dtype": first.dtype}
    fmt = net.format
    capacity = None if fmt is None else fmt.upcycle_capacity(net)
    if capacity is not None:
        left, singular, right_t = torch.linalg.svd(compute, full_matrices=False)
        k = min(capacity, singular.numel())
        root = singular[:k].sqrt()
        fmt.upcycle(net, cores, (left[:, :k] * root).to(**factory), (right_t[:k].T * root).to(**factory))
    else:
        reduced = {name: tuple(x for x in labels if not is_expert_leg(x)) for name, labels in net.cores.items()}
        fitted, _ = als_fit(reduced, net.sizes, compute, ("i", "o"), n_iter_max=max_iter, tol=tol, progress=progress)
        for name, labels in net.cores.items():
            shape = [1 if is_expert_leg(x) else net.sizes[x] for x in labels]
            cores[name].copy_(fitted[name].reshape(shape).expand(cores[name].shape))
    approx = experts.expert((0,) * net.n_expert_modes).to(compute.dtype)
    return float((approx - compute).norm() / compute.norm().clamp_min(1e-30))


@torch.no_grad()
def decompose_dense(
    weight: torch.Tensor,
    decomposition: Decomposition,
    rank: Rank | None = None,
    *,
    n_iter_max: int = 100,
    random_state: int | None = 0,
    **options: Any,
) -> tuple[FactorizedExperts, float]:
    """Decompose a dense expert tensor ``W (N_1, …, N_E, I, O)`` into any μMoE expert network.

    A format's own algorithm is used where it has one (tensorly's ``parafac`` for CP,
    ``tensor_ring`` / ``tensor_ring_als`` for TR, ``tensor_train`` for TT, ``tucker`` for Tucker,
    in a pytorch backend context); any other network (a spec string, a ready network, a
    format without a decomposition) is fitted by alternating least squares. The cores come back
    as a [`FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts] on ``weight``'s device.

    Parameters
    ----------
    weight : torch.Tensor
        Dense floating-point expert tensor, e.g. a trained dense MoE's stacked ``[W_nᵀ; b_n]``.
    decomposition : str or Format or ExpertNetwork or Callable
        Target network: a format name, a spec string, a ready network (its legs are set to
        ``weight``'s sizes), …
    rank : int or Sequence[int] or Mapping[str, int], optional
        Ranks (not needed for a ready network).
    n_iter_max : int, optional
        Iterations (sweeps) of the iterative algorithms.
    random_state : int, optional
        Seed of the iterative algorithms.
    **options
        Format-specific options, e.g. ``method="als"`` for TR (TR-SVD by default; neither is
        guaranteed to find an exact tensor ring of the given ranks).

    Returns
    -------
    experts : FactorizedExperts
    relative_error : float
        ``‖W − Ŵ‖_F / ‖W‖_F``.
    """
    if not isinstance(weight, torch.Tensor) or weight.ndim < 3:
        raise ValueError(
            f"weight must be a tensor (N_1, …, N_E, I, O) with at least one expert mode, got "
            f"{getattr(weight, 'shape', type(weight).__name__)}"
        )
    _check_values("weight", weight)
    *dims, in_features, out_features = weight.shape
    network = _clipped(resolve_network(decomposition, tuple(dims), in_features, out_features, rank, resize=True))
    data = weight.detach().to(torch.promote_types(weight.dtype, torch.float32))
    fmt = network.format
    factors = (
        None
        if fmt is None
        else fmt.decompose(data, network, n_iter_max=n_iter_max, random_state=random_state, **options)
    )
    if factors is None:
        if options:
            raise TypeError(f"options {sorted(options)} apply to a format's own algorithm; {network.name!r} has none")
        labels = (*network.expert_legs, "i", "o")
        fitted, _ = als_fit(
            network.cores, network.sizes, data, labels, n_iter_max=n_iter_max, random_state=random_state
        )
        factors = [fitted[name] for name in network.cores]
    experts = FactorizedExperts(network, device=weight.device, dtype=weight.dtype)
    for name, factor in zip(network.cores, factors, strict=True):
        getattr(experts, name).copy_(factor.reshape(network.core_shape(name)))
    error = float((materialise(network, experts.cores).to(data.dtype) - data).norm() / data.norm().clamp_min(1e-30))
    if not math.isfinite(error):
        raise ValueError(
            f"the decomposition into {network!r} diverged (NaN or inf): try other ranks, more iterations or "
            "another method"
        )
    return experts, error


def _clipped(network: ExpertNetwork) -> ExpertNetwork:
    """``network`` with every bond cut to the largest size a tensor of its legs can use, with a warning."""
    clipped: dict[str, tuple[int, int]] = {}
    while True:
        caps = {bond: bond_cap(network, bond) for bond in network.bonds}
        over = {bond: cap for bond, cap in caps.items() if network.sizes[bond] > cap}
        if not over:
            break
        for bond, cap in over.items():
            clipped[bond] = (clipped.get(bond, (network.sizes[bond], cap))[0], cap)
        network = network.with_sizes(**over)
    if clipped:
        changes = ", ".join(f"{bond} {before} → {after}" for bond, (before, after) in clipped.items())
        warnings.warn(
            f"ranks above what a tensor of shape {network.dense_shape} can use were clipped: {changes}",
            UserWarning,
            stacklevel=4,
        )
    return network


def _check_values(what: str, tensor: torch.Tensor) -> None:
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {tensor.dtype}")
    if tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what} has NaN or infinite entries; upcycling and decomposition need finite weights")
    if math.prod(tensor.shape) == 0:
        raise ValueError(f"{what} is empty (shape {tuple(tensor.shape)})")
