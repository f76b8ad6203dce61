"""Crafted checkpoints, second round: declared sizes held against stored bytes, refusals bounded in time.

Each case uses the harness of ``test_hostile_checkpoints.py`` (the library's ``ValueError`` naming
the field, no sentinel written, nothing imported, peak memory a small multiple of the file, the
model unchanged) and refuses within ``QUICK`` seconds.
"""

import json
import time

import pytest
import torch
from test_hostile_checkpoints import (
    RECORD_KEY,
    _converted,
    _copy,
    _edit,
    _plain,
    _rewrite,
    _set,
    _size,
    _write,
    refused,
)

from mumoe_tn.conversion.convert import apply_conversion, conversion_record, convert
from mumoe_tn.conversion.persistence.bounds import MAX_MESSAGE_CHARS
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted
from mumoe_tn.layers import MuMoEMLP

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
import hf_models  # noqa: E402  (needs transformers)

#: Seconds a refusal may take here: a hang guard, not a benchmark (the first round's took minutes).
QUICK = 5.0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A converted model's safetensors file, its record and its tensors; one good load first (imports settle)."""
    folder = tmp_path_factory.mktemp("bounds")
    model = _converted()
    save_converted(model, folder / "good.safetensors")
    load_converted(_plain(), folder / "good.safetensors")
    state = safetensors_torch.load_file(str(folder / "good.safetensors"))
    return folder, conversion_record(model).to_dict(), state


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A converted GPT-2 saved in two shards; one good load each way first."""
    folder = tmp_path_factory.mktemp("hf") / "converted"
    torch.manual_seed(0)
    model = hf_models.gpt2(layers=1, width=32, vocab=50)
    convert(model, expert_dims=4, mlps=r"mlp$", rank=4)
    model.save_pretrained(folder, max_shard_size="20KB")
    load_converted(transformers.GPT2LMHeadModel, folder)
    transformers.GPT2LMHeadModel.from_pretrained(folder)
    return folder


def _pickled(source, target, change=lambda state, config: None):
    """A copy of a safetensors directory with its weights in one ``pytorch_model.bin``, after ``change``."""
    folder = _copy(source, target)
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(safetensors_torch.load_file(str(shard)))
        shard.unlink()
    (folder / "model.safetensors.index.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    change(state, config)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(state, folder / "pytorch_model.bin")
    return folder


def quick(load, pattern, **options):
    start = time.perf_counter()
    error = refused(load, pattern, **options)
    elapsed = time.perf_counter() - start
    assert elapsed < QUICK, f"the refusal took {elapsed:.1f} s"
    return error


def _expanded(shape):
    """A tensor of ``shape`` storing one element (a stride-0 view)."""
    return torch.zeros(1).expand(*shape)


def _big_rank(record, state, module, rank):
    """``record`` with the rank of every network of ``record.modules[module]`` set to ``rank``, and ``state`` with
    those networks' cores as stride-0 views of that size (each stores 4 bytes)."""
    record = _edit(record, lambda r: [net["sizes"].update(r=rank) for _, net in r["modules"][module]["networks"]])
    state = dict(state)
    entry = record["modules"][module]
    for path in entry["paths"]:
        for key in list(state):
            if key.startswith(path + ".") and key.rpartition(".")[2].startswith("U_"):
                state[key] = _expanded((state[key].shape[0], rank))
    return record, state


# ----------------------------------------------------------------------------- declared sizes against stored bytes
def test_a_pickled_checkpoint_of_expanded_cores_is_refused_before_anything_is_allocated(hf_dir, tmp_path):
    def expand(state, config):  # rank 10⁷: 3 × 10⁸ nominal elements from ~100 KB
        config[RECORD_KEY], expanded = _big_rank(config[RECORD_KEY], state, 0, 10**7)
        state.update(expanded)

    folder = _pickled(hf_dir, tmp_path / "pickled", expand)
    assert _size(folder) < 1 << 20
    pattern = r"pytorch_model\.bin': tensor 'transformer\.h\.0\.mlp\.[\w.]+' of shape \(\d+, 10000000\) has strides "
    for load in (
        lambda: load_converted(transformers.GPT2LMHeadModel, folder),
        lambda: transformers.GPT2LMHeadModel.from_pretrained(folder),
    ):
        quick(load, pattern + r".*share stored bytes", size=_size(folder))


def test_a_pickled_file_whose_tensors_declare_more_than_it_stores_is_refused(hf_dir, tmp_path):
    shared = torch.zeros(64, 64)  # 400 views of one 16 KB storage: 6.5 MB declared
    folder = _pickled(
        hf_dir, tmp_path / "overlapping", lambda state, _: state.update({f"x.{k}": shared for k in range(400)})
    )
    quick(
        lambda: load_converted(transformers.GPT2LMHeadModel, folder),
        r"its tensors declare [\d,]+ bytes, more than a file of [\d,]+ bytes holds",
        size=_size(folder),
    )


