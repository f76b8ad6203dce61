"""Each distillation method under each candidate training recipe: which recipe serves it best.

Run from the repository root::

    python -m benchmarks.recipe_sweep --candidate plain --out DIR   # one candidate's frontier, DIR/plain.json
    python -m benchmarks.recipe_sweep --report DIR                  # benchmarks/recipe-sweep-cpu.{json,md}

Every candidate is one [`run_frontier`][mumoe_tn.distillation.study.run_frontier] of the default
small model (one seed, L0 8 and 32, 200,000 tokens) on the methods it applies to; the report
gives each method's mean CE-loss score (over the blocks and the L0s) per candidate and picks per
method the best (a tie within 0.0005: the shared ``mxd-paper`` recipe).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mumoe_tn.distillation.frontier import FrontierTable
from mumoe_tn.distillation.study import DEFAULT_METHODS, FrontierConfig, run_frontier

TRANSCODERS = ("transcoder", "skip-transcoder")
MUMOE = tuple(method for method in DEFAULT_METHODS if method not in TRANSCODERS)
FLAT_SOFTMAX = ("cp", "tr")
HIERARCHICAL_SOFTMAX = ("cp-hier", "tr-hier")

#: The shared recipe: the one a tie goes to.
SHARED = "mxd-paper"

#: Scores closer than this count as a tie.
TIE = 5e-4

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Candidate:
    """One training choice: a recipe (and rate), the auxiliary-k and balance terms, for some methods."""

    name: str
    methods: tuple[str, ...]
    recipe: str
    settings: dict = field(default_factory=dict)

    def config(self) -> FrontierConfig:
        return FrontierConfig(methods=self.methods, l0s=(8, 32), recipe=self.recipe, seed=0, **self.settings)


CANDIDATES = (
    Candidate("mxd-paper", DEFAULT_METHODS, "mxd-paper"),
    Candidate("plain", DEFAULT_METHODS, "plain"),
    Candidate("adam-warmup", DEFAULT_METHODS, "adam-warmup"),
    Candidate("low-lr", DEFAULT_METHODS, "low-lr"),
    Candidate("topk-paper", TRANSCODERS, "topk-paper"),
    Candidate("topk-transcoder", TRANSCODERS, "topk-transcoder"),
    Candidate("mxd-paper, aux-k on", MUMOE, "mxd-paper", {"aux_k": True}),
    Candidate("mxd-paper, balance off", FLAT_SOFTMAX, "mxd-paper", {"balance": 0.0}),
    Candidate("mxd-paper, balance on", HIERARCHICAL_SOFTMAX, "mxd-paper", {"balance": 4e-5}),
    Candidate("plain, balance off", FLAT_SOFTMAX, "plain", {"balance": 0.0}),
    Candidate("adam-warmup, balance off", FLAT_SOFTMAX, "adam-warmup", {"balance": 0.0}),
    Candidate("plain, balance 1e-5", FLAT_SOFTMAX, "plain", {"balance": 1e-5}),
    Candidate("plain, balance 2e-5", FLAT_SOFTMAX, "plain", {"balance": 2e-5}),
)


def _file_name(name: str) -> str:
    return name.replace(", ", "+").replace(" ", "-") + ".json"


def run_candidate(candidate: Candidate, out: Path) -> Path:
    """Run one candidate's frontier and write its table to ``out``."""
    torch.set_num_threads(1)
    load = os.getloadavg()
    start = time.perf_counter()
    table = run_frontier(candidate.config(), progress=False)
    data = json.loads(table.to_json())
    data["config"] = {
        **data["config"],
        "candidate": candidate.name,
        "load_average": [round(v, 2) for v in load],
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "wall_seconds": round(time.perf_counter() - start, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread",
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / _file_name(candidate.name)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def summarise(tables: dict[str, FrontierTable]) -> dict[str, dict[str, dict[str, float]]]:
    """``method -> candidate ->`` its mean CE-loss score (over blocks and L0s), nMSE and dead units per L0."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name, table in tables.items():
        families = dict.fromkeys(row.family for row in table.rows)
        for family in families:
            rows = [row for row in table.rows if row.family == family]
            scores = [row.score for row in rows if row.meaningful]
            cell = {"score": statistics.fmean(scores) if scores else math.nan,
                    "nmse": statistics.fmean(row.nmse for row in rows)}  # fmt: skip
            for row in rows:
                l0 = row.method.split("@")[1]
                cell[f"score@{l0}"] = statistics.fmean(
                    r.score for r in rows if r.method == row.method and r.meaningful
                ) if any(r.meaningful for r in rows if r.method == row.method) else math.nan  # fmt: skip
                cell[f"nmse@{l0}"] = statistics.fmean(r.nmse for r in rows if r.method == row.method)
                cell[f"dead@{l0}"] = statistics.fmean(r.dead for r in rows if r.method == row.method)
            summary.setdefault(family, {})[name] = cell
    return summary


def choose(summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, str]:
    """Per method the candidate of the best mean score, a change having to beat what it changes by ``TIE``.

    A candidate that changes a recipe's defaults (``"plain, balance off"``) within ``TIE`` of the
    recipe's own score gives way to the recipe (``"plain"``), and any within ``TIE`` of the shared
    recipe's to the shared one.
    """
    recipes = {candidate.name: candidate.recipe for candidate in CANDIDATES}
    chosen = {}
    for method, cells in summary.items():
        best = max(cells, key=lambda name: cells[name]["score"])
        base = recipes.get(best, best)
        if base in cells and cells[best]["score"] - cells[base]["score"] < TIE:
            best = base
        if SHARED in cells and cells[best]["score"] - cells[SHARED]["score"] < TIE:
            best = SHARED
        chosen[method] = best
    return chosen


def _rows_only(table: FrontierTable) -> dict:
    """The table as JSON data without its per-sequence losses (the candidates' own files keep them)."""
    return {key: value for key, value in json.loads(table.to_json()).items() if key != "sequences"}


def write_report(directory: Path, out: Path = HERE) -> Path:
    """Read every candidate's table in ``directory``; write ``recipe-sweep-cpu.{json,md}`` to ``out``."""
    tables, configs = {}, {}
    for candidate in CANDIDATES:
        path = directory / _file_name(candidate.name)
        if path.is_file():
            data = json.loads(path.read_text())
            configs[candidate.name] = data["config"]
            tables[candidate.name] = FrontierTable.from_json(path.read_text())
    summary, chosen = summarise(tables), {}
    chosen = choose(summary)
    l0s = sorted({key.split("@")[1] for cells in summary.values() for cell in cells.values() for key in cell
                  if key.startswith("score@")}, key=int)  # fmt: skip
    names = list(tables)
    lines = [
        "# Recipe sweep (generated by `python -m benchmarks.recipe_sweep`)",
        "",
        "Each candidate is one `run_frontier` of the default small model (GPT-2 shape, 2 layers, width 64, byte "
        "tokens), seed 0, L0 " + ", ".join(l0s) + ", 200,000 tokens, on the methods it applies to. Cells: CE-loss "
        "score, mean over the two blocks and the L0s; **bold**: the recipe chosen (the best; a change of a "
        f"recipe's defaults within {TIE} of the recipe: the recipe; within {TIE} of the shared `{SHARED}`: the "
        "shared one).",
        "",
        "| method | " + " | ".join(f"`{name}`" for name in names) + " | chosen |",
        "|---|" + "---:|" * len(names) + "---|",
    ]
    for method, cells in summary.items():
        row = []
        for name in names:
            if name not in cells:
                row.append("")
                continue
            text = f"{cells[name]['score']:.4f}"
            row.append(f"**{text}**" if name == chosen[method] else text)
        lines.append(f"| {method} | " + " | ".join(row) + f" | `{chosen[method]}` |")
    lines += ["", "Per L0: CE-loss score / normalised MSE / dead units (mean over the blocks):", "",
              "| method | candidate | " + " | ".join(f"L0 = {l0}" for l0 in l0s) + " |",
              "|---|---|" + "---:|" * len(l0s)]  # fmt: skip
    for method, cells in summary.items():
        for name, cell in cells.items():
            parts = [f"{cell[f'score@{l0}']:.4f} / {cell[f'nmse@{l0}']:.4f} / {cell[f'dead@{l0}']:.1f}" for l0 in l0s]
            lines.append(f"| {method} | `{name}` | " + " | ".join(parts) + " |")
    lines += ["", "Runs (wall seconds on the shared machine, load average at the start and the end):", ""]
    lines += [f"- `{name}`: {c.get('wall_seconds')} s, {c.get('machine')}, load {c.get('load_average')} → "
              f"{c.get('load_average_end')}" for name, c in configs.items()]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe-sweep-cpu.md").write_text("\n".join(lines) + "\n")
    stored = {
        "chosen": chosen,
        "summary": summary,
        "runs": {name: _rows_only(t) for name, t in tables.items()},
    }
    (out / "recipe-sweep-cpu.json").write_text(json.dumps(stored, indent=1) + "\n")
    return out / "recipe-sweep-cpu.md"


def main(argv: list[str] | None = None) -> int:
    """Run one candidate, or write the report; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidate", choices=[c.name for c in CANDIDATES])
    parser.add_argument("--report", type=Path, metavar="DIR", help="write the report from the candidates' tables")
    parser.add_argument("--out", type=Path, default=Path("recipe-sweep"))
    args = parser.parse_args(argv)
    if args.report is not None:
        print(write_report(args.report))
        return 0
    if args.candidate is None:
        raise SystemExit("give --candidate NAME or --report DIR")
    candidate = next(c for c in CANDIDATES if c.name == args.candidate)
    print(run_candidate(candidate, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
