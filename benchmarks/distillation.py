"""Distillation throughput: tokens/s of each replacement's training step against its arithmetic floor.

Run from the repository root::

    python -m benchmarks.distillation            # the frontier's sizes: benchmarks/distillation-cpu.{json,md}
    python -m benchmarks.distillation --quick    # a smoke run (writes to a temporary folder)

Each replacement of the default frontier (``mumoe-tn distill``: a GPT-2-shaped block of width 64,
every method at L0 8, 16, 32 and 64, one parameter budget) takes the training step
[`distill`][mumoe_tn.distillation.training.distill] runs, its
[`ReplacementTrainer.step`][mumoe_tn.distillation.trainer.ReplacementTrainer] — forward, the
default loss terms and the replacement's own (a flat block's load-balancing term), backward, the
unit-norm projection, the recipe's optimiser and warm-up — on ``batch_size`` cached activation rows. The
floor is the time its forward and backward multiply-adds take at the machine's measured
matrix-multiply rate: the FLOPs of one step counted by ``torch.utils.flop_counter.FlopCounterMode``
(matrix products, ``2·m·n·k`` each), divided by the FLOP/s of a square fp32 ``torch.mm`` of the
measured size, best of its repeats in the process's CPU time. To show what that rate means at the
step's own shapes, the step's matrix products are recorded and replayed alone on random operands
of the same shapes and strides (``products alone``). ``of floor`` is the measured tokens/s
over the floor's tokens/s (1 = as fast as the arithmetic allows). The replacements are timed in
alternating rounds, one torch thread, the median step of each, in wall time and in the process's
CPU time: on a shared machine the wall time includes the time the process waits for a core, the
CPU time does not (with one thread, the step's own work); the target reads the CPU time. The load
average is recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from mumoe_tn.costs.baselines import transcoder_parameters
from mumoe_tn.distillation.streaming import BlockInfo, select_blocks
from mumoe_tn.distillation.study import DEFAULT_METHODS, FrontierConfig, method_factories
from mumoe_tn.distillation.training import ReplacementTrainer

HERE = Path(__file__).resolve().parent

#: Target: the median replacement reaches at least this fraction of its floor on the CPU.
TARGET = 0.30


def gemm_rate(size: int = 512, repeats: int = 20) -> float:
    """FLOP/s of a square fp32 ``torch.mm`` of ``size`` (best of ``repeats``, in the process's CPU time).

    CPU time, as the steps are read: a repeat the scheduler interrupts does not count the wait.
    """
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    best = min(_both(lambda: torch.mm(a, b))[1] for _ in range(repeats))
    return 2 * size**3 / best


def _both(step) -> tuple[float, float]:
    """Wall and process CPU seconds of one ``step`` call."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - wall, time.process_time() - cpu


class Step:
    """One replacement's distillation step on fixed rows: the trainer ``distill`` gives it."""

    def __init__(
        self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, recipe: str, lr: float | None, steps: int
    ) -> None:
        self.module, self.x, self.y = module, x, y
        self.trainer = ReplacementTrainer(module, recipe=recipe, steps=steps, lr=lr)

    def __call__(self) -> None:
        self.trainer.step(self.x, self.y)

    def flops(self) -> int:
        """Multiply-add FLOPs of one step (its elementwise work, the optimiser's included, not counted)."""
        counter = FlopCounterMode(display=False)
        with counter:
            self()
        return int(counter.get_total_flops())

    def products(self) -> list[tuple[Any, tuple]]:
        """The matrix products of one step: each op with random operands of the step's shapes and strides."""
        recorder = _Products()
        with recorder:
            self()
        return recorder.calls


class _Products(TorchDispatchMode):
    """Records every matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``) dispatched inside it."""

    OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default)  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            operands = tuple(_like(a) if isinstance(a, torch.Tensor) else a for a in args)
            self.calls.append((func, operands))
        return func(*args, **(kwargs or {}))


def _like(tensor: torch.Tensor) -> torch.Tensor:
    """Random values in ``tensor``'s shape and strides (a transposed operand stays transposed)."""
    size = 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return torch.randn(size, dtype=tensor.dtype).as_strided(tensor.shape, tensor.stride())


def products_seconds(calls: list[tuple[Any, tuple]], repeats: int = 10) -> float:
    """CPU seconds of replaying ``calls`` (best of ``repeats``): the step's matrix products alone."""

    def replay() -> None:
        for func, operands in calls:
            func(*operands)

    replay()
    return min(_both(replay)[1] for _ in range(repeats))


def _block(config: FrontierConfig) -> BlockInfo:
    import transformers

    transformers.logging.set_verbosity_error()
    gpt2 = transformers.GPT2Config(vocab_size=256, n_positions=config.context, n_embd=config.width, n_layer=1,
                                   n_head=config.heads)  # fmt: skip
    return select_blocks(transformers.GPT2LMHeadModel(gpt2), config.mlps)[0]


