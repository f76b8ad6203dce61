"""``explore``: one self-contained HTML report of every expert of every μMoE layer of a model."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mumoe_tn.analysis.coefficients import DeadExpertWarning, collect_coefficients, mumoe_layers
from mumoe_tn.analysis.effects import AblationEffects, ablation_effects, expert_units
from mumoe_tn.analysis.explorer.collect import LayerRecord
from mumoe_tn.analysis.explorer.explore_options import ExploreOptions, explore_options
from mumoe_tn.analysis.explorer.page import render
from mumoe_tn.analysis.outputs import decoder, logits_of
from mumoe_tn.analysis.polysemanticity import class_polysemanticity
from mumoe_tn.analysis.progress import check_progress
from mumoe_tn.analysis.progress import progress as progress_bar
from mumoe_tn.layers import MuMoEBase
from mumoe_tn.validation import check_callable, check_int, check_model, check_real, check_tensor

__all__ = ["Exploration", "explore"]


@dataclass
class Exploration:
    """The explorer's findings (``data``, JSON-ready) and its HTML page.

    Attributes
    ----------
    data : dict
        Everything the page shows: per layer, its modes' usage and per unit (an expert, or a
        slice ``n_e = k`` of a hierarchical layer) its statistics, top examples and ablation effects.
    effects : dict
        Layer name -> [`AblationEffects`][mumoe_tn.analysis.effects.AblationEffects] (empty when
        ablation was off).
    """

    data: dict
    effects: dict[str, AblationEffects]

    @property
    def html(self) -> str:
        """The self-contained page (inline script and style, nothing loaded from the network)."""
        return render(self.data)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the page to ``path`` (UTF-8); returns the path.

        The page is written to a temporary file beside ``path`` and renamed onto it: ``path`` holds
        the whole page or, if writing fails, what it held before, never part of one.
        """
        path = Path(path)
        content = self.html.encode("utf-8")
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            os.fchmod(handle, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # not mkstemp's 0o600
            with open(handle, "wb") as stream:
                stream.write(content)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return path


def _unit_label(unit: tuple[int | None, ...]) -> str:
    if len(unit) == 1:
        return str(unit[0])
    return "(" + ", ".join("·" if k is None else str(k) for k in unit) + ")"


def _selectivity(mass: torch.Tensor, present: int) -> torch.Tensor:
    """``1 − H(p)/log(present)`` of each row's distribution ``p`` (1: one target only, 0: uniform)."""
    total = mass.sum(1, keepdim=True)
    p = mass / total.clamp_min(1e-300)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(1)
    result = 1 - entropy / math.log(max(present, 2))
    return torch.where(total.squeeze(1) > 0, result, torch.full_like(result, math.nan))


def _number(value: float, digits: int = 4) -> float | None:
    value = float(value)
    return None if not math.isfinite(value) else float(f"{value:.{digits}g}")


def _check_images(images: object, samples: int) -> torch.Tensor | None:
    if images is None:
        return None
    images = check_tensor("images", images, non_empty=True)
    if images.shape[0] != samples:
        raise ValueError(f"images must hold one image per sample ({samples}), got shape {tuple(images.shape)}")
    if images.ndim == 4 and images.shape[1] in (1, 3) and images.shape[-1] not in (1, 3):
        images = images.permute(0, 2, 3, 1)  # (S, C, H, W) -> (S, H, W, C)
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if not (images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 3)):
        raise ValueError(
            "images must have shape (samples, H, W), (samples, H, W, 3) or (samples, 3, H, W), "
            f"got {tuple(images.shape)}"
        )
    images = images.detach().double().cpu()
    low, high = (
        images.amin(dim=tuple(range(1, images.ndim)), keepdim=True),
        images.amax(dim=tuple(range(1, images.ndim)), keepdim=True),
    )
    return ((images - low) / (high - low).clamp_min(1e-12) * 255).round().to(torch.uint8)


