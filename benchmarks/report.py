"""Results files: the JSON store, the markdown report, the plot and the docs page section."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import opt_einsum
import torch

import mumoe_tn

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "results.md"
METRICS = (
    ("train_s", "fwd+bwd (ms)", 1e3),
    ("infer_s", "fwd (ms)", 1e3),
    ("peak_bytes", "peak (MiB)", 2**-20),
    ("rss_bytes", "RSS peak (MiB)", 2**-20),
)


def machine(device: torch.device) -> dict:
    """Versions and hardware, recorded with every section."""
    info = {
        "device": str(device),
        "processor": _cpu_name(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "opt_einsum": opt_einsum.__version__,
        "mumoe_tn": mumoe_tn.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        info["load average"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load(path: Path) -> dict:
    """The stored results (``{"sections": {name: …}}``), empty if none."""
    if path.exists():
        return json.loads(path.read_text())
    return {"sections": {}}


def save(path: Path, store: dict) -> None:
    """Write the JSON store."""
    path.write_text(json.dumps(store, indent=1, ensure_ascii=False) + "\n")


def ratio(row: dict, reference: dict | None, metric: str) -> float | None:
    """``row[metric] ÷ reference[metric]``, None when either is missing."""
    if reference is None or row.get(metric) is None or not reference.get(metric):
        return None
    return row[metric] / reference[metric]


#: Counts per call a row may hold (the host section): key, column title.
COUNTS = (
    ("eval_kernels", "kernels, fwd"),
    ("train_kernels", "kernels, fwd+bwd"),
    ("eval_host_reads", "host reads, fwd"),
    ("train_host_reads", "host reads, fwd+bwd"),
)

#: Where a row keeps the samples behind each timed metric (seconds, in the order taken).
SAMPLES = {"train_s": "train_samples", "infer_s": "infer_samples"}


def paired_spread(numerator: list[float] | None, denominator: list[float] | None) -> tuple[float, float] | None:
    """Quartiles (25 %, 75 %) of the ratios of samples taken side by side, or None without 2 clean pairs.

    ``numerator[k]`` and ``denominator[k]`` come from the same alternating round, so their ratio
    cancels the slow phases both met; the spread of these ratios shows how far one run's ratio of
    medians can be trusted on a shared machine.
    """
    if not numerator or not denominator or len(numerator) != len(denominator) or len(numerator) < 2:
        return None
    if not all(denominator):
        return None  # as ratio() does for a zero reference
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return low, high


def is_met(target: dict) -> bool | None:
    """Whether a target's measured ratio is within its limit; None when it was not measured."""
    return None if target["value"] is None else target["value"] <= target["limit"]


def target_line(target: dict) -> str:
    """One row of a targets table: measured ratio, paired quartiles, limit and verdict.

    The verdict says *within noise* when the limit lies between the lower and the upper of the
    quartiles of the paired ratios and the measured ratio (the ratio of medians can fall outside
    the quartiles: then the two estimates disagree on the verdict). A target with ``"unit": ""`` is a
    count (kernels per call): shown as a whole number, without quartiles.
    """
    value, limit, spread = target["value"], target["limit"], target.get("spread")
    unit = target.get("unit", "×")
    if value is None:
        return f"| {target['name']} | not measured |  | ≤ {limit}{unit} | — |"
    verdict = "met" if is_met(target) else "**missed**"
    if spread is not None and min(spread[0], value) <= limit <= max(spread[1], value):
        verdict += " (within noise)"
    quartiles = "" if spread is None else f"{spread[0]:.2f}–{spread[1]:.2f}×"
    shown = f"{value:.2f}×" if unit else f"{value:,}"
    return f"| {target['name']} | {shown} | {quartiles} | ≤ {limit}{unit} | {verdict} |"


def targets_header(first: str = "target") -> list[str]:
    """Header of a targets table whose first column is titled ``first``."""
    return [f"| {first} | measured | paired ratios (quartiles) | limit | met |", "|---|---:|---:|---:|:---:|"]


def fmt_ratio(value: float | None) -> str:
    """``1.07×`` or an empty cell."""
    return "" if value is None else f"{value:.2f}×"


