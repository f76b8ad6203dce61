"""Expert-conditional re-writing (the paper's expert-conditional intervention) and the fairness metrics.

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

from mumoe_tn.analysis.coefficients import default_forward
from mumoe_tn.analysis.layer_checks import check_layer, check_layer_in_model
from mumoe_tn.analysis.progress import check_progress
from mumoe_tn.analysis.progress import progress as progress_bar
from mumoe_tn.layers import MuMoEBase
from mumoe_tn.validation import (
    check_callable,
    check_int,
    check_real,
    check_tensor,
)

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
    layer: MuMoEBase,
    batches: Iterable[object],
    *,
    forward: Callable[[nn.Module, object], object] | None = None,
    progress: bool | None = None,
) -> torch.Tensor:
    """``ā``: the mean (outer product of) coefficients of ``layer`` over a subpopulation.

    Parameters
    ----------
    model : nn.Module
        The model (evaluated as given; use ``eval()`` for BatchNorm gates).
    layer : MuMoEBase
        The layer inside ``model``.
    batches : Iterable
        The subpopulation's inputs (tuples/lists are read as ``(inputs, …)``).
    forward : Callable, optional
        ``forward(model, batch)``.
    progress : bool, optional
        Show a progress bar over the batches (tqdm, on stderr); by default only on a terminal.

    Returns
    -------
    torch.Tensor
        Shape ``(N_1, …, N_E)``.
    """
    model, layer = check_layer_in_model(model, layer)
    check_callable("forward", forward)
    check_progress(progress)
    if isinstance(batches, torch.Tensor) or not isinstance(batches, Iterable):
        raise TypeError(
            f"batches must be an iterable of model inputs (a list or DataLoader), got {type(batches).__name__}; "
            "wrap a single tensor as [tensor]"
        )
    total, rows = None, 0
    call = forward or default_forward
    seen: list[tuple[tuple[torch.Tensor, ...], torch.Tensor | None]] = []

    def record(module: nn.Module, args: tuple, output: object) -> None:
        seen.append((module.last_coefficients, module.last_token_mask))

    handle = layer.register_forward_hook(record)
    try:
        for number, batch in enumerate(progress_bar(batches, "mean coefficients", enabled=progress)):
            seen.clear()
            call(model, batch)
            if not seen:
                raise ValueError(f"layer did not run on batch {number}: the batches must pass through it")
            for recorded, tokens in seen:
                if tokens is not None:  # padding tokens do not count
                    recorded = tuple(a[tokens] for a in recorded)
                coefficients = [a.reshape(-1, a.shape[-1]).double() for a in recorded]
                letters = "abcdefghijklmnopqrstuvw"[: len(coefficients)]
                outer = torch.einsum(",".join(f"r{x}" for x in letters) + "->" + letters, *coefficients)
                total = outer if total is None else total + outer
                rows += coefficients[0].shape[0]
    finally:
        handle.remove()
    if total is None:
        raise ValueError("batches is empty: no batch was given")
    if rows == 0:
        raise ValueError("the batches hold no rows (every batch is empty)")
    return total / rows


def rewrite(layer: MuMoEBase, head: int, mean: torch.Tensor, scale: float) -> RemovableHandle:
    """Add ``scale · āᵀa`` to output ``head`` of ``layer`` (a forward hook; call ``.remove()``).

    Parameters
    ----------
    layer : MuMoEBase
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
    layer = check_layer(layer)
    head = check_int("head", head)
    mean = check_tensor("mean", mean, kind="float", finite=True)
    scale = check_real("scale", scale)
    if tuple(mean.shape) != tuple(layer.expert_dims):
        raise ValueError(f"mean coefficients must have shape {tuple(layer.expert_dims)}, got {tuple(mean.shape)}")
    if not -layer.out_features <= head < layer.out_features:
        raise ValueError(f"head {head} is out of range for {layer.out_features} outputs")
    mean = mean.detach().clone()  # later edits of the caller's tensor do not change the hook

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        shift = scale * _apply_mean(mean.to(output.device), module.last_coefficients)
        output = output.clone()
        output[..., head] += shift.to(output.dtype)
        return output

    return layer.register_forward_hook(hook)


def blind_threshold(layer: MuMoEBase, head: int, scale: float = 2.5) -> RemovableHandle:
    """The blind-threshold baseline: ``ā`` all ones, an unconditional shift of ``head``."""
    layer = check_layer(layer)
    return rewrite(layer, head, torch.ones(layer.expert_dims), scale)


def _binary(predictions: object, targets: object, sensitive: object) -> list[torch.Tensor]:
    result = []
    for name, values in (("predictions", predictions), ("targets", targets), ("sensitive", sensitive)):
        try:
            tensor = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{name} must be a 1-D tensor (or sequence) of 0/1 values, got {values!r}") from error
        if tensor.ndim != 1:
            raise ValueError(f"{name} must be 1-D (one value per sample), got shape {tuple(tensor.shape)}")
        if tensor.numel() == 0:
            raise ValueError(f"{name} is empty")
        if tensor.dtype.is_complex:
            raise TypeError(f"{name} must hold real 0/1 values, got dtype {tensor.dtype}")
        if tensor.dtype == torch.bool:
            tensor = tensor.long()
        if not bool(((tensor == 0) | (tensor == 1)).all()):
            raise ValueError(
                f"fairness metrics take binary (0/1) predictions, targets and sensitive attributes; {name} holds "
                f"{sorted(set(tensor.unique().tolist()) - {0, 1})[:5]}"
            )
        result.append(tensor.long().cpu())
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
