"""What switching an expert off does to a model's loss and outputs, per target token or class.

[`ablation_effects`][mumoe_tn.analysis.effects.ablation_effects] ablates experts (or whole
slices of a hierarchical layer's modes) one at a time with
[`ablate`][mumoe_tn.analysis.ablation.ablate] and measures, against the intact model:

- the change of the mean cross-entropy loss;
- that change per target (the next token of a language model, or the label of a classifier);
- the change of each output's mean log-probability (the tokens or classes an expert promotes
  or suppresses);
- accuracy per target.

Several ablations run as one batch (``group_size``), bounded by ``max_rows``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from mumoe_tn.analysis.ablation import ExpertAblation, _multi_indices, ablate
from mumoe_tn.analysis.layer_checks import check_layer_in_model
from mumoe_tn.analysis.outputs import decoder, logits_of
from mumoe_tn.analysis.progress import check_progress
from mumoe_tn.analysis.progress import progress as progress_bar
from mumoe_tn.layers import MuMoEBase
from mumoe_tn.validation import check_callable, check_int, check_tensor

__all__ = ["AblationEffects", "ablation_effects", "expert_units"]


def expert_units(expert_dims: Sequence[int]) -> list[tuple[int | None, ...]]:
    """The units an explorer ablates: every expert of a one-mode layer, every slice ``(…, n_e, …)`` otherwise."""
    dims = tuple(expert_dims)
    if len(dims) == 1:
        return [(n,) for n in range(dims[0])]
    return [tuple(n if f == e else None for f in range(len(dims))) for e, size in enumerate(dims) for n in range(size)]


@dataclass(frozen=True)
class AblationEffects:
    """Loss and output changes when each expert (or slice) is switched off.

    Attributes
    ----------
    experts : list of tuple
        The ablated experts or slices (``None`` = every index of a mode).
    loss : float
        Mean cross-entropy of the intact model over all targets.
    delta_loss : torch.Tensor
        ``(U,)`` — ablated minus intact mean loss.
    target_count : torch.Tensor
        ``(V,)`` — how often each target (token or class) occurs.
    target_loss : torch.Tensor
        ``(V,)`` — the intact model's mean loss per target (NaN where it never occurs).
    target_delta : torch.Tensor
        ``(U, V)`` — mean loss change per target (NaN where the target never occurs).
    logit_delta : torch.Tensor
        ``(U, V)`` — mean change of each output's log-probability over all predictions:
        negative for outputs the expert promotes, positive for those it suppresses.
    accuracy : torch.Tensor
        ``(V,)`` — the intact model's accuracy per target (0 where it never occurs).
    ablated_accuracy : torch.Tensor
        ``(U, V)`` — the same with each expert off.
    decode : Callable
        ``target id -> text`` for tables.
    """

    experts: list[tuple[int | None, ...]]
    loss: float
    delta_loss: torch.Tensor
    target_count: torch.Tensor
    target_loss: torch.Tensor
    target_delta: torch.Tensor
    logit_delta: torch.Tensor
    accuracy: torch.Tensor
    ablated_accuracy: torch.Tensor
    decode: Callable[[int], str]

    def _row(self, expert: object) -> int:
        (key,) = _multi_indices([expert], len(self.experts[0]))
        if key not in self.experts:
            raise ValueError(f"expert {expert!r} was not ablated; the ablated ones are {self.experts[:8]} …")
        return self.experts.index(key)

    def targets(self, expert: object, k: int = 5, *, minimum_count: int = 1) -> list[tuple[int, float, int]]:
        """The ``k`` targets whose loss rises most with ``expert`` off: ``(target, Δloss, occurrences)``."""
        row = self.target_delta[self._row(expert)]
        k = check_int("k", k, minimum=0)
        valid = (self.target_count >= minimum_count) & ~row.isnan()
        order = torch.where(valid, row, torch.full_like(row, -torch.inf)).argsort(descending=True)
        picked = [int(t) for t in order[: min(k, int(valid.sum()))]]
        return [(t, float(row[t]), int(self.target_count[t])) for t in picked]

    def promoted(self, expert: object, k: int = 5) -> list[tuple[int, float]]:
        """Outputs whose log-probability falls most with ``expert`` off (the expert promotes them)."""
        row = self.logit_delta[self._row(expert)]
        order = row.argsort()[: check_int("k", k, minimum=0)]
        return [(int(t), float(row[t])) for t in order]

    def suppressed(self, expert: object, k: int = 5) -> list[tuple[int, float]]:
        """Outputs whose log-probability rises most with ``expert`` off (the expert suppresses them)."""
        row = self.logit_delta[self._row(expert)]
        order = row.argsort(descending=True)[: check_int("k", k, minimum=0)]
        return [(int(t), float(row[t])) for t in order]

    def to_markdown(self, k: int = 3, limit: int | None = 20) -> str:
        """The experts with the largest loss change first: Δloss, the most hurt targets, promoted outputs."""
        lines = [
            f"Intact loss {self.loss:.4g}.\n",
            "| expert | Δ loss | targets hurt most (Δ loss) | promotes (Δ log p) |",
            "|---|---:|---|---|",
        ]

        def text(target: int) -> str:
            return repr(self.decode(target)).replace("|", "\\|")

        order = self.delta_loss.argsort(descending=True).tolist()
        for u in order[:limit]:
            expert = self.experts[u]
            hurt = ", ".join(f"{text(t)} ({d:+.3g})" for t, d, _ in self.targets(expert, k))
            promotes = ", ".join(f"{text(t)} ({d:+.3g})" for t, d in self.promoted(expert, k))
            indices = ", ".join("·" if n is None else str(n) for n in expert)
            name = str(expert[0]) if len(expert) == 1 else f"({indices})"
            lines.append(f"| {name} | {float(self.delta_loss[u]):+.4g} | {hurt} | {promotes} |")
        return "\n".join(lines)

    def plot(self, path: str | None = None):
        """Bar chart of the loss change per ablated expert; saved to ``path`` if given."""
        import matplotlib.pyplot as plt

        figure, ax = plt.subplots(figsize=(8, 2.5))
        values = self.delta_loss.numpy()
        ax.bar(range(len(values)), values, color=["#c0392b" if v > 0 else "#2e86c1" for v in values])
        ax.set_xlabel("ablated expert")
        ax.set_ylabel("Δ loss")
        ax.set_title(f"loss change per ablated expert (intact loss {self.loss:.3g})", fontsize=9)
        figure.tight_layout()
        if path is not None:
            figure.savefig(path, dpi=120)
        return figure


def _pairs(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor | None, forward: Callable | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (rows, V), targets (rows,))``: the next token of a language model, or the labels."""
    logits = logits_of(forward(model, inputs) if forward else model(inputs))
    if labels is None:
        if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(inputs.shape):
            raise ValueError(
                f"a language model must return logits (sequences, positions, vocabulary) for tokens "
                f"{tuple(inputs.shape)}, got {tuple(logits.shape)}; pass labels for a classifier"
            )
        return logits[:, :-1].reshape(-1, logits.shape[-1]), inputs[:, 1:].reshape(-1)
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"the model's logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} (one row of "
            "logits per label)"
        )
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


