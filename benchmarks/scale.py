"""The scale grid: every registered format and a user's tree network at 2⁴ … 2²⁴ experts over E = 1 … 6 modes.

``planning_grid`` plans each parameter-matched layer (``MuMoE(I, O, dims, fmt, match="linear")``
built on the meta device: nothing allocated) for a batch of tokens and records the planning
time, the planned and the closed-form FMAs, and the plan's peak intermediate against the bound
of the planner's cost model (4× the larger of the layer's input and output activations); where
the plan exceeds that, the smallest peak of any pairwise path too. A configuration the matcher
refuses is recorded with its reason. ``construction`` times building
large layers and counts the live tensor bytes they hold at their peak.

Run alone (``python -m benchmarks.scale``) it prints both tables; ``python -m benchmarks.run
--only scale`` adds the timed subset and writes the report.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import opt_einsum
import torch

from benchmarks.measure import LiveTensorPeak
from mumoe_tn import MuMoE
from mumoe_tn.contractions import ContractionPlan, plan_contraction, plan_forward
from mumoe_tn.contractions.search import find_path
from mumoe_tn.decompositions import available
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.network import ExpertNetwork

#: Expert counts of the full grid: 2 to these powers.
EXPONENTS = (4, 8, 12, 16, 20, 24)
#: Expert modes of the full grid.
MODES = (1, 2, 3, 4, 5, 6)
#: The planner's peak bound, in multiples of the larger activation (tokens × max(I, O)).
PEAK_ACTIVATIONS = 4


#: A user's network in the grid and the timed subset, next to the registered formats.
TREE = "tree"


def tree_spec(modes: int) -> str:
    """A hierarchical Tucker tree, written as a user would: a factor per mode, merged pairwise, then ``i`` and ``o``.

    ``U_e: n_e t_e`` for each expert mode, the bonds merged two at a time, level by level, up a
    binary tree (``T_k: x y u_k``; an odd one out moves up a level alone), and the root
    ``C: u a b`` joined to the input factor ``Ui: i a`` and the output factor ``Uo: b o``. No
    registered format: every tool takes its generic path (matching scales every bond).
    """
    cores = [f"U{e}: n{e} t{e}" for e in range(1, modes + 1)]
    level = [f"t{e}" for e in range(1, modes + 1)]
    while len(level) > 1:
        merged = []
        for left, right in zip(level[::2], level[1::2], strict=False):  # an odd one out moves up alone
            bond = f"u{len(cores) - modes + 1}"
            cores.append(f"T{len(cores) - modes + 1}: {left} {right} {bond}")
            merged.append(bond)
        level = merged + level[len(level) - len(level) % 2 :]
    return ", ".join([*cores, f"C: {level[0]} a b", "Ui: i a", "Uo: b o"])


def decomposition(fmt: str, modes: int) -> str:
    """What ``MuMoE`` is given for a grid format: its registered name, or the tree's spec."""
    return tree_spec(modes) if fmt == TREE else fmt


def expert_dims(exponent: int, modes: int) -> tuple[int, ...]:
    """``modes`` powers of two whose product is ``2**exponent``, as equal as can be (largest first)."""
    if not 1 <= modes <= exponent:
        raise ValueError(f"2**{exponent} experts cannot be split into {modes} modes of at least 2")
    base, extra = divmod(exponent, modes)
    return tuple(2 ** (base + (k < extra)) for k in range(modes))


@dataclass
class GridRow:
    """One configuration of the planning grid."""

    format: str
    experts: int
    dims: tuple[int, ...]
    ranks: dict[str, int] | None = None
    params: int | None = None
    plan_s: float | None = None  # seconds of one fresh path search
    planned_fma: int | None = None  # the plan's FMAs for the whole batch
    closed_fma: int | None = None  # the format's closed form × batch (None: it states none)
    peak: int | None = None  # elements of the plan's largest intermediate
    bound: int | None = None  # PEAK_ACTIVATIONS × tokens × max(I, O)
    smallest: int | None = None  # the smallest peak of any pairwise path, where the plan's is over the bound
    note: str = ""

    @property
    def modes(self) -> int:
        """Expert modes E."""
        return len(self.dims)


def smallest_peak(plan: ContractionPlan) -> int:
    """The smallest largest-intermediate of any pairwise path (opt_einsum's exhaustive size search)."""
    inputs, sizes = [tuple(labels) for labels in plan.inputs], dict(plan.sizes)
    optimizer = opt_einsum.paths.DynamicProgramming(search_outer=True, minimize="size")
    path = find_path(inputs, tuple(plan.output), sizes, optimizer)
    return plan_contraction(inputs, plan.output, sizes, path).largest_intermediate


