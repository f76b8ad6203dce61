"""Resume files read as data: a distillation checkpoint checked field by field before anything loads.

A run resumed from a file trusts nothing in it. Before the file is opened its path must name a
regular file itself (not a link, a FIFO, a device or a directory) with one hard link and at most
[`checkpoint_size_limit`][mumoe_tn.distillation.resume_checks.checkpoint_size_limit] bytes; it is
then read once, through one descriptor. Its pickle is unpickled with torch's allow-list loader
twice: first onto the meta device, where every field is checked and the storage sizes the
tensors declare are held against the file's size before any is allocated (a compressed record
could otherwise inflate), then onto the CPU, where every field is checked again with its values.

Every field is held against the live run it would be loaded into: the top-level keys and their
types, the configuration, every module tensor (shape, dtype, dense strided layout, inside its
storage), the optimisers' parameter groups (their number, the parameter ids, every hyperparameter
of the live group's type, finite, with the live group's flags) and per-parameter state (every
tensor entry shaped, typed and laid out as its parameter, ``step`` a finite non-negative whole
number), the schedules, the loss terms' state, the buffered rows, the generator's state (its
length and the positions its Mersenne Twister reads) and the counters. The first field that does
not fit is named in a ``ValueError`` and nothing of the run has changed: a fused optimiser never
sees a moment buffer smaller than its parameter, a stride-0 view or a generator that reads past
its state.
"""

from __future__ import annotations

import io
import math
import os
import stat
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mumoe_tn.conversion.persistence.bounds import SHARED_ALLOWANCE
from mumoe_tn.conversion.persistence.files import read_once
from mumoe_tn.conversion.persistence.storage import check_stored
from mumoe_tn.distillation.streaming import BlockInfo

if TYPE_CHECKING:
    from mumoe_tn.distillation.trainer import ReplacementTrainer

__all__ = [
    "BUFFER_ELEMENT_BYTES",
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_SLACK_BYTES",
    "CHECKPOINT_STATE_FACTOR",
    "checkpoint_size_limit",
    "read_checkpoint",
]

#: The version tag of a distillation checkpoint.
CHECKPOINT_FORMAT = "mumoe_tn.distill/1"

#: How many times the replacements' own tensor bytes a checkpoint may hold for them: the weights,
#: up to three optimiser moments of each (Adam's two, AMSGrad's maximum) and the loss terms'
#: counters (one int64 per unit, never more units than parameters), with room to spare.
CHECKPOINT_STATE_FACTOR = 8

#: Bytes per buffered activation a checkpoint may hold (float64's, the widest).
BUFFER_ELEMENT_BYTES = 8

#: Bytes a checkpoint may hold beyond its tensors: the pickle, the archive's headers, alignment.
CHECKPOINT_SLACK_BYTES = 16 << 20

_KEYS = ("format", "config", "modules", "optimizers", "schedules", "losses", "buffer", "generator", "counters",
         "draining")  # fmt: skip
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
_LARGEST_COUNT = 2**53  # a count beyond float64's whole numbers is no run's
_MESSAGE_CHARS = 600
_CONFIG_NODES = 100_000
_CONFIG_DEPTH = 32
# torch's CPU generator state: a 5,056-byte struct whose Mersenne Twister reads word ``next`` of its
# 624, ``left`` words before it draws new ones (int32 ``left`` at byte 8, ``seeded`` at 12, uint64
# ``next`` at 16). A state that reads past the words is refused; another length is torch's to check.
_GENERATOR_BYTES = 5056
_TWISTER_WORDS = 624


