"""Resume files are data: a distillation checkpoint is checked field by field before any of the run loads.

Each probe is a genuine checkpoint with one field changed; resuming from it must raise the
library's ``ValueError`` naming the field, quickly, with the run's replacements and optimisers as
they were built. The probes that crashed torch's fused AdamW run in a child process, so a
regression fails the test instead of killing the suite.
"""

import io
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from test_training import ToyLM, _batches, _Failing, _Interrupted

from mumoe_tn.distillation.losses import AuxK
from mumoe_tn.distillation.replacements import mumoe_factory
from mumoe_tn.distillation.training import distill
from mumoe_tn.distillation.transcoders import Transcoder

#: Seconds a refusal may take: a hang guard, not a benchmark.
QUICK = 5.0

#: Three steps of 32 tokens; the buffer of 64 rows ends holding 32.
OPTIONS = dict(tokens=96, batch_size=32, buffer_tokens=64, seed=1, progress=False)

#: The documented bound for this run: 8 × the transcoder's tensor bytes (encoder 32×8 + 32, decoder
#: 8×32 + 8 float32) + 64 buffered rows × (8 + 8) features × 8 bytes + 16 MiB.
LIMIT = 8 * (32 * 8 + 32 + 8 * 32 + 8) * 4 + 64 * (8 + 8) * 8 + (16 << 20)


class Run:
    """A distillation whose factories keep what they built: each module with its first weights, each optimiser."""

    def __init__(self):
        self.modules, self.optimizers = [], []

    def replacement(self, block):
        module = Transcoder(block.in_features, 32, block.out_features, k=4)
        self.modules.append((module, {key: value.clone() for key, value in module.state_dict().items()}))
        return module

    def optimizer(self, parameters):
        optimizer = torch.optim.AdamW(parameters, lr=1e-3, fused=True)
        self.optimizers.append(optimizer)
        return optimizer

    def distill(self, path, **options):
        return distill(ToyLM(), _batches(), {"tc": self.replacement}, optimizer=self.optimizer, checkpoint=path,
                       **{**OPTIONS, **options})  # fmt: skip

    def unchanged(self):
        """Whether the run's replacements hold their first weights and its optimisers no state."""
        weights = all(
            torch.equal(value, first[key])
            for module, first in self.modules
            for key, value in module.state_dict().items()
        )
        return bool(self.modules) and weights and all(not optimizer.state for optimizer in self.optimizers)


def resume(path):
    """Resume a fresh run from ``path``; returns the refusal's message (None if it resumed) and whether it changed."""
    run = Run()
    try:
        run.distill(path, resume=True)
    except ValueError as error:
        assert type(error) is ValueError, type(error)
        return str(error), run.unchanged()
    return None, run.unchanged()


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    path = tmp_path_factory.mktemp("genuine") / "distill.pt"
    Run().distill(path)
    return path


def _tampered(genuine, path, edit):
    state = torch.load(genuine, weights_only=True)
    edit(state)
    torch.save(state, path)
    return path


def _set(*keys, value):
    def edit(state):
        for key in keys[:-1]:
            state = state[key]
        state[keys[-1]] = value

    return edit


def _adam(key, value):
    return _set("optimizers", "mlp/tc", "state", 0, key, value=value)


def _generator(left, after):
    def edit(state):
        raw = bytearray(state["generator"].numpy().tobytes())
        raw[8:12], raw[16:24] = left.to_bytes(4, "little", signed=True), after.to_bytes(8, "little")
        state["generator"] = torch.frombuffer(raw, dtype=torch.uint8).clone()

    return edit


def test_a_genuine_checkpoint_resumes(genuine, tmp_path):
    """The harness itself: the untouched file resumes (the probes below fail for their field, not the harness)."""
    path = tmp_path / "distill.pt"
    path.write_bytes(genuine.read_bytes())
    assert os.path.getsize(path) < LIMIT
    run = Run()
    assert run.distill(path, resume=True).steps == 3
    assert not run.unchanged()  # the checkpoint's weights and moments were loaded


