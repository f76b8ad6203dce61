"""Put μMoE layers into existing models: conversion, upcycling and dense-tensor decomposition."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mumoe_tn.contractions.dense import materialize
from mumoe_tn.decompositions.registry import build
from mumoe_tn.layers import Decomposition, FactorizedExperts, MuMoE, MuMoEMLP
from mumoe_tn.network import ExpertNetwork

__all__ = [
    "ConversionReport",
    "Replacement",
    "convert",
    "decompose_dense",
    "find_mlp_blocks",
    "upcycle_linear",
]

Selector = str | Callable[[str, nn.Module], bool] | None


# ----------------------------------------------------------------------------- upcycling
def _linear_matrix(linear: nn.Linear) -> torch.Tensor:
    """``[Wᵀ; b]`` of shape ``(I + 1, O)`` (or ``(I, O)`` without bias), the μMoE's i × o layout."""
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
        Ranks as for :class:`~mumoe_tn.layers.MuMoE`; by default the smallest that represents
        ``W`` exactly (``min(I + 1, O)`` on the input–output bond).
    **layer_options
        Further :class:`~mumoe_tn.layers.MuMoE` arguments (activation, gate_norm, …).

    Returns
    -------
    layer : MuMoE
    relative_error : float
        ``‖W − Ŵ‖_F / ‖W‖_F`` of the expert matrix.
    """
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"upcycle_linear needs an nn.Linear, got {type(linear).__name__}")
    matrix = _linear_matrix(linear)
    matrix = matrix.to(torch.promote_types(matrix.dtype, torch.float32))
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
    left, singular, right_t = torch.linalg.svd(matrix, full_matrices=False)
    k = min(_io_rank(layer.network), singular.numel())
    root = singular[:k].sqrt()
    _replicate(layer.experts, (left[:, :k] * root).to(**factory), (right_t[:k].T * root).to(**factory))
    approx = layer.experts.expert((0,) * layer.network.n_expert_modes).to(matrix.dtype)
    return layer, float((approx - matrix).norm() / matrix.norm().clamp_min(1e-30))


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
    the cores as a :class:`~mumoe_tn.layers.FactorizedExperts` on ``weight``'s device.

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


# ----------------------------------------------------------------------------- conversion
@dataclass(frozen=True)
class Replacement:
    """One replaced module."""

    name: str
    kind: str
    params_before: int
    params_after: int
    expert_dims: tuple[int, ...]
    ranks: str
    upcycle_error: float | None = None


@dataclass
class ConversionReport:
    """What :func:`convert` replaced."""

    replacements: list[Replacement] = field(default_factory=list)

    @property
    def params_before(self) -> int:
        """Parameters of the replaced modules before conversion."""
        return sum(r.params_before for r in self.replacements)

    @property
    def params_after(self) -> int:
        """Parameters of their μMoE replacements."""
        return sum(r.params_after for r in self.replacements)

    def to_markdown(self) -> str:
        """The report as a Markdown table."""
        lines = ["| module | kind | params before | params after | experts | ranks | upcycle error |"]
        lines.append("|---|---|---:|---:|---|---|---:|")
        for r in self.replacements:
            error = "" if r.upcycle_error is None else f"{r.upcycle_error:.2e}"
            experts = "×".join(map(str, r.expert_dims))
            lines.append(
                f"| {r.name} | {r.kind} | {r.params_before:,} | {r.params_after:,} | {experts} | {r.ranks} | {error} |"
            )
        lines.append(f"| **total** | | {self.params_before:,} | {self.params_after:,} | | | |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def _select(selector: Selector) -> Callable[[str, nn.Module], bool]:
    if selector is None:
        return lambda name, module: False
    if isinstance(selector, str):
        pattern = re.compile(selector)
        return lambda name, module: pattern.search(name) is not None
    if callable(selector):
        return selector
    raise TypeError(f"a module selector is a regex string or a callable (name, module) -> bool, got {selector!r}")


def _mlp_parts(module: nn.Module) -> tuple[nn.Linear, nn.Module | None, nn.Linear] | None:
    """``(first, activation, second)`` when ``module`` is an MLP block, else None.

    An MLP block has exactly two ``nn.Linear`` children (direct, in registration order) whose
    sizes chain ``I → H → O``, and no other child with parameters (so an attention block with
    two projections, e.g. ``nn.TransformerEncoderLayer``, is not one); the activation is the
    first other child between them that is not a Dropout.
    """
    children = list(module.children())
    positions = [k for k, child in enumerate(children) if isinstance(child, nn.Linear)]
    if len(positions) != 2:
        return None
    others = [child for k, child in enumerate(children) if k not in positions]
    if any(next(child.parameters(), None) is not None for child in others):
        return None
    first, second = children[positions[0]], children[positions[1]]
    if first.out_features != second.in_features:
        return None
    between = [c for c in children[positions[0] + 1 : positions[1]] if not isinstance(c, (nn.Linear, nn.Dropout))]
    if not between:
        between = [c for c in children if not isinstance(c, (nn.Linear, nn.Dropout))]
    return first, (between[0] if between else None), second


def find_mlp_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that :func:`convert` treats as MLP blocks."""
    return [name for name, module in model.named_modules() if name and _mlp_parts(module) is not None]


