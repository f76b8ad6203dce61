"""Comparison tables: μMoE decompositions against nn.Linear, MLP blocks and MoEs (torch-free)."""

from __future__ import annotations

import csv
import io
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mumoe_tn.costs.baselines import Baseline, dense_moe, linear, mlp, moe_block, sparse_moe
from mumoe_tn.costs.display import cells, rich_table
from mumoe_tn.costs.flops import layer_flops
from mumoe_tn.costs.matching import Match, MatchingWarning, match_block, match_layer, resolve_target, scaled_bonds
from mumoe_tn.costs.params import ParameterCount, block_parameters, layer_parameters
from mumoe_tn.costs.rank import rank_bound
from mumoe_tn.decompositions.format import Format
from mumoe_tn.decompositions.registry import get_format
from mumoe_tn.decompositions.resolve import Decomposition, Rank, is_spec, resolve_network, spec_ranks, split_spec_name
from mumoe_tn.gates.specs import GateSpec, gate_fma_per_token, gate_parameter_count
from mumoe_tn.network import ExpertNetwork, normalise_expert_dims
from mumoe_tn.validation import check_bool, check_size

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


#: ``K`` of the sparse MoE baseline unless told otherwise.
DEFAULT_TOP_K = 2


@dataclass(frozen=True)
class CostRow:
    """One row of a comparison table.

    FMAs are per token (planned ones at the table's batch size, gating included when
    counted); the peak intermediate is for the whole batch; ratios are to the reference layer
    (nn.Linear, or the MLP block when comparing blocks). A baseline that does not apply to the
    configuration (a sparse top-2 MoE of one expert) has every number None.
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
    networks: tuple[ExpertNetwork, ...] = field(default=(), compare=False, repr=False)

    @property
    def spec(self) -> str:
        """The spec string of the row's (first) network, ``""`` for baselines."""
        return self.networks[0].to_spec() if self.networks else ""


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
        """Rows as plain dicts (column key -> value), plus each μMoE row's network ``spec``."""
        return [{**{key: getattr(row, key) for key in COLUMNS}, "spec": row.spec} for row in self.rows]

    def to_json(self) -> str:
        """The configuration and the rows as JSON; a μMoE row's ranks as ``{bond: size}`` (null for baselines)."""
        rows = []
        for record, row in zip(self.records(), self.rows, strict=True):
            first = row.networks[0] if row.networks else None
            rows.append({**record, "ranks": None if first is None else {b: first.sizes[b] for b in first.bonds}})
        return json.dumps({"config": dict(self.config), "rows": rows}, indent=2)

    def to_csv(self) -> str:
        """The rows as CSV with the column keys as header."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[*COLUMNS, "spec"], lineterminator="\n")
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
    decompositions: Sequence[Decomposition] = ("cp", "tr"),
    *,
    ranks: Mapping[str, Rank] | None = None,
    match: str | int | float | None = "linear",
    bonds: Mapping[str, Sequence[str]] | None = None,
    rank_multiple: int = 1,
    bias: bool = True,
    gate: bool | GateSpec = True,
    batch: int = 1,
    top_k: int | None = None,
) -> CostTable:
    """Compare μMoE decompositions with nn.Linear (or an MLP block), dense and sparse MoEs.

    Parameters
    ----------
    in_features, out_features : int
        The layer's sizes. With ``match="mlp"`` the comparison is between *blocks*
        ``in → out → in`` (the transformer/mixer MLP the μMoE block replaces).
    expert_dims : int or Sequence[int]
        ``N`` or ``(N_1, …, N_E)``.
    decompositions : Sequence of str, Format or ExpertNetwork
        Registered names, formats, spec strings (``"A: n1 a b, B: a i c, C: b c o"``, or named:
        ``"mine=A: n1 a b, …"``, which labels the row ``mine``) and ready networks, mixed. A
        ready network keeps its structure and its bond sizes (unless
        ``bonds=`` names bonds of it to match); its physical legs are set to this table's sizes.
    ranks : Mapping[str, rank], optional
        Explicit ranks per row label (a format's name, a named spec's ``NAME``, ``"custom 1"``, … for
        unnamed specs in order, the spec string itself, or a network's name; see ``CostRow.name``):
        one rank, one per bond in the order of the row's ranks column, or ``{bond: size}`` naming
        every bond. Rows without one are parameter-matched.
    match : {"linear", "mlp"} or int or float or None, optional
        Parameter target of the matched rows: ``"linear"`` (the nn.Linear of the same sizes),
        ``"mlp"`` (the MLP block), a number of parameters (int), a fraction of the reference
        layer's parameters (float), or None (no matching).
    bonds : Mapping[str, Sequence[str]], optional
        Bonds to scale per row label (default: the format's, or every bond of a custom network).
    rank_multiple : int, optional
        Matched rows give their scaled bonds a multiple of this (default 1); see
        [`mumoe_tn.costs.matching`][mumoe_tn.costs.matching].
    bias : bool, optional
        Fold a bias into the input leg, and give baselines a bias.
    gate : bool or GateSpec, optional
        Count gating/router parameters and FMAs: True (the default gate), False, or a gate
        descriptor (see [`mumoe_tn.gates.specs`][mumoe_tn.gates.specs]) that reports its own counts. MoE baselines
        count a plain ``I·N`` router whenever gating is counted.
    batch : int, optional
        Tokens per forward pass, for the planned FMAs and the peak intermediate.
    top_k : int, optional
        ``K`` of the sparse MoE baseline (default 2; with fewer than 2 experts the default row is
        shown as not applicable, every number ``—``; an explicit ``top_k`` above the expert count
        is an error).

    Returns
    -------
    CostTable
        Each μMoE row's [`CostRow.networks`][mumoe_tn.costs.table.CostRow] holds the (matched) network(s) it used.
    """
    dims = normalise_expert_dims(expert_dims)
    check_bool("bias", bias)
    if not isinstance(gate, bool):
        gate_parameter_count(gate, in_features, dims)  # checks that gate is a GateSpec
    check_size("batch", batch)
    check_size("in_features", in_features)
    check_size("out_features", out_features)
    explicit_top_k = top_k is not None
    top_k = check_size("top_k", top_k) if explicit_top_k else DEFAULT_TOP_K
    check_size("rank_multiple", rank_multiple)
    if isinstance(decompositions, (str, ExpertNetwork)) or not isinstance(decompositions, Sequence):
        raise TypeError(f"decompositions must be a sequence (list or tuple), got {decompositions!r}")
    ranks = dict(ranks or {})
    bonds = dict(bonds or {})
    block = match == "mlp"
    n_experts = 1
    for size in dims:
        n_experts *= size
    if top_k > n_experts and explicit_top_k:
        raise ValueError(f"top_k={top_k} cannot exceed the number of experts {n_experts} (the sparse MoE baseline)")
    sparse_applies = top_k <= n_experts
    if block:
        reference = mlp(in_features, out_features, in_features, bias=bias)
        baselines = [
            reference,
            moe_block(n_experts, n_experts, in_features, out_features, in_features, bias=bias, gate=bool(gate)),
        ]
        if sparse_applies:
            baselines.append(
                moe_block(n_experts, top_k, in_features, out_features, in_features, bias=bias, gate=bool(gate))
            )
    else:
        reference = linear(in_features, out_features, bias=bias)
        baselines = [
            reference,
            dense_moe(n_experts, in_features, out_features, bias=bias, gate=bool(gate)),
        ]
        if sparse_applies:
            baselines.append(sparse_moe(n_experts, top_k, in_features, out_features, bias=bias, gate=bool(gate)))
    if match is None or match in ("linear", "mlp"):
        target = reference.params
    elif isinstance(match, (int, float)) and not isinstance(match, bool):
        target = resolve_target(match, reference.params)
    else:
        raise ValueError(f"match must be 'linear', 'mlp', a number of parameters, a fraction or None, got {match!r}")
    entries = _entries(decompositions)
    ranks = _by_label(entries, ranks, "ranks")
    bonds = _by_label(entries, bonds, "bonds")

    width = in_features + int(bias)
    rows, networks = [], {}
    for entry in entries:
        given = ranks.get(entry.label)
        scaled = bonds.get(entry.label)
        if scaled is not None and (given is not None or match is None):
            why = "has explicit ranks" if given is not None else "is not matched (match=None)"
            raise ValueError(
                f"bonds= names the bonds parameter matching scales, but row {entry.label!r} {why}: give one or "
                "the other"
            )
        layers = [entry.make(dims, width, out_features, given)]
        if block:
            layers.append(entry.make(dims, out_features + int(bias), in_features, given))
        if given is None and match is not None and (not entry.sized or scaled is not None):
            try:
                matched: Match = (
                    match_block(*layers, target, bonds=scaled, bias=bias, gate=gate, rank_multiple=rank_multiple)
                    if block
                    else match_layer(layers[0], target, bonds=scaled, bias=bias, gate=gate, rank_multiple=rank_multiple)
                )
                layers = list(matched.networks)
            except ValueError as error:
                # A network sized by its legs alone (no bond: MxD) that cannot reach the budget by its
                # number of experts is shown at the table's experts, its miss marked like any other.
                if set(scaled_bonds(layers[0], scaled)) - set(layers[0].expert_legs):
                    raise
                warnings.warn(
                    f"{entry.label}: shown at {dims} experts, not matched: {error}", MatchingWarning, stacklevel=2
                )
        elif given is None and not entry.sized:
            raise ValueError(f"no rank given for {entry.label!r} and match=None")
        count: ParameterCount = (
            block_parameters(*layers, bias=bias, gate=gate)
            if block
            else layer_parameters(layers[0], bias=bias, gate=gate)
        )
        flops = [layer_flops(net, batch=batch, bias=bias, gate=False) for net in layers]
        gate_fma = gate_fma_per_token(gate, in_features, dims)
        closed = None if any(f.closed_form is None for f in flops) else sum(f.closed_form for f in flops) / batch
        planned = sum(f.planned for f in flops) / batch + gate_fma
        label = f"{entry.label} μMoE{' block' if block else ''}"
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
                networks=tuple(layers),
            )
        )
    rows += [_baseline_row(b, reference, batch) for b in baselines]
    if not sparse_applies:
        rows.append(_not_applicable(f"sparse top-{top_k} MoE{' block' if block else ''} (N={n_experts})"))
    config = {
        "in_features": in_features,
        "out_features": out_features,
        "hidden": out_features if block else None,
        "block": block,
        "expert_dims": list(dims),
        "decompositions": [entry.label for entry in entries],
        "ranks": {key: _plain(value) for key, value in ranks.items()},
        "match": match,
        "rank_multiple": rank_multiple,
        "target_params": target,
        "reference": reference.name,
        "bias": bias,
        "gate": gate if isinstance(gate, bool) else repr(gate),
        "batch": batch,
        "top_k": top_k,
    }
    return CostTable(tuple(rows), config, networks)


def _plain(rank: Any) -> Any:
    if isinstance(rank, Mapping):
        return dict(rank)
    return rank if isinstance(rank, int) else list(rank)


def _by_label(entries: Sequence[_Entry], given: Mapping[Any, Any], option: str) -> dict[str, Any]:
    """Key ``ranks=`` / ``bonds=`` by row label; a key is a row's label or alias, or a label in other case.

    A key that selects no row, or a row twice, is refused; the message quotes the keys as given and
    lists the rows by their labels.
    """
    out: dict[str, Any] = {}
    unknown = []
    for key, value in given.items():
        entry = next((e for e in entries if any(key is a or key == a for a in e.aliases)), None)
        if entry is None and isinstance(key, str):
            entry = next((e for e in entries if e.label.casefold() == key.casefold()), None)
        if entry is None:
            unknown.append(key)
        elif entry.label in out:
            raise ValueError(f"{option} given twice for row {entry.label!r} (the second as {key!r})")
        else:
            out[entry.label] = value
    if unknown:
        rows = [entry.label for entry in entries]
        raise ValueError(f"{option} given for {unknown}, which name no row; the rows are {rows}")
    return out


@dataclass(frozen=True)
class _Entry:
    """One μMoE row to build: its label, the keys that select it in ranks=/bonds=, and a maker."""

    label: str
    aliases: tuple[str, ...]
    make: Callable[[tuple[int, ...], int, int, Any], ExpertNetwork]
    sized: bool  # a ready network: usable without ranks or matching


def _entries(decompositions: Sequence[Decomposition]) -> list[_Entry]:
    entries: list[_Entry] = []
    customs = 0

    def unique(label: str) -> str:
        taken = {entry.label for entry in entries}
        k = 2
        candidate = label
        while candidate in taken:
            candidate = f"{label} #{k}"
            k += 1
        return candidate

    for item in decompositions:
        if isinstance(item, ExpertNetwork):
            if item.name == "custom":
                customs += 1
            label = unique(f"custom {customs}" if item.name == "custom" else item.name)
            entries.append(_Entry(label, (label, item.name), _network_maker(item), True))
        elif isinstance(item, str) and is_spec(item):
            name, spec = split_spec_name(item)
            if name is None:
                customs += 1
            label = unique(f"custom {customs}" if name is None else name)
            entries.append(_Entry(label, (label, item, spec), _maker(item), False))
        elif isinstance(item, (str, Format)):
            format = get_format(item) if isinstance(item, str) else item
            label = unique(format.name)
            entries.append(_Entry(label, (label, item) if isinstance(item, str) else (label,), _maker(format), False))
        else:
            raise TypeError(
                "each decomposition must be a format name, a Format, a spec string or an ExpertNetwork, got "
                f"{item!r} ({type(item).__name__})"
            )
    return entries


def _maker(decomposition: str | Format) -> Callable[[tuple[int, ...], int, int, Any], ExpertNetwork]:
    def make(dims: tuple[int, ...], width: int, out: int, rank: Any) -> ExpertNetwork:
        if isinstance(rank, Mapping) and not (isinstance(decomposition, str) and is_spec(decomposition)):
            # a format's bonds by name: build its shape, then size every bond
            shape = resolve_network(decomposition, dims, width, out, 1)
            return shape.with_sizes(**spec_ranks(shape.bonds, rank, shape.name))
        return resolve_network(decomposition, dims, width, out, 1 if rank is None else rank)

    return make


def _network_maker(network: ExpertNetwork) -> Callable[[tuple[int, ...], int, int, Any], ExpertNetwork]:
    def make(dims: tuple[int, ...], width: int, out: int, rank: Any) -> ExpertNetwork:
        resized = resolve_network(network, dims, width, out, None, resize=True)
        if rank is None:
            return resized
        return resized.with_sizes(**spec_ranks(resized.bonds, rank, resized.name, every=False))

    return make


def _not_applicable(name: str) -> CostRow:
    """A baseline row that does not apply to the configuration: every number None (shown as ``—``)."""
    return CostRow(
        name=f"{name}: not applicable",
        ranks="",
        params_experts=None,
        params_gate=None,
        params_total=None,
        fma_closed_form=None,
        fma_planned=None,
        peak_elements=None,
        max_rank=None,
        params_vs_reference=None,
        fma_vs_reference=None,
    )


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
