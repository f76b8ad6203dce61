"""One streaming pass over the data for the explorer: histograms, coefficient-weighted targets, joint loads.

Memory is bounded for any dataset size: per layer and expert mode a histogram of fixed bins, a
coefficient-weighted count per target (token or class) and, for hierarchical layers, the summed
outer products of neighbouring modes' coefficients. The top-activating rows come from
[`collect_coefficients`][mumoe_tn.analysis.coefficients.collect_coefficients] (a streaming top-k)
in the same pass.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

__all__ = ["LayerRecord", "ModeRecord"]


@dataclass
class ModeRecord:
    """What one expert mode of one layer accumulates.

    Attributes
    ----------
    histogram : torch.Tensor
        ``(N, bins)`` counts of active coefficients in ``[0, upper]``, bins of equal width.
    target_mass : torch.Tensor or None
        ``(N, V)`` — ``Σ a_n`` over the rows of each target (the token at the row, or the label).
    largest : float
        The largest coefficient seen.
    upper : float
        The histogram's range: 1 (a softmax's or entmax's coefficients), doubled whenever a
        larger coefficient arrives (a ReLU gate's are unbounded). Doubling merges neighbouring
        bins, so the counts stay exact without a second pass.
    """

    histogram: torch.Tensor
    target_mass: torch.Tensor | None
    largest: float = 0.0
    upper: float = 1.0

    def add(self, a: torch.Tensor, targets: torch.Tensor | None, threshold: float) -> None:
        """Add coefficient rows ``a (rows, N)`` and the target id of each row."""
        bins = self.histogram.shape[1]
        a = a.detach().reshape(-1, a.shape[-1]).double().cpu()
        if a.numel() == 0:
            return
        self.largest = max(self.largest, float(a.max()))
        while self.largest > self.upper and math.isfinite(self.largest):
            self._double_range()
        active = a >= threshold
        index = (a.clamp(0, self.upper) * (bins / self.upper)).long().clamp_max(bins - 1)
        experts = torch.arange(a.shape[1]).expand_as(a)
        flat = (experts * bins + index)[active]
        self.histogram += torch.bincount(flat, minlength=self.histogram.numel()).reshape(self.histogram.shape)
        if self.target_mass is not None and targets is not None:
            targets = targets.reshape(-1).cpu()
            if targets.numel() == a.shape[0]:
                self.target_mass.index_add_(1, targets, a.T)

    def _double_range(self) -> None:
        """Cover ``[0, 2·upper]`` with the same number of bins: bins ``2j`` and ``2j + 1`` become bin ``j``."""
        bins = self.histogram.shape[1]
        padded = torch.nn.functional.pad(self.histogram, (0, bins % 2))
        merged = padded.reshape(padded.shape[0], -1, 2).sum(dim=2)
        self.histogram = torch.nn.functional.pad(merged, (0, bins - merged.shape[1]))
        self.upper *= 2


@dataclass
class LayerRecord:
    """Every mode's record of one layer, and the joint coefficient mass of neighbouring modes."""

    modes: list[ModeRecord] = field(default_factory=list)
    joint: list[torch.Tensor] = field(default_factory=list)

    def add(self, coefficients: tuple[torch.Tensor, ...], targets: torch.Tensor | None, *, bins: int,
            classes: int | None, threshold: float) -> None:  # fmt: skip
        """Add one forward call's coefficients (one tensor per mode) with each row's target."""
        if not self.modes:
            self.modes = [
                ModeRecord(
                    torch.zeros(a.shape[-1], bins, dtype=torch.long),
                    None if classes is None else torch.zeros(a.shape[-1], classes, dtype=torch.float64),
                )
                for a in coefficients
            ]
            self.joint = [
                torch.zeros(first.shape[-1], second.shape[-1], dtype=torch.float64)
                for first, second in itertools.pairwise(coefficients)
            ]
        for record, a in zip(self.modes, coefficients, strict=True):
            record.add(a, targets, threshold)
        rows = [a.detach().reshape(-1, a.shape[-1]).double().cpu() for a in coefficients]
        for k, total in enumerate(self.joint):
            total += rows[k].T @ rows[k + 1]
