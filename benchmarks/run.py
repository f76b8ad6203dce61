"""Benchmarks: μMoE speed and memory against the hand-written einsums, nn.Linear and MoEs.

Run from the repository root::

    python -m benchmarks.run                 # full run (CPU: about 10-15 minutes on 2 cores)
    python -m benchmarks.run --quick         # tiny sizes, seconds (the test suite's smoke test)
    python -m benchmarks.run --device cuda   # CUDA is used automatically when present

Writes ``results/benchmarks.md``, ``results/benchmarks.json`` and PNG plots, and prints a
summary of the targets. Every figure is a ratio of two measurements taken in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import opt_einsum
import torch

import mumoe_tn
from benchmarks.baselines import DenseMoE, HandwrittenCP, HandwrittenTR, SparseMoE, matched_layer
from benchmarks.measure import median_seconds, peak_bytes, peak_bytes_here
from mumoe_tn import MuMoE
from mumoe_tn.contractions.execute import run_plan

FULL = {"in": 768, "out": 3072, "batch": 4096, "experts": 256, "hier_batch": 1024, "sweep_batch": 256, "time": 1.0}
QUICK = {"in": 32, "out": 64, "batch": 64, "experts": 16, "hier_batch": 32, "sweep_batch": 16, "time": 0.02}
MEMORY_LIMIT = 6 * 2**30  # skip baselines whose weights + activations would exceed this


# ----------------------------------------------------------------------------- cases
def build(case: dict, device: torch.device) -> tuple[torch.nn.Module, tuple, torch.Tensor]:
    """Module, forward arguments and a dense output gradient for a case description."""
    gen = torch.Generator().manual_seed(0)
    kind, i, o, b = case["kind"], case["in"], case["out"], case["batch"]
    dims = tuple(case.get("experts", ()))
    if kind == "linear":
        module = torch.nn.Linear(i, o)
        args = (torch.randn(b, i, generator=gen),)
    elif kind == "mumoe":
        if "rank" in case:  # fixed ranks (sweeps), else parameter-matched to nn.Linear
            module = MuMoE(i, o, dims, case["decomposition"], case["rank"], input_norm=True)
        else:
            module = matched_layer(case["decomposition"], i, o, dims)
        args = (torch.randn(b, i, generator=gen),)
    elif kind in ("planned", "handwritten"):
        experts = matched_layer(case["decomposition"], i, o, dims).experts
        module = (
            experts if kind == "planned" else {"cp": HandwrittenCP, "tr": HandwrittenTR}[case["decomposition"]](experts)
        )
        z = torch.cat([torch.randn(b, i, generator=gen), torch.ones(b, 1)], dim=-1)
        coefficients = [torch.softmax(torch.randn(b, n, generator=gen), -1).requires_grad_() for n in dims]
        args = (z, coefficients)
    elif kind == "dense":
        module = DenseMoE(i, o, math.prod(dims))
        args = (torch.randn(b, i, generator=gen),)
    elif kind == "sparse":
        module = SparseMoE(i, o, math.prod(dims), top_k=2)
        args = (torch.randn(b, i, generator=gen),)
    else:
        raise ValueError(f"unknown case kind {kind!r}")
    module = module.to(device)
    args = tuple(_to(a, device) for a in args)
    grad = torch.randn(b, o, generator=gen).to(device)
    return module, args, grad


def _to(value, device):
    if isinstance(value, list):
        return [v.detach().to(device).requires_grad_(v.requires_grad) for v in value]
    return value.to(device)


def estimated_bytes(case: dict) -> int:
    """Rough fp32 footprint of the dense/sparse baselines (weights, grads, activations)."""
    n = math.prod(case.get("experts", (1,)))
    weights = 2 * n * (case["in"] + 1) * case["out"]
    if case["kind"] == "dense":
        return 4 * (weights + 3 * case["batch"] * n * case["out"])
    if case["kind"] == "sparse":
        return 4 * (weights + 6 * case["batch"] * case["out"])
    return 0


@dataclass
class Result:
    """One measured case."""

    group: str
    label: str
    case: dict
    forward_s: float | None = None
    train_s: float | None = None
    peak_bytes: int | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _timers(case: dict, device: torch.device, cfg: dict):
    module, args, grad = build(case, device)

    def forward():
        with torch.no_grad():
            return module(*args)

    def train():
        module(*args).backward(grad)

    threads = torch.get_num_threads()

    def run() -> tuple[float, float]:
        module.eval()  # inference: BatchNorm gates use their running statistics
        forward_s = median_seconds(forward, min_run_time=cfg["time"], threads=threads)
        module.train(case["batch"] > 1)  # BatchNorm cannot train on a single token
        return forward_s, median_seconds(train, min_run_time=cfg["time"], threads=threads)

    return run


def _report(result: Result) -> Result:
    peak = "" if result.peak_bytes is None else f"  peak {result.peak_bytes / 2**20:9.1f} MiB"
    print(
        f"  {result.label:<44} fwd {result.forward_s * 1e3:9.3f} ms  fwd+bwd {result.train_s * 1e3:9.3f} ms{peak}",
        flush=True,
    )
    return result


def measure(group: str, label: str, case: dict, cfg: dict, device: torch.device, *, memory: bool = False) -> Result:
    """Time the forward (no grad) and forward+backward of a case; optionally its peak memory."""
    result = Result(group, label, case)
    if estimated_bytes(case) > MEMORY_LIMIT:
        result.note = f"skipped: needs about {estimated_bytes(case) / 2**30:.0f} GiB"
        print(f"  {label:<44} {result.note}", flush=True)
        return result
    result.forward_s, result.train_s = _timers(case, device, cfg)()
    if memory:
        result.peak_bytes = peak_bytes(case, device.type, torch.get_num_threads())
    return _report(result)


def measure_pair(group: str, cases: dict[str, dict], cfg: dict, device: torch.device, rounds: int = 2) -> list[Result]:
    """Time cases in alternation (A, B, A, B, …) and keep each one's best median.

    A ratio of two cases then does not depend on which ran first while the machine warmed up.
    """
    runs = {label: _timers(case, device, cfg) for label, case in cases.items()}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(rounds):
        for label, run in runs.items():
            forward_s, train_s = run()
            old = best.get(label, (forward_s, train_s))
            best[label] = (min(old[0], forward_s), min(old[1], train_s))
    results = []
    for label, case in cases.items():
        result = Result(group, label, case, *best[label], note=f"best of {rounds} alternating runs")
        results.append(_report(result))
    return results


# ----------------------------------------------------------------------------- suites
def suite(cfg: dict, device: torch.device, quick: bool) -> tuple[list[Result], dict]:
    """Run every benchmark group; returns the results and the cache-overhead figures."""
    i, o, b, n = cfg["in"], cfg["out"], cfg["batch"], cfg["experts"]
    base = {"in": i, "out": o, "batch": b}
    results: list[Result] = []
    extra: dict = {}
    side = math.isqrt(n)

    print("warm-up", flush=True)
    measure("warm-up", "nn.Linear", {**base, "kind": "linear"}, cfg, device)

    print("planned contraction vs the paper's hand-written einsums", flush=True)
    for name in ("cp", "tr"):
        for dims in ((n,), (side, side)):
            cases = {
                f"{name} E={len(dims)} {kind}": {**base, "kind": kind, "decomposition": name, "experts": list(dims)}
                for kind in ("planned", "handwritten")
            }
            results += measure_pair("handwritten", cases, cfg, device)

    print(f"whole layer (LayerNorm + entmax15 gate), N={n}, parameter-matched to nn.Linear({i}, {o})", flush=True)
    layer_cases = {"nn.Linear": {**base, "kind": "linear"}}
    layer_cases |= {
        f"{name} μMoE": {**base, "kind": "mumoe", "decomposition": name, "experts": [n]} for name in ("cp", "tr")
    }
    results += measure_pair("layer", layer_cases, cfg, device)
    for result in results[-3:]:
        result.peak_bytes = peak_bytes(result.case, device.type, torch.get_num_threads())
        print(f"  {result.label:<44} peak fwd+bwd {result.peak_bytes / 2**20:9.1f} MiB", flush=True)
    for name in ("tt", "tucker"):
        case = {**base, "kind": "mumoe", "decomposition": name, "experts": [n]}
        results.append(measure("layer", f"{name} μMoE", case, cfg, device))

    hier = [8, 8] if quick else [32, 32, 32, 32]
    hb = cfg["hier_batch"]
    print(f"{math.prod(hier):,} experts ({'×'.join(map(str, hier))}), batch {hb}", flush=True)
    hier_cases = {"nn.Linear": {**base, "batch": hb, "kind": "linear"}}
    hier_cases |= {
        f"{name} μMoE": {**base, "batch": hb, "kind": "mumoe", "decomposition": name, "experts": hier}
        for name in ("cp", "tr")
    }
    results += measure_pair("hierarchical", hier_cases, cfg, device)
    for result in results[-3:]:
        result.peak_bytes = peak_bytes(result.case, device.type, torch.get_num_threads())
        print(f"  {result.label:<44} peak fwd+bwd {result.peak_bytes / 2**20:9.1f} MiB", flush=True)

    print("plan-cache hit overhead at batch 1", flush=True)
    extra["overhead"] = cache_overhead(i, o, n, device, cfg)

    # Sweeps keep the ranks matched at N experts fixed (the paper's Figure param-ablation): at
    # large N the gate alone outgrows nn.Linear, so matching is no longer possible.
    fixed = {}
    for name in ("cp", "tr", "tt"):
        network = matched_layer(name, i, o, (n,)).network
        fixed[name] = network.sizes[network.bonds[-1]]
    print(f"sweep over experts, batch {cfg['sweep_batch']}, ranks fixed at {fixed}", flush=True)
    counts = [2, 8, 32] if quick else [2, 8, 32, 128, 512, 2048, 8192, 16384]
    sb = {**base, "batch": cfg["sweep_batch"]}
    results.append(measure("experts", "nn.Linear", {**sb, "kind": "linear"}, cfg, device))
    for count in counts:
        for kind, name in (("mumoe", "cp"), ("mumoe", "tr"), ("mumoe", "tt"), ("dense", None), ("sparse", None)):
            case = {**sb, "kind": kind, "experts": [count]}
            if name:
                case |= {"decomposition": name, "rank": fixed[name]}
            label = f"{name + ' μMoE' if name else kind + ' MoE'} N={count}"
            results.append(measure("experts", label, case, cfg, device))

    print(f"sweep over batch, N={n}", flush=True)
    batches = [1, 16, 64] if quick else [1, 16, 256, 4096]
    for batch in batches:
        bb = {**base, "batch": batch}
        results.append(measure("batch", f"nn.Linear B={batch}", {**bb, "kind": "linear"}, cfg, device))
        for kind, name in (("mumoe", "cp"), ("mumoe", "tr"), ("dense", None), ("sparse", None)):
            case = {**bb, "kind": kind, "experts": [n]}
            if name:
                case |= {"decomposition": name, "rank": fixed[name]}
            label = f"{name + ' μMoE' if name else kind + ' MoE'} B={batch}"
            results.append(measure("batch", label, case, cfg, device))

    print("hierarchy: the same number of experts in E = 1, 2, 4 modes", flush=True)
    total = 16 if quick else 4096
    for dims in ((total,), (math.isqrt(total),) * 2, (math.isqrt(math.isqrt(total)),) * 4):
        for name in ("cp", "tr"):
            case = {**sb, "kind": "mumoe", "decomposition": name, "experts": list(dims), "rank": fixed[name]}
            results.append(measure("modes", f"{name} μMoE {'×'.join(map(str, dims))}", case, cfg, device))
    return results, extra


def cache_overhead(i: int, o: int, n: int, device: torch.device, cfg: dict) -> dict:
    """Per-forward time at batch 1 of FactorizedExperts.forward minus running its plan directly."""
    experts = matched_layer("cp", i, o, (n,)).experts.to(device)
    z = torch.randn(1, i + 1, device=device)
    a = [torch.softmax(torch.randn(1, n, device=device), -1)]
    operands = [*experts.cores.values(), *a, z]
    plan = experts.plan(1)
    time_min = max(cfg["time"], 0.2)
    threads = torch.get_num_threads()
    layer_s = direct_s = float("inf")
    with torch.no_grad():
        for _ in range(5):  # alternate, keep the best of each: the difference is a few µs of ~200
            layer_s = min(layer_s, median_seconds(lambda: experts(z, a), min_run_time=time_min, threads=threads))
            direct_s = min(
                direct_s, median_seconds(lambda: run_plan(plan, operands), min_run_time=time_min, threads=threads)
            )
    lookup_s = median_seconds(lambda: experts.plan(1), min_run_time=time_min, threads=1)
    result = {"forward_us": layer_s * 1e6, "plan_only_us": direct_s * 1e6, "lookup_us": lookup_s * 1e6}
    result["overhead_us"] = max(layer_s - direct_s, 0.0) * 1e6
    print(
        f"  FactorizedExperts.forward {result['forward_us']:.1f} µs, "
        f"its plan run directly {result['plan_only_us']:.1f} µs, overhead {result['overhead_us']:.1f} µs "
        f"(cache lookup alone {result['lookup_us']:.2f} µs)",
        flush=True,
    )
    return result


# ----------------------------------------------------------------------------- report
def find(results: list[Result], group: str, label: str) -> Result:
    """The result with that group and label."""
    return next(r for r in results if r.group == group and r.label == label)


def targets(results: list[Result], extra: dict) -> list[tuple[str, float | None, float, str]]:
    """(target, measured ratio or value, limit, unit) for every target of the issue."""
    rows = []
    for name in ("cp", "tr"):
        for modes in (1, 2):
            planned = find(results, "handwritten", f"{name} E={modes} planned")
            hand = find(results, "handwritten", f"{name} E={modes} handwritten")
            rows.append(
                (f"{name} E={modes} planned ÷ hand-written, fwd+bwd", planned.train_s / hand.train_s, 1.00, "×")
            )
    linear = find(results, "layer", "nn.Linear")
    for name in ("cp", "tr"):
        layer = find(results, "layer", f"{name} μMoE")
        rows.append((f"{name} layer ÷ nn.Linear, fwd+bwd time", layer.train_s / linear.train_s, 1.5, "×"))
        if layer.peak_bytes and linear.peak_bytes:
            rows.append(
                (f"{name} layer ÷ nn.Linear, fwd+bwd peak memory", layer.peak_bytes / linear.peak_bytes, 1.3, "×")
            )
    hlinear = find(results, "hierarchical", "nn.Linear")
    for name in ("cp", "tr"):
        layer = find(results, "hierarchical", f"{name} μMoE")
        experts = "×".join(map(str, layer.case["experts"]))
        rows.append((f"{name} {experts} experts ÷ nn.Linear, fwd+bwd time", layer.train_s / hlinear.train_s, 3.0, "×"))
        if layer.peak_bytes is not None:
            rows.append((f"{name} {experts} experts fwd+bwd peak memory", layer.peak_bytes / 2**30, 24.0, "GiB"))
    rows.append(("plan-cache hit overhead at batch 1", extra["overhead"]["overhead_us"], 50.0, "µs"))
    return rows


def machine() -> dict:
    """Versions and hardware, recorded with the results."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "torch": torch.__version__,
        "opt_einsum": opt_einsum.__version__,
        "mumoe_tn": mumoe_tn.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown(results: list[Result], extra: dict, info: dict, device: torch.device) -> str:
    """The report: targets, then one table per group."""
    lines = ["# mumoe_tn benchmarks", "", f"Device: {device}; " + "; ".join(f"{k} {v}" for k, v in info.items()), ""]
    lines += ["## Targets", "", "| target | measured | limit | met |", "|---|---:|---:|:---:|"]
    for name, value, limit, unit in targets(results, extra):
        met = "—" if value is None else ("yes" if value <= limit else "**no**")
        lines.append(f"| {name} | {value:.3f} {unit} | {limit} {unit} | {met} |")
    for group in dict.fromkeys(r.group for r in results):
        lines += [
            "",
            f"## {group}",
            "",
            "| case | fwd (ms) | fwd+bwd (ms) | peak fwd+bwd (MiB) | note |",
            "|---|---:|---:|---:|---|",
        ]
        for r in (r for r in results if r.group == group):
            fwd = "" if r.forward_s is None else f"{r.forward_s * 1e3:.3f}"
            train = "" if r.train_s is None else f"{r.train_s * 1e3:.3f}"
            peak = "" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f}"
            lines.append(f"| {r.label} | {fwd} | {train} | {peak} | {r.note} |")
    overhead = extra["overhead"]
    lines += ["", "## Plan-cache hit at batch 1", ""]
    lines += [f"- {key}: {value:.2f}" for key, value in overhead.items()]
    return "\n".join(lines) + "\n"


