"""How faithful distilled replacements are: L0, normalised MSE, explained variance, cross-entropy, dead units.

[`evaluate_replacements`][mumoe_tn.distillation.faithfulness.evaluate_replacements] runs the model over
held-out batches: once as it is (recording every block's input and output and the next-token
cross-entropy), then once per block with its output zero, and once per replacement spliced in
for its block alone. The block-level metrics compare the replacement's output on the block's
recorded input with the block's output, at the real tokens only. Every formula is in
[`mumoe_tn.distillation.frontier`][mumoe_tn.distillation.frontier].
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable
from mumoe_tn.distillation.streaming import Batch, capture_blocks, run_model, token_rows
from mumoe_tn.distillation.training import code_module, recording_code, spliced

__all__ = ["ZeroBlock", "evaluate_replacements", "next_token_loss"]


class ZeroBlock(nn.Module):
    """A block whose output is zero: ``(…, I) ↦ (…, O)`` zeros (zero-ablation).

    Parameters
    ----------
    out_features : int
        ``O``.
    """

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Zeros of shape ``(…, out_features)``."""
        return x.new_zeros(*x.shape[:-1], self.out_features)


def next_token_loss(output: Any, input_ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[float, int]:
    """Summed next-token cross-entropy (nats) over the real positions, and their number.

    Parameters
    ----------
    output : Any
        The model's output: logits ``(B, T, V)``, a tuple starting with them, or an object with
        ``.logits`` (Hugging Face).
    input_ids : torch.Tensor
        ``(B, T)`` token ids; position ``t`` predicts token ``t + 1``.
    mask : torch.Tensor, optional
        ``(B, T)`` booleans, True = real token: a prediction counts when both tokens are real.

    Returns
    -------
    tuple of (float, int)
    """
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"the model must return next-token logits of shape (B, T, vocab) for input ids {tuple(input_ids.shape)}, "
            f"got {getattr(logits, 'shape', type(logits).__name__)}"
        )
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(), reduction="none")
    if mask is None:
        return float(losses.sum()), losses.numel()
    keep = (mask[:, :-1] & mask[:, 1:]).flatten().to(losses.device)
    return float(losses[keep].sum()), int(keep.sum())


@dataclass
class _Tally:
    """Running sums of one replacement's block-level metrics."""

    squared_error: float = 0.0
    target_energy: float = 0.0
    target_sum: torch.Tensor | None = None
    tokens: int = 0
    active: float = 0.0
    unit_hits: torch.Tensor | None = None
    ce: float = 0.0
    ce_tokens: int = 0
    params: int = 0

    def add(self, prediction: torch.Tensor, target: torch.Tensor, codes: list[tuple[torch.Tensor, ...]]) -> None:
        prediction, target = prediction.double(), target.double()
        self.squared_error += float((prediction - target).pow(2).sum())
        self.target_energy += float(target.pow(2).sum())
        total = target.sum(0)
        self.target_sum = total if self.target_sum is None else self.target_sum + total
        self.tokens += target.shape[0]
        if codes:
            parts = [part.reshape(-1, part.shape[-1]) for part in codes[-1]]
            count = torch.ones(parts[0].shape[0], dtype=torch.float64, device=parts[0].device)
            for part in parts:
                count = count * (part != 0).sum(-1).double()
            self.active += float(count.sum())
            hits = torch.cat([(part != 0).sum(0) for part in parts]).cpu()
            self.unit_hits = hits if self.unit_hits is None else self.unit_hits + hits

    def row(self, block: str, method: str, ce_clean: float, ce_zero: float) -> FrontierRow:
        mean = self.target_sum / max(self.tokens, 1)
        variance = self.target_energy - self.tokens * float(mean.pow(2).sum())
        units = 0 if self.unit_hits is None else self.unit_hits.numel()
        dead = 0 if self.unit_hits is None else int((self.unit_hits == 0).sum())
        return FrontierRow(
            block=block,
            method=method,
            params=self.params,
            l0=self.active / max(self.tokens, 1) if self.unit_hits is not None else float("nan"),
            nmse=self.squared_error / self.target_energy if self.target_energy > 0 else float("nan"),
            explained_variance=1 - self.squared_error / variance if variance > 0 else float("nan"),
            ce_clean=ce_clean,
            ce_spliced=self.ce / max(self.ce_tokens, 1),
            ce_zero=ce_zero,
            dead=dead,
            units=units,
            tokens=self.tokens,
        )


