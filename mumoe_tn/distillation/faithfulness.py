"""How faithful distilled replacements are: L0, normalised MSE, explained variance, cross-entropy, dead units.

[`evaluate_replacements`][mumoe_tn.distillation.faithfulness.evaluate_replacements] runs the model over
held-out batches: once as it is (recording every block's input and output, the next-token
cross-entropy and distribution), then, per block, the zero-ablated block and every replacement
spliced in for it alone. Those run *stacked*: the batch repeated once per candidate, slice ``r``
of the block's input going through candidate ``r``, so one pass measures many replacements; and
the layers that finished before the block started (the earlier entries of the ``nn.ModuleList``
holding it, each called once) are not run again but replay their clean outputs, so a pass costs
only the part of the model from the block's layer on. The block-level metrics compare the
replacement's output on the block's recorded input with the block's output, at the real tokens
only. Every formula is in [`mumoe_tn.distillation.frontier`][mumoe_tn.distillation.frontier].
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable, ScoreInterval, bootstrap_ce_score
from mumoe_tn.distillation.metrics import Metric, resolve_metrics
from mumoe_tn.distillation.paired import SequenceLosses
from mumoe_tn.distillation.streaming import Batch, capture_blocks, run_model, token_rows
from mumoe_tn.distillation.training import code_module, recording_code, spliced
from mumoe_tn.validation import check_size

__all__ = ["StackedReplacements", "ZeroBlock", "evaluate_replacements", "next_token_loss"]


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
    logits = _logits(output, input_ids)
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(), reduction="none")
    if mask is None:
        return float(losses.sum()), losses.numel()
    keep = (mask[:, :-1] & mask[:, 1:]).flatten().to(losses.device)
    return float(losses[keep].sum()), int(keep.sum())


@dataclass
class _Tally:
    """Running sums of one replacement: its metrics (fresh instances), tokens, cross-entropy and KL."""

    metrics: tuple[Metric, ...]
    tokens: int = 0
    ce: list = field(default_factory=list)
    kl: list = field(default_factory=list)
    params: int = 0

    def add(self, prediction: torch.Tensor, target: torch.Tensor, codes: list[tuple[torch.Tensor, ...]]) -> None:
        prediction, target = prediction.double(), target.double()
        self.tokens += target.shape[0]
        code = tuple(part.reshape(-1, part.shape[-1]) for part in codes[-1]) if codes else None
        for metric in self.metrics:
            metric.update(prediction, target, code)

    def row(self, block: str, method: str, reference: _Reference, interval: ScoreInterval) -> FrontierRow:
        own = {m.row_field: m.value() for m in self.metrics if m.row_field is not None}
        extra = {m.name: float(m.value()) for m in self.metrics if m.row_field is None}
        return FrontierRow(
            block=block,
            method=method,
            params=self.params,
            **own,
            ce_clean=reference.ce_clean,
            ce_spliced=float(torch.cat(self.ce).sum()) / reference.predictions,
            ce_zero=reference.ce_zero,
            tokens=self.tokens,
            score_low=interval.score_low,
            score_high=interval.score_high,
            gap_low=interval.gap_low,
            gap_high=interval.gap_high,
            kl_spliced=float(torch.cat(self.kl).sum()) / reference.predictions,
            kl_zero=reference.kl_zero,
            extra=extra,
        )


@dataclass(frozen=True)
class _Reference:
    """A block's clean and zero-ablated cross-entropy and KL (per prediction), and the predictions counted."""

    ce_clean: float
    ce_zero: float
    kl_zero: float
    predictions: int


class StackedReplacements(nn.Module):
    """Several replacements of one block in one pass: slice ``r`` of the batch goes through ``parts[r]``.

    The input's first dimension is ``len(parts)`` equal slices (the batch repeated), in order.

    Parameters
    ----------
    parts : Sequence[nn.Module]
        Modules mapping the block's input ``(…, I)`` to its output ``(…, O)``.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``cat_r parts[r](x_r)`` over the slices ``x_r`` of the first dimension."""
        if x.shape[0] % len(self.parts):
            raise ValueError(f"a stacked input of {x.shape[0]} rows does not split into {len(self.parts)} slices")
        return torch.cat([part(piece) for part, piece in zip(self.parts, x.chunk(len(self.parts)), strict=True)])