def checkpoint_size_limit(trainers: Iterable[ReplacementTrainer], blocks: Sequence[BlockInfo], capacity: int) -> int:
    """The most bytes a checkpoint of this run may have.

    ``CHECKPOINT_STATE_FACTOR`` times the replacements' tensor bytes (their state dicts), plus the
    fullest buffer (``capacity`` rows of every block's input and output at
    ``BUFFER_ELEMENT_BYTES`` each), plus ``CHECKPOINT_SLACK_BYTES``.
    """
    weights = sum(
        tensor.numel() * tensor.element_size()
        for trainer in trainers
        for tensor in trainer.module.state_dict().values()
    )
    rows = capacity * sum(block.in_features + block.out_features for block in blocks) * BUFFER_ELEMENT_BYTES
    return CHECKPOINT_STATE_FACTOR * weights + rows + CHECKPOINT_SLACK_BYTES


def read_checkpoint(
    path: Path,
    config: Mapping[str, Any],
    trainers: Mapping[tuple[str, str], ReplacementTrainer],
    blocks: Sequence[BlockInfo],
) -> dict[str, Any]:
    """Read the checkpoint at ``path`` and check every field against the run it would resume.

    Parameters
    ----------
    path : Path
        The checkpoint (written by [`distill`][mumoe_tn.distillation.training.distill]).
    config : Mapping
        The run's configuration (compared with the checkpoint's; ``tokens``, ``batch_size`` and
        ``buffer_tokens`` bound its counters and rows).
    trainers : Mapping
        ``(block, method) -> ReplacementTrainer`` of the live run (nothing of them changes).
    blocks : Sequence of BlockInfo
        The distilled blocks (their widths bound the buffered rows).

    Returns
    -------
    dict
        The checkpoint, checked, its module state dicts carrying the live modules' versions.

    Raises
    ------
    ValueError
        If the file is not a regular file of one link within the size limit, cannot be read, or
        a field does not fit the live run (the field is named).
    """
    path = Path(path)
    limit = checkpoint_size_limit(trainers.values(), blocks, config["buffer_tokens"])
    data = _read_file(path, limit)
    live = {f"{block}/{method}": trainer for (block, method), trainer in trainers.items()}
    declared = _Check(path, config, live, blocks, values=False)
    declared.checkpoint(_unpickle(data, "meta", path))
    stored = sum(tensor.untyped_storage().nbytes() for tensor in declared.tensors)
    if stored > SHARED_ALLOWANCE * len(data) + 4096:
        raise ValueError(
            f"the distillation checkpoint {path}: its tensors declare {stored:,} bytes of storage, more than a file "
            f"of {len(data):,} bytes holds: refused before any was allocated"
        )
    state = _unpickle(data, "cpu", path)
    _Check(path, config, live, blocks, values=True).checkpoint(state)
    state["modules"] = {
        key: _versioned(state["modules"][key], trainer.module.state_dict()) for key, trainer in live.items()
    }
    return state