def fmt_value(row: dict, metric: str, scale: float) -> str:
    """A metric scaled for display, empty when missing."""
    value = row.get(metric)
    if value is None:
        return ""
    shown = value * scale
    return f"{shown:,.1f}" if shown >= 10 else f"{shown:.3g}"


def section_markdown(section: dict, level: str = "##") -> list[str]:
    """One section as markdown: title, description, machine, table, targets."""
    info = section["machine"]
    lines = [f"{level} {section['title']}", "", section["description"], ""]
    lines.append(
        f"*Measured {info['date']} on {info['device']} ({info['processor']}, threads {info['threads']}"
        + (f", load average {info['load average']}" if "load average" in info else "")
        + f"); torch {info['torch']}, mumoe_tn {info['mumoe_tn']}, path optimizer {section['optimize']}; "
        + f"median of {section['samples']} alternating samples per case; `{section.get('command', '')}`.*"
    )
    # Only the columns something was measured in (a forward-only section has no fwd+bwd or memory).
    shown = [entry for entry in METRICS if any(row.get(entry[0]) is not None for row in section["rows"])] or METRICS
    titles = {"train_s": "fwd+bwd (ms)", "infer_s": "fwd (ms)", "peak_bytes": "peak fwd+bwd (MiB)"}
    titles["rss_bytes"] = "RSS peak (MiB)"
    counts = [(key, title) for key, title in COUNTS if any(row.get(key) is not None for row in section["rows"])]
    header = "| case | params | " + "".join(f"{title} | " for _, title in counts)
    header += " | ".join(f"{titles[metric]} | ×" for metric, _, _ in shown) + " | note |"
    lines += ["", header, "|---|---:|" + "---:|" * len(counts) + "---:|---:|" * len(shown) + "---|"]
    for row in section["rows"]:
        cells = [row["label"], f"{row['params']:,}" if row.get("params") is not None else ""]
        cells += ["" if row.get(key) is None else str(row[key]) for key, _ in counts]
        for metric, _, scale in shown:
            cells += [fmt_value(row, metric, scale), fmt_ratio(row.get("ratios", {}).get(metric))]
        cells.append(row.get("note", ""))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "× = ratio to " + (section["reference_text"]) + "."]
    lines += scale_markdown(section)
    if section["targets"]:
        lines += ["", *targets_header()]
        lines += [target_line(target) for target in section["targets"]]
    return [*lines, ""]


