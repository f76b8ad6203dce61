"""What one call of each gate activation map costs on a decoding-size row, in each of its forms.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks.gate_maps            # (1, 256) float32, one thread
    python -m benchmarks.gate_maps --threads 2 --rows 1 8 64 --width 256

Times the maps on logits ``(rows, width)`` in float32 without gradients (eval), as a layer's
inference program calls them: each public map (which picks its form per call, see
[`mumoe_tn.gates.activation_maps`][mumoe_tn.gates.activation_maps]), the form an inference program
fixes once (``inference_map``), each form of the sparse maps called directly (NumPy, the Newton
search, the full sort in torch), the ``entmax`` package, and ``torch.softmax`` on the same logits,
which every figure is divided by. Each figure is the median over rounds of the fastest single call
of each round, cases alternating: on a shared machine a batch of calls timed together picks up
every other process's time slices, most of all for the forms of many short torch calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import entmax
import torch

from mumoe_tn.gates import activation_maps, simplex_numpy, simplex_torch

#: The logits' default scale: a BatchNorm'd gate's logits are about unit-variance (1.5-entmax keeps
#: about 9 of 256 entries); a smaller scale gives flatter rows and wider supports (0.1: about 200).
SCALE = 1.0


def cases(x: torch.Tensor, k: int) -> dict[str, Callable[[], object]]:
    """Every map and form on the logits ``x`` (no gradient), softmax first."""
    return {
        "softmax (torch)": lambda: torch.softmax(x, dim=-1),
        "entmax15": lambda: activation_maps.entmax15(x),
        "entmax15 inference_map": inference_case(activation_maps.entmax15, x),
        "entmax15 numpy form": lambda: simplex_numpy.forward(x, True),
        "entmax15 search form": lambda: simplex_torch.searched_map(x, -1, True),
        "entmax15 sort form": lambda: simplex_torch.sorted_map(x, True),
        "entmax15 (entmax package)": lambda: entmax.entmax15(x, dim=-1),
        "sparsemax": lambda: activation_maps.sparsemax(x),
        "sparsemax inference_map": inference_case(activation_maps.sparsemax, x),
        "sparsemax numpy form": lambda: simplex_numpy.forward(x, False),
        "sparsemax search form": lambda: simplex_torch.searched_map(x, -1, False),
        "sparsemax sort form": lambda: simplex_torch.sorted_map(x, False),
        "sparsemax (entmax package)": lambda: entmax.sparsemax(x, dim=-1),
        f"softmax_top_k (k={k})": lambda: activation_maps.softmax_top_k(x, k),
        f"relu_top_k (k={k})": lambda: activation_maps.relu_top_k(x, k),
    }


def inference_case(activation: Callable[..., torch.Tensor], x: torch.Tensor) -> Callable[[], object]:
    """A call of the map an inference program fixes for logits like ``x``."""
    mapped = activation_maps.inference_map(activation, x)
    return lambda: mapped(x)


def timings(x: torch.Tensor, k: int, calls: int, rounds: int) -> dict[str, float]:
    """Microseconds per call of every case: the median over ``rounds`` of the fastest of ``calls`` calls."""
    work = cases(x, k)
    samples: dict[str, list[float]] = {name: [] for name in work}
    clock = time.perf_counter
    with torch.no_grad():
        for case in work.values():
            case()
        for _ in range(rounds):
            for name, case in work.items():
                best = float("inf")
                for _ in range(calls):
                    start = clock()
                    case()
                    best = min(best, clock() - start)
                samples[name].append(best)
    return {name: 1e6 * statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> None:
    """Print µs per call and the ratio to softmax for every map and form."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gate_maps", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="rows (tokens × modes) per call")
    parser.add_argument("--width", type=int, default=256, help="logits per row (experts)")
    parser.add_argument("--k", type=int, default=2, help="k of the top-k maps")
    parser.add_argument("--scale", type=float, default=SCALE, help="standard deviation of the logits")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--rounds", type=int, default=30, help="rounds (the minimum is kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        x = torch.randn(rows, args.width, generator=torch.Generator().manual_seed(0)) * args.scale
        print(
            f"\n({rows}, {args.width}) float32 logits of scale {args.scale:g}, no grad; "
            f"{args.threads} torch thread(s); µs per call"
        )
        figures = timings(x, args.k, args.calls, args.rounds)
        softmax = figures["softmax (torch)"]
        for name, value in figures.items():
            print(f"  {name:<30}{value:>9.1f}  {value / softmax:>7.1f}× softmax")


if __name__ == "__main__":
    main()