def _read_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path``: a regular file itself, of one hard link and at most ``limit`` bytes, read once."""
    what = "the distillation checkpoint"
    try:
        status = os.lstat(path)
    except OSError as error:
        raise ValueError(f"{what} {path} cannot be read ({error.strerror})") from None
    if stat.S_ISLNK(status.st_mode):
        raise ValueError(f"{what} {path} is a symbolic link: resume from the file itself")
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"{what} {path} is not a regular file")
    if status.st_nlink != 1:
        raise ValueError(
            f"{what} {path} has {status.st_nlink} hard links: a checkpoint a run writes has one (copy it instead)"
        )
    if status.st_size > limit:
        raise ValueError(
            f"{what} {path} is {status.st_size:,} bytes, more than the {limit:,} a checkpoint of these replacements "
            "and this buffer can have"
        )
    read = read_once(path, what, limit=limit, follow=False)
    if read.identity[:2] != (status.st_dev, status.st_ino):
        raise ValueError(f"{what} {path} was replaced while it was read: resume once it is written")
    return read.data


def _unpickle(data: bytes, device: str, path: Path) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as error:  # a corrupt or foreign file: torch raises many kinds
        raise ValueError(
            f"{path} is not a readable distillation checkpoint ({type(error).__name__}: {str(error)[:200]})"
        ) from None


def _versioned(saved: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]) -> OrderedDict:
    """``saved`` with the live state dict's module versions: a file's ``_metadata`` never reaches a module."""
    state = OrderedDict(saved.items())
    state._metadata = getattr(live, "_metadata", OrderedDict())  # type: ignore[attr-defined]
    return state


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):  # its values are not read (the first pass has none)
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{value!r:.80}"


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Check:
    """One pass over a checkpoint: every field against the live run; ``values`` also reads tensor values."""

    def __init__(
        self,
        path: Path,
        config: Mapping[str, Any],
        live: Mapping[str, ReplacementTrainer],
        blocks: Sequence[BlockInfo],
        *,
        values: bool,
    ) -> None:
        self.path, self.config, self.live, self.blocks, self.values = path, config, live, blocks, values
        self.capacity: int = config["buffer_tokens"]
        self.tensors: list[torch.Tensor] = []
        self.steps = 0

    def refuse(self, field: str, problem: str) -> None:
        message = f"the distillation checkpoint {self.path}: {field}: {problem}"
        if len(message) > _MESSAGE_CHARS:
            message = message[: _MESSAGE_CHARS - 1] + "…"
        raise ValueError(message)

    def mapping(self, field: str, value: object, keys: Iterable[object] | None = None) -> Mapping:
        """``value`` if it is a dict (with exactly ``keys``, when given)."""
        if not isinstance(value, dict):
            self.refuse(field, f"a {type(value).__name__} where a mapping belongs")
        if keys is not None:
            expected = list(keys)
            known = set(expected)
            missing = [key for key in expected if key not in value]
            extra = [key for key in value if key not in known]
            if missing or extra:
                self.refuse(
                    field, f"missing {_short(missing[:5])}, unexpected {_short(extra[:5])}: expected {_short(expected)}"
                )
        return value

    def whole(self, field: str, value: object, low: int, high: int) -> int:
        if not _whole(value) or not low <= value <= high:
            self.refuse(field, f"{_short(value)} where a whole number in [{low:,}, {high:,}] belongs")
        return value

    def tensor(self, field: str, value: object, owner: str, like: torch.Tensor | None = None) -> torch.Tensor:
        """``value`` if it is a dense strided tensor inside its storage (shaped, typed and laid out as ``like``)."""
        if not isinstance(value, torch.Tensor):
            self.refuse(field, f"a {type(value).__name__} where a tensor belongs")
        if value.layout != torch.strided or value.is_nested or value.is_quantized:
            self.refuse(field, f"a {value.layout} tensor where a dense strided one belongs")
        if value.is_complex():
            self.refuse(field, f"dtype {value.dtype}: a checkpoint's tensors are real")
        if like is not None:
            if value.shape != like.shape:
                self.refuse(field, f"shape {tuple(value.shape)} but {owner} has shape {tuple(like.shape)}")
            if value.dtype != like.dtype:
                self.refuse(field, f"dtype {value.dtype} but {owner} has dtype {like.dtype}")
        if not value.is_contiguous() and (like is None or value.stride() != like.stride()):
            self.refuse(field, f"strides {value.stride()} of shape {tuple(value.shape)}: it must be contiguous")
        check_stored(field, value, f"the distillation checkpoint {self.path}")
        self.tensors.append(value)
        return value

    def finite(self, field: str, value: torch.Tensor) -> None:
        if self.values and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            self.refuse(field, "holds NaN or infinite values")

    # ------------------------------------------------------------------ the checkpoint, field by field
    def checkpoint(self, state: object) -> None:
        if (
            not isinstance(state, dict)
            or not isinstance(state.get("format"), str)
            or state["format"] != CHECKPOINT_FORMAT
        ):
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{self.path} is not a distillation checkpoint ({CHECKPOINT_FORMAT}; found {_short(found)})"
            )
        self.mapping("the checkpoint", state, _KEYS)
        self.run_config(state["config"])
        self.counters(state["counters"], state["draining"])
        self.modules(self.mapping("modules", state["modules"], self.live))
        self.optimizers(self.mapping("optimizers", state["optimizers"], self.live))
        self.schedules(self.mapping("schedules", state["schedules"], self.live))
        self.losses(self.mapping("losses", state["losses"], self.live))
        self.buffer(state["buffer"])
        self.generator(state["generator"])

    def run_config(self, saved: object) -> None:
        """Plain data (the run's configuration as written), then the same as this run's."""
        saved = self.mapping("config", saved)
        nodes = 0
        pending: list[tuple[str, object, int]] = [("config", saved, 0)]
        while pending:
            field, value, depth = pending.pop()
            nodes += 1
            if nodes > _CONFIG_NODES or depth > _CONFIG_DEPTH:
                self.refuse("config", f"more than {_CONFIG_NODES:,} entries or {_CONFIG_DEPTH} levels")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        self.refuse(field, f"key {_short(key)}: the configuration's keys are strings")
                    pending.append((f"{field}[{key[:40]!r}]", item, depth + 1))
            elif isinstance(value, (list, tuple)):
                pending.extend((f"{field}[{index}]", item, depth + 1) for index, item in enumerate(value))
            elif value is not None and not isinstance(value, (str, int, float)):
                self.refuse(field, f"a {type(value).__name__}: the configuration is plain data")
        different = {key: (saved.get(key), value) for key, value in self.config.items() if saved.get(key) != value}
        if different:
            listed = ", ".join(
                f"{key}: checkpoint {_short(old)}, now {_short(new)}" for key, (old, new) in sorted(different.items())
            )
            raise ValueError(f"the checkpoint {self.path} was written by a different distillation ({listed[:400]})")

    def counters(self, counters: object, draining: object) -> None:
        tokens, batch_size = self.config["tokens"], self.config["batch_size"]
        counters = self.mapping("counters", counters, ("harvested", "trained", "steps"))
        self.steps = self.whole("counters 'steps'", counters["steps"], 0, -(-tokens // batch_size))
        trained = self.whole("counters 'trained'", counters["trained"], 0, _LARGEST_COUNT)
        if trained != self.steps * batch_size:
            self.refuse("counters 'trained'", f"{trained:,} but {self.steps:,} steps of {batch_size} train on "
                        f"{self.steps * batch_size:,}")  # fmt: skip
        # every harvested batch held a real token, all trained on or in the buffer
        self.whole("counters 'harvested'", counters["harvested"], 0, tokens + self.capacity)
        self.whole("draining", draining, -1, self.capacity - 1)

    def modules(self, modules: Mapping) -> None:
        for key, trainer in self.live.items():
            block, _, method = key.partition("/")
            saved = self.mapping(f"modules {key!r}", modules[key])
            for name, tensor in trainer.module.state_dict().items():
                old = saved.get(name)
                if not isinstance(old, torch.Tensor) or old.shape != tensor.shape:
                    found = (
                        f"shape {tuple(old.shape)}" if isinstance(old, torch.Tensor)
                        else "no such tensor" if old is None else f"a {type(old).__name__}"
                    )  # fmt: skip
                    raise ValueError(
                        f"the checkpoint {self.path} was written by a different distillation: the replacement "
                        f"{method!r} of {block!r} has {name} of shape {tuple(tensor.shape)} now, {found} in the "
                        "checkpoint"
                    )
                self.tensor(f"modules {key!r} {name!r}", old, "the module's tensor", tensor)
            self.mapping(f"modules {key!r}", saved, trainer.module.state_dict())

    def optimizers(self, optimizers: Mapping) -> None:
        for key, trainer in self.live.items():
            field = f"optimiser state {key!r}"
            optimizer = trainer.optimizer
            live = optimizer.state_dict()
            saved = self.mapping(field, optimizers[key], ("state", "param_groups"))
            groups = saved["param_groups"]
            if not isinstance(groups, list) or len(groups) != len(live["param_groups"]):
                self.refuse(f"{field} param_groups", f"{_short(groups)} but the optimiser has "
                            f"{len(live['param_groups'])} parameter group(s)")  # fmt: skip
            parameters, flags = {}, {}
            for index, (group, live_group, params) in enumerate(
                zip(groups, live["param_groups"], optimizer.param_groups, strict=True)
            ):
                where = f"{field} param_groups[{index}]"
                group = self.mapping(where, group, live_group)
                numbers = group["params"]
                if (
                    not isinstance(numbers, list)
                    or not all(_whole(i) for i in numbers)
                    or numbers != live_group["params"]
                ):
                    self.refuse(f"{where} 'params'", f"{_short(group['params'])} but the group's parameters are "
                                f"{_short(live_group['params'])}")  # fmt: skip
                for name, value in live_group.items():
                    if name != "params":
                        self.like(f"{where} {name!r}", group[name], value)
                parameters.update(zip(live_group["params"], params["params"], strict=True))
                flags.update(dict.fromkeys(live_group["params"], bool(live_group.get("amsgrad"))))
            state = self.mapping(f"{field} state", saved["state"])
            adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)  # its state's keys are known
            keys = None
            for number, entry in state.items():
                if not _whole(number) or number not in parameters:
                    self.refuse(
                        f"{field} state", f"key {_short(number)} names none of the {len(parameters)} parameters"
                    )
                where = f"{field} parameter {number}"
                entry = self.mapping(where, entry)
                if adam:
                    expected = ("step", *_ADAM_MOMENTS, *(("max_exp_avg_sq",) if flags[number] else ()))
                    self.mapping(where, entry, expected)
                elif keys is None:
                    keys = list(entry)
                else:
                    self.mapping(where, entry, keys)
                for name, value in entry.items():
                    if name == "step":
                        self.step(f"{where} 'step'", value)
                    elif isinstance(value, torch.Tensor) or adam:
                        self.tensor(f"{where} {_short(name)}", value, "the parameter", parameters[number])
                        self.finite(f"{where} {_short(name)}", value)
                    elif not (value is None or isinstance(value, bool) or (_number(value) and math.isfinite(value))):
                        self.refuse(
                            f"{where} {_short(name)}", f"{_short(value)} where a tensor or a finite number belongs"
                        )

    def step(self, field: str, value: object) -> None:
        """A finite whole number of steps, at most the run's: a 0-dim float tensor or a number."""
        if isinstance(value, torch.Tensor):
            self.tensor(field, value, "")
            if value.ndim != 0 or value.dtype not in (torch.float32, torch.float64):
                self.refuse(field, f"shape {tuple(value.shape)}, dtype {value.dtype}: a step is a 0-dim float tensor")
            if not self.values:
                return
            value = value.item()
        if not _number(value) or not (math.isfinite(value) and value == int(value) and 0 <= value <= self.steps):
            self.refuse(field, f"{_short(value)} where a whole number of steps in [0, {self.steps}] belongs")

    def like(self, field: str, saved: object, live: object) -> None:
        """``saved`` of the live value's kind: flags and strings equal, numbers finite (non-negative like it)."""
        if isinstance(live, torch.Tensor):
            self.tensor(field, saved, "the live value", live)
            self.finite(field, saved)  # type: ignore[arg-type]
        elif _number(live):
            if not _number(saved) or not math.isfinite(saved) or (live >= 0 and saved < 0):
                self.refuse(field, f"{_short(saved)} where a finite number like {_short(live)} belongs")
            if _whole(saved) and abs(saved) > _LARGEST_COUNT:
                self.refuse(field, f"{_short(saved)} exceeds {_LARGEST_COUNT:,}")
        elif isinstance(live, (list, tuple)):
            if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
                self.refuse(field, f"{_short(saved)} where {len(live)} entries like {_short(live)} belong")
            for index, (item, live_item) in enumerate(zip(saved, live, strict=True)):
                self.like(f"{field}[{index}]", item, live_item)
        elif isinstance(live, dict):
            saved = self.mapping(field, saved, live)
            for key, value in live.items():
                self.like(f"{field}[{_short(key)}]", saved[key], value)
        elif type(saved) is not type(live) or saved != live:
            self.refuse(field, f"{_short(saved)} but the live run has {_short(live)}")

    def schedules(self, schedules: Mapping) -> None:
        for key, trainer in self.live.items():
            field = f"schedule {key!r}"
            live = trainer.schedule.state_dict()
            saved = self.mapping(field, schedules[key], live)
            for name, value in live.items():
                self.like(f"{field} {name!r}", saved[name], value)

    def losses(self, losses: Mapping) -> None:
        for key, trainer in self.live.items():
            field = f"loss state {key!r}"
            units = max(1, sum(p.numel() for p in trainer.module.parameters()))  # never more units than parameters
            terms = self.mapping(field, losses[key], trainer.loss_state)
            for term, values in terms.items():
                values = self.mapping(f"{field} {term!r}", values)
                for name, value in values.items():
                    where = f"{field} {term!r} {_short(name)}"
                    if not isinstance(name, str):
                        self.refuse(where, "a loss term's state is named by strings")
                    tensor = self.tensor(where, value, "")
                    if tensor.numel() > units:
                        self.refuse(where, f"{tensor.numel():,} entries, more than the replacement's {units:,} "
                                    "parameters")  # fmt: skip
                    self.finite(where, tensor)

    def buffer(self, buffer: object) -> None:
        buffer = self.mapping("buffer", buffer, ("x", "y", "peak_rows", "shuffled"))
        names = [block.name for block in self.blocks]
        held = [self.mapping(f"buffer {side!r}", buffer[side]) for side in ("x", "y")]
        rows = set()
        if held[0] or held[1]:  # empty before the first batch, else rows of every block
            for side, tensors in zip(("x", "y"), held, strict=True):
                self.mapping(f"buffer {side!r}", tensors, names)
                for block in self.blocks:
                    width = block.in_features if side == "x" else block.out_features
                    where = f"buffer {side!r} {block.name!r}"
                    tensor = self.tensor(where, tensors[block.name], "")
                    if tensor.ndim != 2 or tensor.shape[1] != width or tensor.shape[0] > self.capacity:
                        self.refuse(
                            where, f"shape {tuple(tensor.shape)} where (rows ≤ {self.capacity}, {width}) belongs"
                        )
                    if not tensor.is_floating_point():
                        self.refuse(where, f"dtype {tensor.dtype} where activations (a float dtype) belong")
                    rows.add(tensor.shape[0])
        if len(rows) > 1:
            self.refuse("buffer", f"rows {sorted(rows)}: every block's inputs and outputs hold the same rows")
        self.whole("buffer 'peak_rows'", buffer["peak_rows"], max(rows, default=0), self.capacity)
        if not isinstance(buffer["shuffled"], bool):
            self.refuse("buffer 'shuffled'", f"{_short(buffer['shuffled'])} where a bool belongs")

    def generator(self, state: object) -> None:
        length = torch.Generator().get_state().numel()
        tensor = self.tensor("generator", state, "")
        if tensor.dtype != torch.uint8 or tensor.shape != (length,):
            self.refuse("generator", f"dtype {tensor.dtype}, shape {tuple(tensor.shape)} where torch's CPU generator "
                        f"state (uint8, ({length},)) belongs")  # fmt: skip
        if self.values and length == _GENERATOR_BYTES:
            raw = tensor.numpy().tobytes()
            left, seeded = (int.from_bytes(raw[at : at + 4], "little", signed=True) for at in (8, 12))
            after = int.from_bytes(raw[16:24], "little")
            if seeded != 1 or not 1 <= left <= _TWISTER_WORDS or after + left > _TWISTER_WORDS + 1:
                self.refuse("generator", f"its Mersenne Twister would read words {after:,} to {after + left - 2:,} of "
                            f"its {_TWISTER_WORDS} (seeded {seeded})")  # fmt: skip
