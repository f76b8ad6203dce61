"""Training runs of the quality benchmark: one process per (example, variant, seed), one thread each.

Every run writes its own JSON file (settings, final losses, learning curve, step time) as soon as
it has trained; a run whose file exists with all its seeds is not run again, so an interrupted
benchmark resumes where it stopped (the folder of a study names its settings).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@dataclass(frozen=True)
class Job:
    """One training process: ``example`` with ``variant`` for ``seeds``, writing ``path``."""

    example: str  # "char_gpt" or "mixer_digits"
    variant: str
    seeds: tuple[int, ...]
    arguments: tuple[str, ...]  # the example's other options (steps, evaluation, factors, --quick)
    path: Path
    cost: float = 1.0  # relative duration, longest first
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def command(self) -> list[str]:
        """The command line of the process (one thread)."""
        seeds = [str(seed) for seed in self.seeds]
        script = str(EXAMPLES / f"{self.example}.py")
        return [sys.executable, script, "--variants", self.variant, "--seeds", *seeds, "--threads", "1",
                *self.arguments, "--json", str(self.path)]  # fmt: skip

    def done(self) -> bool:
        """Whether ``path`` holds every seed of this job."""
        try:
            runs = json.loads(self.path.read_text())["runs"]
        except (OSError, ValueError, KeyError):
            return False
        return sorted(run["seed"] for run in runs) == sorted(self.seeds)


def slug(text: str) -> str:
    """A file-name form of a label: ``CP μMoE (32×32×32×32 experts)`` → ``cp-mumoe-32x32x32x32-experts``."""
    text = text.replace("μ", "mu").replace("×", "x").lower()
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def run_jobs(
    jobs: Sequence[Job],
    parallel: int,
    on_done: Callable[[Job, int, float], None] | None = None,
    log: Path | None = None,
) -> list[Job]:
    """Run the jobs not yet done, ``parallel`` processes at a time, longest first; returns the failed ones."""
    pending = sorted((job for job in jobs if not job.done()), key=lambda job: -job.cost)
    running: list[tuple[Job, subprocess.Popen, float, object]] = []
    failed: list[Job] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            job.path.parent.mkdir(parents=True, exist_ok=True)
            out = open(log or os.devnull, "a")  # closed when the process ends
            process = subprocess.Popen(job.command(), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            running.append((job, process, time.perf_counter(), out))
        time.sleep(0.2)
        for entry in list(running):
            job, process, start, out = entry
            if process.poll() is None:
                continue
            running.remove(entry)
            out.close()
            if process.returncode != 0 or not job.done():
                failed.append(job)
            if on_done is not None:
                on_done(job, process.returncode, time.perf_counter() - start)
    return failed
