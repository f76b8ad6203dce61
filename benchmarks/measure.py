"""Timing (alternating rounds, medians) and peak memory (a fresh process per case).

Run as ``python -m benchmarks.measure CASE_JSON --device cpu --threads 2`` it builds one case,
runs one forward+backward and prints, as JSON, the peak bytes of live tensors and the growth of
the resident set during that call. With ``--serve`` it reads
one case per line and forks a fresh child for each (see :class:`MemoryProbe`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.baselines import Case, build_module, input_width, make_inputs
from benchmarks.launches import count_call
from tests.live_tensors import LiveTensorPeak

ROOT = Path(__file__).resolve().parent.parent


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on CUDA (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """A built case: its forward+backward (train mode) and its forward (eval, no grad).

    Every input requires grad, so each layer computes its input gradient as it would inside a
    network. Gradients are set to None before each timed step (as ``zero_grad`` does). With
    ``train=False`` only the forward is timed, and no input requires grad. A case that names
    its ``threads`` is timed with that many CPU threads.
    """

    def __init__(self, case: Case, device: torch.device, *, train: bool = True) -> None:
        self.case, self.device = case, device
        self.module = build_module(case, device)
        self.leaves, self.args = make_inputs(case, self.module, device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if not train:
            for leaf in self.leaves:
                leaf.requires_grad_(False)
            return
        generator = torch.Generator().manual_seed(2)
        self.module.train()
        with torch.no_grad():
            shape = self.module(*self.args).shape
        self.grad = torch.randn(shape, generator=generator).to(device)

    def _clear(self) -> None:
        for tensor in (*self.params, *self.leaves):
            tensor.grad = None

    def train_step(self) -> None:
        """One forward and backward pass."""
        self.module(*self.args).backward(self.grad)

    def infer_step(self) -> None:
        """One inference forward pass."""
        with torch.no_grad():
            self.module(*self.args)

    #: Whether a sample waits for the device after the call (False: the host's time to queue it).
    synchronise_after = True

    def time(self, step: Callable[[], None], *, train: bool) -> float:
        """Seconds of one ``step`` call, the device synchronised before it (and after, see `synchronise_after`)."""
        self.module.train(train)
        if train:
            self._clear()
        if self.case.threads is not None and torch.get_num_threads() != self.case.threads:
            torch.set_num_threads(self.case.threads)
        synchronize(self.device)
        start = time.perf_counter()
        step()
        if self.synchronise_after:
            synchronize(self.device)
        return time.perf_counter() - start


class HostRunner(Runner):
    """A case timed for what its calls cost the host: eval at a few tokens, fwd+bwd at the case's tokens.

    The forward (eval mode, ``torch.no_grad()``) runs on ``eval_tokens`` tokens without grad, the
    forward+backward (train mode) on ``case.batch · case.seq`` tokens that require grad, both
    2-D ``(tokens, features)``. A sample is the time until the call returns: the device is
    synchronised before it, not after, so on an accelerator it is the host's time to queue the
    call's kernels (on the CPU, the call's time). [`launches`][benchmarks.measure.HostRunner.launches]
    counts the kernels and host reads of one call of each.
    """

    synchronise_after = False

    def __init__(self, case: Case, device: torch.device, *, eval_tokens: int = 1) -> None:
        self.case, self.device = case, device
        self.module = build_module(case, device)
        generator = torch.Generator().manual_seed(1)
        width = input_width(case)
        x = torch.randn(case.batch * case.seq, width, generator=generator).to(device).requires_grad_()
        self.leaves, self.args = [x], (x,)
        self.eval_args = (torch.randn(eval_tokens, width, generator=generator).to(device),)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.module.train()
        with torch.no_grad():  # a compiled case's eager twin: this call must compile nothing
            shape = getattr(self.module, "eager", self.module)(x).shape
        self.grad = torch.randn(shape, generator=generator).to(device)

    def infer_step(self) -> None:
        """One inference forward pass at ``eval_tokens`` tokens."""
        with torch.no_grad():
            self.module(*self.eval_args)

    def launches(self) -> dict[str, object]:
        """Kernels and host reads of one eval call and one fwd+bwd, after a warm-up call of each."""
        counts: dict[str, object] = {}
        for name, step, train in (("eval", self.infer_step, False), ("train", self.train_step, True)):
            self.module.train(train)
            self._clear()
            step()
            self._clear()
            found = count_call(step)
            counts[f"{name}_kernels"], counts[f"{name}_host_reads"] = found.kernels, found.host_reads
            counts[f"{name}_kernel_names"], counts[f"{name}_read_names"] = found.by_name, found.reads_by_name
        self._clear()
        synchronize(self.device)
        return counts


@dataclass
class Timing:
    """Samples of one case: forward+backward and forward seconds."""

    train: list[float] = field(default_factory=list)
    infer: list[float] = field(default_factory=list)

    @property
    def train_s(self) -> float | None:
        """Median forward+backward seconds (None when only the forward was timed)."""
        return statistics.median(self.train) if self.train else None

    @property
    def infer_s(self) -> float:
        """Median forward seconds."""
        return statistics.median(self.infer)


def alternate(
    runners: dict[str, Runner],
    *,
    rounds: int,
    reps: int,
    train: bool = True,
    tick: Callable[[], None] = lambda: None,
    done: Callable[[str, Timing], None] = lambda label, timing: None,
) -> dict[str, Timing]:
    """Time every runner in rounds A, B, C, A, B, C, … and keep all samples.

    Each round runs every case ``reps`` times forward+backward, then ``reps`` times forward, after
    one untimed warm-up of each in the first round (forward only with ``train=False``). The
    forward samples follow one another as a decoding loop's calls do: a training step moves a
    norm's running statistics, which a layer's inference caches are derived from, so a forward
    timed right after each training step would time the caches' rebuilding, not the call (the
    first forward of a round still does, one sample of ``reps``). A case's
    median is then taken over its samples from all rounds, so slow phases of a shared machine hit
    every case alike. ``tick`` is called after each case's turn in a round, ``done(label, timing)``
    after a case's last round.
    """
    timings = {label: Timing() for label in runners}
    for round_ in range(rounds):
        for label, runner in runners.items():
            if round_ == 0:
                if train:
                    runner.time(runner.train_step, train=True)
                runner.time(runner.infer_step, train=False)
            timing = timings[label]
            if train:
                timing.train.extend(runner.time(runner.train_step, train=True) for _ in range(reps))
            timing.infer.extend(runner.time(runner.infer_step, train=False) for _ in range(reps))
            tick()
            if round_ == rounds - 1:
                done(label, timing)
    return timings


# ----------------------------------------------------------------------------- memory
def _status_kib(key: str) -> int:
    match = re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key}")
    return int(match.group(1))


def peak_bytes_here(run: Callable[[], object], device: torch.device) -> int:
    """Peak memory that one call of ``run`` adds on top of what exists before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the process's resident-set high-water mark
    (``VmHWM``), reset through ``/proc/self/clear_refs`` just before the call, minus the resident
    size at that moment. Call it in a fresh process (see :func:`peak_bytes`) so that memory freed
    earlier and kept by the allocator does not hide the peak.
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


