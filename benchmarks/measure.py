"""Timing and peak-memory measurement, synchronised on CUDA, in one process run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.benchmark import Timer


def median_seconds(fn: Callable[[], object], *, min_run_time: float, threads: int) -> float:
    """Median wall time of ``fn()`` (torch.utils.benchmark; it synchronises CUDA)."""
    fn()  # warm up: plans, allocator, lazy init
    timer = Timer("fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=min_run_time).median


def _status_kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def peak_bytes_here(run: Callable[[], object], device: torch.device) -> int:
    """Peak memory that one call of ``run`` adds on top of what exists before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the process's resident-set high-water
    mark (``VmHWM``), reset through ``/proc/self/clear_refs`` just before the call, minus the
    resident size at that moment. Call it in a fresh process (see :func:`peak_bytes`) so
    that freed-but-cached memory does not hide the peak.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    run()
    return (_status_kib("VmHWM") - before) * 1024


def peak_bytes(case: dict, device: str, threads: int) -> int | None:
    """Run ``python -m benchmarks.run --probe CASE`` in a fresh process and read its peak."""
    command = [sys.executable, "-m", "benchmarks.run", "--probe", json.dumps(case), "--device", device]
    command += ["--threads", str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if result.returncode != 0:
        print(result.stderr[-2000:], file=sys.stderr)
        return None
    return int(result.stdout.strip().splitlines()[-1])