@torch.no_grad()
def explore(
    model: nn.Module,
    data: torch.Tensor,
    path: str | os.PathLike | None = None,
    *,
    options: ExploreOptions | None = None,
    **keywords: Any,
) -> Exploration:
    """Explore every expert of a model's μMoE layers and write one self-contained HTML page.

    The page has an overview per layer (load per expert and per mode, coefficient sparsity,
    dead experts, specialisation, a joint-load map of hierarchical modes) and a panel per unit
    — an expert of a one-mode layer, or a slice ``n_e = k`` of a hierarchical layer — with its
    top-activating examples in context, a histogram of its coefficient, the targets it weighs
    most and the effect of ablating it. Units can be searched and sorted by usage,
    specialisation and ablation effect. Nothing is loaded from the network when it is opened.

    Parameters
    ----------
    model : nn.Module
        Any model with μMoE layers (any block, any format, hierarchical modes); it is evaluated
        in ``eval()`` mode (restored after).
    data : torch.Tensor
        The inputs, samples along the first dimension. Integer ``(sequences, positions)`` token
        ids without ``labels`` make a language model's report (next-token loss, tokens in
        context); with ``labels`` a classifier's (class breakdowns, per-class ablation effects).
    path : str or PathLike, optional
        Where to write the HTML page (also possible later with ``Exploration.save``).
    options : ExploreOptions, optional
        What to show and how (see [`ExploreOptions`][mumoe_tn.analysis.explorer.explore_options.ExploreOptions]:
        ``labels``, ``images``, ``vocabulary``, ``class_names``, ``layers``, ``top_k``,
        ``context``, ``batch_size``, ``ablation``, ``ablation_samples``, ``max_rows``,
        ``threshold``, ``bins``, ``forward``, ``title``, ``progress``).
    **keywords
        The same options as keywords (``labels=y, top_k=8``), instead of ``options=``: the two
        forms are mutually exclusive (a ``TypeError`` names the keywords given beside ``options=``).

    Returns
    -------
    Exploration

    Examples
    --------
    >>> import torch
    >>> from mumoe_tn import MuMoE
    >>> model = torch.nn.Sequential(MuMoE(8, 3, 16, "cp", 4)).eval()
    >>> report = explore(model, torch.randn(40, 8), labels=torch.randint(0, 3, (40,)), progress=False)
    >>> sorted(report.data["layers"][0]["units"][0])[:3]
    ['ablation', 'dead', 'examples']
    """
    given = explore_options(options, keywords)
    labels, images, vocabulary, class_names, layers = (
        given.labels, given.images, given.vocabulary, given.class_names, given.layers
    )  # fmt: skip
    model = check_model("model", model)
    data = check_tensor("data", data, non_empty=True)
    if data.ndim < 1:
        raise ValueError(f"data must have a sample dimension, got shape {tuple(data.shape)}")
    samples = data.shape[0]
    integer = not (data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool)
    if labels is not None:
        labels = check_tensor("labels", labels, ndim=1, kind="int")
        if labels.shape[0] != samples:
            raise ValueError(f"labels must have shape ({samples},) (one per sample), got {tuple(labels.shape)}")
        if int(labels.min()) < 0:
            raise ValueError(f"labels must be class indices >= 0, got {int(labels.min())}")
    kind = "classes" if labels is not None else "text" if integer and data.ndim == 2 else None
    if kind is None:
        raise ValueError(
            f"data of dtype {data.dtype} and shape {tuple(data.shape)} without labels: give integer token ids "
            "(sequences, positions) for a language model, or labels for a classifier"
        )
    square = data.ndim == 3 and data.shape[1] == data.shape[2]
    if images is None and kind == "classes" and not integer and (square or data.ndim == 4):
        try:
            image_pixels = _check_images(data, samples)
        except ValueError:
            image_pixels = None
    else:
        image_pixels = _check_images(images, samples)
    if not isinstance(given.ablation, bool):
        raise TypeError(f"ablation must be a bool, got {given.ablation!r}")
    check_callable("forward", given.forward)
    if given.title is not None and not isinstance(given.title, str):
        raise TypeError(f"title must be a str, got {type(given.title).__name__}")
    check_progress(given.progress)
    checked = dataclasses.replace(
        given, labels=labels, top_k=check_int("top_k", given.top_k, minimum=1),
        context=check_int("context", given.context, minimum=0),
        batch_size=check_int("batch_size", given.batch_size, minimum=1),
        ablation_samples=check_int("ablation_samples", given.ablation_samples, minimum=1),
        max_rows=check_int("max_rows", given.max_rows, minimum=1), threshold=check_real("threshold", given.threshold),
        bins=check_int("bins", given.bins, minimum=2),
    )  # fmt: skip
    if path is not None:
        path = Path(path)
        if not path.parent.is_dir():
            raise ValueError(f"cannot write {str(path)!r}: its folder does not exist")
    decode = decoder(vocabulary)
    if class_names is not None:
        if isinstance(class_names, (str, bytes)) or not isinstance(class_names, Sequence):
            raise TypeError(f"class_names must be a sequence of str, got {type(class_names).__name__}")
        class_names = [str(name) for name in class_names]
    found = mumoe_layers(model)
    names = list(found) if layers is None else list(layers)
    unknown = [name for name in names if name not in found]
    if unknown:
        raise ValueError(f"no μMoE layer named {unknown}; the model has {list(found)}")
    if not names:
        raise ValueError("the model has no μMoE layer (MuMoE, MuMoEMLP or MuMoEGatedMLP)")
    was_training = model.training
    model.eval()
    try:
        return _explore(
            model, data, path, checked, image_pixels=image_pixels, decode=decode, class_names=class_names,
            layers={name: found[name] for name in names}, kind=kind,
        )  # fmt: skip
    finally:
        model.train(was_training)


