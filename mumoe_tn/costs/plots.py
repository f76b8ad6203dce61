"""Plots of cost tables (matplotlib, imported on use)."""

from __future__ import annotations

from pathlib import Path

from mumoe_tn.costs.baselines import dense_moe, moe_block
from mumoe_tn.costs.params import block_parameters, layer_parameters
from mumoe_tn.costs.table import CostTable

__all__ = ["expert_sweep", "plot_parameters_vs_experts"]


def expert_sweep(table: CostTable, low: int = 2, high: int = 16_384) -> dict[str, list[tuple[int, int]]]:
    """Total parameters against the total number of experts, at the table's ranks.

    The first expert mode takes every power of two that keeps the total in ``[low, high]``;
    the other modes and all ranks stay as in the table (the paper's Figure param-ablation).

    Parameters
    ----------
    table : CostTable
        A table from [`mumoe_tn.costs.compare`][mumoe_tn.costs.table.compare].
    low, high : int, optional
        Range of total expert counts.

    Returns
    -------
    dict
        Series name -> list of ``(total experts, parameters)``.
    """
    c = table.config
    rest = 1
    for size in c["expert_dims"][1:]:
        rest *= size
    counts = [1 << k for k in range(0, 40) if low <= (1 << k) * rest <= high]
    series: dict[str, list[tuple[int, int]]] = {}
    for name, networks in table.networks.items():
        points = []
        for n1 in counts:
            resized = [net.with_sizes(n1=n1) for net in networks]
            if c["block"]:
                count = block_parameters(*resized, bias=c["bias"], gate=c["gate"])
            else:
                count = layer_parameters(resized[0], bias=c["bias"], gate=c["gate"])
            points.append((n1 * rest, count.total))
        series[name] = points
    dense = []
    for n1 in counts:
        n = n1 * rest
        if c["block"]:
            baseline = moe_block(n, n, c["in_features"], c["hidden"], c["in_features"], bias=c["bias"], gate=c["gate"])
        else:
            baseline = dense_moe(n, c["in_features"], c["out_features"], bias=c["bias"], gate=c["gate"])
        dense.append((n, baseline.params))
    series["dense/sparse MoE"] = dense
    return series


def plot_parameters_vs_experts(table: CostTable, path: str | Path) -> Path:
    """Save a log-log plot of parameters against expert count for the table's layers.

    Parameters
    ----------
    table : CostTable
        A table from [`mumoe_tn.costs.compare`][mumoe_tn.costs.table.compare].
    path : str or Path
        Output image (PNG by its suffix).

    Returns
    -------
    Path
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'mumoe_tn[plot]'") from error
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for name, points in expert_sweep(table).items():
        xs, ys = zip(*points, strict=True)
        axes.plot(
            xs, ys, marker="o", markersize=3, label=name, linestyle="--" if "MoE" in name and "μ" not in name else "-"
        )
    reference = next(row for row in table.rows if row.name == table.config["reference"])
    axes.axhline(reference.params_total, color="grey", linewidth=1, label=reference.name)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("number of experts")
    axes.set_ylabel("parameters")
    axes.set_title(f"{table.shape()}: ranks as set at {table.experts()} experts", fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(True, which="major", alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