def measure(config: FrontierConfig, *, rounds: int, steps: int) -> dict:
    """Tokens/s of every replacement of the frontier ``config`` against its floor."""
    torch.manual_seed(0)
    block = _block(config)
    budget = config.budget or transcoder_parameters(block.in_features, config.expansion * block.in_features,
                                                    block.out_features)  # fmt: skip
    factories = method_factories(config.methods, config.l0s, budget, config.experts, top_k=config.top_k,
                                 recipe=config.recipe, aux_k=config.aux_k)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(config.batch_size, block.in_features, generator=generator)
    y = torch.randn(config.batch_size, block.out_features, generator=generator)
    steps_of_run = config.tokens // config.batch_size
    runs = {
        name: Step(factory(block), x, y, config.recipe, config.lr, steps_of_run) for name, factory in factories.items()
    }
    flops = {name: step.flops() for name, step in runs.items()}
    products = {name: products_seconds(step.products()) for name, step in runs.items()}
    rate = gemm_rate()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for step in runs.values():  # warm-up: plans, allocator
        step()
    for _ in range(rounds):
        for name, step in runs.items():
            samples[name] += [_both(step) for _ in range(steps)]
    rate_after = gemm_rate()
    rows = []
    for name, step in runs.items():
        wall = statistics.median(sample[0] for sample in samples[name])
        cpu = statistics.median(sample[1] for sample in samples[name])
        floor = flops[name] / rate
        rows.append({
            "replacement": name, "params": sum(p.numel() for p in step.module.parameters()),
            "flops_per_token": flops[name] / config.batch_size, "step_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu,
            "tokens_per_s": config.batch_size / wall, "cpu_tokens_per_s": config.batch_size / cpu,
            "floor_tokens_per_s": config.batch_size / floor, "of_floor_wall": floor / wall, "of_floor": floor / cpu,
            "products_ms": 1e3 * products[name], "products_rate_of_gemm": floor / products[name],
        })  # fmt: skip
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread",
        "load_average": [round(value, 2) for value in load],
        "gemm_flops": rate,
        "gemm_flops_after": rate_after,
        "batch_size": config.batch_size,
        "recipe": config.recipe,
        "width": config.width,
        "budget": budget,
        "rounds": rounds,
        "steps": steps,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """The report: one row per replacement, the median ratio against the target."""
    ratios = sorted(row["of_floor"] for row in result["rows"])
    median = statistics.median(ratios)
    products = [row["products_rate_of_gemm"] for row in result["rows"]]
    lines = [
        "# Distillation throughput (generated by `python -m benchmarks.distillation`)",
        "",
        f"Machine: {result['machine']}; load average {result['load_average']} (a shared machine: the figures are "
        f"noisy). Matrix-multiply rate {result['gemm_flops'] / 1e9:.1f} GFLOP/s before and "
        f"{result['gemm_flops_after'] / 1e9:.1f} after (square fp32 `torch.mm` of 512, best of 20).",
        "",
        f"Training step of each replacement of the frontier (block width {result['width']}, budget "
        f"≈{result['budget']:,} parameters) on {result['batch_size']} activation rows: forward, normalised MSE, "
        f"the replacement's own terms, backward, the unit-norm projection, the {result.get('recipe', '?')} recipe's "
        "optimiser and warm-up (`ReplacementTrainer.step`, as `distill` runs it). Median of "
        f"{result['rounds']} alternating "
        f"rounds × {result['steps']} steps. Floor: the step's forward and backward FLOPs (FlopCounterMode) at the "
        "measured matrix-multiply rate (CPU time).",
        "",
        f"Median replacement: **{median:.1%} of its floor** in CPU time (target ≥ {TARGET:.0%}: "
        f"{'met' if median >= TARGET else 'missed'}); range {ratios[0]:.1%} – {ratios[-1]:.1%}; in wall time "
        f"{statistics.median(row['of_floor_wall'] for row in result['rows']):.1%}.",
        "",
        "The floor's rate against the step's own shapes: its matrix products alone, replayed on random operands of "
        f"the same shapes and strides (best of 10, CPU time), run at {statistics.median(products):.0%} of the square "
        f"product's rate (median; {min(products):.0%} – {max(products):.0%}).",
        "",
        "| replacement | params | FLOPs per token | step (ms, wall) | step (ms, CPU) | tokens/s (CPU) | floor tokens/s "
        "| of floor (CPU) | of floor (wall) | products alone (ms, CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['replacement']} | {row['params']:,} | {row['flops_per_token']:,.0f} | {row['step_ms']:.2f} | "
            f"{row['cpu_ms']:.2f} | {row['cpu_tokens_per_s']:,.0f} | {row['floor_tokens_per_s']:,.0f} | "
            f"{row['of_floor']:.1%} | {row['of_floor_wall']:.1%} | {row['products_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure and write the report; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run in a temporary folder")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help="methods (default the frontier's)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per replacement and round (default 10)")
    parser.add_argument("--batch-size", type=int, help="activation rows per step (default the frontier's 256)")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/, or a temporary one with --quick)")
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="distillation-")) if args.quick else HERE)
    torch.set_num_threads(1)
    config = FrontierConfig.quick() if args.quick else FrontierConfig()
    changes = {"methods": tuple(args.methods)} | ({"batch_size": args.batch_size} if args.batch_size else {})
    config = dataclasses.replace(config, **changes)
    suffix = "" if args.batch_size is None else f"-batch{args.batch_size}"
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    result = measure(config, rounds=rounds, steps=steps)
    (out / f"distillation-cpu{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"distillation-cpu{suffix}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
