"""Benchmarks: μMoE layers and blocks against nn.Linear / MLP, the paper's einsums and peer MoEs.

Run from the repository root::

    python -m benchmarks.run                    # everything; writes benchmarks/results-cpu.md (-gpu on CUDA)
    python -m benchmarks.run --quick            # tiny sizes, a smoke run (writes to a temporary folder)
    python -m benchmarks.run --only params experts
    python -m benchmarks.run --only inference latency generation   # eval-mode inference and generation
    python -m benchmarks.run --only host --threads 1   # kernels, host time, floors, torch.compile; tiny sizes
    python -m benchmarks.run --only scale      # every format, 2^8 … 2^24 experts: time, memory, planning grid
    python -m benchmarks.run --optimize optimal # the path optimizer handed to every μMoE (optimize=)
    python -m benchmarks.run --only quality     # training quality over seeds (python -m benchmarks.quality)

Each row prints as soon as it is measured and each finished section is saved at once, so an
interrupted run keeps what it measured. Peers come with ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import quality, report
from benchmarks.baselines import PEER_MODULES, PEER_PACKAGES, Case, count_params, fp32_bytes, missing_package
from benchmarks.compiled_host import CompiledHostRunner
from benchmarks.measure import HostRunner, MemoryProbe, Runner, Timing, alternate
from benchmarks.scale import extras as scale_extras
from benchmarks.section_list import SECTIONS, make_sections
from benchmarks.sections import FULL, QUICK, Section, Sizes

HERE = Path(__file__).resolve().parent
COMMAND = "python -m benchmarks.run"


def estimated_params(case: Case, few: int) -> int:
    """Parameters of a peer, counted on the meta device; from two small expert counts when too many.

    A peer's count is linear in its number of experts (each expert is a module of its own, or a
    row of an embedding), so two counts give it exactly without constructing a million modules.
    """
    if case.options["num_experts"] <= 4096 or case.model == "peer":
        return count_params(case)
    small = [Case(case.label, case.model, {**case.options, "num_experts": n}) for n in (few, 2 * few)]
    first, second = (count_params(c) for c in small)
    return first + (second - first) // few * (case.options["num_experts"] - few)


def _gib(params: int) -> str:
    return f"{fp32_bytes(params) / 2**30:,.1f} GiB"


def _row_line(row: dict) -> str:
    parts = [f"  {row['label']:<52}", f"{row['params']:>14,}" if row.get("params") is not None else " " * 14]
    if row.get("train_s") is None and row.get("infer_s") is None:
        return "".join(parts) + f"  {row.get('note', '')}"
    for metric, name in report.COUNTS:
        if row.get(metric) is not None:
            parts.append(f"  {name} {row[metric]:>4}")
    for metric, name, scale in report.METRICS:
        value = report.fmt_value(row, metric, scale)
        if value:
            shown = report.fmt_ratio(row.get("ratios", {}).get(metric))
            parts.append(f"  {name.split(' (')[0]} {value:>9} {name.split(' ')[-1][1:-1]} {shown:>7}")
    return "".join(parts)


def run_section(section: Section, sizes: Sizes, args: argparse.Namespace, device: torch.device, store: dict) -> dict:
    """Measure one section; print each row as soon as it is complete."""
    threads = torch.get_num_threads()
    print(f"\n{section.title}\n  {section.description}", flush=True)
    rows: dict[str, dict] = {}
    runnable: list[Case] = []
    for case in section.cases:
        row = {"label": case.label, "reference": section.reference_of(case.label), "note": "", "params": None}
        row["tokens"] = case.batch * case.seq
        rows[case.label] = row
        package = missing_package(case)
        if package is not None:
            row["note"] = f'not installed: {package} (pip install -e ".[bench]")'
            print(_row_line(row), flush=True)
            continue
        if case.model in PEER_PACKAGES:
            row["params"] = count_params(case)
            if fp32_bytes(row["params"]) > args.memory_limit * 2**30:
                row["note"] = f"not run: weights and gradients {_gib(row['params'])}"
                print(_row_line(row), flush=True)
                continue
        runnable.append(case)
    for case in section.not_run:
        package = missing_package(case)
        params = None if package else estimated_params(case, sizes.few)
        note = f"not installed: {package}" if package else f"not run: weights and gradients {_gib(params)}"
        rows[case.label] = {"label": case.label, "reference": section.reference, "note": note, "params": params}
        print(_row_line(rows[case.label]), flush=True)
    for label, source in section.borrowed:
        found = [row for row in store["sections"].get(source, {}).get("rows", []) if row["label"] == label]
        if found:
            rows[label] = {**found[0], "note": f"timed in the {source!r} section"}
        else:
            rows[label] = {"label": label, "reference": section.reference, "params": None}
            rows[label]["note"] = f"see the {source!r} section (not run in this run)"
        print(_row_line(rows[label]), flush=True)

    memory = section.memory and not args.no_memory
    steps = (len(runnable) if memory else 0) + len(runnable) + args.rounds * len(runnable)
    progress = tqdm(total=steps, desc=section.name, leave=False, file=sys.stderr, mininterval=0.5)
    runners: dict[str, Runner] = {}
    if memory:
        preload = {PEER_MODULES[case.model] for case in runnable if case.model in PEER_MODULES}
        with MemoryProbe(device, threads, sorted(preload)) as probe:
            for case in runnable:
                progress.set_postfix_str(f"peak memory: {case.label}")
                rows[case.label].update(probe.peak(case) or {"peak_bytes": None, "rss_bytes": None})
                progress.update()
    for case in runnable:
        progress.set_postfix_str(f"building: {case.label}")
        try:
            if section.eval_tokens is not None:
                kind = CompiledHostRunner if case.model == "compiled" else HostRunner
                runners[case.label] = kind(case, device, eval_tokens=section.eval_tokens)
            else:
                runners[case.label] = Runner(case, device, train=section.train)
        except Exception as error:  # a peer that fails at this size is reported, not hidden
            rows[case.label]["note"] = f"failed: {type(error).__name__}: {error}"[:160]
            tqdm.write(_row_line(rows[case.label]))
        progress.update()
    for label, runner in runners.items():
        rows[label]["params"] = sum(p.numel() for p in runner.module.parameters())
        if isinstance(runner, HostRunner):  # counted once, before the timing: counts do not vary
            rows[label] |= runner.launches()

    def done(label: str, timing: Timing) -> None:
        row = rows[label]
        row |= {"train_s": timing.train_s, "infer_s": timing.infer_s}
        row |= {"train_samples": list(timing.train), "infer_samples": list(timing.infer)}
        reference = rows.get(row["reference"])
        row["ratios"] = {metric: report.ratio(row, reference, metric) for metric, _, _ in report.METRICS}
        tqdm.write(_row_line(row))

    def tick() -> None:
        progress.update()

    progress.set_postfix_str("timing")
    alternate(runners, rounds=args.rounds, reps=section.reps, train=section.train, tick=tick, done=done)
    for label, runner in runners.items():
        if isinstance(runner, CompiledHostRunner):  # its warm-up compiled; a later graph is a recompile
            rows[label] |= runner.compilation()
    torch.set_num_threads(threads)  # cases that name their threads leave the last one set
    progress.close()
    del runners
    gc.collect()

    targets = []
    for target in section.targets:
        numerator = rows[target.numerator]
        if target.denominator is None:  # a count, not a ratio
            entry = {"name": target.name, "value": numerator.get(target.metric), "limit": target.limit}
            targets.append(entry | {"spread": None, "unit": ""})
            continue
        denominator = rows[target.denominator]
        value = report.ratio(numerator, denominator, target.metric)
        key = report.SAMPLES.get(target.metric)
        spread = None if key is None else report.paired_spread(numerator.get(key), denominator.get(key))
        targets.append({"name": target.name, "value": value, "limit": target.limit, "spread": spread})
    return {
        "title": section.title,
        "description": section.description,
        "reference_text": section.reference_text or section.reference,
        "machine": report.machine(device),
        "command": getattr(args, "command", COMMAND),
        "optimize": args.optimize or "library default",
        "samples": args.rounds * section.reps,
        "rows": [rows[label] for label in section.labels()],
        "targets": targets,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs")
    parser.add_argument("--only", nargs="+", choices=(*SECTIONS, "quality"), default=list(SECTIONS), metavar="NAME",
                        help=f"sections to run, of {', '.join(SECTIONS)} (default all) and quality (training "
                        "quality over seeds, about 30 minutes: python -m benchmarks.quality)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; 1 with --quick)")
    parser.add_argument("--optimize", default=None, help="path optimizer passed to every μMoE as optimize=")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/)")
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process peak-memory probes")
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="leave out the host section's torch.compile rows (each compiles its graphs first)",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the block in docs/results.md")
    parser.add_argument("--report-only", action="store_true", help="rewrite report, plot and docs from the JSON")
    parser.add_argument("--memory-limit", type=float, default=4.0,
                        help="GiB of fp32 weights + gradients above which a peer is listed, not run")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections and write the results."""
    args = parse(argv)
    if "quality" in args.only:
        code = quality.main(["--quick"] if args.quick else [])
        args.only = [name for name in args.only if name != "quality"]
        if not args.only:
            return code
    given = sys.argv[1:] if argv is None else argv
    command = " ".join([COMMAND, *given])
    args.command = command
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else FULL
    extra = {"optimize": args.optimize} if args.optimize else {}
    out = args.out or (Path(tempfile.mkdtemp(prefix="mumoe-bench-")) if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    kind = "gpu" if device.type == "cuda" else "cpu"
    stem = out / f"results-{kind}"
    store = report.load(stem.with_suffix(".json"))
    info = report.machine(device)
    if args.report_only:
        print(f"mumoe_tn benchmarks: rewriting {stem}.md from {stem}.json (nothing measured)")
    else:
        print(f"mumoe_tn benchmarks on {device} ({info['processor']}, {args.threads} threads); writing {stem}.md")
    chosen = (
        []
        if args.report_only
        else make_sections(
            args.only, sizes, extra, int(args.memory_limit * 2**30), args.threads, compile_rows=not args.no_compile
        )
    )
    for section in chosen:
        store["sections"][section.name] = run_section(section, sizes, args, device, store)
        if section.name == "scale":  # the planning grid (every size) and construction (full runs)
            store["sections"]["scale"] |= scale_extras(sizes.width, sizes.batch * sizes.seq // 4, quick=args.quick)
        report.save(stem.with_suffix(".json"), store)
        stem.with_suffix(".md").write_text(report.markdown(store, SECTIONS, COMMAND))
    stem.with_suffix(".md").write_text(report.markdown(store, SECTIONS, COMMAND))
    image = report.plot(store, stem.with_suffix(".png"))
    latency = report.plot_latency(store, out / f"inference-latency-{kind}.png")
    scale_image = report.plot_scale(store, out / f"scale-{kind}.png")
    if scale_image is not None and not args.quick and not args.no_docs:
        shutil.copyfile(scale_image, report.DOCS_PAGE.parent / "img" / scale_image.name)
    if latency is not None and not args.quick and not args.no_docs:
        docs_latency = report.DOCS_PAGE.parent / "img" / latency.name
        shutil.copyfile(latency, docs_latency)
        if report.update_inference_docs(store, kind, f"img/{docs_latency.name}", report.DOCS_PAGE):
            print(f"updated the inference block of {report.DOCS_PAGE}")
    if image is not None and not args.quick and not args.no_docs:
        docs_image = report.DOCS_PAGE.parent / "img" / f"benchmarks-{kind}.png"
        shutil.copyfile(image, docs_image)
        if report.update_docs(store, SECTIONS, kind, f"img/{docs_image.name}", COMMAND, report.DOCS_PAGE):
            print(f"updated {report.DOCS_PAGE}")
    summary = [t for section in store["sections"].values() for t in section["targets"]]
    if summary:
        print("\nTargets" + (" (they apply to the full sizes; --quick only checks that it runs)" if args.quick else ""))
        for target in summary:
            value, unit = target["value"], target.get("unit", "×")
            verdict = {None: "not measured", True: "met", False: "MISSED"}[report.is_met(target)]
            shown = "" if value is None else f"{value:6.2f}×" if unit else f"{value:6d}"
            spread = target.get("spread")
            paired = "" if spread is None else f" (paired quartiles {spread[0]:.2f}–{spread[1]:.2f}×)"
            print(f"  {target['name']:<72} {shown:>8} (limit {target['limit']}{unit}) {verdict}{paired}")
    print(f"\nwrote {stem}.md, {stem}.json" + "".join(f", {path}" for path in (image, latency) if path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
