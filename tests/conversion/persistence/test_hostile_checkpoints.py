"""A crafted checkpoint can only fail clearly: nothing runs, nothing outside is read, memory and time stay bounded.

Every case loads a checkpoint a hostile user wrote and checks, besides the library's ``ValueError``
naming the field and the value: no sentinel file was written, no module was imported
(``sys.modules`` before and after), the peak resident memory grew by at most a small multiple of
the checkpoint's size (``VmHWM`` after resetting it), the load took bounded time, and a given
model is exactly as it was (state dict, module types, hooks, record).
"""

import copy
import dataclasses
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from mumoe_tn.conversion.convert import apply_conversion, conversion_record, convert
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted
from mumoe_tn.conversion.persistence.record import RECORD_KEY, ConversionRecord

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
import hf_models  # noqa: E402  (needs transformers)

transformers.logging.set_verbosity_error()

#: Seconds a refused load may take (generous: the machine may be shared; a hang or a search takes minutes).
TIME_LIMIT = 20.0
#: Peak resident memory a refused load may add: this multiple of the checkpoint's bytes, plus a constant.
MEMORY_FACTOR, MEMORY_SLACK = 8, 96 << 20

SENTINEL = Path(os.environ.get("TMPDIR", "/tmp")) / f"mumoe-hostile-sentinel-{os.getpid()}"


@dataclass(frozen=True)
class Trap:
    """An imported dataclass that is not a gate: constructing it writes the sentinel file."""

    path: str = str(SENTINEL)

    def __post_init__(self):
        Path(self.path).write_text("constructed")

    def build(self, *args, **kwargs):  # looks like a gate descriptor
        raise AssertionError("built")

    parameter_count = fma_per_token = build


class Block(nn.Module):
    def __init__(self, width=12):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _plain():
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.Linear(12, 12), nn.LayerNorm(12))  # the LayerNorm is not converted


def _converted():
    model = _plain()
    convert(model, expert_dims=(3, 4), mlps=r"^0$", linears=r"^1$", rank=3)
    return model.eval()


# ----------------------------------------------------------------------------- the measuring harness
def _peak_kb() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _fingerprint(model):
    if model is None:
        return None
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    return state, [type(m) for m in model.modules()], hooks, model.__dict__.get(RECORD_KEY)


def _same(before, after):
    if before is None:
        return True
    (state, types, hooks, record), (state2, types2, hooks2, record2) = before, after
    return (
        state.keys() == state2.keys()
        and all(torch.equal(state[key], state2[key]) for key in state)
        and types == types2
        and hooks == hooks2
        and record == record2
    )


def refused(load, pattern, *, model=None, size=0):
    """Run ``load()``; check it raised the library's ValueError matching ``pattern`` and changed and ran nothing."""
    SENTINEL.unlink(missing_ok=True)
    before_model = _fingerprint(model)
    modules = set(sys.modules)
    measured = _reset_peak()
    start_kb = _peak_kb()
    start = time.perf_counter()
    with pytest.raises(Exception) as caught:
        load()
    elapsed = time.perf_counter() - start
    grown = (_peak_kb() - start_kb) * 1024
    error = caught.value
    assert type(error) is ValueError, f"{type(error).__name__}: {error}"
    assert re.search(pattern, str(error)), f"{pattern!r} not in {str(error)!r}"
    frames = traceback.extract_tb(error.__traceback__)
    assert "mumoe_tn" in Path(frames[-1].filename).parts, f"raised from {frames[-1].filename}"
    assert not SENTINEL.exists(), "the checkpoint ran code: the sentinel file was written"
    assert set(sys.modules) - modules == set(), f"the load imported {sorted(set(sys.modules) - modules)[:5]}"
    assert elapsed < TIME_LIMIT, f"the refusal took {elapsed:.1f} s"
    if measured:
        assert grown <= MEMORY_FACTOR * size + MEMORY_SLACK, f"peak memory grew by {grown / 2**20:.0f} MiB"
    assert _same(before_model, _fingerprint(model)), "a failed load changed the model"
    return error


