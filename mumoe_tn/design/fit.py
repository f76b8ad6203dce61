"""What a design measures with torch: the upcycle error of a pretrained layer, and forward latency.

Imported only when a search is given a pretrained weight or asked to measure, so
``import mumoe_tn.design`` and a plain search stay torch-free.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mumoe_tn.conversion.fitting.upcycling import decompose_dense, linear_matrix, upcycle_experts
from mumoe_tn.layers.experts import FactorizedExperts
from mumoe_tn.layers.moe import MuMoE
from mumoe_tn.network import ExpertNetwork

__all__ = ["Fit", "forward_latency", "upcycle_error_of"]


@dataclass(frozen=True)
class Fit:
    """The relative error of each network on one pretrained target.

    Attributes
    ----------
    error : Callable[[ExpertNetwork], float]
        ``network -> relative error``.
    expert_dims : tuple of int or None
        The expert dims a dense expert tensor fixes (None for a single layer).
    """

    error: Callable[[ExpertNetwork], float]
    expert_dims: tuple[int, ...] | None = None

    def __call__(self, network: ExpertNetwork) -> float:
        return self.error(network)


def upcycle_error_of(weight: object, in_features: int, out_features: int, bias: bool, *, max_iter: int = 50) -> Fit:
    """How well each network holds ``weight``.

    Parameters
    ----------
    weight : nn.Linear or torch.Tensor
        An nn.Linear (every expert starts as it: the error of
        [`upcycle_experts`][mumoe_tn.conversion.fitting.upcycling.upcycle_experts]), a ``(out, in)``
        weight matrix (nn.Linear's layout, with a zero bias column when ``bias``), or a dense
        expert tensor ``(N_1, …, N_E, I, O)`` (the error of
        [`decompose_dense`][mumoe_tn.conversion.fitting.upcycling.decompose_dense]; ``I`` counts the bias).
    in_features, out_features : int
        The layer's sizes, which the weight must have.
    bias : bool
        Whether leg ``i`` holds a folded bias column.
    max_iter : int, optional
        Sweeps of the generic fit (networks without a closed form) and of the dense decompositions.

    Returns
    -------
    Fit
    """
    width = in_features + int(bias)
    if isinstance(weight, nn.Linear):
        has_bias = weight.bias is not None
        if (weight.in_features, weight.out_features, has_bias) != (in_features, out_features, bias):
            raise ValueError(
                f"the pretrained nn.Linear({weight.in_features}, {weight.out_features}, bias={has_bias}) does not "
                f"match the design's {in_features} → {out_features}, bias={bias}"
            )
        matrix = linear_matrix(weight).double()
    elif isinstance(weight, torch.Tensor) and weight.ndim == 2:
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(
                f"a pretrained weight matrix has nn.Linear's layout (out, in) = ({out_features}, {in_features}), "
                f"got {tuple(weight.shape)}"
            )
        matrix = weight.detach().T.double()
        if bias:
            matrix = torch.cat([matrix, matrix.new_zeros(1, out_features)])
    elif isinstance(weight, torch.Tensor) and weight.ndim >= 3:
        *dims, rows, cols = weight.shape
        if (rows, cols) != (width, out_features):
            raise ValueError(
                f"a dense expert tensor is (N_1, …, N_E, I, O) with I = {width} (bias included) and O = "
                f"{out_features}, got {tuple(weight.shape)}"
            )
        dense = weight.detach().double()

        def dense_error(network: ExpertNetwork) -> float:
            return decompose_dense(dense, network, n_iter_max=max_iter)[1]

        return Fit(dense_error, tuple(dims))
    else:
        raise TypeError(
            "weight must be an nn.Linear, a (out, in) weight tensor or a dense expert tensor, got "
            f"{type(weight).__name__}"
        )

    def error(network: ExpertNetwork) -> float:
        experts = FactorizedExperts(network, dtype=torch.float64)
        return upcycle_experts(experts, matrix, max_iter=max_iter, progress=False)

    return Fit(error)


@torch.no_grad()
def forward_latency(network: ExpertNetwork, *, batch: int = 1, bias: bool = True, repeats: int = 20) -> float:
    """Median milliseconds of a μMoE layer's forward pass on ``batch`` tokens (CPU, float32).

    Parameters
    ----------
    network : ExpertNetwork
        The layer's network (leg ``i`` counts the bias when ``bias``).
    batch : int, optional
        Tokens per forward.
    bias : bool, optional
        Whether leg ``i`` holds a folded bias column.
    repeats : int, optional
        Timed calls (after three warm-up calls).

    Returns
    -------
    float
    """
    layer = MuMoE(network.in_features - int(bias), network.out_features, decomposition=network, bias=bias).eval()
    x = torch.randn(batch, layer.in_features)
    for _ in range(3):
        layer(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