def _explore(model, data, path, options: ExploreOptions, *, image_pixels, decode, class_names,
             layers: dict[str, MuMoEBase], kind) -> Exploration:  # fmt: skip
    """The exploration itself, of checked options (``class_names`` and ``layers`` resolved)."""
    labels, top_k, context, batch_size, ablation, ablation_samples = (
        options.labels, options.top_k, options.context, options.batch_size, options.ablation, options.ablation_samples
    )  # fmt: skip
    max_rows, threshold, bins, forward, title, progress = (
        options.max_rows, options.threshold, options.bins, options.forward, options.title, options.progress
    )  # fmt: skip
    samples = data.shape[0]
    batches = list(data.split(batch_size))
    label_batches = None if labels is None else list(labels.split(batch_size))
    if kind == "text":
        classes = int(data.max()) + 1
    else:
        classes = int(labels.max()) + 1
        if class_names is not None and len(class_names) < classes:
            raise ValueError(f"class_names has {len(class_names)} names but the labels go up to {classes - 1}")
    target_names = _Names(decode if kind == "text" else None, class_names)
    records = {name: LayerRecord() for name in layers}
    current: dict[str, object] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output: object) -> None:
            coefficients = module.last_coefficients
            batch, leading = current["batch"], tuple(coefficients[0].shape[:-1])
            targets = None
            if kind == "text" and leading == tuple(batch.shape):
                targets = batch
            elif kind == "classes" and leading and leading[0] == batch.shape[0]:
                per_sample = math.prod(leading[1:])
                targets = current["labels"].repeat_interleave(per_sample)
            tokens = module.last_token_mask
            if tokens is not None:
                coefficients = tuple(a[tokens] for a in coefficients)
                targets = None if targets is None else targets.reshape(tokens.shape)[tokens]
            records[name].add(coefficients, targets, bins=bins, classes=classes, threshold=threshold)

        return record

    def run(model: nn.Module, index: int) -> object:
        current["batch"] = batches[index]
        current["labels"] = None if label_batches is None else label_batches[index]
        return forward(model, batches[index]) if forward else model(batches[index])

    # each kept text example hides at most 4·context others (positions within 2·context of it): the
    # first top_k non-overlapping examples are always among the top_k·(4·context + 1) coefficients
    candidates = top_k * (4 * context + 1) if kind == "text" else top_k
    handles = [layer.register_forward_hook(hook(name)) for name, layer in layers.items()]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeadExpertWarning)  # the page reports dead experts
            statistics = collect_coefficients(
                model, range(len(batches)), layers=list(layers), threshold=threshold, top_k=candidates, forward=run,
                progress=progress,
            )  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()

    # the examples: (sample, position) of every unit's top rows, then the context windows' coefficients
    located: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    wanted: set[int] = set()
    for name in layers:
        located[name] = []
        for mode in statistics[name].modes:
            sample, position = statistics[name].locate(mode.top_rows.reshape(-1))
            shape = mode.top_rows.shape
            located[name].append((sample.reshape(shape), position.reshape(shape), mode.top_values))
            wanted.update(int(s) for s in sample.tolist() if s >= 0)
    windows = _window_coefficients(model, data, sorted(wanted), layers, batch_size, forward, progress) if (
        kind == "text"
    ) else {}  # fmt: skip

    effects: dict[str, AblationEffects] = {}
    polysemanticity = {}
    if ablation:
        subset = data[:ablation_samples]
        subset_labels = None if labels is None else labels[:ablation_samples]
        for name, layer in layers.items():
            effects[name] = ablation_effects(
                model, layer, subset, labels=subset_labels, vocabulary=decode, batch_size=batch_size,
                max_rows=max_rows, forward=forward, progress=progress,
            )  # fmt: skip
            if kind == "classes":
                polysemanticity[name] = class_polysemanticity(
                    model, layer, subset, subset_labels, experts=effects[name].experts, n_classes=classes,
                    max_rows=max_rows, forward=(lambda m, x: _logits(m, x, forward)), progress=progress,
                )  # fmt: skip

    report_layers = []
    for name, layer in layers.items():
        stats, record = statistics[name], records[name]
        present = int((record.modes[0].target_mass.sum(0) > 0).sum()) if record.modes[0].target_mass is not None else 2
        units = []
        for unit in expert_units(layer.expert_dims):
            (e, n) = next((e, k) for e, k in enumerate(unit) if k is not None)
            mode, rec = stats.modes[e], record.modes[e]
            mass = rec.target_mass[n] if rec.target_mass is not None else None
            entry = {
                "id": len(units),
                "label": _unit_label(unit),
                "unit": list(unit),
                "mode": e,
                "index": n,
                "load": int(mode.load[n]),
                "load_fraction": _number(mode.load_fraction[n]),
                "mean": _number(mode.mean[n]),
                "std": _number(mode.std[n]),
                "max": _number(mode.maximum[n]) if mode.rows else None,
                "dead": bool(mode.load[n] == 0),
                "histogram": rec.histogram[n].tolist(),
                "selectivity": _number(_selectivity(mass[None], present)[0]) if mass is not None else None,
                "targets": _top_mass(mass, target_names),
                "examples": _examples(
                    located[name][e], n, kind, data, labels, target_names, decode, windows.get(name), e, context
                )[:top_k],
            }
            if name in effects:
                entry["ablation"] = _ablation_entry(effects[name], unit, target_names, kind, polysemanticity.get(name))
            units.append(entry)
        report_layers.append(
            {
                "name": name or "(model)",
                "type": type(layer).__name__,
                "description": layer.extra_repr() if hasattr(layer, "extra_repr") else "",
                "expert_dims": list(layer.expert_dims),
                "rows": stats.modes[0].rows,
                "modes": [
                    {
                        "experts": mode.load.shape[0],
                        "dead": mode.dead.tolist(),
                        "load": [_number(v) for v in mode.load_fraction],
                        "active_per_row": _number(float(mode.load.sum()) / max(mode.rows, 1)),
                        "largest": _number(rec.largest),
                        "upper": _number(rec.upper),
                    }
                    for mode, rec in zip(stats.modes, record.modes, strict=True)
                ],
                "joint": [(joint / max(stats.modes[0].rows, 1)).to(torch.float32).tolist() for joint in record.joint],
                "loss": _number(effects[name].loss) if name in effects else None,
                "polysemanticity": _number(polysemanticity[name].mean) if name in polysemanticity else None,
                "units": units,
            }
        )
    images = {}
    if image_pixels is not None:
        used = {ex["sample"] for layer in report_layers for unit in layer["units"] for ex in unit["examples"]}
        images = {str(s): image_pixels[s].flatten().tolist() for s in sorted(used)}
    result = {
        "title": title or f"Experts of {type(model).__name__}",
        "kind": kind,
        "samples": samples,
        "ablation_samples": min(ablation_samples, samples) if ablation else 0,
        "threshold": threshold,
        "bins": bins,
        "top_k": top_k,
        "targets": [target_names[c] for c in range(classes)] if kind == "classes" else None,
        "image_shape": list(image_pixels.shape[1:]) if image_pixels is not None else None,
        "images": images,
        "layers": report_layers,
    }
    exploration = Exploration(result, effects)
    if path is not None:
        exploration.save(path)
    return exploration