class _Tally:
    """Per-target sums of the losses, log-probabilities and hits of one model variant."""

    def __init__(self, classes: int) -> None:
        self.loss = torch.zeros(classes, dtype=torch.float64)
        self.log_p = torch.zeros(classes, dtype=torch.float64)
        self.hits = torch.zeros(classes, dtype=torch.float64)
        self.rows = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        log_p = F.log_softmax(logits.double(), dim=-1)
        loss = -log_p.gather(1, targets[:, None]).squeeze(1)
        self.loss.index_add_(0, targets.cpu(), loss.cpu())
        self.log_p += log_p.sum(0).cpu()
        self.hits.index_add_(0, targets.cpu(), (log_p.argmax(-1) == targets).double().cpu())
        self.rows += targets.numel()


@torch.no_grad()
def ablation_effects(
    model: nn.Module,
    layer: MuMoEBase,
    inputs: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    experts: Sequence[object] | None = None,
    vocabulary: Sequence[str] | Callable[[int], str] | None = None,
    batch_size: int = 32,
    max_rows: int = 8192,
    forward: Callable[[nn.Module, torch.Tensor], object] | None = None,
    progress: bool | None = None,
) -> AblationEffects:
    """Ablate each expert of ``layer`` in turn and measure the loss and output changes.

    Parameters
    ----------
    model : nn.Module
        A language model (``labels=None``: ``inputs`` are token ids ``(sequences, positions)`` and
        the model returns next-token logits ``(sequences, positions, V)``) or a classifier
        (``labels`` given: logits ``(samples, C)``, or any shape matching ``labels`` plus the class
        dim). Hugging Face outputs are read through ``.logits``. Evaluated in ``eval()`` mode
        (restored after).
    layer : MuMoEBase
        The layer whose experts are ablated.
    inputs : torch.Tensor
        The evaluation inputs; the first dimension is the sample dimension.
    labels : torch.Tensor, optional
        Class labels (a classifier); without them the targets are the next tokens.
    experts : Sequence, optional
        Experts or slices to ablate (see [`ablate`][mumoe_tn.analysis.ablation.ablate]); default:
        every expert of a one-mode layer, every slice ``n_e = k`` of a hierarchical one.
    vocabulary : sequence of str or Callable, optional
        Decodes targets for ``to_markdown``.
    batch_size : int, optional
        Samples per forward pass.
    max_rows : int, optional
        Largest batch of replicated samples (sets how many ablations run together).
    forward : Callable, optional
        ``forward(model, inputs)`` if the model is not simply called.
    progress : bool, optional
        Show a progress bar over the ablation passes (tqdm, on stderr); by default only on a terminal.

    Returns
    -------
    AblationEffects
    """
    model, layer = check_layer_in_model(model, layer)
    inputs = check_tensor("inputs", inputs, non_empty=True)
    if inputs.ndim < 1:
        raise ValueError(f"inputs must have a sample dimension, got shape {tuple(inputs.shape)}")
    if labels is None:
        check_tensor("inputs", inputs, ndim=2, kind="int")
        if inputs.shape[1] < 2:
            raise ValueError(f"a language model's sequences need two or more tokens, got {inputs.shape[1]}")
    else:
        labels = check_tensor("labels", labels, kind="int")
        if labels.ndim < 1 or labels.shape[0] != inputs.shape[0]:
            raise ValueError(f"labels must have one entry per input ({inputs.shape[0]}), got {tuple(labels.shape)}")
        if int(labels.min()) < 0:
            raise ValueError(f"labels must be class indices >= 0, got {int(labels.min())}")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    max_rows = check_int("max_rows", max_rows, minimum=1)
    check_callable("forward", forward)
    check_progress(progress)
    if experts is None:
        experts = expert_units(layer.expert_dims)
    else:
        experts = ExpertAblation(layer.expert_dims, [experts]).groups[0]
        if not experts:
            raise ValueError("experts is empty: give at least one expert to ablate (or None for all)")
    decode = decoder(vocabulary)
    was_training = model.training
    model.eval()
    batches = [
        (inputs[k : k + batch_size], None if labels is None else labels[k : k + batch_size])
        for k in range(0, inputs.shape[0], batch_size)
    ]
    try:
        intact = None
        for x, y in batches:
            logits, target = _pairs(model, x, y, forward)
            if intact is None:
                classes = logits.shape[-1]
                top = int((inputs if labels is None else labels).max())
                if top >= classes:
                    raise ValueError(f"the targets go up to {top} but the model has {classes} outputs")
                intact = _Tally(classes)
            intact.add(logits, target)
        tallies = [_Tally(classes) for _ in experts]
        group = max(1, max_rows // batch_size)
        chunks = [list(range(k, min(k + group, len(experts)))) for k in range(0, len(experts), group)]
        passes = list(itertools.product(chunks, batches))
        for chunk, (x, y) in progress_bar(passes, f"ablating {len(experts)} experts", enabled=progress):
            replicated = x.repeat(len(chunk), *([1] * (x.ndim - 1)))
            targets = None if y is None else y.repeat(len(chunk), *([1] * (y.ndim - 1)))
            with ablate(layer, [[experts[u]] for u in chunk], group_size=x.shape[0]):
                logits, target = _pairs(model, replicated, targets, forward)
            rows = logits.shape[0] // len(chunk)
            for j, u in enumerate(chunk):
                tallies[u].add(logits[j * rows : (j + 1) * rows], target[j * rows : (j + 1) * rows])
    finally:
        model.train(was_training)
    count = torch.zeros(classes, dtype=torch.float64)
    for x, y in batches:
        target = x[:, 1:].reshape(-1) if y is None else y.reshape(-1)
        count += torch.bincount(target.cpu(), minlength=classes)[:classes].double()
    seen = count > 0
    nan = torch.full((classes,), torch.nan, dtype=torch.float64)
    target_loss = torch.where(seen, intact.loss / count.clamp_min(1), nan)
    loss = float(intact.loss.sum() / intact.rows)
    return AblationEffects(
        experts=list(experts),
        loss=loss,
        delta_loss=torch.tensor([float(t.loss.sum() / t.rows) - loss for t in tallies], dtype=torch.float64),
        target_count=count.long(),
        target_loss=target_loss,
        target_delta=torch.stack(
            [torch.where(seen, (t.loss - intact.loss) / count.clamp_min(1), nan) for t in tallies]
        ),
        logit_delta=torch.stack([(t.log_p - intact.log_p) / intact.rows for t in tallies]),
        accuracy=intact.hits / count.clamp_min(1),
        ablated_accuracy=torch.stack([t.hits / count.clamp_min(1) for t in tallies]),
        decode=decode,
    )
