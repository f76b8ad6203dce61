"""Class-level polysemanticity of experts (as the paper defines it).

For every expert ``n``: ``d^(n)_c = (y_c − ŷ^(n)_c) / y_c`` is the relative drop of class
``c``'s accuracy when expert ``n`` is switched off, and ``p^(n) = ‖d^(n) − 1^(n)‖₂`` its
distance to the one-hot vector at ``argmax_c d^(n)_c`` (0: the expert is needed for exactly one
class and all of it). The paper averages ``p`` over the experts whose ablation changes some
class's accuracy. Ablations run in groups: ``K`` experts' counterfactual passes form one batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mumoe_tn.analysis.ablation import ExpertAblation, ablate
from mumoe_tn.analysis.layer_checks import check_layer_in_model
from mumoe_tn.analysis.progress import check_progress
from mumoe_tn.analysis.progress import progress as progress_bar
from mumoe_tn.layers import MuMoEBase
from mumoe_tn.validation import check_callable, check_int, check_tensor

__all__ = ["Polysemanticity", "class_accuracies", "class_polysemanticity"]


def class_accuracies(predictions: torch.Tensor, labels: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Accuracy of every class (0 for a class with no sample).

    Parameters
    ----------
    predictions, labels : torch.Tensor
        Predicted and true classes, 1-D integer tensors of one length on one device.
    n_classes : int
        Number of classes; every label must be below it.

    Returns
    -------
    torch.Tensor
        Shape ``(n_classes,)``, float64.
    """
    predictions = check_tensor("predictions", predictions, ndim=1, kind="int")
    labels = check_tensor("labels", labels, ndim=1, kind="int")
    n_classes = check_int("n_classes", n_classes, minimum=1)
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions {tuple(predictions.shape)} and labels {tuple(labels.shape)} differ in length")
    if predictions.device != labels.device:
        raise ValueError(f"predictions are on {predictions.device} but labels on {labels.device}")
    _check_labels(labels, n_classes)
    correct = torch.bincount(labels[predictions == labels], minlength=n_classes).double()
    support = torch.bincount(labels, minlength=n_classes).double()
    return correct / support.clamp_min(1)


@dataclass(frozen=True)
class Polysemanticity:
    """Per-expert class accuracy changes and polysemanticity.

    Attributes
    ----------
    experts : list of tuple of int
        The ablated experts (multi-indices).
    accuracy : torch.Tensor
        Per-class accuracy of the intact model, ``(C,)``.
    ablated : torch.Tensor
        Per-class accuracy with each expert off, ``(len(experts), C)``.
    differences : torch.Tensor
        ``d`` — relative accuracy drops (0 for classes the intact model never gets right).
    polysemanticity : torch.Tensor
        ``p`` per expert.
    changed : torch.Tensor
        Whether ablating the expert changes any class's accuracy.
    """

    experts: list[tuple[int, ...]]
    accuracy: torch.Tensor
    ablated: torch.Tensor
    differences: torch.Tensor
    polysemanticity: torch.Tensor
    changed: torch.Tensor

    @property
    def mean(self) -> float:
        """Mean ``p`` over the experts whose ablation changes some class (NaN if none does)."""
        if not bool(self.changed.any()):
            return float("nan")
        return float(self.polysemanticity[self.changed].mean())

    def __repr__(self) -> str:
        changed = int(self.changed.sum())
        return (
            f"Polysemanticity(experts={len(self.experts)}, classes={self.accuracy.numel()}, "
            f"changed={changed}, mean={self.mean:.4g})"
        )


def _check_labels(labels: torch.Tensor, n_classes: int) -> None:
    if labels.numel() and int(labels.min()) < 0:
        raise ValueError(f"labels must be class indices >= 0, got {int(labels.min())}")
    if labels.numel() and int(labels.max()) >= n_classes:
        raise ValueError(f"labels go up to {int(labels.max())} but n_classes is {n_classes}")


