"""Expert coefficients of every μMoE layer of a model, collected with forward hooks.

Nothing in the model is edited: a forward hook on each [`MuMoE`][mumoe_tn.layers.moe.MuMoE] /
[`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP] reads ``last_coefficients`` after every call. Memory stays
bounded for any expert count: per expert mode, running sums, a load count, a running top-k of
activating rows, and the coefficient-weighted sum of the layer's inputs (for cluster centres).
Rows are counted in the order the layer sees them (``row = sample · tokens + token`` for
inputs of shape ``(samples, tokens, features)``);
[`LayerCoefficients.locate`][mumoe_tn.analysis.coefficients.LayerCoefficients.locate] maps them
back to ``(sample, position)``. Experts no row ever loaded are reported (a
[`DeadExpertWarning`][mumoe_tn.analysis.coefficients.DeadExpertWarning] and the summary), and the
top rows never list a row on which the expert was inactive.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from mumoe_tn.analysis.progress import check_progress
from mumoe_tn.analysis.progress import progress as progress_bar
from mumoe_tn.layers import MuMoEBase
from mumoe_tn.validation import check_callable, check_int, check_model, check_real, check_tensor

__all__ = [
    "Coefficients",
    "DeadExpertWarning",
    "ExpertStatistics",
    "LayerCoefficients",
    "collect_coefficients",
    "default_forward",
    "mumoe_layers",
]


class DeadExpertWarning(UserWarning):
    """Some experts loaded no row of the data (their coefficient never reached the load threshold)."""


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
        (``min(k, rows)`` columns: memory grows with the rows seen, never with ``k`` alone). A
        row on which the expert was inactive (``a_n < threshold``) is never listed: its slot
        holds row ``-1`` (see [`examples`][mumoe_tn.analysis.coefficients.ExpertStatistics.examples]).
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
        rows_kept = indices.gather(1, order)
        self.top_rows = torch.where(self.top_values >= self.threshold, rows_kept, torch.full_like(rows_kept, -1))
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

    @property
    def dead(self) -> torch.Tensor:
        """Indices of the experts that loaded no row (never active on the data seen)."""
        return (self.load == 0).nonzero().flatten()

    def examples(self, expert: int) -> list[tuple[int, float]]:
        """``(row, coefficient)`` of expert ``expert``'s top rows, largest first, active rows only."""
        expert = check_int("expert", expert, minimum=0)
        if expert >= self.load.shape[0]:
            raise ValueError(f"expert must be below {self.load.shape[0]} (experts of this mode), got {expert}")
        return [
            (int(row), float(value))
            for row, value in zip(self.top_rows[expert].tolist(), self.top_values[expert].tolist(), strict=True)
            if row >= 0
        ]

    def centres(self) -> torch.Tensor:
        """Each expert's cluster centre: the coefficient-weighted mean input ``Σ a_n x / Σ a_n``."""
        if self.input_sum is None:
            raise ValueError("input sums were not collected (collect_coefficients(..., centres=True))")
        return self.input_sum / self.total.clamp_min(1e-30)[:, None]


