"""Every file a load reads is inside the checkpoint and read once: links out refused, concurrent writers seen whole.

Two guarantees, each with crafted directories: (1) every file read on behalf of a checkpoint —
mumoe_tn's reads and the ones transformers makes itself (``config.json``,
``generation_config.json``, a shard index) — is a regular file inside the directory, within the
size limit, on ``load_converted`` and on stock ``from_pretrained``; a sentinel file outside is
never read (no ``open`` of it, its access time unchanged). (2) a load reads each file once and
checks what it read, so a writer atomically replacing files while loads run can only make a load
fail with the library's ``ValueError``; a failed load leaves a given model exactly as it was.
"""

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from mumoe_tn.conversion.convert import conversion_record, convert
from mumoe_tn.conversion.persistence import files as checkpoint_files
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
import hf_models  # noqa: E402  (needs transformers)

transformers.logging.set_verbosity_error()

INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- reading nothing outside
class Opened:
    """Records every path opened through Python (``open``, ``os.open``) while active."""

    def __init__(self, monkeypatch):
        self.paths: list[Path] = []
        original_open, original_os_open = open, os.open

        def recording_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)):
                self.paths.append(Path(os.path.realpath(file)))
            return original_open(file, *args, **kwargs)

        def recording_os_open(path, *args, **kwargs):
            self.paths.append(Path(os.path.realpath(path)))
            return original_os_open(path, *args, **kwargs)

        monkeypatch.setattr("builtins.open", recording_open)
        monkeypatch.setattr(os, "open", recording_os_open)


@pytest.fixture
def sentinel(tmp_path_factory):
    """A JSON file outside every checkpoint, with an access time in the past: reading it would update it."""
    path = tmp_path_factory.mktemp("outside") / "secret.json"
    path.write_text(json.dumps({"secret": "never-read", "bos_token_id": 7}))
    os.utime(path, (1_000_000, time.time()))  # relatime updates an access time older than the modification
    return path