def plots(results: list[Result], out: Path) -> list[Path]:
    """Forward+backward time against expert count and against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for group, key, xlabel in (("experts", "N=", "number of experts"), ("batch", "B=", "batch (tokens)")):
        figure, axes = plt.subplots(figsize=(6.4, 4.2))
        series: dict[str, list[tuple[int, float]]] = {}
        for r in results:
            if r.group != group or r.train_s is None or key not in r.label:
                continue
            name, value = r.label.rsplit(" ", 1)
            series.setdefault(name, []).append((int(value.split("=")[1]), r.train_s * 1e3))
        for name, points in series.items():
            xs, ys = zip(*sorted(points), strict=True)
            axes.plot(xs, ys, marker="o", markersize=3, label=name)
        linear = [r for r in results if r.group == group and r.label == "nn.Linear"]
        if linear:
            axes.axhline(linear[0].train_s * 1e3, color="grey", linewidth=1, label="nn.Linear")
        axes.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="forward+backward (ms)")
        axes.legend(fontsize=8)
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        path = out / f"time_vs_{group}.png"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--out", default="results", help="results folder (default results/)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.probe:  # a fresh process measuring one case's peak memory
        case = json.loads(args.probe)
        module, inputs, grad = build(case, device)
        module.train(case["batch"] > 1)
        print(peak_bytes_here(lambda: module(*inputs).backward(grad), device))
        return 0
    cfg = QUICK if args.quick else FULL
    info = machine()
    print(f"mumoe_tn benchmarks on {device} ({info['processor']}, {args.threads} threads)", flush=True)
    results, extra = suite(cfg, device, args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.md").write_text(markdown(results, extra, info, device))
    payload = {"machine": info, "device": str(device), "config": cfg, "overhead": extra["overhead"]}
    payload["results"] = [r.__dict__ for r in results]
    payload["targets"] = [
        dict(zip(("target", "value", "limit", "unit"), t, strict=True)) for t in targets(results, extra)
    ]
    (out / "benchmarks.json").write_text(json.dumps(payload, indent=2))
    written = plots(results, out)
    print(
        "\nTargets"
        + (" (they apply to the full run; --quick only checks that everything runs):" if args.quick else ":")
    )
    for name, value, limit, unit in targets(results, extra):
        verdict = "met" if value <= limit else "MISSED"
        print(f"  {name:<52} {value:8.3f} {unit:<3} (limit {limit} {unit}) {verdict}")
    print(f"\nwrote {out / 'benchmarks.md'}, {out / 'benchmarks.json'}, " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
