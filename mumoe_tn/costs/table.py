"""Comparison tables: μMoE decompositions against nn.Linear, MLP blocks and MoEs (torch-free)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mumoe_tn.costs.baselines import Baseline, dense_moe, linear, mlp, moe_block, sparse_moe
from mumoe_tn.costs.display import cells, rich_table
from mumoe_tn.costs.flops import layer_flops
from mumoe_tn.costs.matching import Match, match_block, match_layer
from mumoe_tn.costs.params import ParameterCount, block_parameters, layer_parameters
from mumoe_tn.costs.rank import rank_bound
from mumoe_tn.decompositions.registry import build
from mumoe_tn.network import ExpertNetwork, normalize_expert_dims

__all__ = ["COLUMNS", "CostRow", "CostTable", "compare"]

#: Column keys and headers, in display order. FMAs are per token; the peak intermediate is
#: the largest tensor of the planned contraction of one batch (the table's ``batch`` tokens).
COLUMNS = {
    "name": "layer",
    "ranks": "ranks",
    "params_experts": "expert params",
    "params_gate": "gate params",
    "params_total": "total params",
    "fma_closed_form": "FMA per token (closed form)",
    "fma_planned": "FMA per token (planned)",
    "peak_elements": "peak intermediate per batch (elements)",
    "max_rank": "expert rank bound",
    "params_vs_reference": "params ÷ reference",
    "fma_vs_reference": "FMA ÷ reference",
}


@dataclass(frozen=True)
class CostRow:
    """One row of a comparison table.

    FMAs are per token (planned ones at the table's batch size, gating included when
    counted); the peak intermediate is for the whole batch; ratios are to the reference layer
    (nn.Linear, or the MLP block when comparing blocks).
    """

    name: str
    ranks: str
    params_experts: int
    params_gate: int
    params_total: int
    fma_closed_form: float | None
    fma_planned: float
    peak_elements: int
    max_rank: int
    params_vs_reference: float
    fma_vs_reference: float


@dataclass(frozen=True)
class CostTable:
    """A comparison table with the configuration that produced it.

    Attributes
    ----------
    rows : tuple of CostRow
        μMoE rows first, then the baselines.
    config : Mapping[str, Any]
        The inputs of [`compare`][mumoe_tn.costs.table.compare].
    networks : Mapping[str, tuple of ExpertNetwork]
        The (matched) network(s) of every μMoE row, by row name.
    """

    rows: tuple[CostRow, ...]
    config: Mapping[str, Any]
    networks: Mapping[str, tuple[ExpertNetwork, ...]] = field(default_factory=dict)

    def records(self) -> list[dict[str, Any]]:
        """Rows as plain dicts (column key -> value)."""
        return [asdict(row) for row in self.rows]

    def to_json(self) -> str:
        """The configuration and the rows as JSON."""
        return json.dumps({"config": dict(self.config), "rows": self.records()}, indent=2)

    def to_csv(self) -> str:
        """The rows as CSV with the column keys as header."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.records())
        return buffer.getvalue()

    def to_markdown(self, *, dtype: str | None = None) -> str:
        """The rows as a GitHub-flavoured Markdown table.

        Parameters
        ----------
        dtype : str, optional
            Add the peak intermediate's memory in bytes for this dtype (``"float32"``, …)
            next to its element count.
        """
        keys = list(COLUMNS)
        headers = dict(COLUMNS)
        if dtype is not None:
            keys.insert(keys.index("peak_elements") + 1, "peak_bytes")
            headers["peak_bytes"] = f"peak intermediate per batch ({dtype})"
        rule = "|" + "".join("---|" if key in ("name", "ranks") else "---:|" for key in keys)
        lines = ["| " + " | ".join(headers[key] for key in keys) + " |", rule]
        lines += ["| " + " | ".join(row) + " |" for row in cells(self.records(), keys, dtype)]
        return "\n".join(lines)

    def to_rich(self, *, dtype: str | None = "float32", width: int | None = None) -> Any:
        """The rows as a ``rich.table.Table`` for the terminal.

        Parameters
        ----------
        dtype : str, optional
            Show the peak intermediate's memory for this dtype next to its element count
            (None: elements only).
        width : int, optional
            The terminal's width: columns are left out, least important first, until every
            number fits in full (the caption names them). None keeps every column.
        """
        keys = list(COLUMNS)
        keys.insert(keys.index("peak_elements") + 1, "peak_bytes")
        return rich_table(self.title(), self.records(), keys, dtype=dtype, width=width)

    def shape(self) -> str:
        """The compared layer's shape, e.g. ``768 → 3072`` or ``768 → 3072 → 768 block``."""
        c = self.config
        if c["block"]:
            return f"{c['in_features']} → {c['hidden']} → {c['in_features']} block"
        return f"{c['in_features']} → {c['out_features']}"

    def experts(self) -> str:
        """The expert dims, e.g. ``256`` or ``32×32``."""
        return "×".join(map(str, self.config["expert_dims"]))

    def title(self) -> str:
        """A one-line description of the configuration."""
        c = self.config
        return (
            f"μMoE costs: {self.shape()}, experts {self.experts()}, bias {'on' if c['bias'] else 'off'}, "
            f"gating {'counted' if c['gate'] else 'not counted'}; FMA per token (1 FMA = 1 FLOP), "
            f"peak intermediate per batch of {c['batch']:,} token{'s' if c['batch'] != 1 else ''}; "
            f"ratios to {c['reference']}"
        )

    def __str__(self) -> str:
        return self.title() + "\n" + self.to_markdown()


