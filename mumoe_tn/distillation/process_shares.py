"""Distillation across processes: each process of a ``torchrun`` job trains its share of the replacements.

Under an initialised ``torch.distributed`` process group of more than one process,
[`distill`][mumoe_tn.distillation.training.distill] splits the work by replacement: the
``(block, method)`` pairs, in the order of the one-process run (blocks in model order, methods in
the order given), go round-robin to the ranks — pair ``i`` to rank ``i mod world_size``
([`assign_replacements`][mumoe_tn.distillation.process_shares.assign_replacements]). Every process
streams the same batches through its own copy of the frozen model, keeps the activations of the
blocks its pairs need, and trains its pairs; the trained state dicts, losses and counters are
gathered on rank 0, which rebuilds every replacement with its factory and loads its state. A
[`BatchDigest`][mumoe_tn.distillation.process_shares.BatchDigest] of the batches each process
trained on, compared at the gather, refuses a run whose processes were given different data.

A replacement's training depends only on its own seed (``seed`` and its block and method names),
the buffered rows (the same rows, shuffled by the same generator, in every process) and its own
optimiser, never on the other replacements a process trains: the gathered replacements equal
those of one process, parameter for parameter.

Every process writes its own checkpoint, ``FILE.rank<r>-of-<n>``
([`process_checkpoint`][mumoe_tn.distillation.process_shares.process_checkpoint]), and resumes
from it; a run resumes with the same number of processes. When one process fails or stops, the
others learn it when they finish their share and raise as well, rather than wait for it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mumoe_tn.distillation.interruption import DistillationStopped

__all__ = [
    "BatchDigest",
    "ProcessWorld",
    "assign_replacements",
    "check_resume_files",
    "gather_replacements",
    "joined_process_group",
    "outcomes_shared",
    "process_checkpoint",
    "process_world",
]

#: ``(rank, world_size)`` of this process.
ProcessWorld = tuple[int, int]


def process_world() -> ProcessWorld | None:
    """``(rank, world_size)`` of an initialised process group of more than one process, else None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    size = dist.get_world_size()
    return (dist.get_rank(), size) if size > 1 else None


def assign_replacements(pairs: Sequence[tuple[str, str]], world_size: int) -> list[list[tuple[str, str]]]:
    """The pairs each rank trains: pair ``i`` to rank ``i mod world_size``, each rank's in the given order.

    Parameters
    ----------
    pairs : Sequence of (str, str)
        The ``(block, method)`` pairs in the one-process run's order.
    world_size : int
        The number of processes.

    Returns
    -------
    list of list of (str, str)
        Rank ``r``'s pairs at index ``r``.

    Raises
    ------
    ValueError
        If ``world_size`` is not a positive int, or is larger than the number of pairs (a process
        would have nothing to train).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if world_size > len(pairs):
        raise ValueError(
            f"{world_size} processes for {len(pairs)} replacements (blocks × methods): run at most {len(pairs)} "
            "processes, so that each trains at least one"
        )
    return [list(pairs[rank::world_size]) for rank in range(world_size)]


def process_checkpoint(path: str | os.PathLike, world: ProcessWorld | None = None) -> Path:
    """The checkpoint file of this process: ``path`` alone, ``path.rank<r>-of-<n>`` in a group of ``n``.

    ``world`` defaults to [`process_world`][mumoe_tn.distillation.process_shares.process_world]().
    """
    path = Path(path)
    world = process_world() if world is None else world
    if world is None:
        return path
    rank, size = world
    return path.with_name(f"{path.name}.rank{rank}-of-{size}")


def check_resume_files(path: str | os.PathLike, world: ProcessWorld | None) -> None:
    """Refuse to start afresh where the checkpoint of another number of processes lies beside ``path``.

    ``distill(resume=True)`` starts afresh when this process's file
    ([`process_checkpoint`][mumoe_tn.distillation.process_shares.process_checkpoint]) is missing;
    when files of another number of processes are there instead, that is a resume with the wrong
    number of processes, not a new run.

    Raises
    ------
    ValueError
        Naming the files found and the number of processes that wrote them.
    """
    path = Path(path)
    if process_checkpoint(path, world).exists():
        return
    size = 1 if world is None else world[1]
    found = [path] if world is not None and path.exists() else []
    if path.parent.is_dir():
        found += sorted(
            other for other in path.parent.glob(f"{glob_escape(path.name)}.rank*-of-*")
            if not other.name.endswith(f"-of-{size}")
        )  # fmt: skip
    if found:
        wrote = "one process" if found[0] == path else f"{found[0].name.rpartition('-of-')[2]} processes"
        raise ValueError(
            f"there is no checkpoint for a run of {size} process(es) at {str(process_checkpoint(path, world))!r}, but "
            f"{str(found[0])!r} was written by {wrote}: resume with as many processes"
        )


class BatchDigest:
    """A CRC-32 of the batches a process read, to tell whether every process was given the same ones.

    Each tensor of a batch (of a mapping, in key order, with its key) adds its dtype, shape and
    bytes (read on the host); other values of a mapping add their key only.

    Parameters
    ----------
    enabled : bool, optional
        False: ``update`` does nothing (one process has no other to compare with).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.value, self.enabled = 0, enabled

    def update(self, batch: object) -> None:
        """Add ``batch`` (a tensor, or a mapping of the model's keyword arguments); None adds nothing."""
        if not self.enabled or batch is None:
            return
        items = sorted(batch.items(), key=lambda item: str(item[0])) if isinstance(batch, Mapping) else [("", batch)]
        for key, value in items:
            self.value = zlib.crc32(str(key).encode(), self.value)
            if isinstance(value, torch.Tensor):
                tensor = value.detach().cpu().contiguous()
                self.value = zlib.crc32(f"{tensor.dtype}{tuple(tensor.shape)}".encode(), self.value)
                self.value = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), self.value)