def _ranks(network: ExpertNetwork) -> str:
    return ", ".join(f"{bond}={network.sizes[bond]}" for bond in network.bonds)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def convert(
    model: nn.Module,
    *,
    expert_dims: int | Sequence[int],
    linears: Selector = None,
    mlps: Selector = None,
    decomposition: Decomposition = "cp",
    rank: int | Sequence[int] | str = "match",
    upcycle: bool = False,
    **layer_options: Any,
) -> ConversionReport:
    """Replace chosen ``nn.Linear`` layers and MLP blocks of ``model`` with μMoE layers, in place.

    Parameters
    ----------
    model : nn.Module
        The model; everything not selected is left as it is.
    expert_dims : int or Sequence[int]
        Experts of every new layer.
    linears : str or Callable, optional
        ``nn.Linear`` modules to replace with :class:`~mumoe_tn.layers.MuMoE`: a regex searched
        in the qualified module name, or a predicate ``(name, module) -> bool``.
    mlps : str or Callable, optional
        MLP blocks (see :func:`find_mlp_blocks`) to replace with
        :class:`~mumoe_tn.layers.MuMoEMLP`, selected the same way. A block is replaced by its
        two linears and activation; dropout inside it is not carried over.
    decomposition : str or Callable, optional
        Decomposition of every new layer.
    rank : int or Sequence[int] or "match", optional
        ``"match"`` (default) parameter-matches each replacement to what it replaces (gating
        counted); otherwise explicit ranks.
    upcycle : bool, optional
        Start each replaced Linear's experts as that Linear (:func:`upcycle_linear`); with
        matched ranks this is the best approximation of its rank, and the report gives the error.
    **layer_options
        Further layer arguments (activation, gate_norm, input_norm, …).

    Returns
    -------
    ConversionReport
    """
    select_linear, select_mlp = _select(linears), _select(mlps)
    chosen: list[tuple[str, str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if _mlp_parts(module) is not None and select_mlp(name, module):
            chosen.append((name, "mlp", module))
            taken.append(name)
        elif isinstance(module, nn.Linear) and select_linear(name, module):
            chosen.append((name, "linear", module))
    if not chosen:
        raise ValueError("no module was selected: check the linears=/mlps= patterns (see find_mlp_blocks(model))")
    report = ConversionReport()
    for name, kind, module in chosen:
        error = None
        if kind == "linear":
            layer_rank = "linear" if rank == "match" else rank
            if upcycle:
                new, error = upcycle_linear(module, expert_dims, decomposition, layer_rank, **layer_options)
            else:
                new = MuMoE(
                    module.in_features,
                    module.out_features,
                    expert_dims,
                    decomposition,
                    layer_rank,
                    bias=module.bias is not None,
                    device=module.weight.device,
                    dtype=module.weight.dtype,
                    **layer_options,
                )
            network = new.network
        else:
            first, activation, second = _mlp_parts(module)
            new = MuMoEMLP(
                first.in_features,
                first.out_features,
                second.out_features,
                expert_dims,
                decomposition,
                "mlp" if rank == "match" else rank,
                bias=first.bias is not None,
                hidden_activation=copy.deepcopy(activation) if activation is not None else None,
                device=first.weight.device,
                dtype=first.weight.dtype,
                **layer_options,
            )
            network = new.experts1.network
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        before = _count(module)
        setattr(parent, child, new)
        report.replacements.append(
            Replacement(name, kind, before, _count(new), network.expert_dims, _ranks(network), error)
        )
    return report