def _ranks(network: ExpertNetwork) -> str:
    return ", ".join(f"{bond}={network.sizes[bond]}" for bond in network.bonds)


def compare(
    in_features: int = 768,
    out_features: int = 3072,
    expert_dims: int | Sequence[int] = 256,
    decompositions: Sequence[str] = ("cp", "tr"),
    *,
    ranks: Mapping[str, int | Sequence[int]] | None = None,
    match: str | int | None = "linear",
    bonds: Mapping[str, Sequence[str]] | None = None,
    bias: bool = True,
    gate: bool = True,
    batch: int = 1,
    top_k: int = 2,
) -> CostTable:
    """Compare μMoE decompositions with nn.Linear (or an MLP block), dense and sparse MoEs.

    Parameters
    ----------
    in_features, out_features : int
        The layer's sizes. With ``match="mlp"`` the comparison is between *blocks*
        ``in → out → in`` (the transformer/mixer MLP the μMoE block replaces).
    expert_dims : int or Sequence[int]
        ``N`` or ``(N_1, …, N_E)``.
    decompositions : Sequence of str
        Registered names.
    ranks : Mapping[str, int or Sequence[int]], optional
        Explicit ranks per decomposition; those without one are parameter-matched.
    match : {"linear", "mlp"} or int or None, optional
        Parameter target for decompositions without explicit ranks: ``"linear"`` (the
        nn.Linear of the same sizes), ``"mlp"`` (the MLP block), or a number.
    bonds : Mapping[str, Sequence[str]], optional
        Bonds to scale per decomposition (Tucker defaults to all of its bonds).
    bias : bool, optional
        Fold a bias into the input leg, and give baselines a bias.
    gate : bool, optional
        Count gating/router parameters and FMAs.
    batch : int, optional
        Tokens per forward pass, for the planned FMAs and the peak intermediate.
    top_k : int, optional
        ``K`` of the sparse MoE baseline.

    Returns
    -------
    CostTable
    """
    dims = normalize_expert_dims(expert_dims)
    ranks = dict(ranks or {})
    bonds = dict(bonds or {})
    block = match == "mlp"
    n_experts = 1
    for size in dims:
        n_experts *= size
    if block:
        reference = mlp(in_features, out_features, in_features, bias=bias)
        baselines = [
            reference,
            moe_block(n_experts, n_experts, in_features, out_features, in_features, bias=bias, gate=gate),
            moe_block(n_experts, min(top_k, n_experts), in_features, out_features, in_features, bias=bias, gate=gate),
        ]
    else:
        reference = linear(in_features, out_features, bias=bias)
        baselines = [
            reference,
            dense_moe(n_experts, in_features, out_features, bias=bias, gate=gate),
            sparse_moe(n_experts, min(top_k, n_experts), in_features, out_features, bias=bias, gate=gate),
        ]
    if match is None or match in ("linear", "mlp"):
        target = reference.params
    elif isinstance(match, int) and not isinstance(match, bool):
        target = match
    else:
        raise ValueError(f"match must be 'linear', 'mlp', a number of parameters or None, got {match!r}")
    unknown = sorted(set(ranks) - set(decompositions))
    if unknown:
        raise ValueError(f"ranks given for {unknown}, which are not among the decompositions {list(decompositions)}")

    width = in_features + int(bias)
    rows, networks = [], {}
    for name in decompositions:
        layers = _layers(name, dims, in_features, out_features, width, block, ranks.get(name, 1))
        if name not in ranks:
            if match is None:
                raise ValueError(f"no rank given for {name!r} and match=None")
            scaled = bonds.get(name, layers[0].bonds if name == "tucker" else None)
            matched: Match = (
                match_block(*layers, target, bonds=scaled, bias=bias, gate=gate)
                if block
                else match_layer(layers[0], target, bonds=scaled, bias=bias, gate=gate)
            )
            layers = matched.networks
        count: ParameterCount = (
            block_parameters(*layers, bias=bias, gate=gate)
            if block
            else layer_parameters(layers[0], bias=bias, gate=gate)
        )
        flops = [layer_flops(net, batch=batch, bias=bias, gate=False) for net in layers]
        gate_fma = in_features * sum(dims) if gate else 0
        closed = None if any(f.closed_form is None for f in flops) else sum(f.closed_form for f in flops) / batch
        planned = sum(f.planned for f in flops) / batch + gate_fma
        label = f"{name} μMoE{' block' if block else ''}"
        networks[label] = tuple(layers)
        rows.append(
            CostRow(
                name=label,
                ranks=_ranks(layers[0]),
                params_experts=count.experts,
                params_gate=count.gate,
                params_total=count.total,
                fma_closed_form=None if closed is None else closed + gate_fma,
                fma_planned=planned,
                peak_elements=max(f.peak_elements for f in flops),
                max_rank=min(rank_bound(net) for net in layers),
                params_vs_reference=count.total / reference.params,
                fma_vs_reference=planned / reference.fma,
            )
        )
    rows += [_baseline_row(b, reference, batch) for b in baselines]
    config = {
        "in_features": in_features,
        "out_features": out_features,
        "hidden": out_features if block else None,
        "block": block,
        "expert_dims": list(dims),
        "decompositions": list(decompositions),
        "ranks": {k: v if isinstance(v, int) else list(v) for k, v in ranks.items()},
        "match": match,
        "target_params": target,
        "reference": reference.name,
        "bias": bias,
        "gate": gate,
        "batch": batch,
        "top_k": top_k,
    }
    return CostTable(tuple(rows), config, networks)


def _layers(
    name: str, dims: tuple[int, ...], in_features: int, out_features: int, width: int, block: bool, rank: Any
) -> tuple[ExpertNetwork, ...]:
    if not block:
        return (build(name, dims, width, out_features, rank),)
    bias = width - in_features
    return (build(name, dims, width, out_features, rank), build(name, dims, out_features + bias, in_features, rank))


def _baseline_row(baseline: Baseline, reference: Baseline, batch: int) -> CostRow:
    return CostRow(
        name=baseline.name,
        ranks="",
        params_experts=baseline.params - baseline.gate_params,
        params_gate=baseline.gate_params,
        params_total=baseline.params,
        fma_closed_form=float(baseline.fma),
        fma_planned=float(baseline.fma),
        peak_elements=baseline.activations * batch,
        max_rank=baseline.max_rank,
        params_vs_reference=baseline.params / reference.params,
        fma_vs_reference=baseline.fma / reference.fma,
    )