class _Names:
    """Target id -> text: decoded tokens, or class names (``"7"`` past the names given)."""

    def __init__(self, decode: Callable[[int], str] | None, class_names: list[str] | None) -> None:
        self.decode, self.class_names = decode, class_names or []

    def __getitem__(self, target: int) -> str:
        target = int(target)
        if self.decode is not None:
            return self.decode(target)
        return self.class_names[target] if target < len(self.class_names) else str(target)


def _logits(model: nn.Module, x: torch.Tensor, forward: Callable | None) -> torch.Tensor:
    return logits_of(forward(model, x) if forward else model(x))


def _top_mass(mass: torch.Tensor | None, names: _Names, k: int = 8) -> list[list]:
    """The targets carrying most of a unit's coefficient mass: ``[name, share]``."""
    if mass is None or float(mass.sum()) <= 0:
        return []
    share = mass / mass.sum()
    top = share.topk(min(k, share.numel()))
    return [[names[t], _number(v, 3)] for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True) if v > 0]


def _window_coefficients(model, data, wanted, layers, batch_size, forward, progress) -> dict[str, dict]:
    """Each layer's coefficients at every position of the sequences holding top examples (only those)."""
    if not wanted:
        return {}
    chosen = torch.tensor(wanted, dtype=torch.long)
    captured: dict[str, list[tuple[torch.Tensor, ...]]] = {name: [] for name in layers}

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output: object) -> None:
            captured[name].append(tuple(a.detach().float().cpu() for a in module.last_coefficients))

        return record

    handles = [layer.register_forward_hook(hook(name)) for name, layer in layers.items()]
    try:
        for chunk in progress_bar(list(chosen.split(batch_size)), "example contexts", enabled=progress):
            batch = data[chunk]
            forward(model, batch) if forward else model(batch)
    finally:
        for handle in handles:
            handle.remove()
    result = {}
    for name, parts in captured.items():
        chunks = chosen.split(batch_size)
        if len(parts) != len(chunks) or any(
            tuple(p[0].shape[:-1]) != tuple(data[c].shape) for p, c in zip(parts, chunks, strict=True)
        ):
            continue  # not one row per token: no windows for this layer
        modes = [torch.cat(mode) for mode in zip(*parts, strict=True)]
        result[name] = {"rows": {int(s): k for k, s in enumerate(wanted)}, "modes": modes}
    return result


