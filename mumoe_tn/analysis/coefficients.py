"""Expert coefficients of every μMoE layer of a model, collected with forward hooks.

Nothing in the model is edited: a forward hook on each [`MuMoE`][mumoe_tn.layers.moe.MuMoE] /
[`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP] reads ``last_coefficients`` after every call. Memory stays
bounded for any expert count: per expert mode, running sums, a load count, a running top-k of
activating rows, and the coefficient-weighted sum of the layer's inputs (for cluster centres).
Rows are counted in the order the layer sees them (``row = sample · tokens + token`` for
inputs of shape ``(samples, tokens, features)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from mumoe_tn.analysis.validation import check_callable, check_int, check_model, check_real, check_tensor
from mumoe_tn.layers import MuMoEBase

__all__ = ["ExpertStatistics", "LayerCoefficients", "collect_coefficients", "default_forward", "mumoe_layers"]


def mumoe_layers(model: nn.Module) -> dict[str, MuMoEBase]:
    """Every μMoE layer of ``model`` by qualified name (the model itself is named ``""``)."""
    check_model("model", model)
    return {name: module for name, module in model.named_modules() if isinstance(module, MuMoEBase)}


@dataclass
class ExpertStatistics:
    """Streaming statistics of one expert mode's coefficients ``a ∈ R^{rows × N}``.

    Attributes
    ----------
    rows : int
        Rows (tokens) seen.
    total, total_sq : torch.Tensor
        ``Σ a`` and ``Σ a²`` per expert.
    maximum : torch.Tensor
        Largest coefficient per expert.
    load : torch.Tensor
        Rows with ``a_n ≥ threshold`` per expert (the paper's expert load).
    top_values, top_rows : torch.Tensor
        The ``k`` largest coefficients per expert and the rows they came from, largest first
        (``min(k, rows)`` columns: memory grows with the rows seen, never with ``k`` alone).
    input_sum : torch.Tensor or None
        ``Σ a_n · x`` over rows (``N × I``), where ``x`` is the layer's input.
    threshold : float
        Load threshold.
    top_k : int
        ``k``, the most top rows kept per expert.
    """

    total: torch.Tensor
    total_sq: torch.Tensor
    maximum: torch.Tensor
    load: torch.Tensor
    top_values: torch.Tensor
    top_rows: torch.Tensor
    input_sum: torch.Tensor | None
    threshold: float
    rows: int = 0
    top_k: int = 8

    @classmethod
    def empty(cls, n: int, top_k: int, in_features: int | None, threshold: float) -> ExpertStatistics:
        """Statistics of no rows for ``n`` experts."""
        n = check_int("n", n, minimum=1)
        top_k = check_int("top_k", top_k, minimum=0)
        if in_features is not None:
            in_features = check_int("in_features", in_features, minimum=1)
        threshold = check_real("threshold", threshold)
        zeros = torch.zeros(n, dtype=torch.float64)
        return cls(
            total=zeros.clone(),
            total_sq=zeros.clone(),
            maximum=torch.full((n,), -torch.inf, dtype=torch.float64),
            load=torch.zeros(n, dtype=torch.long),
            top_values=torch.empty(n, 0, dtype=torch.float64),
            top_rows=torch.empty(n, 0, dtype=torch.long),
            input_sum=None if in_features is None else torch.zeros(n, in_features, dtype=torch.float64),
            threshold=threshold,
            top_k=top_k,
        )

    @torch.no_grad()
    def update(self, a: torch.Tensor, x: torch.Tensor | None) -> None:
        """Add a batch of coefficient rows ``a (rows, N)`` and the matching inputs ``x (rows, I)``."""
        n = self.total.shape[0]
        check_tensor("a", a, kind="float")
        if a.ndim < 1 or a.shape[-1] != n:
            raise ValueError(f"a must have shape (..., {n}) (one coefficient per expert), got {tuple(a.shape)}")
        if x is not None and self.input_sum is not None:
            check_tensor("x", x, kind="float")
            width = self.input_sum.shape[1]
            if x.ndim < 1 or x.shape[-1] != width or x.numel() // width != a.numel() // n:
                raise ValueError(
                    f"x must hold one row of {width} inputs per coefficient row ({a.numel() // n}), "
                    f"got shape {tuple(x.shape)}"
                )
        a = a.detach().reshape(-1, a.shape[-1]).double().cpu()
        if a.shape[0] == 0:  # an empty batch adds nothing
            return
        rows = torch.arange(self.rows, self.rows + a.shape[0])
        self.total += a.sum(0)
        self.total_sq += (a * a).sum(0)
        self.maximum = torch.maximum(self.maximum, a.max(0).values)
        self.load += (a >= self.threshold).sum(0)
        values = torch.cat([self.top_values, a.T], dim=1)
        k = min(self.top_k, values.shape[1])
        indices = torch.cat([self.top_rows, rows.expand(a.shape[1], -1)], dim=1)
        self.top_values, order = values.topk(k, dim=1)
        self.top_rows = indices.gather(1, order)
        if self.input_sum is not None and x is not None:
            self.input_sum += a.T @ x.detach().reshape(-1, x.shape[-1]).double().cpu()
        self.rows += a.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        """Mean coefficient per expert."""
        return self.total / max(self.rows, 1)

    @property
    def std(self) -> torch.Tensor:
        """Standard deviation of the coefficient per expert."""
        return (self.total_sq / max(self.rows, 1) - self.mean**2).clamp_min(0).sqrt()

    @property
    def load_fraction(self) -> torch.Tensor:
        """Fraction of rows with ``a_n ≥ threshold``."""
        return self.load.double() / max(self.rows, 1)

    def centres(self) -> torch.Tensor:
        """Each expert's cluster centre: the coefficient-weighted mean input ``Σ a_n x / Σ a_n``."""
        if self.input_sum is None:
            raise ValueError("input sums were not collected (collect_coefficients(..., centres=True))")
        return self.input_sum / self.total.clamp_min(1e-30)[:, None]


@dataclass
class LayerCoefficients:
    """Statistics of every expert mode of one layer."""

    name: str
    modes: list[ExpertStatistics] = field(default_factory=list)


def default_forward(model: nn.Module, batch: object) -> object:
    """``model(**batch)`` for a mapping, ``model(batch[0])`` for a tuple or list, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch[0]) if isinstance(batch, (tuple, list)) else model(batch)


@torch.no_grad()
def collect_coefficients(
    model: nn.Module,
    batches: Iterable[object],
    *,
    layers: Iterable[str] | None = None,
    threshold: float = 1e-6,
    top_k: int = 8,
    centres: bool = False,
    forward: Callable[[nn.Module, object], object] | None = None,
) -> dict[str, LayerCoefficients]:
    """Run ``model`` over ``batches`` and collect every μMoE layer's expert statistics.

    Parameters
    ----------
    model : nn.Module
        Any model containing [`MuMoE`][mumoe_tn.layers.moe.MuMoE] / [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP]
        layers (put it in
        ``eval()`` mode yourself if its gates use BatchNorm).
    batches : Iterable
        Inputs (a DataLoader, a list …); each is passed to ``forward``.
    layers : Iterable of str, optional
        Qualified names of the layers to watch (default: all μMoE layers).
    threshold : float, optional
        Load threshold: a row loads expert ``n`` when ``a_n ≥ threshold`` (entmax gives exact
        zeros, so the default counts every non-zero coefficient).
    top_k : int, optional
        Top-activating rows kept per expert.
    centres : bool, optional
        Also accumulate coefficient-weighted input sums (``N × I`` per mode), for
        [`ExpertStatistics.centres`][mumoe_tn.analysis.coefficients.ExpertStatistics.centres] and steering.
    forward : Callable, optional
        ``forward(model, batch)``; by default ``model(**batch)`` for a mapping (a Hugging Face
        batch with ``input_ids`` and ``attention_mask``), ``model(batch[0])`` for tuples/lists (an
        ``(inputs, labels)`` loader) and ``model(batch)`` otherwise.

    Notes
    -----
    Padding tokens are skipped: the rows a layer's token mask marks as padding (see
    [`mumoe_tn.masking`][mumoe_tn.masking]; a converted model takes it from its ``attention_mask``)
    count towards no statistic, and row numbers (``top_rows``) count real tokens only.

    Returns
    -------
    dict
        Layer name -> [`LayerCoefficients`][mumoe_tn.analysis.coefficients.LayerCoefficients].
    """
    found = mumoe_layers(model)
    if layers is not None and (isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable)):
        raise TypeError(f"layers must be an iterable of layer names, got {layers!r}")
    names = list(found) if layers is None else list(layers)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"layers must hold qualified layer names (str), got {name!r}")
    names = list(dict.fromkeys(names))
    if layers is not None and not names:
        raise ValueError("layers is empty: name at least one layer, or pass None for all μMoE layers")
    threshold = check_real("threshold", threshold)
    top_k = check_int("top_k", top_k, minimum=0)
    if not isinstance(centres, bool):
        raise TypeError(f"centres must be a bool, got {centres!r}")
    check_callable("forward", forward)
    if isinstance(batches, torch.Tensor) or not isinstance(batches, Iterable):
        raise TypeError(
            f"batches must be an iterable of model inputs (a list or DataLoader), got {type(batches).__name__}; "
            "wrap a single tensor as [tensor]"
        )
    unknown = [name for name in names if name not in found]
    if unknown:
        raise ValueError(f"no μMoE layer named {unknown}; the model has {list(found)}")
    if not names:
        raise ValueError("the model has no μMoE layer (MuMoE, MuMoEMLP or MuMoEGatedMLP)")
    results = {name: LayerCoefficients(name) for name in names}

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output: object) -> None:
            coefficients = module.last_coefficients
            stats = results[name].modes
            if not stats:
                width = module.in_features if centres else None
                stats += [ExpertStatistics.empty(a.shape[-1], top_k, width, threshold) for a in coefficients]
            tokens = module.last_token_mask
            x = args[0] if centres else None
            if tokens is not None:  # padding tokens are not counted
                coefficients = [a[tokens] for a in coefficients]
                x = None if x is None else x[tokens]
            for mode, a in zip(stats, coefficients, strict=True):
                mode.update(a, x)

        return record

    handles = [found[name].register_forward_hook(hook(name)) for name in names]
    call = forward or default_forward
    try:
        for batch in batches:
            call(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    if not any(results[name].modes for name in names):
        raise ValueError(f"no μMoE layer ran: batches gave no input that reached layer(s) {names}")
    return results
