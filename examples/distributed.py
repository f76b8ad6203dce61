"""μMoE blocks on PyTorch's distributed stack: FSDP2, bf16 mixed precision, activation checkpointing,
BatchNorm gates synchronised across ranks, and a sharded checkpoint that resumes the loss curve.

    torchrun --nproc-per-node 2 examples/distributed.py                 # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/distributed.py --steps 200 --checkpoint ./ckpt

Every rank draws its own batch of a synthetic regression task (a fixed random teacher MLP). The
model is a stack of residual μMoE MLP blocks (CP and TR experts, BatchNorm gates); each block is
activation-checkpointed and sharded with ``fully_shard``. Half-way, the model and optimizer are
saved with ``torch.distributed.checkpoint``; a freshly initialised model then loads that save and
repeats the second half, which reproduces the loss curve exactly.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mumoe_tn.gates import keep_statistics_on_recompute, sync_gate_norms
from mumoe_tn.layers import MuMoEMLP


class Residual(nn.Module):
    """``x + block(LayerNorm(x))``."""

    def __init__(self, block: nn.Module, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(self.norm(x))


def build(width: int, depth: int, seed: int) -> nn.Sequential:
    """``depth`` residual μMoE blocks, alternating CP (8×8 experts) and TR (64 experts)."""
    torch.manual_seed(seed)
    blocks = [
        MuMoEMLP(width, 2 * width, width, (8, 8), "cp", 16)
        if i % 2 == 0
        else MuMoEMLP(width, 2 * width, width, 64, "tr", 4)
        for i in range(depth)
    ]
    return nn.Sequential(*[Residual(block, width) for block in blocks])


def distribute(model: nn.Sequential, mesh, bf16: bool) -> nn.Sequential:
    """Synchronise the gates' BatchNorm, checkpoint every block's activations, shard every block."""
    sync_gate_norms(model)
    for index, block in enumerate(model):
        model[index] = checkpoint_wrapper(block, context_fn=keep_statistics_on_recompute(block))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    for block in model:
        fully_shard(block, **options)
    return fully_shard(model, **options)


def batches(width: int, rows: int, rank: int, device: torch.device):
    """An endless stream of this rank's ``(x, teacher(x))`` batches."""
    teacher = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    teacher.requires_grad_(False)
    generator = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(7)) / 4)
    while True:
        x = torch.randn(rows, 16, width, generator=generator)
        with torch.no_grad():
            y = teacher(x)
        yield x.to(device), y.to(device)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data, steps: int) -> list[float]:
    """``steps`` AdamW steps; the mean loss over every rank's batch after each."""
    losses = []
    for _ in range(steps):
        x, y = next(data)
        optimizer.zero_grad()
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        optimizer.step()
        value = loss.detach()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return losses


def train_save_resume(
    args: argparse.Namespace, rank: int, world: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Train half the steps, save a sharded checkpoint, train on; resume a fresh model from the save."""
    mesh = init_device_mesh(device.type, (world,))
    folder = args.checkpoint
    if folder is None:  # every rank writes into a temporary folder of rank 0's
        shared = [tempfile.mkdtemp(prefix="mumoe-dcp-") if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        folder = shared[0]

    half = args.steps // 2
    model = distribute(build(args.width, args.depth, seed=0).to(device), mesh, bf16=not args.fp32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(args.width, args.rows, rank, device)
    losses = train(model, optimizer, data, half)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=folder)
    losses += train(model, optimizer, data, half)

    fresh = distribute(build(args.width, args.depth, seed=1).to(device), mesh, bf16=not args.fp32)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    model_state, optimizer_state = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    data = batches(args.width, args.rows, rank, device)
    for _ in range(half):  # the batches the first half consumed
        next(data)
    resumed = train(fresh, fresh_optimizer, data, half)

    if rank == 0:
        print(f"{world} ranks on {device.type}, {args.depth} μMoE blocks of width {args.width}, {args.steps} steps")
        print(f"loss: {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {args.steps}")
        same = "the same curve" if resumed == losses[half:] else "a different curve"
        print(f"resumed from the checkpoint of step {half} ({folder}): {same}")
    dist.barrier()  # every rank is done with the save before it goes, and before the group goes
    if args.checkpoint is None and rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return losses, resumed


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (an even number)")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="sequences of 16 tokens per rank and step")
    parser.add_argument("--checkpoint", default=None, help="folder of the sharded save (default: a temporary one)")
    parser.add_argument("--fp32", action="store_true", help="train in float32 (default: bf16 compute)")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        parser.error(f"--steps must be an even number >= 2, got {args.steps}")

    started = not dist.is_initialized()
    if started:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    losses, resumed = train_save_resume(args, rank, world, device)
    if started:
        gc.collect()  # the sharded models go before the group: gloo's threads must not outlive it
        dist.barrier()  # no rank tears the process group down while another still talks to it
        dist.destroy_process_group()
    return {"losses": losses, "resumed": resumed}


if __name__ == "__main__":
    main()