def _predict(model: nn.Module, inputs: torch.Tensor, forward: Callable | None, device: torch.device) -> torch.Tensor:
    logits = forward(model, inputs) if forward else model(inputs)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[0] != inputs.shape[0]:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"the model must return logits of shape ({inputs.shape[0]}, classes) for inputs of shape "
            f"{tuple(inputs.shape)}, got {shape}; pass forward=lambda model, x: ... to select them"
        )
    return logits.argmax(-1).to(device)


@torch.no_grad()
def class_polysemanticity(
    model: nn.Module,
    layer: MuMoEBase,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    experts: Sequence[object] | None = None,
    n_classes: int | None = None,
    max_rows: int = 65_536,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    progress: bool | None = None,
) -> Polysemanticity:
    """Ablate every expert of ``layer`` in turn and measure each class's accuracy change.

    Parameters
    ----------
    model : nn.Module
        A classifier containing ``layer``; evaluated in ``eval()`` mode (restored after).
    layer : MuMoEBase
        The layer whose experts are ablated.
    inputs : torch.Tensor
        Evaluation inputs; the first dimension is the sample dimension.
    labels : torch.Tensor
        Class labels ``(samples,)``.
    experts : Sequence, optional
        Experts to ablate (default: all ``∏N_e`` multi-indices).
    n_classes : int, optional
        Number of classes (default: ``labels.max() + 1``).
    max_rows : int, optional
        Largest batch of replicated samples per forward pass (sets how many ablations run
        together).
    forward : Callable, optional
        ``forward(model, inputs) -> logits`` if the model is not simply called.
    progress : bool, optional
        Show a progress bar over the ablation passes (tqdm, on stderr); by default only on a terminal.

    Returns
    -------
    Polysemanticity
    """
    model, layer = check_layer_in_model(model, layer)
    inputs = check_tensor("inputs", inputs, non_empty=True)
    labels = check_tensor("labels", labels, ndim=1, kind="int")
    if inputs.ndim < 1 or labels.shape[0] != inputs.shape[0]:
        raise ValueError(f"labels must have shape ({inputs.shape[0]},) (one per input), got {tuple(labels.shape)}")
    n_classes = int(labels.max()) + 1 if n_classes is None else check_int("n_classes", n_classes, minimum=1)
    _check_labels(labels, n_classes)
    max_rows = check_int("max_rows", max_rows, minimum=1)
    check_callable("forward", forward)
    check_progress(progress)
    if experts is None:
        experts = list(itertools.product(*(range(n) for n in layer.expert_dims)))
    else:
        experts = ExpertAblation(layer.expert_dims, [experts]).groups[0]
        if not experts:
            raise ValueError("experts is empty: give at least one expert to ablate (or None for all)")
    was_training = model.training
    model.eval()
    try:
        accuracy = class_accuracies(_predict(model, inputs, forward, labels.device), labels, n_classes)
        samples = inputs.shape[0]
        group = max(1, max_rows // samples)
        rows = []
        starts = range(0, len(experts), group)
        for start in progress_bar(starts, f"ablating {len(experts)} experts", enabled=progress):
            chunk = experts[start : start + group]
            replicated = inputs.repeat(len(chunk), *([1] * (inputs.ndim - 1)))
            with ablate(layer, [[e] for e in chunk], group_size=samples):
                predictions = _predict(model, replicated, forward, labels.device).reshape(len(chunk), samples)
            rows += [class_accuracies(p, labels, n_classes) for p in predictions]
    finally:
        model.train(was_training)
    ablated = torch.stack(rows)
    differences = torch.where(accuracy > 0, (accuracy - ablated) / accuracy.clamp_min(1e-30), torch.zeros_like(ablated))
    one_hot = torch.nn.functional.one_hot(differences.argmax(1), n_classes).double()
    return Polysemanticity(
        experts=experts,
        accuracy=accuracy,
        ablated=ablated,
        differences=differences,
        polysemanticity=(differences - one_hot).norm(dim=1),
        changed=(ablated != accuracy).any(dim=1),
    )
