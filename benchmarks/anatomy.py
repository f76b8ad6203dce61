"""Where an inference call of a CP μMoE layer spends its time, next to nn.Linear and the floor.

Run from the repository root::

    python -m benchmarks.anatomy                 # 768 → 3072, 256 experts, B = 1, 8, 64, one thread
    python -m benchmarks.anatomy --batches 1 --threads 2

For each batch it times, side by side in alternating rounds (eval mode, ``torch.no_grad()``,
the median of per-round minima):

- ``nn.Linear`` — the layer the μMoE replaces;
- the whole μMoE layer, its gate alone and its expert contraction alone;
- the floor: the same matrix products written by hand on the layer's own cores
  (``(z @ U_i[:I] + U_i[I]) * (a @ U_n1) @ U_oᵀ`` and ``z @ Gᵀ``, ``U_oᵀ`` stored as the layer's
  prepared plan stores it), with no Python around them;
- the gate's sparse map (1.5-entmax) alone on the layer's logits.

The difference between the layer and the floor is the per-call work of the library (dispatch,
checks, records, the sparse map); the difference between the floor and ``nn.Linear`` is the
arithmetic and memory traffic of the factorized form itself.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from mumoe_tn import MuMoE
from mumoe_tn.contractions.prepared import COLUMN_MAJOR_ROWS
from mumoe_tn.gates.entmax import entmax15


def _timings(cases: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """Median over rounds of each case's fastest call per round, in microseconds, cases alternating."""
    for case in cases.values():
        case()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            best = float("inf")
            for _ in range(calls):
                start = time.perf_counter()
                case()
                best = min(best, time.perf_counter() - start)
            samples[name].append(best)
    return {name: 1e6 * statistics.median(values) for name, values in samples.items()}


def anatomy(batch: int, *, in_features: int = 768, out_features: int = 3072, experts: int = 256) -> dict[str, float]:
    """Per-part timings (µs) of one inference call of a parameter-matched CP layer with ``batch`` tokens."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = MuMoE(in_features, out_features, experts, "cp", match="linear").eval()
    linear = nn.Linear(in_features, out_features).eval()
    cores = {name: core.detach() for name, core in layer.experts.cores.items()}
    head, last = cores["U_i"][:-1].contiguous(), cores["U_i"][-1:].contiguous()
    expert_factor, output = cores["U_n1"].contiguous(), cores["U_o"].t()
    if batch < COLUMN_MAJOR_ROWS:  # the layout the layer's prepared plan reads its output factor in
        output = output.contiguous()
    projection = layer.gate.projections["n1"].weight.detach().t().contiguous()
    x = torch.randn(batch, in_features)
    with torch.no_grad():
        (coefficients,) = layer.gate(x)
        logits = x @ projection
        cases = {
            "nn.Linear": lambda: linear(x),
            "μMoE layer": lambda: layer(x),
            "its gate": lambda: layer.gate(x),
            "its experts": lambda: layer.experts(x, (coefficients,), append_one=True),
            "floor: products": lambda: (torch.addmm(last, x, head) * (coefficients @ expert_factor)) @ output,
            "floor: gate product": lambda: x @ projection,
            "entmax15": lambda: entmax15(logits),
        }
        return _timings(cases, calls=5, rounds=30)


def main(argv: list[str] | None = None) -> None:
    """Print the per-part timings for each batch size."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.anatomy", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="tokens per call")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CP μMoE 768 → 3072, 256 experts, parameter-matched; eval, no_grad; {args.threads} thread(s); µs")
    for batch in args.batches:
        timings = anatomy(batch)
        linear = timings["nn.Linear"]
        print(f"\nB = {batch}")
        for name, value in timings.items():
            print(f"  {name:<22}{value:>10.0f}  {value / linear:>6.2f}× nn.Linear")


if __name__ == "__main__":
    main()