# ----------------------------------------------------------------------------- plain safetensors files
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A converted model's safetensors file, its record and its tensors; one good load first (imports settle)."""
    folder = tmp_path_factory.mktemp("hostile")
    model = _converted()
    save_converted(model, folder / "good.safetensors")
    load_converted(_plain(), folder / "good.safetensors")
    state = safetensors_torch.load_file(str(folder / "good.safetensors"))
    return folder, conversion_record(model).to_dict(), state


def _write(folder, record, state, name="crafted.safetensors"):
    path = folder / name
    text = record if isinstance(record, str) else json.dumps(record)
    safetensors_torch.save_file(state, str(path), metadata={RECORD_KEY: text})
    return path


def _edit(record, change):
    record = copy.deepcopy(record)
    change(record)
    return record


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def change(record):
        target = record
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


def _long_chain(record):
    cores = [["C0", ["n1", "i", "b0"]], ["C1", ["b0", "n2", "b1"]]]
    cores += [[f"C{k}", [f"b{k - 1}", f"b{k}"]] for k in range(2, 7999)] + [["C7999", ["b7998", "o"]]]
    network = record["modules"][1]["networks"][0][1]
    network.update(
        format=None, cores=cores, sizes={"n1": 3, "n2": 4, "i": 13, "o": 12, **{f"b{k}": 2 for k in range(7999)}}
    )


CASES = {
    "gate class: an imported dataclass that is not a gate": (
        _set("modules", 0, "gate", "class", f"{Trap.__module__}.Trap"),
        r"gate\.class = '[\w.]+\.Trap' is invalid: it is not a registered gate descriptor class",
    ),
    "gate class: a lazily imported package": (
        _set("modules", 0, "gate", "class", "transformers.Trainer"),
        r"gate\.class = 'transformers\.Trainer' is invalid",
    ),
    "gate class: a private submodule": (
        _set("modules", 0, "gate", "class", "torch._inductor.config"),
        r"gate\.class = 'torch\._inductor\.config' is invalid",
    ),
    "gate class: not a string": (_set("modules", 0, "gate", "class", ["os", "system"]), r"gate\.class = \['os'"),
    "gate field the class does not declare": (
        _set("modules", 0, "gate", "fields", "evil", 1),
        r"gate\.fields\['evil'\] = 1 is invalid: the keys of record\.modules\[0\]\.gate\.fields are",
    ),
    "gate field holding a mapping": (
        _set("modules", 0, "gate", "fields", "norm", {"__class__": "x"}),
        r"gate\.fields\['norm'\] = \{'__class__': 'x'\} is invalid",
    ),
    "gate field the class refuses": (
        _set("modules", 0, "gate", "fields", "activation", -3.0),
        r"gate\.fields = .* is invalid: mumoe_tn\.gates\.specs\.Gate refuses them",
    ),
    "optimizer that is not a name": (
        _set("modules", 0, "execution", "optimize", "os.system"),
        r"execution\['optimize'\] = 'os\.system' is invalid: it must be one of the optimizer names",
    ),
    "execution option that does not exist": (
        _set("modules", 0, "execution", "memory_limit", "1TB"),
        r"execution\['memory_limit'\] = '1TB' is invalid",
    ),
    "negative plan cache": (_set("modules", 0, "execution", "max_plans", -1), r"\['max_plans'\] = -1 is invalid"),
    "expert count of a billion": (
        _set("modules", 1, "networks", 0, 1, "sizes", "n1", 10**9),
        r"record\.modules\[1\] implies '1\.[\w.]+' of shape \(.*1000000000.*\), the checkpoint holds",
    ),
    "rank of 25 million": (
        _set("modules", 1, "networks", 0, 1, "sizes", "r", 25 * 10**6),
        r"record\.modules\[1\] implies '1\.[\w.]+' of shape \(.*25000000.*\), the checkpoint holds",
    ),
    "size beyond any device": (
        _set("modules", 1, "networks", 0, 1, "sizes", "r", 10**30),
        r"sizes\['r'\] = 10{30} is invalid: it must be an int of at least 1 and at most",
    ),
    "size that is a bool": (
        _set("modules", 1, "networks", 0, 1, "sizes", "r", True),
        r"sizes\['r'\] = True is invalid",
    ),
    "chain of 8,000 cores": (
        _long_chain,
        r"networks\[0\]\[1\]\.cores = '<8000 entries>' is invalid: it may have at most 256",
    ),
    "5,000 duplicate module entries": (
        lambda record: record["modules"].extend([record["modules"][0]] * 5000),
        r"record\.modules\[2\]\.paths = '0' is invalid: record\.modules\[0\] already replaces it",
    ),
    "version -5": (_set("version", -5), r"record\.version = -5 is invalid"),
    "version true": (_set("version", True), r"record\.version = True is invalid"),
    "version from the future": (_set("version", 99), r"reads versions up to 1: upgrade mumoe_tn"),
    "empty module path": (_set("modules", 0, "paths", 0, ""), r"record\.modules\[0\]\.paths\[0\] = '' is invalid"),
    "path naming a parameter, not a module": (
        _set("modules", 0, "paths", 0, "1.weight"),
        r"replaces '1\.weight', which this Sequential does not have",
    ),
    "unknown kind": (_set("modules", 0, "kind", "exec"), r"record\.modules\[0\]\.kind = 'exec' is invalid"),
    "wrong roles": (_set("modules", 0, "networks", 0, 0, "down"), r"networks\[0\]\[0\] = 'down' is invalid"),
    "unregistered format": (
        _set("modules", 1, "networks", 0, 1, "format", "pickle"),
        r"format = 'pickle' is invalid: it names no format registered",
    ),
    "mask argument that is not a name": (
        _set("mask_argument", "__class__.x"),
        r"mask_argument = '__class__\.x' is invalid",
    ),
    "record that is a list": (
        lambda record: record.clear() or record.update(modules=[], version=1, extra=1),
        r"record\['extra'\]",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_record_is_refused_before_anything_is_built(case, saved):
    folder, record, state = saved
    change, pattern = CASES[case]
    path = _write(folder, _edit(record, change), state)
    model = _plain()
    refused(lambda: load_converted(model, path), pattern, model=model, size=path.stat().st_size)
    assert load_converted(model, folder / "good.safetensors") is model  # and the model still loads the right file


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("[" * 100_000 + "]" * 100_000, r"the conversion record is not valid JSON \(RecursionError"),
        ("{'version': 1}", r"the conversion record is not valid JSON"),
        ('"a string"', r"record = 'a string' is invalid: it must be a mapping"),
        ("1" * 5000, r"the conversion record is not valid JSON \(ValueError"),
    ],
    ids=["deep nesting", "not JSON", "a string", "a 5,000-digit number"],
)
def test_a_record_that_is_not_a_record_is_refused(text, pattern, saved):
    folder, _, state = saved
    path = _write(folder, text, state)
    model = _plain()
    refused(lambda: load_converted(model, path), pattern, model=model, size=path.stat().st_size)


