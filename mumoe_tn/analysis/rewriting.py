"""Expert-conditional re-writing (paper Eq. mmoe-intervention) and the fairness metrics.

``y_o ← y_o + λ āᵀa``: an output head ``o`` is shifted by how much a token's coefficients
``a`` overlap with ``ā``, the mean coefficients of a target subpopulation. With ``ā`` a vector
of ones the shift is unconditional: the *blind threshold* baseline (paper appendix "Fairness
baselines & metric details", ``λ = 2.5``). For hierarchical layers ``ā`` is the mean of the
outer products ``a_1 ⊗ … ⊗ a_E`` (shape ``N_1 × … × N_E``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mumoe_tn.layers import MuMoE, MuMoEMLP

__all__ = [
    "blind_threshold",
    "equality_of_opportunity",
    "max_min_fairness",
    "mean_coefficients",
    "rewrite",
    "std_bias",
    "subpopulation_accuracies",
]


def _apply_mean(mean: torch.Tensor, coefficients: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``āᵀa`` for every row, for one or several expert modes."""
    if mean.ndim != len(coefficients):
        raise ValueError(f"the mean coefficients have {mean.ndim} mode(s) but the layer has {len(coefficients)}")
    letters = "abcdefghijklmnopqrstuvw"[: mean.ndim]
    equation = letters + "," + ",".join(f"...{x}" for x in letters) + "->..."
    return torch.einsum(equation, mean.to(coefficients[0].dtype), *coefficients)


@torch.no_grad()
def mean_coefficients(
    model: nn.Module,
    layer: MuMoE | MuMoEMLP,
    batches: Iterable[object],
    *,
    forward: Callable[[nn.Module, object], object] | None = None,
) -> torch.Tensor:
    """``ā``: the mean (outer product of) coefficients of ``layer`` over a subpopulation.

    Parameters
    ----------
    model : nn.Module
        The model (evaluated as given; use ``eval()`` for BatchNorm gates).
    layer : MuMoE or MuMoEMLP
        The layer inside ``model``.
    batches : Iterable
        The subpopulation's inputs (tuples/lists are read as ``(inputs, …)``).
    forward : Callable, optional
        ``forward(model, batch)``.

    Returns
    -------
    torch.Tensor
        Shape ``(N_1, …, N_E)``.
    """
    total, rows = None, 0
    call = forward or (lambda m, batch: m(batch[0]) if isinstance(batch, (tuple, list)) else m(batch))
    for batch in batches:
        call(model, batch)
        coefficients = [a.reshape(-1, a.shape[-1]).double() for a in layer.last_coefficients]
        letters = "abcdefghijklmnopqrstuvw"[: len(coefficients)]
        outer = torch.einsum(",".join(f"r{x}" for x in letters) + "->" + letters, *coefficients)
        total = outer if total is None else total + outer
        rows += coefficients[0].shape[0]
    if total is None:
        raise ValueError("no batch was given")
    return total / rows


def rewrite(layer: MuMoE | MuMoEMLP, head: int, mean: torch.Tensor, scale: float) -> RemovableHandle:
    """Add ``scale · āᵀa`` to output ``head`` of ``layer`` (a forward hook; call ``.remove()``).

    Parameters
    ----------
    layer : MuMoE or MuMoEMLP
        The layer whose output is re-written.
    head : int
        Output index ``o``.
    mean : torch.Tensor
        ``ā`` of shape ``(N_1, …, N_E)`` (see [`mean_coefficients`][mumoe_tn.analysis.rewriting.mean_coefficients]).
    scale : float
        ``λ`` (its sign sets the direction of the correction; the paper uses ``λ = N``).

    Returns
    -------
    torch.utils.hooks.RemovableHandle
    """
    if not isinstance(layer, (MuMoE, MuMoEMLP)):
        raise TypeError(f"rewrite needs a MuMoE or MuMoEMLP layer, got {type(layer).__name__}")
    if tuple(mean.shape) != tuple(layer.expert_dims):
        raise ValueError(f"mean coefficients must have shape {tuple(layer.expert_dims)}, got {tuple(mean.shape)}")
    if not -layer.out_features <= head < layer.out_features:
        raise ValueError(f"head {head} is out of range for {layer.out_features} outputs")

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        shift = scale * _apply_mean(mean.to(output.device), module.last_coefficients)
        output = output.clone()
        output[..., head] += shift.to(output.dtype)
        return output

    return layer.register_forward_hook(hook)


def blind_threshold(layer: MuMoE | MuMoEMLP, head: int, scale: float = 2.5) -> RemovableHandle:
    """The blind-threshold baseline: ``ā`` all ones, an unconditional shift of ``head``."""
    return rewrite(layer, head, torch.ones(layer.expert_dims), scale)


def _binary(*tensors: torch.Tensor) -> list[torch.Tensor]:
    result = []
    for tensor in tensors:
        tensor = torch.as_tensor(tensor).reshape(-1)
        if tensor.dtype == torch.bool:
            tensor = tensor.long()
        if not bool(((tensor == 0) | (tensor == 1)).all()):
            raise ValueError("fairness metrics take binary (0/1) predictions, targets and sensitive attributes")
        result.append(tensor.long())
    if len({t.shape[0] for t in result}) != 1:
        raise ValueError(f"predictions, targets and sensitive attributes differ in length: {[len(t) for t in result]}")
    return result


def subpopulation_accuracies(
    predictions: torch.Tensor, targets: torch.Tensor, sensitive: torch.Tensor
) -> dict[tuple[int, int], float]:
    """Accuracy of each subpopulation ``(A = a, Y = y)``, the four groups of the paper's tables."""
    predictions, targets, sensitive = _binary(predictions, targets, sensitive)
    accuracies = {}
    for a in (0, 1):
        for y in (0, 1):
            group = (sensitive == a) & (targets == y)
            if bool(group.any()):
                accuracies[(a, y)] = float((predictions[group] == y).double().mean())
    return accuracies


def equality_of_opportunity(predictions: torch.Tensor, targets: torch.Tensor, sensitive: torch.Tensor) -> float:
    """``|P(Ŷ=1 | A=0, Y=1) − P(Ŷ=1 | A=1, Y=1)|`` (Hardt et al. 2016)."""
    accuracies = subpopulation_accuracies(predictions, targets, sensitive)
    if (0, 1) not in accuracies or (1, 1) not in accuracies:
        raise ValueError("equality of opportunity needs positive targets in both sensitive groups")
    return abs(accuracies[(0, 1)] - accuracies[(1, 1)])


def std_bias(predictions: torch.Tensor, targets: torch.Tensor, sensitive: torch.Tensor) -> float:
    """Standard deviation (population) of the subpopulations' accuracies (Wang et al. 2020)."""
    values = torch.tensor(list(subpopulation_accuracies(predictions, targets, sensitive).values()), dtype=torch.float64)
    return float(values.std(unbiased=False))


def max_min_fairness(predictions: torch.Tensor, targets: torch.Tensor, sensitive: torch.Tensor) -> float:
    """The worst subpopulation's accuracy, ``min_{a,y} P(Ŷ=y | A=a, Y=y)`` (Lahoti et al. 2020)."""
    return min(subpopulation_accuracies(predictions, targets, sensitive).values())
