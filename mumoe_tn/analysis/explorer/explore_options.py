"""The options of the expert explorer, as one documented object.

[`explore`][mumoe_tn.analysis.explorer.explore.explore] takes them as
``options=ExploreOptions(...)`` or as keywords (``top_k=…, labels=…``), the same names, one form
or the other: keywords given beside ``options=`` are refused with a ``TypeError`` that names them
(change an options object with ``dataclasses.replace(options, top_k=20)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["OPTION_NAMES", "ExploreOptions", "explore_options"]


@dataclass(frozen=True)
class ExploreOptions:
    """What [`explore`][mumoe_tn.analysis.explorer.explore.explore] shows and how: all but the model, data and path.

    Each is checked by ``explore`` before any work, with an error naming it.

    Attributes
    ----------
    labels : torch.Tensor or None
        Class labels, ``(samples,)``: a classifier's report (class breakdowns, per-class ablation
        effects); without them integer token ids make a language model's.
    images : torch.Tensor or None
        One image per sample to show with the examples, ``(samples, H, W)``, ``(samples, H, W, 3)``
        or ``(samples, 3, H, W)``; by default the data itself when it is a classifier's float input
        of shape ``(samples, H, H)`` or ``(samples, C, H, W)``.
    vocabulary : sequence of str or Callable or None
        Token id -> text (a list, or e.g. ``tokenizer.decode``).
    class_names : sequence of str or None
        Names of the classes (default ``"0"``, ``"1"``, …).
    layers : Iterable of str or None
        Qualified names of the layers to explore (default: all μMoE layers).
    top_k : int
        Top-activating examples per unit (default 12; kept with a streaming top-k: memory does not
        grow with the data). Text examples never overlap: of two windows of one sequence within
        ``2 × context`` positions of each other only the larger coefficient's is shown, and the
        next largest takes its place.
    context : int
        Tokens of context on each side of a text example (default 12).
    batch_size : int
        Samples per forward pass (default 32).
    ablation : bool
        Measure each unit's ablation effect (one counterfactual pass per unit over
        ``ablation_samples`` samples; default True).
    ablation_samples : int
        Samples (the first ones) on which ablation effects are measured (default 64).
    max_rows : int
        Largest batch of replicated samples in the ablation passes (default 8,192).
    threshold : float
        A unit is active on a row when its coefficient is at least this (default 1e-6).
    bins : int
        Histogram bins over ``[0, 1]``, or over ``[0, 2^k]`` where a coefficient exceeds 1 (a
        ReLU gate's), the smallest such range that holds the largest coefficient (default 24).
    forward : Callable or None
        ``forward(model, batch)`` if the model is not simply called; it must return logits (or
        an output with ``.logits``).
    title : str or None
        The page's title.
    progress : bool or None
        Show progress bars (tqdm, on stderr); by default only on a terminal.

    Examples
    --------
    >>> import dataclasses
    >>> options = ExploreOptions(top_k=4, ablation=False)
    >>> dataclasses.replace(options, context=3).context
    3
    """

    labels: torch.Tensor | None = None
    images: torch.Tensor | None = None
    vocabulary: Sequence[str] | Callable[[int], str] | None = None
    class_names: Sequence[str] | None = None
    layers: Iterable[str] | None = None
    top_k: int = 12
    context: int = 12
    batch_size: int = 32
    ablation: bool = True
    ablation_samples: int = 64
    max_rows: int = 8192
    threshold: float = 1e-6
    bins: int = 24
    forward: Callable[[nn.Module, torch.Tensor], object] | None = None
    title: str | None = None
    progress: bool | None = None


#: The names ``explore`` takes as options, in order.
OPTION_NAMES = tuple(field.name for field in dataclasses.fields(ExploreOptions))


def explore_options(options: ExploreOptions | None, keywords: Mapping[str, Any]) -> ExploreOptions:
    """The options of an ``explore`` call given as ``options=`` or as keywords, never both.

    Raises
    ------
    TypeError
        ``options`` of another type, an unknown keyword, or keywords beside ``options=`` (named).
    """
    unknown = sorted(str(name) for name in keywords if name not in OPTION_NAMES)
    if unknown:
        raise TypeError(f"explore() got unknown options {unknown}; its options are {list(OPTION_NAMES)}")
    if options is None:
        return ExploreOptions(**keywords)
    if not isinstance(options, ExploreOptions):
        raise TypeError(f"options must be an ExploreOptions, got {type(options).__name__}")
    if keywords:
        raise TypeError(
            f"explore() takes its options as options= or as keywords, not both: got options= and {sorted(keywords)}; "
            "set them in the options (dataclasses.replace(options, ...))"
        )
    return options