_CHILD = """
import os, resource, sys
from test_resume_files import resume
if os.path.exists("/proc/self/status"):  # 1 GiB more address space: a regression fails, not the machine
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
for path in sys.argv[1:]:
    message, unchanged = resume(path)
    print("REFUSED" if message else "RESUMED", unchanged, message, flush=True)
print("PEAK_MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def test_moments_that_would_crash_the_fused_optimiser_are_refused_in_a_child_that_exits_normally(genuine, tmp_path):
    """A short moment wrote past its buffer (SIGSEGV, ``free(): invalid next size``); a stride-0 one too.

    The stride-0 float64 30000² moment would have been cast to a 3.6 GB float32 one; the
    generator state reading words 624 to 1,246 of 624 is accepted by torch itself.
    """
    probes = {
        "short": (_adam("exp_avg", torch.zeros(4)),
                  r"optimiser state 'mlp/tc' parameter 0 'exp_avg': shape (4,) but the parameter has shape (32, 8)"),
        "stride-0": (_adam("exp_avg_sq", torch.zeros(1).expand(32, 8)),
                     "'exp_avg_sq': strides (0, 0) of shape (32, 8): it must be contiguous"),
        "huge": (_adam("exp_avg", torch.zeros(1, dtype=torch.float64).expand(30000, 30000)),
                 "'exp_avg': shape (30000, 30000) but the parameter has shape (32, 8)"),
        "generator": (_generator(624, 624), "generator: its Mersenne Twister would read words 624 to 1,246 of its 624"),
    }  # fmt: skip
    paths = [str(_tampered(genuine, tmp_path / f"{name}.pt", edit)) for name, (edit, _) in probes.items()]
    here = Path(__file__).parent
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here), str(here.parent)]),
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
    child = subprocess.run([sys.executable, "-c", _CHILD, *paths], capture_output=True, text=True, timeout=240,
                           env=environment, cwd=tmp_path)  # fmt: skip
    assert child.returncode == 0, (child.returncode, child.stdout[-2000:], child.stderr[-2000:])  # not a signal
    lines = child.stdout.splitlines()
    assert len(lines) == len(probes) + 1, child.stdout[-2000:]
    for line, (name, (_, expected)) in zip(lines, probes.items(), strict=False):
        assert line.startswith("REFUSED True "), (name, line)
        assert expected in line, (name, line)
    assert int(lines[-1].split()[1]) < 1500  # no probe's declared size was allocated


def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    path = tmp_path / "distill.pt"
    os.mkfifo(path)
    # a writer that would release a reader blocked on the FIFO: a regression fails here instead of hanging
    writer = threading.Thread(target=lambda: open(path, "wb").close(), daemon=True)
    writer.start()
    start = time.perf_counter()
    message, unchanged = resume(path)
    assert time.perf_counter() - start < QUICK
    assert message is not None and f"the distillation checkpoint {path} is not a regular file" in message
    assert unchanged
    assert writer.is_alive()  # nobody opened the FIFO for reading
    os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # let the writer finish
    writer.join(QUICK)


def test_links_directories_and_files_over_the_size_limit_are_refused_unread(genuine, tmp_path):
    copy = tmp_path / "copy.pt"
    copy.write_bytes(genuine.read_bytes())
    linked = tmp_path / "linked.pt"
    linked.symlink_to(copy)
    message, unchanged = resume(linked)
    assert "is a symbolic link" in message and unchanged
    second = tmp_path / "second.pt"
    os.link(copy, second)
    message, unchanged = resume(second)
    assert "has 2 hard links" in message and unchanged
    os.unlink(second)
    directory = tmp_path / "directory.pt"
    directory.mkdir()
    message, unchanged = resume(directory)
    assert "is not a regular file" in message and unchanged
    large = tmp_path / "large.pt"
    with open(large, "wb") as sparse:
        sparse.truncate(LIMIT + 1)
    start = time.perf_counter()
    message, unchanged = resume(large)
    assert time.perf_counter() - start < QUICK
    assert f"is {LIMIT + 1:,} bytes, more than the {LIMIT:,} a checkpoint" in message and unchanged
    with open(large, "r+b") as sparse:
        sparse.truncate(LIMIT)  # at the limit it is read: zeros are no checkpoint
    message, unchanged = resume(large)
    assert "is not a readable distillation checkpoint" in message and unchanged


def _deflated(data):
    """The same archive with every record compressed (torch reads it; the records inflate)."""
    source, target = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(target, "w") as archive:
        for name in source.namelist():
            archive.writestr(name, source.read(name), compress_type=zipfile.ZIP_DEFLATED)
    return target.getvalue()


def test_a_compressed_record_is_refused_before_its_storage_is_allocated(genuine, tmp_path):
    path = _tampered(
        genuine, tmp_path / "distill.pt", _set("buffer", "x", "mlp", value=torch.zeros(10**7)[:256].view(32, 8))
    )
    path.write_bytes(_deflated(path.read_bytes()))
    assert os.path.getsize(path) < 10**6  # 40 MB of storage in a small file
    message, unchanged = resume(path)
    assert "its tensors declare 40,0" in message and "refused before any was allocated" in message and unchanged


_FIELDS = {
    "not a mapping": (lambda state: state.clear(), "is not a distillation checkpoint"),
    "missing key": (lambda state: state.pop("counters"), "the checkpoint: missing ['counters']"),
    "extra key": (_set("code", value="os.system"), "the checkpoint: missing [], unexpected ['code']"),
    "list config": (_set("config", value=[1, 2]), "config: a list where a mapping belongs"),
    "tensor in config": (_set("config", "seed", value=torch.ones(3)),
                         "config['seed']: a Tensor: the configuration is plain data"),
    "draining nan": (_set("draining", value="nan"), "draining: 'nan' where a whole number in [-1, 63] belongs"),
    "draining huge": (_set("draining", value=2**200), f"draining: {2**200} where a whole number"),
    "draining bool": (_set("draining", value=True), "draining: True where a whole number"),
    "short generator": (_set("generator", value=torch.zeros(3, dtype=torch.uint8)),
                        "generator: dtype torch.uint8, shape (3,) where torch's CPU generator state (uint8, (5056,))"),
    "unseeded generator": (_generator(0, 0), "generator: its Mersenne Twister would read"),
    "junk schedule": (_set("schedules", "mlp/tc", value={"optimizer": 1}), "schedule 'mlp/tc': missing ['base_lrs'"),
    "schedule field": (_set("schedules", "mlp/tc", "last_epoch", value="x"),
                       "schedule 'mlp/tc' 'last_epoch': 'x' where a finite number"),
    "schedule lambda": (_set("schedules", "mlp/tc", "lr_lambdas", value=[{"func": 1}]),
                        "schedule 'mlp/tc' 'lr_lambdas'[0]: missing [], unexpected ['func']"),
    "two-element step": (_adam("step", torch.tensor([1.0, 2.0])),
                         "parameter 0 'step': shape (2,), dtype torch.float32: a step is a 0-dim float tensor"),
    "nan step": (_adam("step", torch.tensor(float("nan"))), "parameter 0 'step': nan where a whole number of steps"),
    "step past the run": (_adam("step", torch.tensor(4.0)),
                          "parameter 0 'step': 4.0 where a whole number of steps in [0, 3]"),
    "missing moment": (lambda state: state["optimizers"]["mlp/tc"]["state"][1].pop("exp_avg_sq"),
                       "parameter 1: missing ['exp_avg_sq']"),
    "moment dtype": (_adam("exp_avg", torch.zeros(32, 8, dtype=torch.float64)),
                     "'exp_avg': dtype torch.float64 but the parameter has dtype torch.float32"),
    "transposed moment": (_adam("exp_avg", torch.zeros(8, 32).t()), "'exp_avg': strides (1, 32) of shape (32, 8)"),
    "unknown parameter": (_set("optimizers", "mlp/tc", "state", 9, value={}), "state: key 9 names none of the 4"),
    "infinite lr": (_set("optimizers", "mlp/tc", "param_groups", 0, "lr", value=float("inf")),
                    "param_groups[0] 'lr': inf where a finite number"),
    "amsgrad flipped": (_set("optimizers", "mlp/tc", "param_groups", 0, "amsgrad", value=True),
                        "param_groups[0] 'amsgrad': True but the live run has False"),
    "tensor ids": (_set("optimizers", "mlp/tc", "param_groups", 0, "params", value=torch.arange(4)),
                   "param_groups[0] 'params': a tensor of shape (4,) but the group's parameters are [0, 1, 2, 3]"),
    "tensor format": (_set("format", value=torch.ones(3)), "is not a distillation checkpoint"),
    "two groups": (lambda state: state["optimizers"]["mlp/tc"]["param_groups"].append({}),
                   "param_groups: [{'lr'"),
    "module dtype": (_set("modules", "mlp/tc", "encoder.bias", value=torch.zeros(32, dtype=torch.float64)),
                     "modules 'mlp/tc' 'encoder.bias': dtype torch.float64 but the module's tensor has dtype"),
    "module extra": (_set("modules", "mlp/tc", "extra", value=torch.zeros(1)),
                     "modules 'mlp/tc': missing [], unexpected ['extra']"),
    "module not a tensor": (_set("modules", "mlp/tc", "encoder.bias", value=[0.0] * 32),
                            "'tc' of 'mlp' has encoder.bias of shape (32,) now, a list in the checkpoint"),
    "loss state": (_set("losses", "mlp/tc", "normalised-mse", "idle", value=torch.zeros(10**4)),
                   "loss state 'mlp/tc' 'normalised-mse' 'idle': 10,000 entries, more than the replacement's 552"),
    "wide rows": (_set("buffer", "x", "mlp", value=torch.zeros(32, 9)),
                  "buffer 'x' 'mlp': shape (32, 9) where (rows ≤ 64, 8)"),
    "uneven rows": (_set("buffer", "y", "mlp", value=torch.zeros(16, 8)), "buffer: rows [16, 32]"),
    "trained": (_set("counters", "trained", value=64), "counters 'trained': 64 but 3 steps of 32 train on 96"),
    "harvested": (_set("counters", "harvested", value=10**18), "counters 'harvested': 1000000000000000000 where"),
    "long key": (_set("modules", "mlp/tc", "k" * 100_000, value=torch.zeros(1)),
                 "modules 'mlp/tc': missing [], unexpected ['kkkk"),
}  # fmt: skip


@pytest.mark.parametrize("field", sorted(_FIELDS))
def test_a_malformed_field_gets_the_library_error_naming_it(genuine, tmp_path, field):
    edit, expected = _FIELDS[field]
    path = _tampered(genuine, tmp_path / "distill.pt", edit)
    start = time.perf_counter()
    message, unchanged = resume(path)
    assert time.perf_counter() - start < QUICK
    assert message is not None and expected in message, message
    assert len(message) <= 700
    assert unchanged


def test_a_loss_terms_state_for_other_units_gets_the_library_error_when_it_runs(tmp_path):
    """The aux-k term's idle counters pass the generic checks (a whole tensor, fewer entries than parameters)."""
    methods = {"cp": mumoe_factory("cp", 8, 2, 600, aux_k=AuxK(dead_after=64))}
    options = {**OPTIONS, "tokens": 192}
    path = tmp_path / "distill.pt"
    with pytest.raises(_Interrupted):
        distill(ToyLM(), _Failing(_batches(), 2), methods, checkpoint=path, checkpoint_every=1, **options)
    _tampered(path, path, _set("losses", "mlp/cp", "aux-k", "idle", value=torch.zeros(3, dtype=torch.int64)))
    with pytest.raises(
        ValueError, match=r"'aux-k' term's state 'idle' has shape \(3,\), but the replacement has 8 units"
    ):
        distill(ToyLM(), _batches(), methods, checkpoint=path, resume=True, **options)