def _examples(located, n, kind, data, labels, target_names, decode, windows, mode, context) -> list[dict]:
    samples, positions, values = located
    examples = []
    shown: dict[int, list[int]] = {}  # sample -> positions of the text examples kept
    for sample, position, value in zip(samples[n].tolist(), positions[n].tolist(), values[n].tolist(), strict=True):
        if sample < 0:
            continue  # an inactive slot (the unit was active on fewer rows)
        if kind == "text":
            if any(abs(position - kept) <= 2 * context for kept in shown.get(sample, ())):
                continue  # its window would overlap a larger example's of the same sequence
            shown.setdefault(sample, []).append(position)
        example = {"sample": sample, "position": position, "value": _number(value)}
        if kind == "text":
            sequence = data[sample].tolist()
            start, stop = max(0, position - context), min(len(sequence), position + context + 1)
            coefficients = None
            if windows is not None:
                coefficients = windows["modes"][mode][windows["rows"][sample], :, n]
            example["tokens"] = [
                [decode(sequence[p]), _number(coefficients[p], 3) if coefficients is not None else None]
                for p in range(start, stop)
            ]
            example["centre"] = position - start
            if position + 1 < len(sequence):
                example["next"] = decode(sequence[position + 1])
        else:
            example["label"] = target_names[int(labels[sample])]
        examples.append(example)
    return examples


def _ablation_entry(effects: AblationEffects, unit, names, kind, polysemanticity) -> dict:
    u = effects.experts.index(tuple(unit))
    k = 6
    entry = {
        "delta_loss": _number(effects.delta_loss[u]),
        "hurt": [[names[t], _number(d), c] for t, d, c in effects.targets(tuple(unit), k) if d > 0],
        "promoted": [[names[t], _number(d)] for t, d in effects.promoted(tuple(unit), k)],
        "suppressed": [[names[t], _number(d)] for t, d in effects.suppressed(tuple(unit), k)],
    }
    if kind == "classes":
        entry["classes"] = [
            {
                "class": names[c],
                "accuracy": _number(effects.accuracy[c]),
                "ablated": _number(effects.ablated_accuracy[u, c]),
                "delta_loss": _number(effects.target_delta[u, c]),
                "count": int(effects.target_count[c]),
            }
            for c in range(effects.target_count.numel())
            if effects.target_count[c] > 0
        ]
        if polysemanticity is not None:
            entry["polysemanticity"] = _number(polysemanticity.polysemanticity[u])
            entry["changed"] = bool(polysemanticity.changed[u])
    return entry