@dataclass
class LayerCoefficients:
    """Statistics of every expert mode of one layer.

    Attributes
    ----------
    name : str
        The layer's qualified name.
    modes : list of ExpertStatistics
        One per expert mode.
    calls : list of tuple
        Per forward call: its first row, its first sample and the leading shape of the layer's
        input (``(samples, …)``), and the flat positions of its real tokens (None: all real);
        what [`locate`][mumoe_tn.analysis.coefficients.LayerCoefficients.locate] reads.
    """

    name: str
    modes: list[ExpertStatistics] = field(default_factory=list)
    calls: list[tuple[int, int, tuple[int, ...], torch.Tensor | None]] = field(default_factory=list)

    def record_call(self, leading: tuple[int, ...], real: torch.Tensor | None) -> None:
        """Note a forward call whose input had leading shape ``leading`` (``real``: its token mask)."""
        first_row = self.modes[0].rows if self.modes else 0
        first_sample = 0
        if self.calls:
            _, sample, shape, _ = self.calls[-1]
            first_sample = sample + (shape[0] if shape else 1)
        positions = None if real is None else real.reshape(-1).nonzero().flatten().cpu()
        self.calls.append((first_row, first_sample, tuple(leading), positions))

    def locate(self, rows: torch.Tensor | Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sample, position)`` of each row (``-1`` for row ``-1``).

        The sample counts along the layer input's first dimension over all calls; the position is
        the flat index within it (a token's index for inputs ``(samples, tokens, features)``).
        """
        rows = torch.as_tensor(rows if isinstance(rows, torch.Tensor) else list(rows), dtype=torch.long).flatten()
        total = self.modes[0].rows if self.modes else 0
        if rows.numel() and (int(rows.max()) >= total or int(rows.min()) < -1):
            raise ValueError(f"rows must lie in [-1, {total}) (rows seen by layer {self.name!r}), got {rows.tolist()}")
        samples = torch.full_like(rows, -1)
        positions = torch.full_like(rows, -1)
        starts = torch.tensor([call[0] for call in self.calls] or [0], dtype=torch.long)
        for k, row in enumerate(rows.tolist()):
            if row < 0:
                continue
            first_row, first_sample, leading, real = self.calls[int(torch.searchsorted(starts, row, right=True)) - 1]
            flat = row - first_row
            if real is not None:
                flat = int(real[flat])
            per_sample = 1
            for size in leading[1:]:
                per_sample *= size
            samples[k] = first_sample + flat // per_sample
            positions[k] = flat % per_sample
        return samples, positions

    def dead(self) -> list[torch.Tensor]:
        """Per expert mode, the experts that loaded no row."""
        return [mode.dead for mode in self.modes]


class Coefficients(dict):
    """Layer name -> [`LayerCoefficients`][mumoe_tn.analysis.coefficients.LayerCoefficients], with a summary.

    What [`collect_coefficients`][mumoe_tn.analysis.coefficients.collect_coefficients] returns.
    """

    def rows(self) -> list[dict[str, object]]:
        """One row per layer and expert mode: rows seen, experts, dead, load and coefficient statistics."""
        result = []
        for name, layer in self.items():
            for e, mode in enumerate(layer.modes):
                n = mode.load.shape[0]
                fraction = mode.load_fraction
                result.append(
                    {
                        "layer": name or "(model)",
                        "mode": e,
                        "experts": n,
                        "rows": mode.rows,
                        "dead": int(mode.dead.numel()),
                        "mean active per row": float(mode.load.sum()) / max(mode.rows, 1),
                        "max load": float(fraction.max()) if n else 0.0,
                        "median load": float(fraction.median()) if n else 0.0,
                    }
                )
        return result

    def warnings(self) -> list[str]:
        """One line per layer mode with dead experts."""
        return [
            f"{row['dead']} of {row['experts']} experts of layer {row['layer']!r} mode {row['mode']} were never "
            f"active on {row['rows']} rows"
            for row in self.rows()
            if row["dead"]
        ]

    def to_markdown(self) -> str:
        """The summary as a Markdown table, dead-expert warnings below it."""
        rows = self.rows()
        head = list(rows[0]) if rows else ["layer"]
        rule = "|" + "|".join("---" if k == 0 else "---:" for k in range(len(head))) + "|"
        lines = ["| " + " | ".join(head) + " |", rule]
        for row in rows:
            cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [f"\n**Warning:** {line}." for line in self.warnings()]
        return "\n".join(lines)

    def summary(self) -> str:
        """The summary as plain text (a rich table), dead-expert warnings below it."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title="expert coefficients")
        rows = self.rows()
        for k, column in enumerate(rows[0] if rows else ["layer"]):
            table.add_column(column, justify="left" if k == 0 else "right")
        for row in rows:
            table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()))
        console = Console(width=120, record=True, file=None, force_terminal=False)
        with console.capture() as captured:
            console.print(table)
            for line in self.warnings():
                console.print(f"warning: {line}")
        return captured.get()

    def plot(self, path: str | None = None):
        """Bar charts of every layer mode's load per expert (dead experts in red); saved to ``path`` if given.

        Returns the matplotlib figure.
        """
        import matplotlib.pyplot as plt

        panels = [(name, e, mode) for name, layer in self.items() for e, mode in enumerate(layer.modes)]
        figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), squeeze=False)
        for ax, (name, e, mode) in zip(axes[:, 0], panels, strict=True):
            fraction = mode.load_fraction.numpy()
            colours = ["#c0392b" if v == 0 else "#2e86c1" for v in fraction]
            ax.bar(range(len(fraction)), fraction, color=colours)
            ax.set_ylabel("load")
            ax.set_title(f"{name or '(model)'} mode {e}: {int(mode.dead.numel())} dead of {len(fraction)}", fontsize=9)
        axes[-1, 0].set_xlabel("expert")
        figure.tight_layout()
        if path is not None:
            figure.savefig(path, dpi=120)
        return figure


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
    progress: bool | None = None,
) -> Coefficients:
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
    progress : bool, optional
        Show a progress bar over the batches (tqdm, on stderr); by default only on a terminal.

    Notes
    -----
    Padding tokens are skipped: the rows a layer's token mask marks as padding (see
    [`mumoe_tn.masking`][mumoe_tn.masking]; a converted model takes it from its ``attention_mask``)
    count towards no statistic, and row numbers (``top_rows``) count real tokens only.

    Experts that loaded no row are reported with a
    [`DeadExpertWarning`][mumoe_tn.analysis.coefficients.DeadExpertWarning] and in the summary.

    Returns
    -------
    Coefficients
        Layer name -> [`LayerCoefficients`][mumoe_tn.analysis.coefficients.LayerCoefficients];
        ``summary()`` / ``to_markdown()`` / ``plot()`` show load, sparsity and dead experts.
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
    check_progress(progress)
    results = Coefficients({name: LayerCoefficients(name) for name in names})

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output: object) -> None:
            coefficients = module.last_coefficients
            stats = results[name].modes
            if not stats:
                width = module.in_features if centres else None
                stats += [ExpertStatistics.empty(a.shape[-1], top_k, width, threshold) for a in coefficients]
            tokens = module.last_token_mask
            results[name].record_call(tuple(coefficients[0].shape[:-1]), tokens)
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
        for batch in progress_bar(batches, "collecting coefficients", enabled=progress):
            call(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    if not any(results[name].modes for name in names):
        raise ValueError(f"no μMoE layer ran: batches gave no input that reached layer(s) {names}")
    dead = results.warnings()
    if dead:
        warnings.warn("; ".join(dead), DeadExpertWarning, stacklevel=2)
    return results
