"""Distillation across processes: two gloo ranks on CPU against one process, and the share of each rank.

One job spawns two ranks once and runs every distributed check: the gathered replacements of a
two-process run against the one-process run of the same seeds (parameter for parameter, and the
losses), a stop in one rank and the resume of both from their own checkpoints, and a failure in
one rank that the other reports instead of waiting.
"""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mumoe_tn.distillation.interruption import DistillationStopped
from mumoe_tn.distillation.process_shares import (
    BatchDigest,
    assign_replacements,
    check_resume_files,
    joined_process_group,
    process_checkpoint,
    process_world,
)
from mumoe_tn.distillation.replacements import mumoe_factory
from mumoe_tn.distillation.training import distill
from mumoe_tn.distillation.transcoders import Transcoder

WORLD = 2
TOKENS = 512
SETTINGS = {"mlps": r"mlp\d$", "tokens": TOKENS, "batch_size": 32, "buffer_tokens": 128, "seed": 3,
            "progress": False}  # fmt: skip


class TwoBlockLM(nn.Module):
    """Embedding → two residual MLP blocks of different widths → head."""

    def __init__(self, vocab=32, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.mlp1 = nn.Sequential(nn.Linear(width, 16), nn.GELU(), nn.Linear(16, width))
        self.mlp2 = nn.Sequential(nn.Linear(width, 12), nn.GELU(), nn.Linear(12, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        h = h + self.mlp1(h)
        return self.head(h + self.mlp2(h))


def _batches(count=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (4, 16), generator=generator) for _ in range(count)]


def _methods():
    """Three methods over two blocks: each rank trains three of the six replacements, of both blocks."""
    return {
        "tc4": lambda block: Transcoder(block.in_features, 24, block.out_features, k=4),
        "tc2": lambda block: Transcoder(block.in_features, 16, block.out_features, k=2),
        "cp": mumoe_factory("cp", 4, 2, 400),
    }


def _run(methods=None, **options):
    return distill(TwoBlockLM(), _batches(), methods or _methods(), **SETTINGS, **options)


def _one_method():
    """One method over two blocks: each rank streams and trains one block."""
    return {"tc4": _methods()["tc4"]}


def _flat(result):
    """Every replacement's parameters and buffers, and every loss, keyed by block/method."""
    states = {
        f"{block}/{method}/{name}": tensor.detach().clone()
        for block, methods in result.replacements.items()
        for method, module in methods.items()
        for name, tensor in module.state_dict().items()
    }
    losses = {
        f"{block}/{method}": value for block, methods in result.losses.items() for method, value in methods.items()
    }
    return {"states": states, "losses": losses, "tokens": result.tokens, "steps": result.steps}


class _StopAfter:
    """A stop request after ``calls`` questions (``stop=`` of distill)."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self):
        self.calls -= 1
        return self.calls < 0


class _FailAfter(_StopAfter):
    def __call__(self):
        if super().__call__():
            raise RuntimeError("the data source went away")
        return False


def _worker(rank, world, port, directory):
    """Every check in one pair of processes, which join the group from the environment as under torchrun."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with joined_process_group() as joined:
        results = _checks(rank, joined, directory)
        dist.barrier()  # no rank leaves the group while another still talks to it
    results["left"] = dist.is_initialized()
    torch.save(results, os.path.join(directory, f"rank{rank}.pt"))


def _checks(rank, joined, directory):
    results = {"world": joined, "whole": _flat(_run())}
    by_block = _run(_one_method())
    results["by_block"] = {**_flat(by_block), "buffer_bytes": by_block.buffer_bytes}
    checkpoint = os.path.join(directory, "run.pt")
    # rank 1 stops early; rank 0 finishes its share, then learns of the stop and stops too
    try:
        _run(checkpoint=checkpoint, checkpoint_every=3, stop=_StopAfter(5) if rank == 1 else None)
    except DistillationStopped as stopped:
        results["stopped"] = (str(stopped.checkpoint), stopped.trained)
    results["resumed"] = _flat(_run(checkpoint=checkpoint, checkpoint_every=3, resume=True))
    try:
        _run(stop=_FailAfter(4) if rank == 1 else None)
    except RuntimeError as error:
        results["failure"] = str(error)

    def unbuildable(block):  # fails in rank 1, before any process streams a batch
        if rank == 1:
            raise ValueError(f"no replacement for {block.name}")
        return Transcoder(block.in_features, 16, block.out_features, k=2)

    try:
        distill(TwoBlockLM(), _batches(), {"tc4": _methods()["tc4"], "bad": unbuildable}, **SETTINGS)
    except (ValueError, RuntimeError) as error:
        results["unbuilt"] = str(error)
    try:  # the data split by rank: as many tokens, other ones
        distill(TwoBlockLM(), _batches(seed=rank), _methods(), **SETTINGS)
    except ValueError as error:
        results["split"] = str(error)
    with joined_process_group() as again:  # a group already joined is used and left alone
        results["again"] = (again, dist.is_initialized())
    return results


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The ranks' results (one dict per rank) and the job's folder."""
    for attempt in range(2):
        directory = tmp_path_factory.mktemp("distributed-distill")
        try:
            mp.spawn(_worker, args=(WORLD, _free_port(), str(directory)), nprocs=WORLD, join=True)
            break
        except mp.ProcessExitedException as error:
            # A rank killed by a signal (SIGABRT from gloo's threads, or a port taken between probing and
            # binding it on a busy machine) is the job's environment, not its result: run it once more.
            if error.signal_name is None or attempt == 1:
                raise
    return [torch.load(directory / f"rank{r}.pt", weights_only=True) for r in range(WORLD)], directory


@pytest.fixture(scope="module")
def one_process():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _flat(_run())
    finally:
        torch.set_num_threads(threads)


def _assert_same(got, want, *, losses=True):
    assert list(got["states"]) == list(want["states"])  # every replacement, in the one-process order
    for name, tensor in want["states"].items():
        assert torch.equal(got["states"][name], tensor), name
    if losses:
        assert got["losses"] == want["losses"]
    assert (got["tokens"], got["steps"]) == (want["tokens"], want["steps"]) == (TOKENS, TOKENS // 32)


def test_two_processes_train_the_replacements_of_one(job, one_process):
    (first, second), _ = job
    assert first["world"] == (0, WORLD) and second["world"] == (1, WORLD)
    assert first["again"] == ((0, WORLD), True) and not first["left"] and not second["left"]
    _assert_same(first["whole"], one_process)
    # rank 1 keeps its own share only: the pairs 1, 3, 5 of the one-process order
    shared = {key.rsplit("/", 1)[0] for key in second["whole"]["states"]}
    assert shared == {"mlp1/tc2", "mlp2/tc4", "mlp2/cp"}


def test_a_process_streams_only_the_blocks_of_its_share(job):
    (first, second), _ = job
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _run(_one_method())
    finally:
        torch.set_num_threads(threads)
    _assert_same(first["by_block"], _flat(alone))
    assert {key.rsplit("/", 1)[0] for key in second["by_block"]["states"]} == {"mlp2/tc4"}
    # rank 0 sums the buffers: one block's rows in each process, both blocks' in one
    assert first["by_block"]["buffer_bytes"] == alone.buffer_bytes
    assert second["by_block"]["buffer_bytes"] == alone.buffer_bytes // 2  # the blocks are as wide


def test_a_stop_in_one_process_stops_both_and_both_resume_to_the_same_replacements(job, one_process):
    (first, second), directory = job
    (where_first, trained_first), (where_second, trained_second) = first["stopped"], second["stopped"]
    assert trained_first == TOKENS and 0 < trained_second < TOKENS
    assert Path(where_first).name == "run.pt.rank0-of-2" and Path(where_second).name == "run.pt.rank1-of-2"
    assert not (directory / "run.pt").exists()
    # a resumed run reports the losses of the steps it took itself (as in one process)
    _assert_same(first["resumed"], one_process, losses=False)


def test_a_failure_in_one_process_is_raised_in_the_other(job):
    (first, second), _ = job
    assert second["unbuilt"] == "no replacement for mlp1"
    assert first["unbuilt"] == "the distillation failed in the process of rank 1: ValueError: no replacement for mlp1"
    assert second["failure"] == "the data source went away"
    assert (
        first["failure"] == "the distillation failed in the process of rank 1: RuntimeError: the data source went away"
    )


def test_processes_given_different_batches_are_refused(job):
    (first, second), _ = job
    for results in (first, second):
        assert results["split"].startswith("the processes trained on different data (batches of CRC-32 [")
        assert "every process must be given the same batches (do not split the data by rank)" in results["split"]


# ----------------------------------------------------------------------------- the share of each rank
def test_pairs_go_round_robin_to_the_ranks():
    pairs = [(block, method) for block in ("a", "b", "c") for method in ("x", "y")]
    assert assign_replacements(pairs, 1) == [pairs]
    assert assign_replacements(pairs, 2) == [
        [("a", "x"), ("b", "x"), ("c", "x")],
        [("a", "y"), ("b", "y"), ("c", "y")],
    ]
    assert assign_replacements(pairs, 4) == [
        [("a", "x"), ("c", "x")],
        [("a", "y"), ("c", "y")],
        [("b", "x")],
        [("b", "y")],
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 6])
def test_every_pair_goes_to_exactly_one_rank(world):
    pairs = [(f"block{b}", f"method{m}") for b in range(2) for m in range(3)]
    shares = assign_replacements(pairs, world)
    assert len(shares) == world and all(shares)
    assert sorted(pair for share in shares for pair in share) == sorted(pairs)


def test_more_processes_than_replacements_or_a_bad_world_size_is_refused():
    pairs = [("a", "x"), ("b", "x")]
    with pytest.raises(ValueError, match="3 processes for 2 replacements"):
        assign_replacements(pairs, 3)
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="world_size must be a positive int"):
            assign_replacements(pairs, bad)


def test_each_process_has_its_own_checkpoint_file(tmp_path):
    assert process_world() is None  # no process group in this process
    assert process_checkpoint(tmp_path / "run.pt") == tmp_path / "run.pt"
    assert process_checkpoint(tmp_path / "run.pt", (1, 4)) == tmp_path / "run.pt.rank1-of-4"


def test_one_process_joins_no_group_and_a_bad_world_size_is_refused():
    with joined_process_group({"WORLD_SIZE": "1"}) as world:
        assert world is None and not dist.is_initialized()
    for bad in ("0", "two", "-2"):
        with pytest.raises(ValueError, match=f"WORLD_SIZE must be a positive int, got '{bad}'"):
            with joined_process_group({"WORLD_SIZE": bad}):
                pass


def _digest(*batches, enabled=True):
    digest = BatchDigest(enabled)
    for batch in batches:
        digest.update(batch)
    return digest.value


def test_the_batch_digest_tells_batches_apart():
    ids = torch.arange(12).reshape(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    assert _digest(ids) == _digest(ids.clone()) != 0
    assert _digest(ids) != _digest(ids + 1)
    assert _digest(ids) != _digest(ids.reshape(4, 3))  # the same bytes in another shape
    assert _digest(ids) != _digest(ids.to(torch.int32))
    assert _digest(ids, ids + 1) != _digest(ids + 1, ids)  # order counts
    assert _digest({"input_ids": ids, "attention_mask": mask}) == _digest({"attention_mask": mask, "input_ids": ids})
    assert _digest({"input_ids": ids}) != _digest({"labels": ids})
    assert _digest(ids, None) == _digest(ids)
    assert _digest(ids, enabled=False) == 0


def test_a_resume_with_another_number_of_processes_is_refused(tmp_path):
    plain, shard = tmp_path / "run.pt", tmp_path / "run.pt.rank1-of-2"
    shard.write_bytes(b"")
    one = r"for a run of 1 process\(es\) at '.*/run\.pt', but '.*/run\.pt\.rank1-of-2' was written by 2 processes"
    with pytest.raises(ValueError, match=one + ": resume with as many processes"):
        _run(checkpoint=plain, resume=True)
    check_resume_files(plain, (1, 2))  # this process's own file is there
    check_resume_files(plain, (0, 2))  # another rank's only: this one starts afresh
    with pytest.raises(ValueError, match=r"/run\.pt\.rank1-of-2' was written by 2 processes"):
        check_resume_files(plain, (0, 3))
    plain.write_bytes(b"")
    with pytest.raises(ValueError, match=r"at '.*/run\.pt\.rank0-of-3', but '.*/run\.pt' was written by one process"):
        check_resume_files(plain, (0, 3))
    check_resume_files(tmp_path / "new" / "run.pt", (0, 2))  # nothing there: a new run