def evaluate_replacements(
    model: nn.Module,
    batches: Iterable[Batch],
    replacements: Mapping[str, Mapping[str, nn.Module]],
    *,
    mask_argument: str | None = "attention_mask",
    config: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> FrontierTable:
    """Measure every replacement of every block on held-out ``batches``.

    Parameters
    ----------
    model : nn.Module
        The original model (restored after every splice; run in eval mode without gradients).
    batches : Iterable
        Held-out text, as for [`distill`][mumoe_tn.distillation.training.distill]; a mapping batch
        must hold ``input_ids`` (the next-token targets).
    replacements : Mapping
        ``block name -> method -> module`` (e.g. ``Distillation.replacements``).
    mask_argument : str or None, optional
        The key of a mapping batch that marks real tokens (default ``"attention_mask"``).
    config : Mapping, optional
        Plain data stored with the table.
    progress : bool, optional
        Show a tqdm bar over the batches.

    Returns
    -------
    FrontierTable
        One row per block and method. A replacement that exposes no sparse code (see
        [`code_module`][mumoe_tn.distillation.training.code_module]) gets L0 NaN and 0 units.
    """
    if not isinstance(replacements, Mapping) or not replacements:
        raise TypeError("replacements must be a non-empty mapping of block name -> method -> module")
    names = list(replacements)
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{name!r} is not a module of the model") from None
    tallies = {b: {m: _Tally(params=sum(p.numel() for p in mod.parameters())) for m, mod in ms.items()}
               for b, ms in replacements.items()}  # fmt: skip
    clean = [0.0, 0]
    zero = {name: [0.0, 0] for name in names}
    was_training = model.training
    model.eval()
    modes = {id(mod): mod.training for ms in replacements.values() for mod in ms.values()}
    for methods in replacements.values():
        for module in methods.values():
            module.eval()
    try:
        with torch.no_grad():
            for batch in tqdm(batches, desc="evaluating", disable=not progress, leave=False):
                kwargs, mask = token_rows(batch, mask_argument)
                ids = kwargs.get("input_ids")
                if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
                    raise ValueError("every evaluation batch needs input_ids of shape (B, T): the next-token targets")
                with capture_blocks(model, names) as captured:
                    output = run_model(model, kwargs, mask)
                _add(clean, next_token_loss(output, ids, mask))
                for name in names:
                    x, y = captured[name]
                    keep = None if mask is None else mask.reshape(-1).to(x.device)
                    rows_x, rows_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
                    if keep is not None:
                        rows_x, rows_y = rows_x[keep], rows_y[keep]
                    with spliced(model, {name: ZeroBlock(y.shape[-1])}):
                        _add(zero[name], next_token_loss(run_model(model, kwargs, mask), ids, mask))
                    for method, module in replacements[name].items():
                        tally = tallies[name][method]
                        if code_module(module) is None:
                            codes, prediction = [], module(rows_x)
                        else:
                            with recording_code(module) as codes:
                                prediction = module(rows_x)
                        tally.add(prediction, rows_y, codes)
                        with spliced(model, {name: module}):
                            loss, count = next_token_loss(run_model(model, kwargs, mask), ids, mask)
                        tally.ce += loss
                        tally.ce_tokens += count
    finally:
        model.train(was_training)
        for methods in replacements.values():
            for module in methods.values():
                module.train(modes[id(module)])
    ce_clean = clean[0] / max(clean[1], 1)
    rows = [
        tallies[name][method].row(name, method, ce_clean, zero[name][0] / max(zero[name][1], 1))
        for name in names
        for method in replacements[name]
    ]
    return FrontierTable(tuple(rows), dict(config or {}))


def _add(total: list, measured: tuple[float, int]) -> None:
    total[0] += measured[0]
    total[1] += measured[1]