def test_weights_that_do_not_fit_leave_the_model_as_it_was_and_the_right_file_then_loads(saved):
    folder, record, state = saved
    model = _plain()
    bias = "2.bias"  # checked with the whole state dict, once the rebuilt modules are in place
    wrong_shape = {**state, bias: torch.zeros(11)}
    path = _write(folder, record, wrong_shape)
    refused(
        lambda: load_converted(model, path), rf"shapes differ for \['{re.escape(bias)}: checkpoint \(11,\)", model=model
    )
    missing = {key: value for key, value in state.items() if key != "2.weight"}
    path = _write(folder, record, missing)
    refused(
        lambda: load_converted(model, path),
        r"the checkpoint lacks 1 key\(s\) of the model, e\.g\. \['2\.weight'\]",
        model=model,
    )
    integer = {key: value.to(torch.int32) if key == bias else value for key, value in state.items()}
    path = _write(folder, record, integer)
    refused(lambda: load_converted(model, path), rf"dtypes of another kind for \['{re.escape(bias)}", model=model)
    loaded = load_converted(model, folder / "good.safetensors")
    x = torch.randn(5, 12)
    reference = load_converted(_plain(), folder / "good.safetensors")
    with torch.no_grad():
        assert torch.equal(loaded(x), reference(x))


def test_a_record_is_refused_before_apply_conversion_changes_anything(saved):
    _, record, state = saved
    model = _plain()
    bad = _edit(record, _set("modules", 1, "networks", 0, 1, "sizes", "n1", 10**9))
    refused(lambda: apply_conversion(model, bad, shapes=state), r"implies '1\.[\w.]+' of shape", model=model)
    refused(
        lambda: apply_conversion(model, _edit(record, _set("modules", 0, "gate", "class", f"{Trap.__module__}.Trap"))),
        r"is not a registered gate descriptor class",
        model=model,
    )