def live_peak_bytes_here(run: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of tensors that one call of ``run`` creates and holds at once.

    CUDA: ``torch.cuda.max_memory_allocated`` above the allocation before the call; CPU:
    ``LiveTensorPeak`` (the tests' tracker, ``tests/live_tensors.py``).
    """
    if device.type == "cuda":
        return peak_bytes_here(run, device)
    with LiveTensorPeak() as tracker:
        run()
    return tracker.peak


def peak_bytes(case: Case, device: torch.device, threads: int) -> dict[str, int | None] | None:
    """Peak memory of one forward+backward of ``case``, measured in a fresh process (see `_probe`)."""
    command = [sys.executable, "-m", "benchmarks.measure", json.dumps(case.to_json())]
    command += ["--device", str(device), "--threads", str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    if result.returncode != 0:
        print(result.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


class MemoryProbe:
    """Peak memory per case, each in a fresh child of one pristine process.

    Starting Python and importing torch, the library and the peers takes seconds (much longer on
    a busy machine), so a server process imports them once, computes nothing, and forks one child
    per case: the child starts from that clean state, builds the case, runs one forward+backward
    and reports its peak (see :func:`peak_bytes_here`). On CUDA, or where ``os.fork`` is missing,
    each case gets a new interpreter instead (:func:`peak_bytes`).
    """

    def __init__(self, device: torch.device, threads: int, preload: Iterable[str] = ()) -> None:
        self.device, self.threads = device, threads
        self.process: subprocess.Popen | None = None
        if device.type == "cpu" and hasattr(os, "fork"):
            command = [sys.executable, "-m", "benchmarks.measure", "--serve", "--threads", str(threads)]
            command += [f"--preload={module}" for module in preload]
            self.process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def peak(self, case: Case) -> dict[str, int | None] | None:
        """Peak bytes of one forward+backward of ``case`` (see `_probe`); None if it failed."""
        if self.process is None:
            return peak_bytes(case, self.device, self.threads)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(case.to_json()) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        if not answer.startswith("{"):
            print(f"peak memory of {case.label!r} failed: {answer}", file=sys.stderr)
            return None
        return json.loads(answer)

    def close(self) -> None:
        """Stop the server."""
        if self.process is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(timeout=60)
            self.process = None

    def __enter__(self) -> MemoryProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(threads: int, preload: list[str]) -> None:
    """Fork one child per case read from stdin; print each child's answer on one line."""
    for module in preload:  # import once, here, so that children start warm
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    for line in sys.stdin:
        if not line.strip():
            continue
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: measure, answer, leave without running the parent's cleanup
            os.close(read_end)
            try:
                torch.set_num_threads(threads)
                answer = json.dumps(_probe(Case.from_json(json.loads(line)), torch.device("cpu")))
            except BaseException as error:  # reported to the parent, which carries on
                answer = f"error: {type(error).__name__}: {error}"
            os.write(write_end, answer.replace("\n", " ").encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            answer = pipe.read().decode()
        os.waitpid(pid, 0)
        print(answer or "error: the child died", flush=True)


def _probe(case: Case, device: torch.device) -> dict[str, int | None]:
    """``peak_bytes``: live tensors of one fwd+bwd; ``rss_bytes``: the resident set's growth (CPU).

    The resident set is measured first, on the fresh process; the live-tensor peak does not
    depend on what the allocator kept from that call.
    """
    # Start torch's thread pools, autograd engine and allocator first on a tiny problem, so that
    # their one-off footprint (tens of MiB) is not charged to the case.
    warm = torch.nn.Linear(4, 4).to(device)
    warm(torch.randn(2, 4, device=device, requires_grad=True)).sum().backward()
    del warm
    module = build_module(case, device)
    module.train()
    leaves, args = make_inputs(case, module, device)

    def step() -> None:
        out = module(*args)
        out.backward(torch.randn_like(out))

    if device.type == "cuda":
        return {"peak_bytes": peak_bytes_here(step, device), "rss_bytes": None}
    rss = peak_bytes_here(step, device)
    for tensor in (*module.parameters(), *leaves):
        tensor.grad = None
    return {"peak_bytes": live_peak_bytes_here(step, device), "rss_bytes": rss}


def main(argv: Iterable[str] | None = None) -> int:
    """Print the peak bytes of one forward+backward of the case given as JSON."""
    parser = argparse.ArgumentParser(description="peak memory of one case, in a fresh process")
    parser.add_argument("case", nargs="?", help="the case as JSON (Case.to_json())")
    parser.add_argument("--serve", action="store_true", help="read cases from stdin, fork a child for each")
    parser.add_argument("--preload", action="append", default=[], help="module the server imports first")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(None if argv is None else list(argv))
    if args.serve:
        _serve(args.threads, args.preload)
        return 0
    if args.case is None:
        parser.error("give a case as JSON, or --serve")
    torch.set_num_threads(args.threads)
    print(json.dumps(_probe(Case.from_json(json.loads(args.case)), torch.device(args.device))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