def _sequence_terms(
    output: Any, input_ids: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence the summed next-token cross-entropy and the predictions (``(B,)``), log-probabilities, weights.

    The log-probabilities are ``(B, T − 1, V)``, the weights ``(B, T − 1)`` (1 where a prediction counts).
    """
    logits = _logits(output, input_ids)
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
    targets = input_ids[:, 1:].to(log_probs.device)
    nll = -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    keep = torch.ones_like(nll) if mask is None else (mask[:, :-1] & mask[:, 1:]).to(nll)
    return (nll * keep).sum(1).double(), keep.sum(1).double(), log_probs, keep


def _kl(clean: torch.Tensor, other: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per sequence ``Σ_t KL(clean_t ‖ other_t)`` over the counted predictions (float64, ``(B,)``)."""
    return ((clean.exp() * (clean - other)).sum(-1) * keep).sum(1).double()


def _logits(output: Any, input_ids: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"the model must return next-token logits of shape (B, T, vocab) for input ids {tuple(input_ids.shape)}, "
            f"got {getattr(logits, 'shape', type(logits).__name__)}"
        )
    return logits


def _earlier_layers(model: nn.Module, name: str) -> list[str]:
    """The modules before the block's layer: earlier entries of every ``nn.ModuleList`` on the block's path."""
    parts = name.split(".")
    earlier = []
    for depth in range(1, len(parts)):
        container = model.get_submodule(".".join(parts[:depth]))
        if isinstance(container, nn.ModuleList) and parts[depth].isdigit():
            prefix = ".".join(parts[:depth])
            earlier += [f"{prefix}.{index}" for index in range(int(parts[depth]))]
    return earlier


class _Replay(nn.Module):
    """Stands in for a layer that finished before the replaced block: its clean output, repeated per slice."""

    def __init__(self, output: Any, copies: int, rows: tuple[int, ...]) -> None:
        super().__init__()
        self.output, self.copies, self.rows = output, copies, rows

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _tile(self.output, self.copies, self.rows)


def _tile(value: Any, copies: int, rows: tuple[int, ...]) -> Any:
    """``value`` with every tensor whose first dimension is a batch size in ``rows`` repeated ``copies`` times."""
    if isinstance(value, torch.Tensor):
        return torch.cat([value] * copies) if value.ndim and value.shape[0] in rows else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_tile(item, copies, rows) for item in value)
    if isinstance(value, list):
        return [_tile(item, copies, rows) for item in value]
    return value


@contextmanager
def _call_order(model: nn.Module, names: list[str]) -> Iterator[dict[str, list]]:
    """Record, per named module, ``(start, end, output)`` of every call, ``start``/``end`` on one counter."""
    calls: dict[str, list] = {name: [] for name in names}
    clock = [0]
    starts: dict[str, int] = {}

    def hooks(name: str) -> tuple[Any, Any]:
        def before(module: nn.Module, args: tuple) -> None:
            clock[0] += 1
            starts[name] = clock[0]

        def after(module: nn.Module, args: tuple, output: Any) -> None:
            clock[0] += 1
            calls[name].append((starts[name], clock[0], output))

        return before, after

    handles = []
    for name in dict.fromkeys(names):
        before, after = hooks(name)
        module = model.get_submodule(name)
        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _replays(calls: dict[str, list], block: str, layers: list[str]) -> dict[str, Any] | None:
    """The clean outputs of ``layers``, if each ran once and finished before ``block`` started; else None."""
    if len(calls[block]) != 1 or any(len(calls[layer]) != 1 for layer in layers):
        return None
    start = calls[block][0][0]
    if any(calls[layer][0][1] > start for layer in layers):
        return None
    return {layer: calls[layer][0][2] for layer in layers}


def _repeat(kwargs: Mapping[str, Any], copies: int, rows: int) -> dict[str, Any]:
    return {key: _tile(value, copies, (rows,)) for key, value in kwargs.items()}