def test_recorded_optimizers_are_checked_names_that_plan_only_when_the_layer_runs(saved, monkeypatch):
    folder, record, state = saved
    import mumoe_tn.layers.experts as experts_module

    resolved = []
    original = experts_module.resolve_optimizer
    monkeypatch.setattr(experts_module, "resolve_optimizer", lambda name: resolved.append(name) or original(name))
    for name in ("cotengra", "optimal"):
        path = _write(folder, _edit(record, _set("modules", 1, "execution", "optimize", name)), state)
        modules = set(sys.modules)
        model = load_converted(_plain(), path)
        assert set(sys.modules) - modules == set() and name not in resolved
        assert model[1].experts.optimize == name


def test_files_that_are_not_regular_files_are_refused_without_blocking(saved, tmp_path):
    os.mkfifo(tmp_path / "fifo.safetensors")
    model = _plain()
    refused(
        lambda: load_converted(model, tmp_path / "fifo.safetensors"),
        r"fifo\.safetensors' is not a regular file",
        model=model,
    )
    refused(lambda: load_converted(model, tmp_path), r"is not a regular file", model=model)
    refused(lambda: load_converted(model, tmp_path / "absent.safetensors"), r"cannot be read", model=model)
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 64)
    refused(
        lambda: load_converted(model, tmp_path / "garbage.safetensors"), r"is not a valid safetensors file", model=model
    )