def scale_markdown(section: dict) -> list[str]:
    """The scale section's planning grid and construction table (nothing for other sections)."""
    lines = []
    if section.get("grid"):
        lines += ["", "Planning grid: one fresh path search per layer (`plan_forward(network, tokens)`); FMAs of the "
                  "planned contraction and the format's closed form × tokens; the plan's largest intermediate ÷ "
                  "4 × tokens × max(I, O) (the planner's bound where some path keeps within it; where none does, "
                  "the note gives the smallest peak of any pairwise path, which the plan keeps within 1.5×).",
                  ""]  # fmt: skip
        lines += ["| format | experts | modes | ranks | params | planning (ms) | planned FMAs | ÷ closed form "
                  "| peak ÷ bound | note |", "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for row in section["grid"]:
            dims = "×".join(map(str, row["dims"]))
            if row["planned_fma"] is None:
                lines.append(f"| {row['format']} | 2^{row['experts'].bit_length() - 1} | {dims} | | | | | | | "
                             f"{row['note'].split(':')[0]} |")  # fmt: skip
                continue
            ranks = ", ".join(f"{k}={v}" for k, v in row["ranks"].items())
            closed = "—" if row["closed_fma"] is None else f"{row['planned_fma'] / row['closed_fma']:.3f}"
            peak = row["peak"] / row["bound"]
            lines.append(
                f"| {row['format']} | 2^{row['experts'].bit_length() - 1} | {dims} | {ranks} | {row['params']:,} "
                f"| {row['plan_s'] * 1e3:.1f} | {row['planned_fma']:.3g} | {closed} | {peak:.2f}"
                + (" (over)" if peak > 1 else "")
                + f" | {row.get('note', '')} |"
            )
    if section.get("construction"):
        lines += ["", "Construction: one build (after a warm-up build of a small layer) and the peak bytes of live "
                  "tensors during a second build (`LiveTensorPeak`), ÷ the parameters' float32 bytes.", ""]  # fmt: skip
        lines += ["| layer | params | seconds | s per 100 M params | peak ÷ params |", "|---|---:|---:|---:|---:|"]
        for row in section["construction"]:
            per = row["seconds"] * 1e8 / row["params"]
            lines.append(f"| {row['label']} | {row['params']:,} | {row['seconds']:.2f} | {per:.2f} | "
                         f"{row['peak_ratio']:.2f} |")  # fmt: skip
    return lines


def plot_scale(store: dict, path: Path) -> Path | None:
    """fwd+bwd time ÷ nn.Linear of the timed layers, and planning time of the grid, against the expert count."""
    section = store["sections"].get("scale")
    if section is None or not section.get("grid"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed: dict[str, list[tuple[int, float]]] = {}
    for row in section["rows"]:
        ratio = row.get("ratios", {}).get("train_s")
        if ratio is None or row["label"] == row["reference"]:
            continue
        name, rest = row["label"].split(" ", 1)
        modes = rest.count("×") + 1
        exponent = int(rest.split("=")[0].strip()[2:])
        timed.setdefault(name, []).append((exponent + 0.08 * (modes - 3), ratio))
    if timed:
        figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    else:  # the planning grid alone (python -m benchmarks.scale)
        figure, right = plt.subplots(1, 1, figsize=(6, 4.2))
        left = None
    for name, points in timed.items():
        left.plot([p[0] for p in points], [p[1] for p in points], "o", label=name)
    if left is not None:
        left.axhline(1.0, color="grey", linewidth=1)
        left.set_yscale("log")
        left.set_xlabel("log2 experts (points spread by mode count)")
        left.set_ylabel("fwd+bwd time ÷ nn.Linear (log)")
        left.set_title("Timed subset, 1,024 tokens", fontsize=10)
    for fmt in sorted({row["format"] for row in section["grid"]}):
        points = [(row["experts"].bit_length() - 1 + 0.1 * len(row["dims"]), row["plan_s"] * 1e3)
                  for row in section["grid"] if row["format"] == fmt and row["plan_s"] is not None]  # fmt: skip
        right.plot([p[0] for p in points], [p[1] for p in points], "o", markersize=4, label=fmt)
    right.set_yscale("log")
    right.set_xlabel("log2 experts (+0.1 per expert mode)")
    right.set_ylabel("one path search (ms, log)")
    right.set_title("Planning time, every matched layer of the grid", fontsize=10)
    for ax in (left, right):
        if ax is not None:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    return _save_figure(figure, section, path)


#: How to read the targets tables.
PAIRED_NOTE = (
    "*measured*: the ratio of the two medians. *Paired ratios*: the quartiles of the ratios of the samples "
    "the two cases took side by side in each alternating round. Where the limit lies between the lowest and "
    "the highest of these three figures the verdict is *within noise*: another run on this machine may well "
    "read the other way."
)


#: How to read times measured on the shared CPU machine.
CPU_NOTE = (
    "This CPU machine is shared with other jobs (see the load average of each section): absolute times vary "
    "run to run, and ratios by several percent. While the load average is well above the 2 cores, a 2-thread "
    "OpenMP region stalls whenever one of its threads is descheduled, which distorts ratios far more than "
    "running on one thread does: `--threads 1` is then the fairer setting."
)

#: How to read times measured on a GPU.
GPU_NOTE = (
    "On a GPU the host queues kernels ahead of the device, and a call costs the longer of the two: "
    "a μMoE layer launches tens of kernels where nn.Linear launches one, so at small batches (the "
    "inference rows) the host's Python and launch time, not the arithmetic, sets its time. *threads* "
    "is the host's thread count."
)


def markdown(store: dict, order: tuple[str, ...], command: str) -> str:
    """The whole report."""
    sections = [store["sections"][name] for name in order if name in store["sections"]]
    lines = [
        "# mumoe_tn benchmarks",
        "",
        f"Regenerate with `{command}` (each section names the command that measured it).",
        "",
    ]
    lines += [
        "Every ratio divides two medians measured in the same run, alternating the cases (A B C … A B C …) "
        "so that a slow phase hits all alike. Inputs require grad (as inside a network). fwd+bwd runs in "
        "train mode; fwd is inference (eval mode, no grad). Peak memory is that of one fwd+bwd in a fresh "
        "process (CPU: a child forked from a process that imported everything and computed nothing). "
        "*peak*: the most bytes of tensors alive at once, parameter gradients included (CUDA: "
        "`torch.cuda.max_memory_allocated`; CPU: every storage an op creates, counted until it is freed, "
        "`benchmarks.measure.LiveTensorPeak`). *RSS peak* (CPU only): the resident-set high-water mark "
        "`VmHWM` above the child's size before the call; it adds what glibc's allocator keeps after frees "
        "(mid-sized temporaries are served from the heap once its dynamic mmap threshold has risen, and "
        "the heap is not returned at once), which penalises layers with many mid-sized intermediates: "
        "with `MALLOC_MMAP_THRESHOLD_=131072` the CP layer's RSS ratio falls from 1.49× to 1.28×. The "
        "memory target is on *peak*, the allocator-independent figure (the one CUDA reports). "
        + (GPU_NOTE if any(s["machine"]["device"].startswith("cuda") for s in sections) else CPU_NOTE),
        "",
    ]
    summary = [t for section in sections for t in section["targets"]]
    if summary:
        lines += ["## Targets", "", PAIRED_NOTE, "", *targets_header()]
        lines += [target_line(target) for target in summary]
        lines.append("")
    for section in sections:
        lines += section_markdown(section)
    return "\n".join(lines)


def _measured(sections: list[dict]) -> str:
    info = sections[0]["machine"]
    return (
        f"Measured {info['date']} on {info['device']} ({info['processor']}, threads {info['threads']}, "
        f"load average {info.get('load average', '?')}) with `{sections[0].get('command', '')}`; the machine "
        "is shared with other jobs."
    )


def plot(store: dict, path: Path) -> Path | None:
    """Bars of fwd+bwd time, fwd time and peak memory as ratios to the dense MLP, per table."""
    panels = [store["sections"][name] for name in ("params", "experts") if name in store["sections"]]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [max(2.0, 0.32 * len(section["rows"]) + 1.2) for section in panels]
    figure, axes = plt.subplots(len(panels), 1, figsize=(8.5, sum(heights)), height_ratios=heights, squeeze=False)
    for ax, section in zip(axes[:, 0], panels, strict=True):
        measured = [row for row in section["rows"] if row.get("train_s") is not None]
        reference_params = next(row["params"] for row in section["rows"] if row["label"] == row["reference"])
        labels = [f"{row['label']}  ({_short(row['params'])} params)" for row in measured]
        y = range(len(measured))
        for offset, (metric, name, _) in zip((-0.3, -0.1, 0.1), METRICS[:3], strict=True):
            values = [row.get("ratios", {}).get(metric) or 0.0 for row in measured]
            ax.barh([k + offset for k in y], values, height=0.2, label=name.split(" (")[0])
        params = [row["params"] / reference_params if row.get("params") else 0.0 for row in measured]
        ax.barh([k + 0.3 for k in y], params, height=0.2, label="parameters")
        ax.axvline(1.0, color="grey", linewidth=1)
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ratio to the dense MLP (log scale; < 1 is faster / smaller)")
        ax.set_title(section["title"], fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def latency_series(section: dict) -> dict[str, list[tuple[int, float, float | None]]]:
    """The latency sweep's rows by model: ``(tokens, fwd seconds, ratio to its reference)``, by tokens.

    A row's model is its label before the last ``", "`` (the labels end in ``", N tokens"``).
    """
    series: dict[str, list[tuple[int, float, float | None]]] = {}
    for row in section["rows"]:
        if row.get("infer_s") is None or row.get("tokens") is None:
            continue
        name = row["label"].rsplit(", ", 1)[0]
        series.setdefault(name, []).append((row["tokens"], row["infer_s"], row.get("ratios", {}).get("infer_s")))
    return {name: sorted(points) for name, points in series.items()}


def plot_latency(store: dict, path: Path) -> Path | None:
    """Log-log latency against tokens per call, and each μMoE / MoE's ratio to its dense counterpart."""
    if "latency" not in store["sections"]:
        return None
    section = store["sections"]["latency"]
    series = latency_series(section)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    references = {row["reference"] for row in section["rows"]}
    for name, points in series.items():
        tokens = [point[0] for point in points]
        dense = any(row["label"] in references and row["label"].startswith(name) for row in section["rows"])
        style = "--" if dense else "-"
        left.plot(tokens, [point[1] * 1e3 for point in points], style, marker="o", markersize=3, label=name)
        if not dense:
            right.plot(tokens, [point[2] or float("nan") for point in points], marker="o", markersize=3, label=name)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("tokens per call")
    left.set_ylabel("forward time (ms, log scale)")
    left.set_title("Latency (eval, no grad)", fontsize=10)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.axhline(1.0, color="grey", linewidth=1)
    right.set_xlabel("tokens per call")
    right.set_ylabel("ratio to nn.Linear (layer) / dense MLP (blocks), log")
    right.set_title("Ratio to the dense counterpart", fontsize=10)
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return _save_figure(figure, section, path)


#: Sections shown in the inference block of the results page rather than the benchmarks block.
INFERENCE = ("inference", "latency", "generation")
#: Sections with a part of their own on the results page (written by hand from the report).
OWN_PART = ("scale", "host")


def update_inference_docs(store: dict, device: str, image: str, page: Path) -> bool:
    """Replace the marked inference block of the results page; False when its markers are missing.

    The block holds the targets and tables of the inference, latency and generation sections
    measured so far, and the latency plot.
    """
    start, end = f"<!-- inference-{device}:start -->", f"<!-- inference-{device}:end -->"
    text = page.read_text()
    if start not in text or end not in text:
        return False
    names = [name for name in INFERENCE if name in store["sections"]]
    body = [start, ""]
    for name in names:
        section = store["sections"][name]
        info = section["machine"]
        body.append(
            f"*Measured on {info['processor']} ({info['device']}, {info['threads']} threads, load average "
            f"{info.get('load average', '?')}; a machine shared with other jobs), {info['date']}, with "
            f"`{section.get('command', '')}`: {section['title'].split(':')[0].lower()}.*"
        )
        body.append("")
    targets = [t for name in names for t in store["sections"][name]["targets"]]
    if targets:
        body += [PAIRED_NOTE, "", *targets_header("target")]
        body += [target_line(target) for target in targets]
        body.append("")
    if "latency" in store["sections"]:
        body += [f"![inference latency against tokens per call]({image})", ""]
    for name in names:
        body += section_markdown(store["sections"][name], level="###")
    body.append(end)
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    page.write_text(before + "\n".join(body) + after)
    return True


def _short(count: int | None) -> str:
    if count is None:
        return "?"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


def update_docs(store: dict, order: tuple[str, ...], device: str, image: str, command: str, page: Path) -> bool:
    """Replace the marked benchmark block of the results page; False when its markers are missing."""
    start, end = f"<!-- benchmarks-{device}:start -->", f"<!-- benchmarks-{device}:end -->"
    text = page.read_text()
    if start not in text or end not in text:
        return False
    # The inference sections have their own block (update_inference_docs).
    sections = [
        store["sections"][name] for name in order if name in store["sections"] and name not in INFERENCE + OWN_PART
    ]
    body = [start, "", f"`{command}` regenerates this block, `benchmarks/results-{device}.md` and the plot.", ""]
    body += ["*" + _measured(sections) + "*", ""] if sections else []
    summary = [t for section in sections for t in section["targets"]]
    if summary:
        body += [PAIRED_NOTE, "", *targets_header("target")]
        body += [target_line(target) for target in summary]
        body.append("")
    for name in ("params", "experts"):
        if name in store["sections"]:
            body += section_markdown(store["sections"][name], level="###")
    body += [f"![benchmark ratios to the dense MLP]({image})", "", end]
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    page.write_text(before + "\n".join(body) + after)
    return True


def _save_figure(figure: Any, section: dict, path: Path) -> Path:
    """Title ``figure`` with the section's machine and date, write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    info = section["machine"]
    figure.suptitle(f"{info['processor']}, {info['threads']} threads, {info['date']}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
