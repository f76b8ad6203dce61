"""Saved frontier runs describe themselves and are read as data (save_frontier, load_frontier, load_replacements)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from hf_models import gpt2
from safetensors.torch import load_file, save_file
from torch import nn

from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.methods import factory_from_spec, spec_from_data
from mumoe_tn.distillation.replacement_files import load_replacements, save_replacements
from mumoe_tn.distillation.replacement_specs import ReplacementSpec
from mumoe_tn.distillation.replacements import mumoe_factory, transcoder_factory
from mumoe_tn.distillation.run_files import MAX_RUN_JSON_BYTES, load_frontier, save_frontier
from mumoe_tn.distillation.streaming import select_blocks
from mumoe_tn.distillation.training import distill

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batches(count, seed=7):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (2, 12), generator=generator) for _ in range(count)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run saved from the Python API: distill, evaluate_replacements, save_frontier (two blocks, three methods)."""
    torch.manual_seed(0)
    model = gpt2(layers=2, width=16, heads=2, vocab=50, positions=16).eval()
    factories = {
        "transcoder@4": transcoder_factory(4, 2.0),
        "cp-hier@4": mumoe_factory("cp", (4, 4), 4, 2.0),
        "mxd@4": mumoe_factory("mxd", 16, 4, 3000),
    }
    torch.manual_seed(1)
    result = distill(model, _batches(12), factories, tokens=192, batch_size=32, buffer_tokens=96, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = evaluate_replacements(model, _batches(2, seed=8), result.replacements, config={"note": "api"},
                                      resamples=20)  # fmt: skip
    directory = save_frontier(tmp_path_factory.mktemp("runs") / "run", table, result.replacements, model)
    return directory, model, result.replacements, table


def _copy(run, tmp_path):
    return Path(shutil.copytree(run[0], tmp_path / "copy"))


def _edit_json(directory, edit):
    data = json.loads((directory / "frontier.json").read_text())
    edit(data)
    (directory / "frontier.json").write_text(json.dumps(data))


def _edit_record(directory, edit):
    """Edit the record in both frontier.json and the replacements file's metadata (they agree)."""
    data = json.loads((directory / "frontier.json").read_text())
    edit(data["config"]["saved_run"])
    (directory / "frontier.json").write_text(json.dumps(data))
    tensors = load_file(str(directory / "replacements.safetensors"))
    metadata = {"format": "mumoe_tn.replacements/1", "saved_run": json.dumps(data["config"]["saved_run"])}
    save_file(tensors, str(directory / "replacements.safetensors"), metadata=metadata)


def _snapshot(replacements):
    return {(b, m, k): v.clone() for b, ms in replacements.items() for m, mod in ms.items()
            for k, v in mod.state_dict().items()}  # fmt: skip


def test_a_run_saved_from_the_python_api_loads_back_bitwise(run):
    directory, model, replacements, table = run
    loaded_model, loaded, loaded_table = load_frontier(directory)
    expected = dataclasses.replace(table, config={**table.config, "saved_run": loaded_table.config["saved_run"]})
    assert loaded_table.to_json() == expected.to_json()
    assert loaded_table.sequences is not None  # the paired comparisons travel with the run
    assert {b: list(ms) for b, ms in loaded.items()} == {b: list(ms) for b, ms in replacements.items()}
    for block, methods in replacements.items():
        for method, module in methods.items():
            again = loaded[block][method]
            assert type(again) is type(module) and not again.training
            assert again.state_dict().keys() == module.state_dict().keys()
            for key, value in module.state_dict().items():
                assert torch.equal(again.state_dict()[key], value), (block, method, key)
            assert again.replacement_spec == module.replacement_spec
    ids = _batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(loaded_model(ids).logits, model(ids).logits)
    record = loaded_table.config["saved_run"]
    assert record["model"] == "model" and set(record["blocks"]) == {"transformer.h.0.mlp", "transformer.h.1.mlp"}
    assert record["methods"]["cp-hier@4"] == {"kind": "mumoe", "k": [2, 2], "budget": 2.0, "skip": False,
                                              "format": "cp", "experts": [4, 4], "top_k": "auto", "recipe": None,
                                              "aux_k": None, "balance": None}  # fmt: skip


def test_a_replacement_that_cannot_describe_itself_is_refused_when_saved(run, tmp_path):
    _, model, _, table = run
    own = {"transformer.h.0.mlp": {"linear": nn.Linear(16, 16)}}
    with pytest.raises(ValueError, match=r"\['linear'\] carries no replacement_spec"):
        save_frontier(tmp_path / "a", table, own, model)
    custom = mumoe_factory("cp", 4, 2, 2.0, rank_multiple=2)(select_blocks(model)[0])
    with pytest.raises(ValueError, match="carries no replacement_spec"):
        save_frontier(tmp_path / "b", table, {"transformer.h.0.mlp": {"cp": custom}}, model)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_run_without_its_model_needs_the_model(run, tmp_path):
    _, model, replacements, table = run
    directory = save_frontier(tmp_path / "run", table, replacements, model, save_model=False)
    assert not (directory / "model").exists()
    with pytest.raises(ValueError, match=r"saved_run.model is null.*model="):
        load_frontier(directory)
    same, loaded, _ = load_frontier(directory, model=model)
    assert same is model
    assert all(torch.equal(loaded[b][m].state_dict()[k], v) for (b, m, k), v in _snapshot(replacements).items())


def test_a_sharded_model_of_the_run_loads(run, tmp_path):
    directory = _copy(run, tmp_path)
    shutil.rmtree(directory / "model")
    run[1].save_pretrained(directory / "model", max_shard_size="8KB")
    assert len(list((directory / "model").glob("*.safetensors"))) > 1
    model, _, _ = load_frontier(directory)
    ids = _batches(1, seed=4)[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, run[1](ids).logits)


@pytest.mark.parametrize("name", ["frontier.json", "model", "model/config.json", "replacements.safetensors"])
def test_a_file_linked_out_of_the_run_is_refused_unread(run, tmp_path, monkeypatch, name):
    directory = _copy(run, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / Path(name).name
    shutil.move(directory / name, target)
    (directory / name).symlink_to(target)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    with pytest.raises(ValueError, match="leads outside"):
        load_frontier(directory)
    assert not [path for path in opened if path.startswith(str(outside))]


def test_a_link_inside_the_run_is_followed(run, tmp_path):
    directory = _copy(run, tmp_path)
    shutil.move(directory / "frontier.json", directory / "table.json")
    (directory / "frontier.json").symlink_to(directory / "table.json")
    load_frontier(directory)


def test_hard_links_and_files_that_are_not_regular_are_refused(run, tmp_path):
    directory = _copy(run, tmp_path)
    os.link(directory / "replacements.safetensors", tmp_path / "second-name")
    with pytest.raises(ValueError, match=r"replacements\.safetensors has 2 hard links"):
        load_frontier(directory)
    os.unlink(tmp_path / "second-name")
    os.unlink(directory / "model" / "config.json")
    os.mkfifo(directory / "model" / "config.json")
    with pytest.raises(ValueError, match="is not a regular file"):
        load_frontier(directory)


def _set(path, value):
    def edit(data):
        *parents, last = path
        for key in parents:
            data = data[key]
        data[last] = value

    return edit


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("model",), "/etc", r"saved_run.model = '/etc' is invalid: the model must lie inside"),
        (("model",), "../run", r"saved_run.model = '../run' is invalid"),
        (("model",), "model/../../x", r"saved_run.model = 'model/../../x' is invalid"),
        (("model",), 7, r"saved_run.model = 7 is invalid"),
        (("format",), "other/1", r"saved_run.format = 'other/1' is invalid"),
        (("methods",), [], r"saved_run.methods is invalid"),
        (("methods", "cp-hier@4", "k"), "4", r"saved_run.methods\['cp-hier@4'\].k = '4' is invalid"),
        (("methods", "cp-hier@4", "k"), [9, 1], r"\.k = \[9, 1\] is invalid: it keeps more experts"),
        (("methods", "cp-hier@4", "experts"), [1 << 20, 1 << 20], r"\.experts = .* at most 16,777,216 experts"),
        (("methods", "cp-hier@4", "format"), "os.system", r"\.format = 'os.system' is invalid: it must name a"),
        (("methods", "cp-hier@4", "aux_k"), 1, r"\.aux_k = 1 is invalid"),
        (("methods", "cp-hier@4", "balance"), True, r"\.balance = True is invalid: it must be null or a number"),
        (("methods", "cp-hier@4", "balance"), float("nan"), r"\.balance = nan is invalid"),
        (("methods", "cp-hier@4", "balance"), -0.5, r"\.balance = -0.5 is invalid"),
        (("methods", "transcoder@4", "balance"), 0.1, r"\.balance = 0.1 is invalid: a transcoder's must be None"),
        (("methods", "transcoder@4", "budget"), -1, r"\.budget = -1 is invalid"),
        (("methods", "transcoder@4", "budget"), float("inf"), r"\.budget = inf is invalid"),
        (("methods", "transcoder@4", "shape"), 1, r"methods\['transcoder@4'\] is invalid: .*unknown \['shape'\]"),
        (("blocks", "transformer.h.0.mlp", "in_features"), True, r"\.in_features = True is invalid"),
        (("blocks", "transformer.h.0.mlp", "methods"), ["gone@1"], r"names 'gone@1', which .*methods does not"),
        (("blocks", "h/0"), {}, r"saved_run.blocks = 'h/0' is invalid: a block or method name is 1 to 256 printable"),
        (("blocks", "transformer.h.0.mlp(.*)*"), {}, r"blocks\['transformer.h.0.mlp\(\.\*\)\*'\] is invalid: it must"),
    ],
)
def test_every_field_of_the_record_is_checked_and_named(run, tmp_path, path, value, message):
    directory = _copy(run, tmp_path)
    _edit_json(directory, lambda data: _set(path, value)(data["config"]["saved_run"]))
    with pytest.raises(ValueError, match=message):
        load_frontier(directory)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 200_000, "frontier.json is not valid JSON|nests objects and lists more than 32 deep"),
        ('{"rows": [], "config": ' * 40 + "{}" + "}" * 40, "nests objects and lists more than 32 deep"),
        ('{"rows": [', "frontier.json is not valid JSON"),
        ("[]", "frontier.json must be an object with a 'rows' list"),
        ('{"rows": [1]}', r"rows\[0\] = 1 is invalid"),
        ('{"rows": [{"block": "b"}]}', r"rows\[0\] lacks"),
        ('{"rows": [], "config": []}', r"config = \[\] is invalid"),
        ('{"rows": []}', "config.saved_run is missing"),
        ('{"rows": [], "config": {"saved_run": "x"}}', "config.saved_run = 'x' is invalid"),
        ('{"rows": [], "config": {"saved_run": {"format": 1}}}', r"missing \['model', 'blocks', 'methods'\]"),
    ],
)
def test_malformed_json_gets_the_library_error(run, tmp_path, text, message):
    directory = _copy(run, tmp_path)
    (directory / "frontier.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_frontier(directory)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tie_word_embeddings", "x", r"model/config.json does not describe a model \(.*tie_word_embeddings"),
        ("n_positions", 17, r"n_positions = 17 is invalid: .*'transformer.wpe.weight' of shape \(17, 16\)"),
        ("activation_function", "", r"activation_function = '' is invalid: it must name an activation"),
        ("model_type", "no-such-model", r"model_type = 'no-such-model' names no model type"),
        ("n_embd", 1 << 30, r"n_embd"),
    ],
)
def test_a_crafted_model_config_gets_the_library_error(run, tmp_path, field, value, message):
    directory = _copy(run, tmp_path)
    config = json.loads((directory / "model" / "config.json").read_text())
    config[field] = value
    (directory / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_frontier(directory)


def test_a_row_of_the_wrong_type_is_named(run, tmp_path):
    directory = _copy(run, tmp_path)
    _edit_json(directory, lambda data: data["rows"][2].__setitem__("params", "many"))
    with pytest.raises(ValueError, match=r"frontier.json: rows\[2\].params = 'many' is invalid"):
        load_frontier(directory)


def test_a_table_file_over_the_limit_is_refused_before_it_is_read(run, tmp_path):
    directory = _copy(run, tmp_path)
    with open(directory / "frontier.json", "r+b") as file:
        file.truncate(MAX_RUN_JSON_BYTES + 1)  # sparse: nothing written
    with pytest.raises(ValueError, match=r"frontier\.json is 16,777,217 bytes, more than the 16,777,216"):
        load_frontier(directory)


def test_records_that_disagree_are_refused_naming_the_field(run, tmp_path):
    directory = _copy(run, tmp_path)
    _edit_json(directory, _set(("config", "saved_run", "methods", "transcoder@4", "budget"), 3.0))
    with pytest.raises(ValueError, match=r"saved_run.methods.transcoder@4.budget differs between frontier.json and"):
        load_frontier(directory)


def test_a_budget_that_disagrees_with_the_stored_tensors_is_refused_before_anything_is_built(
    run, tmp_path, monkeypatch
):
    directory = _copy(run, tmp_path)
    _edit_record(directory, _set(("methods", "mxd@4", "budget"), 400_000_000))
    import mumoe_tn.distillation.run_files as run_files

    built = []
    monkeypatch.setattr(run_files, "factory_from_spec", lambda spec: built.append(spec) or factory_from_spec(spec))
    with pytest.raises(ValueError, match=r"methods\['mxd@4'\].budget = 400000000 is invalid: .*400,000,000 param"):
        load_frontier(directory)
    assert built == []  # not even on the meta device


def test_a_spec_that_builds_other_shapes_is_refused(run, tmp_path):
    directory = _copy(run, tmp_path)
    _edit_record(directory, _set(("methods", "transcoder@4", "skip"), True))  # the same budget, other shapes
    with pytest.raises(ValueError, match=r"methods\['transcoder@4'\] builds a replacement of 'transformer.h.0.mlp'"):
        load_frontier(directory)


def test_stored_tensors_of_no_recorded_method_are_refused(run, tmp_path):
    directory = _copy(run, tmp_path)
    tensors = load_file(str(directory / "replacements.safetensors"))
    record = json.loads((directory / "frontier.json").read_text())["config"]["saved_run"]
    tensors["transformer.h.0.mlp/extra@1/w"] = torch.zeros(3)
    save_file(tensors, str(directory / "replacements.safetensors"),
              metadata={"format": "mumoe_tn.replacements/1", "saved_run": json.dumps(record)})  # fmt: skip
    with pytest.raises(ValueError, match=r"holds the tensor 'transformer\.h\.0\.mlp/extra@1/w', which belongs to no"):
        load_frontier(directory)


def test_catastrophic_fields_are_refused_in_bounded_time(run, tmp_path):
    """A budget of 4e8 and a catastrophic regex in the table's config, in a subprocess with a time limit."""
    budget = _copy(run, tmp_path)
    _edit_record(budget, _set(("methods", "cp-hier@4", "budget"), 400_000_000))
    regex = Path(shutil.copytree(run[0], tmp_path / "regex"))
    _edit_json(regex, _set(("config", "mlps"), "^((.+)+)+!$"))
    script = textwrap.dedent(f"""
        import resource, sys, time
        from mumoe_tn.distillation.run_files import load_frontier
        start = time.perf_counter()
        try:
            load_frontier({str(budget)!r})
        except ValueError as error:
            print("refused:", str(error)[:200])
        model, replacements, table = load_frontier({str(regex)!r})  # the config's mlps is never compiled
        print("loaded", sorted(replacements), round(time.perf_counter() - start, 2))
        print("peak MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused: saved_run.methods['cp-hier@4'].budget = 400000000 is invalid"), lines
    assert lines[1].startswith("loaded ['transformer.h.0.mlp', 'transformer.h.1.mlp']"), lines
    assert int(lines[2].split()[-1]) < 1500  # 4e8 parameters in float32 would be 1.6 GB


def test_a_truncated_or_mismatched_replacements_file_leaves_every_module_unchanged(run, tmp_path):
    _, model, replacements, _ = run
    blocks = select_blocks(model)
    specs = {m: mod.replacement_spec for m, mod in replacements[blocks[0].name].items()}
    torch.manual_seed(5)
    built = {b.name: {m: factory_from_spec(spec)(b) for m, spec in specs.items()} for b in blocks}
    before = _snapshot(built)
    path = tmp_path / "r.safetensors"
    save_replacements(replacements, path)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="is not a valid safetensors file"):
        load_replacements(built, tmp_path / "cut.safetensors")
    tensors = load_file(str(path))
    last = sorted(tensors)[-1]  # every other tensor fits: the last one checked does not
    tensors[last] = torch.zeros(tensors[last].numel() + 1)
    save_file(tensors, str(tmp_path / "wrong.safetensors"), metadata={"format": "mumoe_tn.replacements/1"})
    with pytest.raises(ValueError, match="holds replacements of other shapes"):
        load_replacements(built, tmp_path / "wrong.safetensors")
    after = _snapshot(built)
    assert all(torch.equal(before[key], after[key]) for key in before)
    loaded = load_replacements(built, path)  # the right file then loads
    assert all(torch.equal(loaded[b][m].state_dict()[k], v) for (b, m, k), v in _snapshot(replacements).items())


def test_a_file_changed_while_it_is_read_leaves_every_module_unchanged(run, tmp_path, monkeypatch):
    _, model, replacements, _ = run
    path = tmp_path / "r.safetensors"
    save_replacements(replacements, path)
    blocks = {block.name: block for block in select_blocks(model)}
    built = {b: {m: factory_from_spec(mod.replacement_spec)(blocks[b]) for m, mod in ms.items()}
             for b, ms in replacements.items()}  # fmt: skip
    before = _snapshot(built)
    import mumoe_tn.conversion.persistence.files as files

    real = files.os.fstat
    calls = []

    def growing(descriptor):  # the second look at the descriptor sees a file written meanwhile
        calls.append(descriptor)
        status = real(descriptor)
        if len(calls) == 2:
            return os.stat_result((*status[:6], status.st_size + 1, *status[7:]))
        return status

    monkeypatch.setattr(files.os, "fstat", growing)
    with pytest.raises(ValueError, match="changed while it was read"):
        load_replacements(built, path)
    after = _snapshot(built)
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_specs_round_trip_and_refuse_what_they_do_not_describe():
    spec = ReplacementSpec("mumoe", (2, 2), 2.0, False, "cp", (4, 4), "softmax", "plain", False)
    assert spec_from_data(json.loads(json.dumps(spec.to_data()))) == spec
    transcoder = ReplacementSpec("transcoder", None, 1000, True)
    assert spec_from_data(transcoder.to_data()) == transcoder
    with pytest.raises(ValueError, match=r"spec.format = 'cp' is invalid: a transcoder's must be None"):
        spec_from_data({**transcoder.to_data(), "format": "cp"})
    with pytest.raises(ValueError, match=r"spec.skip = 1 is invalid"):
        spec_from_data({**transcoder.to_data(), "skip": 1})
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"spec = \[\] is invalid"):
        spec_from_data([])
    assert time.perf_counter() - started < 1
