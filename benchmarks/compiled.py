"""Decoding on a GPU: μMoE blocks against the dense MLP, eager and under ``torch.compile``.

Run from the repository root on a machine with CUDA::

    python -m benchmarks.compiled                        # B = 1, mode="reduce-overhead" (CUDA graphs)
    python -m benchmarks.compiled --batch 1 8 --mode max-autotune

At decoding batches a μMoE block is bound by the host: it launches tens of small kernels where
the MLP launches three, so its eager time is the host's Python and launch time. A CUDA graph
(``mode="reduce-overhead"``) replays all of them in one launch. The blocks are
``MuMoEMLP(d, 4d, d, experts, fmt, match="mlp")`` (CP and TR with 256 experts, CP with
32×32×32×32) in eval mode under ``torch.no_grad()``, compiled with ``fullgraph=True``; the
reference is ``Linear → GELU → Linear`` of the same width. Every case prints its time per call
(mean of ``--calls`` calls after 20 warm-up calls), its ratio to the dense MLP run the same way
(eager to eager, compiled to compiled), and the largest difference between its compiled and eager
outputs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from mumoe_tn import MuMoEMLP

FORMATS: dict[str, tuple[int | tuple[int, ...], str]] = {
    "CP block, 256 experts": (256, "cp"),
    "TR block, 256 experts": (256, "tr"),
    "CP block, 32×32×32×32 experts": ((32, 32, 32, 32), "cp"),
}


def time_per_call(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    """Milliseconds per call without gradients, after 20 warm-up calls (the first ones compile)."""
    with torch.no_grad():
        for _ in range(20):
            module(x)
        torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        for _ in range(calls):
            module(x)
        torch.cuda.synchronize(x.device)
    return (time.perf_counter() - start) / calls * 1e3


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768, help="model width d (default 768)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="tokens per call (default 1)")
    parser.add_argument("--mode", default="reduce-overhead", help="torch.compile mode (default reduce-overhead)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per case (default 200)")
    args = parser.parse_args(argv)
    if args.width < 1 or args.calls < 1 or min(args.batch) < 1:
        parser.error("--width, --calls and every --batch must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Time every block eager and compiled at each batch and print the table."""
    args = parse(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs CUDA: decoding on a CPU is measured by python -m benchmarks.run", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    width = args.width
    dense = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    cases = {"dense MLP": dense.to(device).eval()}
    for name, (experts, fmt) in FORMATS.items():
        cases[name] = MuMoEMLP(width, 4 * width, width, experts, fmt, match="mlp").to(device).eval()
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, width {width}, mode {args.mode!r}")
    print("| case | B | eager (ms) | ÷ dense | compiled (ms) | ÷ dense | compiled − eager (max) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        x = torch.randn(batch, width, device=device)
        rows = {}
        for name, module in cases.items():
            compiled = torch.compile(module, mode=args.mode, fullgraph=True)
            eager_ms, compiled_ms = time_per_call(module, x, args.calls), time_per_call(compiled, x, args.calls)
            with torch.no_grad():
                difference = (compiled(x).clone() - module(x)).abs().max().item()
            rows[name] = (eager_ms, compiled_ms, difference)
        eager_dense, compiled_dense, _ = rows["dense MLP"]
        for name, (eager_ms, compiled_ms, difference) in rows.items():
            print(f"| {name} | {batch} | {eager_ms:.4f} | {eager_ms / eager_dense:.2f}× | {compiled_ms:.4f} | "
                  f"{compiled_ms / compiled_dense:.2f}× | {difference:.1e} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