def _untouched(sentinel, opened):
    assert Path(os.path.realpath(sentinel)) not in opened.paths, "the sentinel outside the directory was opened"
    assert sentinel.stat().st_atime == 1_000_000, "the sentinel outside the directory was read"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A converted GPT-2 saved in shards, with a generation config."""
    folder = tmp_path_factory.mktemp("hf") / "converted"
    torch.manual_seed(0)
    model = hf_models.gpt2(layers=1, width=32, vocab=50, bos_token_id=0, eos_token_id=0)
    convert(model, expert_dims=4, mlps=r"mlp$", rank=4)
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "generation_config.json").exists() and (folder / INDEX).exists()
    load_converted(transformers.GPT2LMHeadModel, folder)  # imports settle
    return folder


def _copy(source, target):
    shutil.copytree(source, target)
    return target


def _link_out(folder, name, sentinel):
    (folder / name).unlink()
    (folder / name).symlink_to(sentinel)


LOADERS = {
    "load_converted": lambda folder: load_converted(transformers.GPT2LMHeadModel, folder),
    "from_pretrained": lambda folder: transformers.GPT2LMHeadModel.from_pretrained(folder),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_generation_config_linked_outside_is_refused_unread(loader, hf_dir, sentinel, tmp_path, monkeypatch):
    folder = _copy(hf_dir, tmp_path / "linked")
    _link_out(folder, "generation_config.json", sentinel)
    opened = Opened(monkeypatch)
    with pytest.raises(
        ValueError, match=r"generation_config\.json = 'generation_config\.json' is invalid: it leads outside"
    ):
        LOADERS[loader](folder)
    _untouched(sentinel, opened)


def test_load_converted_reads_no_config_or_index_linked_outside(hf_dir, sentinel, tmp_path, monkeypatch):
    opened = Opened(monkeypatch)
    for name in ("config.json", INDEX):
        folder = _copy(hf_dir, tmp_path / name)
        _link_out(folder, name, sentinel)
        with pytest.raises(ValueError, match=rf"{re.escape(name)} = '{re.escape(name)}' is invalid: it leads outside"):
            load_converted(transformers.GPT2LMHeadModel, folder)
    _untouched(sentinel, opened)


def test_stock_from_pretrained_refuses_a_config_or_index_linked_outside(hf_dir, sentinel, tmp_path):
    # transformers reads config.json and the index before any hook runs: the load is refused, nothing is built
    for name, content in (("config.json", hf_dir / "config.json"), (INDEX, hf_dir / INDEX)):
        folder = _copy(hf_dir, tmp_path / name)
        outside = tmp_path / f"outside-{name}"
        shutil.copy(content, outside)
        _link_out(folder, name, outside)
        with pytest.raises(ValueError, match=rf"{re.escape(name)} = '{re.escape(name)}' is invalid: it leads outside"):
            transformers.GPT2LMHeadModel.from_pretrained(folder)


def test_files_linked_inside_the_directory_are_read(hf_dir, tmp_path):
    folder = _copy(hf_dir, tmp_path / "inside")
    (folder / "settings").mkdir()
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "settings" / "generation.json").write_text(json.dumps({**generation, "max_length": 17}))
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").symlink_to(Path("settings") / "generation.json")
    for loader in LOADERS.values():
        assert loader(folder).generation_config.max_length == 17


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_json_files_that_are_fifos_or_too_large_are_refused(loader, hf_dir, tmp_path, monkeypatch):
    folder = _copy(hf_dir, tmp_path / "fifo")
    (folder / "generation_config.json").unlink()
    os.mkfifo(folder / "generation_config.json")
    with pytest.raises(ValueError, match=r"generation_config\.json '[\w/.-]+' is not a regular file"):
        LOADERS[loader](folder)
    folder = _copy(hf_dir, tmp_path / "large")
    limit = max(len((folder / name).read_bytes()) for name in ("config.json", INDEX)) + 1
    monkeypatch.setattr(checkpoint_files, "MAX_JSON_BYTES", limit)
    (folder / "generation_config.json").write_text(json.dumps({"padding": "x" * limit}))
    with pytest.raises(ValueError, match=rf"generation_config\.json is {limit + 15:,} bytes, more than the {limit:,}"):
        LOADERS[loader](folder)


def test_a_generation_config_that_is_not_an_object_gets_the_library_error(hf_dir, tmp_path):
    folder = _copy(hf_dir, tmp_path / "list")
    (folder / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"generation_config\.json = \[1\] is invalid: it must be a JSON object"):
        load_converted(transformers.GPT2LMHeadModel, folder)


# ----------------------------------------------------------------------------- all or nothing, read once
class Block(nn.Module):
    def __init__(self, width=12):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _plain():
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.Linear(12, 12), nn.LayerNorm(12))


def _versions(folder):
    """Two converted models' files with the same record and other weights, and one whose weights do not fit."""
    states = {}
    for version in ("a", "b"):
        model = _plain()
        convert(model, expert_dims=(3, 4), linears=r"^1$", rank=3)  # one layer: quick loads
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0 if version == "a" else -1.0)
        save_converted(model, folder / f"{version}.safetensors")
        states[version] = {key: value.clone() for key, value in model.state_dict().items()}
    from safetensors.torch import load_file, save_file

    broken = load_file(str(folder / "a.safetensors"))
    broken["2.bias"] = torch.zeros(11)
    record = conversion_record(model).to_json()
    save_file(broken, str(folder / "c.safetensors"), metadata={"mumoe_conversion": record})
    return states


def _state(model):
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _equal(state, other):
    return state.keys() == other.keys() and all(torch.equal(state[key], other[key]) for key in state)


class Replacer(threading.Thread):
    """Atomically replaces ``target`` with each of ``sources`` in turn (a copy renamed over it) until stopped."""

    def __init__(self, target, sources):
        super().__init__(daemon=True)
        self.target, self.sources, self.stop, self.replaced = target, sources, threading.Event(), 0

    def run(self):
        while not self.stop.is_set():
            source = self.sources[self.replaced % len(self.sources)]
            temporary = self.target.with_name(f".{self.target.name}.{self.replaced}")
            if source.is_dir() or source.is_symlink():  # a link to a directory version, swapped
                temporary.symlink_to(source)
            else:
                shutil.copyfile(source, temporary)
            os.replace(temporary, self.target)
            self.replaced += 1
            time.sleep(0.002)  # let the loads run: the writer would otherwise hold the interpreter


def test_a_file_replaced_during_loads_gives_one_whole_version_or_the_library_error(tmp_path):
    states = _versions(tmp_path)
    target = tmp_path / "live.safetensors"
    shutil.copyfile(tmp_path / "a.safetensors", target)
    writer = Replacer(target, [tmp_path / f"{v}.safetensors" for v in "bca"])
    writer.start()
    outcomes = []
    try:
        for _ in range(30):
            model = _plain()
            before = _state(model)
            try:
                load_converted(model, target)
            except ValueError as error:
                assert re.search(r"do not fit the converted model|changed while it was read", str(error)), error
                assert _equal(before, _state(model)), "a failed load changed the model"
                assert conversion_record(model) is None
                outcomes.append("refused")
            else:
                (version,) = [v for v, state in states.items() if _equal(state, _state(model))]
                outcomes.append(version)
    finally:
        writer.stop.set()
        writer.join()
    assert writer.replaced > 30 and len(outcomes) == 30 and {"a", "b"} & set(outcomes)