def evaluate_replacements(
    model: nn.Module,
    batches: Iterable[Batch],
    replacements: Mapping[str, Mapping[str, nn.Module]],
    *,
    mask_argument: str | None = "attention_mask",
    config: Mapping[str, Any] | None = None,
    progress: bool = False,
    stack_tokens: int = 4096,
    resamples: int = 1000,
    seed: int = 0,
    metrics: Sequence[str | type[Metric]] | None = None,
) -> FrontierTable:
    """Measure every replacement of every block on held-out ``batches``.

    Parameters
    ----------
    model : nn.Module
        The original model (restored after every splice; run in eval mode without gradients).
    batches : Iterable
        Held-out text, as for [`distill`][mumoe_tn.distillation.training.distill]; a mapping batch
        must hold ``input_ids`` (the next-token targets). Each row of a batch is one sequence of
        the bootstrap.
    replacements : Mapping
        ``block name -> method -> module`` (e.g. ``Distillation.replacements``).
    mask_argument : str or None, optional
        The key of a mapping batch that marks real tokens (default ``"attention_mask"``).
    config : Mapping, optional
        Plain data stored with the table.
    progress : bool, optional
        Show a tqdm bar over the batches.
    stack_tokens : int, optional
        Most tokens of one stacked pass (default 4,096): ``stack_tokens // tokens per batch``
        candidates (at least one) share a pass. Its logits take ``stack_tokens × vocab`` floats.
    resamples : int, optional
        Bootstrap resamples of the CE-loss score's interval (default 1,000).
    seed : int, optional
        Seeds the bootstrap.
    metrics : Sequence of str or Metric subclasses, optional
        The registered [`Metric`][mumoe_tn.distillation.metrics.Metric]s to measure beside the
        row's own fields (default every registered one): each in the rows' ``extra``.

    Returns
    -------
    FrontierTable
        One row per block and method. A replacement that exposes no sparse code (see
        [`code_module`][mumoe_tn.distillation.training.code_module]) gets L0 NaN and 0 units.

    Warns
    -----
    UserWarning
        One line per block whose zero-ablation does not raise the loss beyond its bootstrap
        noise: its CE-loss scores are left empty (see
        [`FrontierRow.meaningful`][mumoe_tn.distillation.frontier.FrontierRow]).
    """
    if not isinstance(replacements, Mapping) or not replacements:
        raise TypeError("replacements must be a non-empty mapping of block name -> method -> module")
    stack_tokens = check_size("stack_tokens", stack_tokens)
    measured = resolve_metrics(metrics)
    names = list(replacements)
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{name!r} is not a module of the model") from None
    tallies = {b: {m: _Tally(tuple(cls() for cls in measured), params=sum(p.numel() for p in mod.parameters()))
                   for m, mod in ms.items()} for b, ms in replacements.items()}  # fmt: skip
    layers = {name: _earlier_layers(model, name) for name in names}
    watched = list(dict.fromkeys([*names, *(layer for ls in layers.values() for layer in ls)]))
    clean: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    zero: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    kl_zero: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    takes_cache = "use_cache" in inspect.signature(model.forward).parameters
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
                with capture_blocks(model, names) as captured, _call_order(model, watched) as calls:
                    output = run_model(model, kwargs, mask)
                nll, count, clean_log_probs, keep = _sequence_terms(output, ids, mask)
                clean.append(nll)
                counts.append(count)
                if takes_cache and "use_cache" not in kwargs:
                    kwargs["use_cache"] = False
                copies = max(1, stack_tokens // ids.numel())
                for name in names:
                    x, y = captured[name]
                    rows_x, rows_y = _real(x, mask), _real(y, mask)
                    for method, module in replacements[name].items():
                        if code_module(module) is None:
                            codes, prediction = [], module(rows_x)
                        else:
                            with recording_code(module) as codes:
                                prediction = module(rows_x)
                        tallies[name][method].add(prediction, rows_y, codes)
                    candidates = [("", ZeroBlock(y.shape[-1])), *replacements[name].items()]
                    replays = _replays(calls, name, layers[name])
                    for first in range(0, len(candidates), copies):
                        group = candidates[first : first + copies]
                        stand_ins: dict[str, nn.Module] = {name: StackedReplacements([m for _, m in group])}
                        rows = (ids.shape[0], ids.numel())
                        for layer, value in (replays or {}).items():
                            stand_ins[layer] = _Replay(value, len(group), rows)
                        stacked_mask = None if mask is None else torch.cat([mask] * len(group))
                        with spliced(model, stand_ins):
                            out = run_model(model, _repeat(kwargs, len(group), ids.shape[0]), stacked_mask)
                        stacked_ids = torch.cat([ids] * len(group))
                        nlls, _, log_probs, _ = _sequence_terms(out, stacked_ids, stacked_mask)
                        for r, (method, _) in enumerate(group):
                            part = slice(r * ids.shape[0], (r + 1) * ids.shape[0])
                            kl = _kl(clean_log_probs, log_probs[part], keep)
                            if method == "":
                                zero[name].append(nlls[part])
                                kl_zero[name].append(kl)
                            else:
                                tallies[name][method].ce.append(nlls[part])
                                tallies[name][method].kl.append(kl)
    finally:
        model.train(was_training)
        for methods in replacements.values():
            for module in methods.values():
                module.train(modes[id(module)])
    clean_sums, tokens = torch.cat(clean), torch.cat(counts)
    predictions = int(tokens.sum())
    ce_clean = float(clean_sums.sum()) / max(predictions, 1)
    rows = []
    for name in names:
        zero_sums = torch.cat(zero[name])
        per = max(predictions, 1)
        reference = _Reference(ce_clean, float(zero_sums.sum()) / per, float(torch.cat(kl_zero[name]).sum()) / per, per)
        for method, tally in tallies[name].items():
            interval = bootstrap_ce_score(clean_sums.numpy(), torch.cat(tally.ce).numpy(), zero_sums.numpy(),
                                          tokens.numpy(), resamples=resamples, seed=seed)  # fmt: skip
            rows.append(tally.row(name, method, reference, interval))
    headers = {cls.name: cls.column for cls in measured if cls.row_field is None}
    sequences = SequenceLosses(
        tokens.numpy().astype(np.float64),
        clean_sums.double().numpy(),
        {name: torch.cat(zero[name]).double().numpy() for name in names},
        {name: {m: torch.cat(t.ce).double().numpy() for m, t in tallies[name].items()} for name in names},
    )
    table = FrontierTable(tuple(rows), dict(config or {}), headers, sequences)
    for name in table.not_meaningful():
        row = next(row for row in table.rows if row.block == name)
        warnings.warn(
            f"{name}: CE-loss score not meaningful — zero-ablating the block changes the loss by {row.gap:+.4f} nats "
            f"(95 % interval {row.gap_low:+.4f} to {row.gap_high:+.4f}); read the KL score and the loss increase",
            UserWarning,
            stacklevel=2,
        )
    return table


def _real(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``t`` as ``(tokens, features)`` rows at the real tokens."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if mask is None else rows[mask.reshape(-1).to(t.device)]