# ----------------------------------------------------------------------------- Hugging Face directories
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A converted GPT-2 saved in two shards; one good load first."""
    folder = tmp_path_factory.mktemp("hf") / "converted"
    torch.manual_seed(0)
    model = hf_models.gpt2(layers=1, width=32, vocab=50)
    convert(model, expert_dims=4, mlps=r"mlp$", rank=4)
    model.save_pretrained(folder, max_shard_size="20KB")
    load_converted(transformers.GPT2LMHeadModel, folder)
    transformers.GPT2LMHeadModel.from_pretrained(folder)
    return folder


def _copy(source, target):
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def _rewrite(folder, name, change):
    data = json.loads((folder / name).read_text())
    change(data)
    (folder / name).write_text(json.dumps(data))


def _size(folder):
    return sum(file.stat().st_size for file in folder.iterdir() if file.is_file())


def _index_entry(value):
    def change(index):
        key = sorted(index["weight_map"])[0]
        index["weight_map"][key] = value

    return change


def test_index_entries_stay_inside_the_directory_and_name_regular_files(hf_dir, tmp_path):
    victim = _copy(hf_dir, tmp_path / "victim")
    index = "model.safetensors.index.json"
    shard = sorted(set(json.loads((hf_dir / index).read_text())["weight_map"].values()))[0]
    cases = {
        f"../victim/{shard}": r"(weight_map entry|weight file) = '\.\./victim/[\w.-]+' is invalid: it leads outside",
        str(
            victim / shard
        ): r"weight_map entry = '/[\w/.-]+' is invalid: a checkpoint names its files by relative paths",
        "fifo.safetensors": r"weight_map entry '[\w/.-]+fifo\.safetensors' is not a regular file",
        "link.safetensors": r"weight_map entry = 'link\.safetensors' is invalid: it leads outside",
        "absent.safetensors": r"weight_map entry '[\w/.-]+absent\.safetensors' cannot be read",
        "model.bin": r"weight_map\['[\w.]+'\] = 'model\.bin' is invalid: it must name a \.safetensors file",
    }
    for number, (entry, pattern) in enumerate(cases.items()):
        folder = _copy(hf_dir, tmp_path / f"case{number}")
        os.mkfifo(folder / "fifo.safetensors")
        (folder / "link.safetensors").symlink_to(victim / shard)
        _rewrite(folder, index, _index_entry(entry))
        refused(lambda folder=folder: load_converted(transformers.GPT2LMHeadModel, folder), pattern, size=_size(folder))
        if number == 0:  # stock from_pretrained: the hook checks the files transformers resolved
            refused(
                lambda folder=folder: transformers.GPT2LMHeadModel.from_pretrained(folder), pattern, size=_size(folder)
            )


def test_a_malformed_directory_is_refused_before_a_model_is_built(hf_dir, tmp_path):
    cases = {
        "model class of another type": (
            lambda folder: None,
            transformers.LlamaForCausalLM,
            r"config\.json: model_type = 'gpt2' is invalid for LlamaForCausalLM",
        ),
        "quantization_config with options": (
            lambda folder: _rewrite(folder, "config.json", lambda c: c["quantization_config"].update(code="x")),
            transformers.GPT2LMHeadModel,
            r"config\.json: quantization_config = \{.*'code': 'x'\} is invalid",
        ),
        "config.json is a FIFO": (
            lambda folder: ((folder / "config.json").unlink(), os.mkfifo(folder / "config.json")),
            transformers.GPT2LMHeadModel,
            r"config\.json '[\w/.-]+' is not a regular file",
        ),
        "config.json nests too deeply": (
            lambda folder: (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000),
            transformers.GPT2LMHeadModel,
            r"config\.json is not valid JSON",
        ),
        "weight_map is a list": (
            lambda folder: _rewrite(folder, "model.safetensors.index.json", lambda i: i.update(weight_map=[1])),
            transformers.GPT2LMHeadModel,
            r"weight_map = \[1\] is invalid: it must be a mapping",
        ),
        "a tensor stored in two shards": (
            lambda folder: _duplicate_tensor(folder),
            transformers.GPT2LMHeadModel,
            r"tensor '[\w.]+' is stored in two weight files",
        ),
        "record with an unregistered gate": (
            lambda folder: _rewrite(
                folder, "config.json", lambda c: c[RECORD_KEY]["modules"][0]["gate"].update({"class": "os.system"})
            ),
            transformers.GPT2LMHeadModel,
            r"gate\.class = 'os\.system' is invalid",
        ),
    }
    for number, (change, cls, pattern) in enumerate(cases.values()):
        folder = _copy(hf_dir, tmp_path / f"case{number}")
        change(folder)
        refused(lambda cls=cls, folder=folder: load_converted(cls, folder), pattern, size=_size(folder))


def _duplicate_tensor(folder):
    shards = sorted(folder.glob("model-*.safetensors"))
    first = safetensors_torch.load_file(str(shards[0]))
    second = safetensors_torch.load_file(str(shards[1]))
    key = sorted(first)[0]
    second[key] = first[key]
    safetensors_torch.save_file(second, str(shards[1]), metadata={"format": "pt"})


def test_stock_from_pretrained_refuses_a_crafted_record_with_the_library_error(hf_dir, tmp_path):
    folder = _copy(hf_dir, tmp_path / "crafted")
    _rewrite(
        folder,
        "config.json",
        lambda c: [network["sizes"].update(r=10**9) for _, network in c[RECORD_KEY]["modules"][0]["networks"]],
    )
    refused(
        lambda: transformers.GPT2LMHeadModel.from_pretrained(folder),
        r"implies 'transformer\.h\.0\.mlp\.[\w.]+' of shape \(.*1000000000.*\), the checkpoint holds",
        size=_size(folder),
    )


def test_registered_classes_are_the_only_gates_a_record_may_name():
    from mumoe_tn.gates.registry import register_gate, registered_gates, unregister_gate

    assert {"mumoe_tn.gates.specs.Gate", "mumoe_tn.gates.specs.TopKGate"} <= set(registered_gates())
    with pytest.raises(TypeError, match="takes a dataclass type"):
        register_gate(Block)
    record = ConversionRecord.from_dict(conversion_record(_converted()).to_dict())
    data = record.to_dict()
    data["modules"][0]["gate"] = {"class": f"{Trap.__module__}.Trap", "fields": {"path": str(SENTINEL)}}
    register_gate(Trap)
    try:
        SENTINEL.unlink(missing_ok=True)
        ConversionRecord.from_dict(data)  # registered: now it may be constructed, and it is
        assert SENTINEL.exists()
    finally:
        unregister_gate(Trap)
        SENTINEL.unlink(missing_ok=True)
    with pytest.raises(ValueError, match="not a registered gate descriptor class"):
        ConversionRecord.from_dict(data)
    assert dataclasses.is_dataclass(Trap)