def plan_row(
    fmt: str, dims: Sequence[int], in_features: int, out_features: int, tokens: int, optimize: str = "auto"
) -> GridRow:
    """Plan one parameter-matched layer and record what the grid reports."""
    experts = math.prod(dims)
    row = GridRow(fmt, experts, tuple(dims))
    try:
        layer = MuMoE(
            in_features,
            out_features,
            expert_dims=list(dims),
            decomposition=decomposition(fmt, len(dims)),
            match="linear",
            device="meta",
        )
    except (ValueError, RuntimeError) as error:
        row.note = f"not matched: {error}".split("\n")[0][:200]
        return row
    network: ExpertNetwork = layer.experts.network
    row.params = sum(p.numel() for p in layer.parameters())
    row.ranks = {bond: network.sizes[bond] for bond in network.bonds}
    start = time.perf_counter()
    plan = plan_forward(network, tokens, optimize)
    row.plan_s = time.perf_counter() - start
    row.planned_fma, row.peak = plan.fma, plan.largest_intermediate
    closed = None if network.format is None else network.format.closed_form_fma(network)
    row.closed_fma = None if closed is None else closed * tokens
    row.bound = PEAK_ACTIVATIONS * tokens * max(network.in_features, network.out_features)
    if row.peak > row.bound:
        row.smallest = smallest_peak(plan)
        ratio = row.smallest / row.bound
        # The planner's own bound is 4× the largest operand or result: a core larger than the
        # activations allows more than the grid's bound.
        held = max(math.prod(plan.sizes[x] for x in labels) for labels in (*plan.inputs, plan.output))
        row.note = (
            f"no path within the bound: the smallest peak of any path is {ratio:.3f}× it"
            if ratio > 1
            else f"the planner missed a path within the bound (smallest peak {ratio:.3f}× it)"
            if row.peak > PEAK_ACTIVATIONS * held
            else f"a core exceeds the activations: the planner's bound is {PEAK_ACTIVATIONS * held / row.bound:.2f}× it"
        )
    return row


def planning_grid(
    in_features: int = 768,
    out_features: int = 3072,
    tokens: int = 1024,
    exponents: Sequence[int] = EXPONENTS,
    modes: Sequence[int] = MODES,
    formats: Sequence[str] | None = None,
    progress: Callable[[GridRow], None] = lambda row: None,
) -> list[GridRow]:
    """Every format × expert count × mode count of the grid (formats: every registered one and the tree)."""
    rows = []
    for fmt in (*available(), TREE) if formats is None else formats:
        for exponent in exponents:
            for count in modes:
                if count > exponent:
                    continue
                rows.append(plan_row(fmt, expert_dims(exponent, count), in_features, out_features, tokens))
                progress(rows[-1])
    return rows


# ----------------------------------------------------------------------------- construction
@dataclass
class Construction:
    """Building one layer: seconds and the live-tensor peak against the parameters' bytes."""

    label: str
    params: int
    seconds: float
    peak_bytes: int

    @property
    def peak_ratio(self) -> float:
        """Peak bytes ÷ parameter bytes."""
        return self.peak_bytes / (4 * self.params)

    @property
    def seconds_per_100m(self) -> float:
        """Seconds per 100 M parameters."""
        return self.seconds * 1e8 / self.params


def io_network(width: int, rank: int, experts: int = 16) -> ExpertNetwork:
    """A custom network whose bulk is one ``i × o × rank`` core, the rank split over two expert cores."""
    spec = "E: n1 r s, IO: i o r, F: s n2"
    return ExpertNetwork.from_spec(
        spec, expert_dims=(experts, experts), in_features=width, out_features=width, ranks=rank, name="io-core"
    )


def grid_network(rows: int, columns: int, rank: int, width: int) -> ExpertNetwork:
    """A ``rows × columns`` grid of cores (expert mode of 2 each, bonds of ``rank``); ``i``, ``o`` at corners."""
    cores, sizes = {}, {"i": width, "o": width}
    for row in range(rows):
        for column in range(columns):
            mode = f"n{row * columns + column + 1}"
            labels = [mode]
            sizes[mode] = 2
            if row + 1 < rows:
                labels.append(f"v{row}_{column}")
            if row:
                labels.append(f"v{row - 1}_{column}")
            if column + 1 < columns:
                labels.append(f"h{row}_{column}")
            if column:
                labels.append(f"h{row}_{column - 1}")
            cores[f"c{row}_{column}"] = tuple(labels)
    cores["c0_0"] += ("i",)
    cores[f"c{rows - 1}_{columns - 1}"] += ("o",)
    sizes.update({label: rank for labels in cores.values() for label in labels if label[0] in "vh"})
    return ExpertNetwork(cores, sizes, name=f"grid-{rows}x{columns}")


