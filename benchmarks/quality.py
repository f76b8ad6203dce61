"""Quality at equal parameters: the examples' models with MLP and μMoE blocks, over seeds.

Run from the repository root::

    python -m benchmarks.quality                       # char-GPT (2,400 steps) and mixer (40 epochs), 3 seeds
    python -m benchmarks.quality --quick               # CI-sized: the examples' --quick sizes (temporary folder)
    python -m benchmarks.quality --only char_gpt --steps 600          # another training length
    python -m benchmarks.quality --only char_gpt --variants "CP μMoE (32×32×32×32 experts)" --factor "--gate-lr 0.5"
                                                       # one factor for some variants, against the defaults
    python -m benchmarks.quality --report-only         # tables, plot and docs block from the stored runs

``examples/char_gpt.py`` (and ``examples/mixer_digits.py``) train every variant of the example's
``VARIANTS`` (a format added there is benchmarked here) once per seed, each in a process of its
own with one thread, ``--parallel`` processes at a time. The μMoE blocks are parameter-matched
to the MLP blocks by the library's matcher (``match="mlp"``: the MLP block's parameter count,
the gate included). Every run writes its JSON file under ``benchmarks/data/quality/`` as soon as it
has trained, and runs already in their study's folder (example, training length, factor) are not
repeated, so an interrupted benchmark resumes.

The report gives, per variant, the validation loss (test accuracy for the mixer) as mean ±
standard deviation over the seeds, the gap to the MLP with a 95 % t-interval **paired by seed**
(the runs of one seed share training batches, evaluation batches and the initialisation of
everything but the MLP blocks, so the per-seed difference removes what a seed does to both runs
alike), and training steps per second (median step, one thread, ``--parallel`` processes sharing
the machine). ``quality-cpu.png`` plots the learning curves (mean ± std band per variant) and the
paired gap along training.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.quality_jobs import EXAMPLES, Job, run_jobs, slug
from benchmarks.quality_stats import Interval, mean_std, paired_differences, t_interval

HERE = Path(__file__).resolve().parent
COMMAND = "python -m benchmarks.quality"
DOCS_PAGE = HERE.parent / "docs" / "results.md"
#: The stored runs, one folder per study.
RUNS = HERE / "data" / "quality"
REFERENCE = "MLP"

#: The paper's GPT-2 (OpenWebText) gaps to the MLP, in % of its validation loss.
PAPER_GAPS = {"cp": 0.6, "tr": 0.35}


def paper_gap(variant: str) -> float | None:
    """The paper's gap for a variant's format (named first in the variant, e.g. ``CP μMoE (…)``), if it has one."""
    return PAPER_GAPS.get(variant.split()[0].lower())


def verdict(gap: Interval, paper: float) -> str:
    """Where a measured gap stands against the paper's."""
    if gap.mean <= paper:
        return "within the paper's gap"
    if math.isnan(gap.low):
        return "above the paper's gap (one seed)"
    if gap.low <= paper:
        return "mean above the paper's gap; the interval reaches it"
    return "above the paper's gap"


#: Per example: the metric, whether higher is better, the training-length option and its full default.
EXAMPLE_SETTINGS = {
    "char_gpt": {"metric": "val_loss", "name": "validation loss", "higher": False, "length": "steps", "full": 2400},
    "mixer_digits": {"metric": "accuracy", "name": "test accuracy", "higher": True, "length": "epochs", "full": 40},
}

#: Milliseconds per char-GPT training step at one thread (measured), to start the longest runs first.
STEP_MS = {
    "MLP": 35, "CP μMoE (64 experts)": 48, "TR μMoE (64 experts)": 51, "TT μMoE (64 experts)": 54,
    "Tucker μMoE (64 experts)": 86, "CP μMoE (32×32×32×32 experts)": 68,
}  # fmt: skip