def test_an_honest_pickled_checkpoint_still_loads(hf_dir, tmp_path):
    folder = _pickled(hf_dir, tmp_path / "honest")
    model = load_converted(transformers.GPT2LMHeadModel, folder)
    reference = load_converted(transformers.GPT2LMHeadModel, hf_dir)
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits)


def test_apply_conversion_refuses_expanded_tensors_before_building_anything(saved):
    _, record, state = saved
    model = _plain()
    bad_record, bad_state = _big_rank(record, state, 1, 10**7)
    quick(
        lambda: apply_conversion(model, bad_record, shapes=bad_state),
        r"shapes: tensor '1\.experts\.U_\w+' of shape \(\d+, 10000000\) has strides \(0, 0\), so its elements share",
        model=model,
    )
    fine = {key: value.clone() for key, value in state.items()}
    assert apply_conversion(model, record, shapes=fine) is model  # the honest tensors pass the same check


# ----------------------------------------------------------------------------- work before refusal
def _star(record, cores):
    """One hyperedge joining ``cores`` cores (each its own leg too): far above the network budget."""
    network = record["modules"][1]["networks"][0][1]
    star = [["A", ["n1", "n2", "i", "o", "h"]]] + [[f"C{k}", ["h", f"b{k}"]] for k in range(cores)]
    star += [[f"D{k}", [f"b{k}"]] for k in range(cores)]
    network.update(format=None, cores=star[:256], sizes={"n1": 3, "n2": 4, "i": 13, "o": 12, "h": 2})


def test_a_network_beyond_the_work_budget_is_refused_before_it_is_built(saved):
    folder, record, state = saved
    bad = _edit(record, lambda r: _star(r, 200))
    path = _write(folder, bad, state)
    model = _plain()
    quick(
        lambda: load_converted(model, path),
        r"cores × labels × the most cores a label joins is [\d,]+, above the bound 524,288",
        model=model,
        size=path.stat().st_size,
    )


def _clique(record, cores):
    """Every pair of ``cores`` cores bonded at size 1: within the work budget, and once a planning stall."""
    network = record["modules"][1]["networks"][0][1]
    labels = [[f"C{k}", []] for k in range(cores)]
    sizes = {"n1": 3, "n2": 4, "i": 13, "o": 12}
    for a in range(cores):
        for b in range(a + 1, cores):
            labels[a][1].append(f"b{a}_{b}")
            labels[b][1].append(f"b{a}_{b}")
            sizes[f"b{a}_{b}"] = 1
    for k, leg in enumerate(("n1", "n2", "i", "o")):
        labels[k][1].append(leg)
    network.update(name="clique", format=None, cores=labels, sizes=sizes)
    record["modules"][1]["execution"]["optimize"] = "optimal"


def test_a_clique_record_with_a_recorded_optimal_builds_and_runs_in_seconds(saved):
    _, record, _ = saved
    crafted = _edit(record, lambda r: _clique(r, 12))
    model = _plain()
    start = time.perf_counter()
    apply_conversion(model, crafted)  # builds and calibrates the clique's layer
    with torch.no_grad():
        y = model(torch.randn(4, 12))
    assert time.perf_counter() - start < 4 * QUICK  # over 90 s before planning was bounded
    assert torch.isfinite(y).all()
    plan = model[1].experts.plan(4)
    assert "'optimal' is an exhaustive search over 15 operands" in plan.note


def _renamed_core(record):
    network = record["modules"][1]["networks"][0][1]
    network.update(format=None, cores=[["Q", ["n1", "r"]], *network["cores"][1:]])


def test_a_record_that_does_not_fit_the_weights_is_refused_before_a_module_is_built(saved, monkeypatch):
    folder, record, state = saved
    import mumoe_tn.conversion.persistence.replay as replay_module

    def never(*args, **kwargs):
        raise AssertionError("a module was built before the cheap checks")

    monkeypatch.setattr(replay_module, "build_block", never)
    for change, pattern in [
        (
            _set("modules", 1, "networks", 0, 1, "sizes", "n1", 10**6),
            r"implies '1\.experts\.U_n1' of shape \(1000000, 3\)",
        ),
        (
            _renamed_core,
            r"implies a 'layer' core 'Q' of shape \(3, 3\) under '1', which the checkpoint does not hold",
        ),
    ]:
        path = _write(folder, _edit(record, change), state)
        model = _plain()
        quick(lambda p=path, m=model: load_converted(m, p), pattern, model=model, size=path.stat().st_size)