def construction_cases() -> list[tuple[str, Callable[[], torch.nn.Module]]]:
    """The layers whose construction is measured: large custom networks and named formats."""
    return [
        ("custom i-o core 4096×4096×12 (201 M)", lambda: FactorizedExperts(io_network(4096, 12), init="linear")),
        ("custom i-o core 2048×2048×24 (101 M)", lambda: FactorizedExperts(io_network(2048, 24), init="linear")),
        ("custom grid 8×10 = 80 cores, rank 4, 768 → 768", lambda: FactorizedExperts(grid_network(8, 10, 4, 768))),
        ("CP 4096 → 16384, 256 experts, rank 4096", lambda: MuMoE(4096, 16384, 256, "cp", rank=4096)),
        ("TR 4096 → 16384, 256 experts, ranks (4, 4, 1024)", lambda: MuMoE(4096, 16384, 256, "tr", rank=(4, 4, 1024))),
        ("TT 4096 → 16384, 16×16, rank 1024", lambda: MuMoE(4096, 16384, (16, 16), "tt", rank=1024)),
        ("Tucker 4096 → 16384, 16×16, rank 96", lambda: MuMoE(4096, 16384, (16, 16), "tucker", rank=96)),
    ]


def measure_construction(label: str, build: Callable[[], torch.nn.Module]) -> Construction:
    """Build once untimed-free: the time of one build, and (a second build) its live-tensor peak."""
    gc.collect()
    start = time.perf_counter()
    module = build()
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in module.parameters())
    del module
    gc.collect()
    with LiveTensorPeak() as tracker:
        module = build()
    del module
    gc.collect()
    return Construction(label, params, seconds, tracker.peak)


def construction(progress: Callable[[Construction], None] = lambda row: None) -> list[Construction]:
    """Time and live-tensor peak of every construction case (after a small warm-up build)."""
    MuMoE(64, 64, 16, "tucker", rank=4)  # first-call costs (imports, planner set-up) are not charged
    FactorizedExperts(io_network(64, 4))
    rows = []
    for label, build in construction_cases():
        rows.append(measure_construction(label, build))
        progress(rows[-1])
    return rows


def extras(width: int, tokens: int, *, quick: bool = False) -> dict:
    """The planning grid at ``width → 4·width`` and ``tokens`` and the construction table, as JSON data.

    ``quick``: 2⁸ and 2¹² experts over E = 1 … 3 only, and no construction.
    """
    sizes = {"exponents": (8, 12), "modes": (1, 2, 3)} if quick else {}
    out: dict = {"grid": [asdict(row) for row in planning_grid(width, 4 * width, tokens, **sizes)]}
    if not quick:
        out["construction"] = [asdict(row) | {"peak_ratio": row.peak_ratio} for row in construction()]
    return out


def _fmt_grid(row: GridRow) -> str:
    dims = "×".join(map(str, row.dims))
    if row.planned_fma is None:
        return f"{row.format:<7} 2^{int(math.log2(row.experts)):<3} {dims:<22} {row.note}"
    closed = "—" if row.closed_fma is None else f"{row.planned_fma / row.closed_fma:.3f}"
    return (
        f"{row.format:<7} 2^{int(math.log2(row.experts)):<3} {dims:<22} plan {row.plan_s * 1e3:8.1f} ms  "
        f"FMA {row.planned_fma:.3e} (÷ closed {closed})  peak {row.peak / row.bound:.3f}× bound"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the planning grid and the construction table (``--json PATH`` saves them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--skip-construction", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: dict = {}
    if not args.skip_construction:
        print("construction: seconds, s per 100 M parameters, live-tensor peak ÷ parameter bytes")
        built = construction(
            lambda c: print(
                f"  {c.label:<48} {c.params:>13,}  {c.seconds:6.2f} s  {c.seconds_per_100m:5.2f} s/100M  "
                f"peak {c.peak_ratio:.2f}×",
                flush=True,
            )
        )
        out["construction"] = [asdict(c) for c in built]
    if not args.skip_grid:
        print("planning grid: 768 → 3072, 1,024 tokens, matched to nn.Linear")
        rows = planning_grid(progress=lambda row: print("  " + _fmt_grid(row), flush=True))
        out["grid"] = [asdict(row) for row in rows]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
