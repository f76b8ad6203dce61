"""What μMoE blocks cost on PyTorch's distributed stack: activation checkpointing and FSDP2 per rank.

    python -m benchmarks.distributed            # a stack of 8 residual μMoE blocks, 2 ranks (gloo on CPU)
    python -m benchmarks.distributed --quick    # tiny sizes, a smoke run

Two tables, printed as markdown:

- **Activation checkpointing**, one process: the peak bytes of live tensors during one
  forward+backward (CUDA: ``torch.cuda.max_memory_allocated``; CPU:
  [`LiveTensorPeak`][benchmarks.measure.LiveTensorPeak]) and the median step time, plain and with
  every block in ``checkpoint_wrapper`` (``keep_statistics_on_recompute``).
- **Data parallelism**, ``--ranks`` processes: per rank, the bytes of parameters, gradients and
  AdamW state it holds, the peak live bytes of a training step and the median step time, for
  ``DistributedDataParallel``, ``fully_shard`` per block (float32), the same with bf16 parameters
  (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), and that with activation
  checkpointing.

Times on a shared CPU are indicative only (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.measure import live_peak_bytes_here, synchronize
from examples.distributed import Residual
from mumoe_tn.gates import keep_statistics_on_recompute, sync_gate_norms
from mumoe_tn.layers import MuMoEMLP

CONFIGS = ("DDP", "FSDP2 fp32", "FSDP2 bf16", "FSDP2 bf16 + checkpointing")


@dataclass(frozen=True)
class Sizes:
    """Block width, number of blocks, expert dims, batch rows and sequence length."""

    width: int
    depth: int
    experts: tuple[int, ...]
    batch: int
    seq: int


FULL = Sizes(width=256, depth=8, experts=(16, 16), batch=8, seq=128)
QUICK = Sizes(width=32, depth=2, experts=(4, 4), batch=2, seq=16)


def build(s: Sizes, device: torch.device) -> nn.Sequential:
    """``depth`` residual CP μMoE MLP blocks (``width → 4·width → width``), parameter-matched to the MLP."""
    torch.manual_seed(0)
    blocks = [
        Residual(MuMoEMLP(s.width, 4 * s.width, s.width, s.experts, "cp", match="mlp"), s.width) for _ in range(s.depth)
    ]
    return nn.Sequential(*blocks).to(device)


def checkpointed(model: nn.Sequential) -> nn.Sequential:
    """Every block in ``checkpoint_wrapper``, its gates' running statistics kept on recompute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, block in enumerate(model):
        model[index] = checkpoint_wrapper(block, context_fn=keep_statistics_on_recompute(block))
    return model


def step_of(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    """One training step on ``x`` (mean square of the output), gradients set to None first."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()

    return step


def median_ms(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``step``, in milliseconds (CUDA synchronised)."""
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


def local_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (the local shard of a DTensor)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def checkpointing_rows(s: Sizes, device: torch.device, repeats: int) -> list[dict]:
    """Peak live bytes of one forward+backward and the step time, plain and checkpointed."""
    rows = []
    for name, wrap in (("plain", False), ("checkpoint_wrapper per block", True)):
        model = build(s, device)
        model = checkpointed(model) if wrap else model
        x = torch.randn(s.batch, s.seq, s.width, device=device, requires_grad=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = step_of(model, optimizer, x)
        step()  # plans, lazy state
        peak = live_peak_bytes_here(lambda m=model, x=x: m(x).float().square().mean().backward(), device)
        rows.append({"model": name, "peak_mib": peak / 2**20, "step_ms": median_ms(step, device, repeats)})
    return rows


def _rank(rank: int, world: int, sizes: dict, repeats: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    s = Sizes(**{**sizes, "experts": tuple(sizes["experts"])})
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh(device.type, (world,))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rows = []
    for config in CONFIGS:
        model = sync_gate_norms(build(s, device))
        if config.endswith("checkpointing"):
            model = checkpointed(model)
        if config == "DDP":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            options = {"mesh": mesh, **({"mp_policy": bf16} if "bf16" in config else {})}
            for block in model:
                fully_shard(block, **options)
            fully_shard(model, **options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(s.batch // world, s.seq, s.width, device=device)
        step = step_of(model, optimizer, x)
        step()
        params = list(model.parameters())
        peak = live_peak_bytes_here(step, device)
        state = [t for group in optimizer.state.values() for t in group.values() if torch.is_tensor(t)]
        rows.append(
            {
                "config": config,
                "params_mib": local_bytes(params) / 2**20,
                "grads_mib": local_bytes(p.grad for p in params if p.grad is not None) / 2**20,
                "adamw_mib": local_bytes(state) / 2**20,
                "peak_mib": peak / 2**20,
                "step_ms": median_ms(step, device, repeats),
            }
        )
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def parallel_rows(s: Sizes, world: int, repeats: int) -> list[dict]:
    """Rank 0's row per configuration of ``CONFIGS``, measured by ``world`` spawned ranks."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.pt")
        args = (world, asdict(s), repeats, os.path.join(folder, "init"), out)
        mp.spawn(_rank, args=args, nprocs=world, join=True)
        return torch.load(out, weights_only=True)


def table(rows: list[dict]) -> str:
    """Rows of equal keys as a markdown table."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    """Measure both tables, print them, and return their rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (median)")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{s}, {device.type}, torch {torch.__version__}, load average {load:.1f}\n")
    single = checkpointing_rows(s, device, args.repeats)
    print("Activation checkpointing (one process, the whole batch):\n\n" + table(single) + "\n")
    parallel = parallel_rows(s, args.ranks, args.repeats)
    print(f"Data parallelism ({args.ranks} ranks, per rank, batch {s.batch} split between them):\n")
    print(table(parallel))
    return {"checkpointing": single, "parallel": parallel}


if __name__ == "__main__":
    main()