def test_config_sizes_are_held_against_the_weights_before_the_model_is_built(hf_dir, tmp_path):
    cases = {
        "vocab_size": (16_000_000, r"config\.json: vocab_size = 16000000 is invalid: no stored tensor has a dimension"),
        "n_layer": (
            6000,
            r"config\.json: n_layer = 6000 is invalid: the weights hold 1 layer\(s\) of 'transformer\.h'",
        ),
        "n_positions": (10**7, r"config\.json: n_positions = 10000000 is invalid"),
        "n_embd": (-1, r"config\.json: n_embd = -1 is invalid: a layer count or size is a non-negative int"),
    }
    for number, (field, (value, pattern)) in enumerate(cases.items()):
        folder = _copy(hf_dir, tmp_path / f"size{number}")
        _rewrite(folder, "config.json", lambda c, field=field, value=value: c.update({field: value}))
        quick(lambda folder=folder: load_converted(transformers.GPT2LMHeadModel, folder), pattern, size=_size(folder))


def test_recorded_padding_is_held_to_its_documented_bound(saved):
    folder, record, state = saved
    path = _write(folder, _edit(record, _set("modules", 1, "execution", "pad_bonds", 1 << 40)), state)
    model = _plain()
    quick(
        lambda: load_converted(model, path),
        r"execution\['pad_bonds'\] = 1099511627776 is invalid: it must be an int of at least 1 and at most 1,024",
        model=model,
    )
    fine = load_converted(
        _plain(), _write(folder, _edit(record, _set("modules", 1, "execution", "pad_bonds", 64)), state)
    )
    assert fine[1].experts.pad_bonds == 64


# ----------------------------------------------------------------------------- the library's errors, bounded
@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value", ["float8_e4m3fn", "auto", "__class__", "int8", 32])
def test_config_dtypes_get_the_library_error(hf_dir, tmp_path, field, value):
    folder = _copy(hf_dir, tmp_path / "dtype")
    _rewrite(folder, "config.json", lambda c: c.update({field: value}))
    quick(
        lambda: load_converted(transformers.GPT2LMHeadModel, folder),
        rf"config\.json: {field} = .* is invalid: a converted checkpoint's dtype is null or one of",
        size=_size(folder),
    )


def test_a_core_beyond_any_storage_gets_the_library_error(saved):
    folder, record, state = saved
    big = _edit(record, lambda r: r["modules"][1]["networks"][0][1]["sizes"].update(n1=1 << 40, r=1 << 40))
    path = _write(folder, big, state)
    model = _plain()
    quick(
        lambda: load_converted(model, path),
        r"cores\[0\] = \['U_n1', \['n1', 'r'\]\] is invalid: its sizes give",
        model=model,
    )


def test_a_huge_field_gets_a_short_message_naming_it(saved):
    folder, record, state = saved
    for change, field in [
        (_set("modules", 0, "gate", "fields", "activation", "x" * 5_000_000), r"gate\.fields\['activation'\]"),
        (_set("modules", 0, "paths", 0, "a" * 5_000_000), r"record\.modules\[0\]\.paths\[0\]"),
        (lambda r: r["modules"][1]["networks"][0][1]["sizes"].update({"q" * 5_000_000: 0}), r"sizes\['qqq"),
    ]:
        path = _write(folder, _edit(record, change), state)
        model = _plain()
        error = quick(lambda p=path, m=model: load_converted(m, p), field, model=model, size=path.stat().st_size)
        assert len(str(error)) <= MAX_MESSAGE_CHARS


# ----------------------------------------------------------------------------- the stock path
def test_stock_from_pretrained_rebuilds_a_record_saved_without_a_quantization_config(hf_dir, tmp_path):
    folder = _copy(hf_dir, tmp_path / "unmarked")
    _rewrite(folder, "config.json", lambda c: c.pop("quantization_config"))
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    assert isinstance(model.transformer.h[0].mlp, MuMoEMLP)
    reference = load_converted(transformers.GPT2LMHeadModel, hf_dir)
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits)


@pytest.mark.parametrize("mangled", [{"quant_method": "mumoe"}, {"quant_method": "bitsandbytes_8bit"}, {"bits": 4}])
def test_stock_from_pretrained_refuses_a_record_under_another_quantization_config(hf_dir, tmp_path, mangled):
    folder = _copy(hf_dir, tmp_path / "mangled")
    _rewrite(folder, "config.json", lambda c: c.update(quantization_config=mangled))
    quick(
        lambda: transformers.GPT2LMHeadModel.from_pretrained(folder),
        r"config\.json: quantization_config = .* is invalid: the config carries a mumoe_tn conversion record",
        size=_size(folder),
    )
    quick(
        lambda: load_converted(transformers.GPT2LMHeadModel, folder),
        r"quantization_config = .* is invalid",
        size=_size(folder),
    )