def test_a_load_opens_the_checkpoint_file_once(tmp_path, monkeypatch):
    _versions(tmp_path)
    opened = Opened(monkeypatch)
    load_converted(_plain(), tmp_path / "a.safetensors")
    assert opened.paths.count((tmp_path / "a.safetensors").resolve()) == 1


def test_a_shard_or_index_replaced_after_it_was_read_fails_the_load(hf_dir, tmp_path, monkeypatch):
    shards = sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values()))
    assert len(shards) >= 2
    original = checkpoint_files.read_weights
    for victim in (shards[0], INDEX):
        folder = _copy(hf_dir, tmp_path / victim)

        def read_then_replace(read, folder=folder, victim=victim):
            if read.path.name == shards[-1]:  # the last shard read: replace a file read before it
                shutil.copyfile(folder / victim, folder / f".{victim}")
                os.replace(folder / f".{victim}", folder / victim)
            return original(read)

        monkeypatch.setattr(checkpoint_files, "read_weights", read_then_replace)
        with pytest.raises(ValueError, match=rf"'{re.escape(str(folder.resolve() / victim))}' was replaced or changed"):
            load_converted(transformers.GPT2LMHeadModel, folder)


def test_stock_from_pretrained_fails_when_a_shard_is_replaced_after_the_hook_checked_it(hf_dir, tmp_path, monkeypatch):
    from mumoe_tn.conversion.persistence.quantizer import MuMoEQuantizer

    folder = _copy(hf_dir, tmp_path / "stock")
    shard = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))[0]
    original = MuMoEQuantizer._process_model_before_weight_loading

    def check_then_replace(self, model, **kwargs):
        result = original(self, model, **kwargs)
        shutil.copyfile(folder / shard, folder / f".{shard}")
        os.replace(folder / f".{shard}", folder / shard)  # the same bytes, another file
        return result

    monkeypatch.setattr(MuMoEQuantizer, "_process_model_before_weight_loading", check_then_replace)
    with pytest.raises(ValueError, match=rf"from_pretrained: '[\w/.-]+{re.escape(shard)}' was replaced or changed"):
        transformers.GPT2LMHeadModel.from_pretrained(folder)


def test_a_directory_swapped_during_loads_gives_one_whole_version(hf_dir, tmp_path):
    versions = {}
    for name, shift in (("one", 0.0), ("two", 1.0)):
        model = load_converted(transformers.GPT2LMHeadModel, hf_dir)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(shift)
        model.save_pretrained(tmp_path / name, max_shard_size="20KB")
        versions[name] = _state(model)
    live = tmp_path / "live"
    live.symlink_to(tmp_path / "one")
    writer = Replacer(live, [tmp_path / "two", tmp_path / "one"])
    writer.start()
    seen = set()
    try:
        for _ in range(12):
            try:
                model = load_converted(transformers.GPT2LMHeadModel, live)
            except ValueError as error:
                assert "was replaced or changed" in str(error), error
                seen.add("refused")
            else:
                (version,) = [v for v, state in versions.items() if _equal(state, _state(model))]
                seen.add(version)
    finally:
        writer.stop.set()
        writer.join()
    assert seen and writer.replaced > 12


def test_gathered_weight_files_refuse_a_tensor_stored_in_two_of_them(tmp_path):
    from safetensors.torch import save

    def read(name, tensors):
        return name, checkpoint_files.FileBytes(tmp_path / f"{name}.safetensors", save(tensors), (0, 0, 0, 0))

    first = read("a", {"w": torch.arange(6.0).reshape(2, 3)})
    state, shapes = checkpoint_files.gather_weights([first, read("b", {"v": torch.ones(4)})], "the model")
    assert shapes == {"w": (2, 3), "v": (4,)}
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3)) and torch.equal(state["v"], torch.ones(4))
    with pytest.raises(ValueError, match=r"^b: tensor 'w' is stored in two weight files of the model$"):
        checkpoint_files.gather_weights([first, read("b", {"w": torch.zeros(2, 3)})], "the model")