@functools.cache
def example_module(example: str) -> Any:
    """The example's module, imported from ``examples/``."""
    spec = importlib.util.spec_from_file_location(f"_quality_{example}", EXAMPLES / f"{example}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_variants(example: str) -> tuple[str, ...]:
    """The variant names of an example's ``VARIANTS`` (the MLP first)."""
    return tuple(example_module(example).VARIANTS)


def budget_markdown(width: int = 64) -> list[str]:
    """Where each char-GPT block's parameters go: gate, expert-mode cores, the other cores; the bond sizes."""
    from mumoe_tn.layers.base import MuMoEBase
    from mumoe_tn.layers.experts import FactorizedExperts
    from mumoe_tn.network import is_expert_leg

    module = example_module("char_gpt")
    lines = [
        "| block | params | gate | expert-mode cores | other cores | bond sizes (first layer) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, make in module.VARIANTS.items():
        block = make(width)
        total = sum(p.numel() for p in block.parameters())
        if not isinstance(block, MuMoEBase):
            lines.append(f"| {name} | {total:,} | — | — | — | hidden {4 * width} |")
            continue
        gate = sum(p.numel() for p in block.gate.parameters())
        expert = other = 0
        layers = [m for m in block.modules() if isinstance(m, FactorizedExperts)]
        for layer in layers:
            for core_name, core in layer.cores.items():
                if any(is_expert_leg(label) for label in layer.network.cores[core_name]):
                    expert += core.numel()
                else:
                    other += core.numel()
        network = layers[0].network
        bonds = ", ".join(f"{bond}={network.sizes[bond]}" for bond in network.bonds)
        cells = [f"{total:,}", f"{gate:,} ({100 * gate / total:.0f} %)", f"{expert:,}", f"{other:,}", bonds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def study_name(example: str, length: int | None, factor: str) -> str:
    """The folder of one study: example, training length (``quick``) and factor."""
    name = f"{example}-{'quick' if length is None else length}"
    return name + (f"-{slug(factor)}" if factor else "")


def plan(
    example: str, variants: list[str], seeds: list[int], length: int | None, factor: str, out: Path, eval_every: int
) -> list[Job]:
    """The jobs of one study; each variant and seed is a process of its own (all seeds in one when quick)."""
    settings = EXAMPLE_SETTINGS[example]
    folder = out / study_name(example, length, factor)
    arguments = ["--quick"] if length is None else [f"--{settings['length']}", str(length)]
    if example == "char_gpt" and eval_every:
        arguments += ["--eval-every", str(eval_every)]
    arguments += shlex.split(factor)
    folder.mkdir(parents=True, exist_ok=True)
    study = {"example": example, "length": length, "factor": factor, "arguments": arguments}
    (folder / "study.json").write_text(json.dumps(study, indent=1))
    mean_ms = sum(STEP_MS.values()) / len(STEP_MS)
    groups = [tuple(seeds)] if length is None else [(seed,) for seed in seeds]
    return [
        Job(
            example,
            variant,
            group,
            tuple(arguments),
            folder / f"{slug(variant)}-seed{'-'.join(map(str, group))}.json",
            cost=STEP_MS.get(variant, mean_ms),
        )
        for group in groups
        for variant in variants
    ]


def load(out: Path) -> list[dict]:
    """Every study under ``out``: its settings and runs, grouped as ``{variant: {seed: run}}``."""
    studies = []
    for path in sorted(out.glob("*/study.json")):
        study = json.loads(path.read_text())
        runs: dict[str, dict[int, dict]] = defaultdict(dict)
        for run_file in sorted(path.parent.glob("*-seed*.json")):
            for run in json.loads(run_file.read_text())["runs"]:
                runs[run["model"]][run["seed"]] = run
        order = {name: k for k, name in enumerate(example_variants(study["example"]))}
        ordered = dict(sorted(runs.items(), key=lambda item: order.get(item[0], len(order))))
        if ordered:  # a study planned but not yet run has nothing to report
            studies.append({**study, "name": path.parent.name, "runs": ordered})
    return studies


def baseline_of(study: dict, studies: list[dict]) -> dict | None:
    """The study of the same example and length without a factor (whose MLP and defaults a factor is compared to)."""
    for other in studies:
        if other["example"] == study["example"] and other["length"] == study["length"] and not other["factor"]:
            return other
    return None


def summarise(study: dict, baseline: dict | None = None) -> list[dict]:
    """Per variant: the metric's mean ± std, the paired gap to the MLP and to the default (for a factor)."""
    settings = EXAMPLE_SETTINGS[study["example"]]
    metric, relative = settings["metric"], not settings["higher"]
    reference = (baseline or study)["runs"].get(REFERENCE, {}) or study["runs"].get(REFERENCE, {})
    rows = []
    for variant, runs in study["runs"].items():
        values = {seed: run[metric] for seed, run in runs.items()}
        mean, std = mean_std(list(values.values()))
        row = {"variant": variant, "seeds": sorted(values), "mean": mean, "std": std}
        any_run = next(iter(runs.values()))
        row["params"] = any_run["params"]
        row["block_params"] = any_run.get("mlp_params")
        row["steps_per_s"] = mean_std([run["steps_per_s"] for run in runs.values()])[0]
        if variant != REFERENCE and reference:
            row["gap"] = t_interval(paired_differences(values, {s: r[metric] for s, r in reference.items()}, relative))
        if baseline is not None and variant in baseline["runs"]:
            default = {seed: run[metric] for seed, run in baseline["runs"][variant].items()}
            row["change"] = t_interval(paired_differences(values, default, relative))
        rows.append(row)
    return rows


def curve_gaps(study: dict) -> dict[str, tuple[list[int], list[Interval]]]:
    """Per μMoE variant, the paired % gap of the validation loss to the MLP at every evaluated step."""
    reference = study["runs"].get(REFERENCE, {})
    gaps = {}
    for variant, runs in study["runs"].items():
        if variant == REFERENCE or not reference:
            continue
        seeds = sorted(set(runs) & set(reference))
        if not seeds or not runs[seeds[0]].get("curve"):
            continue
        steps = [step for step, _ in runs[seeds[0]]["curve"]]
        intervals = []
        for k in range(len(steps)):
            values = {s: runs[s]["curve"][k][1] for s in seeds}
            intervals.append(t_interval(paired_differences(values, {s: reference[s]["curve"][k][1] for s in seeds})))
        gaps[variant] = (steps, intervals)
    return gaps


def fmt_interval(interval: Interval | None, unit: str = " %") -> str:
    """``+0.42 % [−0.10, +0.94]``; the bounds are omitted for one seed."""
    if interval is None:
        return "—"
    if math.isnan(interval.low):
        return f"{interval.mean:+.2f}{unit} (one seed)"
    return f"{interval.mean:+.2f}{unit} [{interval.low:+.2f}, {interval.high:+.2f}]"


def _length(study: dict) -> str:
    unit = EXAMPLE_SETTINGS[study["example"]]["length"]
    return "quick" if study["length"] is None else f"{study['length']:,} {unit}"


def study_markdown(study: dict, baseline: dict | None) -> list[str]:
    """The table of one study."""
    settings = EXAMPLE_SETTINGS[study["example"]]
    rows = summarise(study, baseline)
    seeds = sorted({seed for row in rows for seed in row["seeds"]})
    gap_unit = "% of the MLP's loss" if not settings["higher"] else "accuracy points"
    title = f"`{study['example']}`, {_length(study)}" + (f", `{study['factor']}`" if study["factor"] else "")
    lines = [f"**{title}** — seeds {', '.join(map(str, seeds))}", ""]
    blocks = any(row["block_params"] is not None for row in rows)
    header = ["model", "params", *(["MLP-block params"] if blocks else [])]
    header += [f"{settings['name']} (mean ± std)", f"gap to MLP ({gap_unit}, 95 % CI)"]
    if study["factor"]:
        header.append("change vs defaults (paired, 95 % CI)")
    header.append("steps/s")
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for row in rows:
        block = ["—" if row["block_params"] is None else f"{row['block_params']:,}"] if blocks else []
        unit = " %" if not settings["higher"] else " pt"
        scale = 1.0 if not settings["higher"] else 100.0
        spread = "(one seed)" if len(row["seeds"]) < 2 else f"± {row['std']:.4f}"
        cells = [row["variant"], f"{row['params']:,}", *block, f"{row['mean']:.4f} {spread}"]
        cells.append(fmt_interval(_scaled(row.get("gap"), scale), unit) if row["variant"] != REFERENCE else "—")
        if study["factor"]:
            cells.append(fmt_interval(_scaled(row.get("change"), scale), unit))
        cells.append(f"{row['steps_per_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _scaled(interval: Interval | None, scale: float) -> Interval | None:
    if interval is None or scale == 1.0:
        return interval
    return Interval(interval.mean * scale, interval.low * scale, interval.high * scale, interval.n)


def paper_markdown(study: dict) -> list[str]:
    """The gaps of the formats the paper measured (and of the same formats' other shapes) against its gaps."""
    rows = [row for row in summarise(study) if row.get("gap") is not None and paper_gap(row["variant"]) is not None]
    if not rows:
        return []
    lines = [f"**Against the paper's GPT-2 gaps** ({_length(study)})", ""]
    lines += ["| model | gap to MLP (95 % CI) | paper | verdict |", "|---|---:|---:|---|"]
    for row in rows:
        paper = paper_gap(row["variant"])
        cells = [fmt_interval(row["gap"]), f"+{paper} %", verdict(row["gap"], paper)]
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def curve_markdown(study: dict, columns: int = 6) -> list[str]:
    """The paired gap to the MLP at evenly spaced evaluations along the run (its learning curves)."""
    gaps = curve_gaps(study)
    if not gaps:
        return []
    steps = next(iter(gaps.values()))[0]
    stride = max(1, len(steps) // columns)
    chosen = steps[::-stride][:columns][::-1]  # evenly spaced, ending at the last step
    lines = [f"**The gap to the MLP along the run of {_length(study)}** (paired, mean over seeds)", ""]
    lines += ["| model | " + " | ".join(f"step {step:,}" for step in chosen) + " |"]
    lines.append("|---|" + "---:|" * len(chosen))
    for variant, (at, intervals) in gaps.items():
        by_step = dict(zip(at, intervals, strict=True))
        lines.append(f"| {variant} | " + " | ".join(f"{by_step[step].mean:+.2f} %" for step in chosen) + " |")
    return [*lines, ""]


def settled_ranking(study: dict) -> tuple[int, list[str]] | None:
    """The first evaluated step from which the variants' order by mean validation loss stays as at the end.

    Returns the step and the final order (best first), or None without learning curves. Ties keep
    the variants' order, so they do not count as a change.
    """
    curves = {
        variant: [run["curve"] for run in runs.values() if run.get("curve")] for variant, runs in study["runs"].items()
    }
    if len(curves) < 2 or not all(curves.values()):
        return None
    steps = [step for step, _ in next(iter(curves.values()))[0]]

    def order(k: int) -> list[str]:
        means = {v: sum(c[k][1] for c in cs) / len(cs) for v, cs in curves.items()}
        return sorted(means, key=means.__getitem__)

    final = order(len(steps) - 1)
    first = len(steps) - 1
    while first > 0 and order(first - 1) == final:
        first -= 1
    return steps[first], final


def settled_markdown(study: dict) -> list[str]:
    """One sentence: from which step of the run the ranking no longer moves."""
    settled = settled_ranking(study)
    if settled is None:
        return []
    step, final = settled
    last = next(run["curve"][-1][0] for runs in study["runs"].values() for run in runs.values())
    return [
        f"Ranked by mean validation loss, the variants keep their final order ({' < '.join(final)}) at every "
        f"evaluation from step {step:,} of {last:,} on.",
        "",
    ]


def factor_markdown(studies: list[dict], example: str) -> list[str]:
    """Every factor study of ``example``, one row per factor: the paired change against the defaults per variant."""
    settings = EXAMPLE_SETTINGS[example]
    lines = []
    lengths = sorted({s["length"] for s in studies if s["example"] == example and s["factor"] and s["length"]})
    for length in reversed(lengths):
        chosen = [s for s in studies if s["example"] == example and s["factor"] and s["length"] == length]
        baseline = baseline_of(chosen[0], studies)
        if baseline is None:
            continue
        known = {name: k for k, name in enumerate(example_variants(example))}
        variants = sorted(dict.fromkeys(v for s in chosen for v in s["runs"]), key=lambda v: known.get(v, len(known)))
        unit, scale = (" %", 1.0) if not settings["higher"] else (" pt", 100.0)
        better = "negative" if not settings["higher"] else "positive"
        title = f"**`{example}`, {_length(chosen[0])}: one factor at a time**"
        lines += [f"{title} (change against the defaults, paired by seed, 95 % CI; "
                  f"{better} is better)", ""]  # fmt: skip
        lines += ["| factor | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
        for study in sorted(chosen, key=lambda s: s["factor"]):
            changes = {row["variant"]: row.get("change") for row in summarise(study, baseline)}
            cells = []
            for variant in variants:
                change = _scaled(changes.get(variant), scale)
                seeds = "" if change is None or change.n < 2 else f" ({change.n} seeds)"
                cells.append("—" if change is None else fmt_interval(change, unit) + seeds)
            lines.append(f"| `{study['factor']}` | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def length_markdown(studies: list[dict], example: str) -> list[str]:
    """The paired gap to the MLP of every variant at every stored training length (separate runs)."""
    chosen = sorted(
        (s for s in studies if s["example"] == example and not s["factor"] and s["length"] is not None),
        key=lambda s: s["length"],
    )
    if len(chosen) < 2:
        return []
    unit = EXAMPLE_SETTINGS[example]["length"]
    variants = list(dict.fromkeys(v for s in chosen for v in s["runs"] if v != REFERENCE))
    gaps = {s["length"]: {row["variant"]: row.get("gap") for row in summarise(s)} for s in chosen}
    lines = ["| model | " + " | ".join(f"{s['length']:,} {unit}" for s in chosen) + " |"]
    lines.append("|---|" + "---:|" * len(chosen))
    for variant in variants:
        cells = [fmt_interval(gaps[s["length"]].get(variant)) for s in chosen]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def own_longest(studies: list[dict]) -> dict | None:
    """The longest study without a factor."""
    return max((s for s in studies if not s["factor"]), key=lambda s: s["length"] or 0, default=None)


def markdown(studies: list[dict], machine: str, factor_tables: bool = True) -> str:
    """The whole report; without ``factor_tables``, factor studies appear only in the one-factor summary."""
    lines = [
        "# Quality at equal parameters", "",
        f"`{COMMAND}` regenerates this file and `quality-cpu.png` from the runs under `benchmarks/data/quality/`.", "",
        f"Measured on {machine}, with `{COMMAND}`. Gaps are paired by seed (the mean of the per-seed "
        "differences with its Student-t 95 % interval); steps/s is the median training step of one thread, "
        "two runs sharing the machine. The paper's GPT-2 gaps: CP +0.6 %, TR +0.35 %.", "",
    ]  # fmt: skip
    if any(s["example"] == "char_gpt" for s in studies):
        lines += ['**Where the char-GPT blocks\' parameters go** (`match="mlp"`, width 64; per block)', ""]
        lines += budget_markdown()
    for example in EXAMPLE_SETTINGS:
        own = [s for s in studies if s["example"] == example]
        for study in sorted(own, key=lambda s: (bool(s["factor"]), -(s["length"] or 0), s["factor"])):
            if study["factor"] and not factor_tables:
                continue
            lines += study_markdown(study, baseline_of(study, studies) if study["factor"] else None)
            if example == "char_gpt" and not study["factor"] and study is own_longest(own):
                lines += paper_markdown(study)
                lines += curve_markdown(study)
                lines += settled_markdown(study)
        table = length_markdown(studies, example)
        if table:
            lines += [f"**`{example}`: the gap to the MLP against training length** (separate runs)", "", *table]
        lines += factor_markdown(studies, example)
    return "\n".join(lines)


def plot(study: dict, path: Path, title: str) -> Path | None:
    """Learning curves (mean ± std band per variant) and the paired gap to the MLP along training."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = study["runs"]
    if not any(run.get("curve") for variant in runs.values() for run in variant.values()):
        return None
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colours = {}
    for variant, by_seed in runs.items():
        curves = [run["curve"] for run in by_seed.values() if run.get("curve")]
        steps = [step for step, _ in curves[0]]
        points = [[curve[k][1] for curve in curves] for k in range(len(steps))]
        means = [mean_std(p)[0] for p in points]
        spreads = [0.0 if len(p) < 2 else mean_std(p)[1] for p in points]
        (line,) = left.plot(steps, means, label=f"{variant} ({len(curves)} seeds)")
        colours[variant] = line.get_color()
        lower = [m - d for m, d in zip(means, spreads, strict=True)]
        upper = [m + d for m, d in zip(means, spreads, strict=True)]
        left.fill_between(steps, lower, upper, color=line.get_color(), alpha=0.2)
    final = [mean_std([r["val_loss"] for r in by_seed.values()])[0] for by_seed in runs.values()]
    left.set_ylim(min(final) - 0.05, min(final) + 0.8)
    left.set(xlabel="training step", ylabel="validation loss", title="learning curves (mean ± std over seeds)")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    lowest, highest = 0.0, 1.0
    for variant, (steps, intervals) in curve_gaps(study).items():
        means = [i.mean for i in intervals]
        # the band is ± the standard deviation of the per-seed gaps (the t-interval is in the tables)
        spread = [_std_of(i) for i in intervals]
        tail = means[len(means) // 4 :]
        lowest, highest = min(lowest, *tail), max(highest, *tail)
        right.plot(steps, means, color=colours.get(variant), label=variant)
        lower = [m - d for m, d in zip(means, spread, strict=True)]
        upper = [m + d for m, d in zip(means, spread, strict=True)]
        right.fill_between(steps, lower, upper, color=colours.get(variant), alpha=0.15)
    for name, gap in PAPER_GAPS.items():
        right.axhline(gap, color="grey", linestyle=":", linewidth=1)
        right.annotate(f"paper {name.upper()} +{gap} %", (right.get_xlim()[1], gap), fontsize=7, ha="right",
                       va="bottom", color="grey")  # fmt: skip
    right.axhline(0, color="black", linewidth=0.8)
    right.set(xlabel="training step", ylabel="gap to the MLP (% of its validation loss)",
              title="paired gap to the MLP (mean ± std of the per-seed gaps)")  # fmt: skip
    right.set_ylim(lowest - 1.0, highest + 1.5)
    right.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _std_of(interval: Interval) -> float:
    """The standard deviation behind a t-interval (0 for one value)."""
    if interval.n < 2 or math.isnan(interval.half_width):
        return 0.0
    from scipy import stats

    return interval.half_width * math.sqrt(interval.n) / float(stats.t.ppf(0.975, interval.n - 1))


def update_docs(text: str, page: Path, image: str) -> bool:
    """Replace the marked quality block of the results page; False when its markers are missing."""
    start, end = "<!-- quality-cpu:start -->", "<!-- quality-cpu:end -->"
    page_text = page.read_text()
    if start not in page_text or end not in page_text:
        return False
    body = text.split("\n", 4)[4]  # without the report's own heading and first line
    body = f"`{COMMAND}` regenerates this block, `benchmarks/quality-cpu.md` and the plot.\n\n" + body
    before, rest = page_text.split(start, 1)
    page.write_text(before + start + "\n\n" + body + f"\n![learning curves and gap to the MLP]({image})\n\n" + end
                    + rest.split(end, 1)[1])  # fmt: skip
    return True


def machine() -> str:
    """The machine and date of a report: ``PROCESSOR (N cores), YYYY-MM-DD``."""
    import torch

    processor = report.machine(torch.device("cpu"))["processor"] or platform.machine()
    return f"{processor} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d', time.gmtime())}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the examples' --quick sizes: checks that it runs")
    parser.add_argument("--only", nargs="+", choices=list(EXAMPLE_SETTINGS), default=list(EXAMPLE_SETTINGS))
    parser.add_argument("--variants", nargs="+", default=None, help="the example's variants to run (default all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], metavar="SEED")
    parser.add_argument("--steps", type=int, default=EXAMPLE_SETTINGS["char_gpt"]["full"], help="char-GPT steps")
    parser.add_argument("--epochs", type=int, default=EXAMPLE_SETTINGS["mixer_digits"]["full"], help="mixer epochs")
    parser.add_argument("--eval-every", type=int, default=None, help="char-GPT curve points (default steps / 12)")
    parser.add_argument("--factor", default="", help="extra options of the example for every run (one factor)")
    parser.add_argument("--parallel", type=int, default=2, help="processes at a time, one thread each (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="folder of the runs (default benchmarks/data/quality)")
    parser.add_argument("--report-only", action="store_true", help="rewrite report, plot and docs from the runs")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the block in docs/results.md")
    args = parser.parse_args(argv)
    if args.parallel < 1 or args.steps < 1 or args.epochs < 1:
        parser.error("--parallel, --steps and --epochs must be at least 1")
    if any(seed < 0 for seed in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the studies not yet stored, then write the report, the plot and the docs block."""
    args = parse(argv)
    failed: list[Job] = []
    out = args.out or (Path(tempfile.mkdtemp(prefix="mumoe-quality-")) if args.quick else RUNS)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        jobs = []
        for example in args.only:
            known = list(example_variants(example))
            variants = known if args.variants is None else [v for v in args.variants if v in known]
            unknown = [] if args.variants is None else [v for v in args.variants if v not in known]
            if unknown and len(args.only) == 1:
                print(f"unknown variants of {example}: {unknown}; choose from {known}", file=sys.stderr)
                return 2
            if args.factor and REFERENCE in variants:
                variants.remove(REFERENCE)  # a factor changes the μMoE blocks; the MLP is the baseline's
            length = None if args.quick else (args.steps if example == "char_gpt" else args.epochs)
            every = args.eval_every if args.eval_every is not None else max(1, (length or 40) // 12)
            jobs += plan(example, variants, args.seeds, length, args.factor, out, every)
        todo = [job for job in jobs if not job.done()]
        print(f"{len(jobs)} runs, {len(jobs) - len(todo)} already stored under {out}; "
              f"{args.parallel} at a time, one thread each", flush=True)  # fmt: skip

        def done(job: Job, code: int, seconds: float) -> None:
            status = "ok" if code == 0 and job.done() else f"FAILED (exit {code}, see {out / 'runs.log'})"
            print(f"  {job.example}: {job.variant}, seeds {list(job.seeds)}: {seconds:.0f} s {status}", flush=True)

        failed = run_jobs(todo, args.parallel, done, out / "runs.log")
        if failed:
            print(f"{len(failed)} runs failed", file=sys.stderr)
    studies = load(out)
    text = markdown(studies, machine())
    target = out if (args.quick or args.out) else HERE
    (target / "quality-cpu.md").write_text(text)
    print("\n" + text)
    baselines = [s for s in studies if s["example"] == "char_gpt" and not s["factor"]]
    main_study = max(baselines, key=lambda s: s["length"] or 0, default=None)  # the longest training
    image = None
    if main_study is not None:
        title = f"char-GPT on pydoc_data, {_length(main_study)}, parameter-matched MLP blocks ({machine()})"
        image = plot(main_study, target / "quality-cpu.png", title)
    if image is not None and not (args.quick or args.out or args.no_docs):
        docs_image = DOCS_PAGE.parent / "img" / "quality-cpu.png"
        docs_image.write_bytes(image.read_bytes())
        if update_docs(markdown(studies, machine(), factor_tables=False), DOCS_PAGE, "img/quality-cpu.png"):
            print(f"updated the quality block of {DOCS_PAGE}")
    print(f"\nwrote {target / 'quality-cpu.md'}" + (f", {image}" if image else ""))
    return 1 if not args.report_only and failed else 0


if __name__ == "__main__":
    sys.exit(main())