@contextmanager
def joined_process_group(environ: Mapping[str, str] | None = None) -> Iterator[ProcessWorld | None]:
    """The process group ``torchrun`` describes in the environment, joined for the block, then left.

    With ``WORLD_SIZE`` above 1 and no group yet, a gloo group is initialised from the environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and destroyed after the block; a
    group the caller initialised is used and left alone. Yields ``(rank, world_size)``, or None for
    one process.

    Raises
    ------
    ValueError
        If ``WORLD_SIZE`` is not a positive int, or above 1 without ``torch.distributed``.
    """
    environ = os.environ if environ is None else environ
    size = environ.get("WORLD_SIZE", "1")
    if not size.strip().isdigit() or int(size) < 1:
        raise ValueError(f"the environment's WORLD_SIZE must be a positive int, got {size!r}")
    if int(size) > 1 and not dist.is_available():
        raise ValueError(f"WORLD_SIZE is {size} but this build of torch has no torch.distributed")
    joined = int(size) > 1 and not dist.is_initialized()
    if joined:
        dist.init_process_group("gloo")
    try:
        yield process_world()
    finally:
        if joined:
            dist.destroy_process_group()


@contextmanager
def outcomes_shared(
    world: ProcessWorld | None, *, checkpoint: Path | None, tokens: int, trained: Callable[[], int]
) -> Iterator[None]:
    """Run a process's share, then tell every process how every other one ended.

    A process whose share raised tells the others, then raises its error. A process that
    finished raises when another did not: ``DistillationStopped`` (its own checkpoint, holding its
    finished share) when one stopped on request, else a ``RuntimeError`` naming the rank and
    its error. Without a group (``world`` None) the block just runs.
    """
    if world is None:
        yield
        return
    try:
        yield
    except DistillationStopped:
        _exchange(("stopped", ""))
        raise
    except Exception as error:
        _exchange(("failed", f"{type(error).__name__}: {error}"))
        raise
    outcomes = _exchange(("finished", ""))
    failed = [(rank, message) for rank, (kind, message) in enumerate(outcomes) if kind == "failed"]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"the distillation failed in the process of rank {rank}: {message}")
    if any(kind == "stopped" for kind, _ in outcomes):
        raise DistillationStopped(checkpoint, trained(), tokens)


def _exchange(outcome: tuple[str, str]) -> list[tuple[str, str]]:
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    return outcomes


def gather_replacements(
    world: ProcessWorld,
    modules: Mapping[tuple[str, str], nn.Module],
    losses: Mapping[tuple[str, str], float],
    counters: Mapping[str, int],
    build: Callable[[str, str], nn.Module],
) -> tuple[dict[tuple[str, str], nn.Module], dict[tuple[str, str], float], list[dict[str, int]]] | None:
    """Gather every process's trained replacements, losses and counters on rank 0.

    Parameters
    ----------
    world : ProcessWorld
    modules : Mapping
        ``(block, method) -> trained module`` of this process.
    losses : Mapping
        ``(block, method) -> loss`` of this process.
    counters : Mapping
        This process's ``tokens``, ``steps``, ``peak_buffer_rows``, ``buffer_bytes`` and
        ``batches`` (the [`BatchDigest`][mumoe_tn.distillation.process_shares.BatchDigest] of the
        batches it trained on).
    build : Callable
        ``build(block, method)`` makes a replacement as its factory does, for a state to load into.

    Returns
    -------
    tuple or None
        On rank 0: every pair's module (its own, and the others' rebuilt and loaded), every pair's
        loss and every rank's counters; None on the other ranks.

    Raises
    ------
    ValueError
        On every rank, when the processes trained on different numbers of tokens or different
        batches.
    """
    rank, size = world
    summaries: list[Any] = [None] * size
    dist.all_gather_object(summaries, dict(counters))
    trained = [summary["tokens"] for summary in summaries]
    digests = [summary["batches"] for summary in summaries]
    if len(set(trained)) > 1 or len(set(digests)) > 1:
        found = f"{trained} tokens" if len(set(trained)) > 1 else f"batches of CRC-32 {digests}"
        raise ValueError(
            f"the processes trained on different data ({found} by rank): every process must be given the same "
            "batches (do not split the data by rank)"
        )
    states = {
        pair: {name: tensor.detach().cpu() for name, tensor in module.state_dict().items()}
        for pair, module in modules.items()
    }  # on the host: a process's device means nothing to rank 0
    shares: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object({"states": states, "losses": dict(losses)}, shares, dst=0)
    if rank != 0 or shares is None:
        return None
    gathered, gathered_losses = dict(modules), dict(losses)
    for share in shares[1:]:
        for (block, method), state in share["states"].items():
            module = build(block, method)
            module.load_state_dict(state)
            gathered[block, method] = module
        gathered_losses.update(share["losses"])
    return gathered, gathered_losses, summaries
