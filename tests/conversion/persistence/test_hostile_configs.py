"""Crafted ``config.json`` fields: each refused with the library's short error, quickly, before the model is built.

A converted GPT-2 or Llama is saved by ``save_pretrained``, its ``config.json`` is tampered with
(or a key added to its weights), and the directory is loaded with ``load_converted`` and with stock
``from_pretrained``, using the harness of ``test_hostile_checkpoints.py`` (the library's
``ValueError``, nothing imported, memory bounded) plus a time bound and a message-length bound.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_hostile_checkpoints import _converted, _copy, _plain, _rewrite, _size, refused

from mumoe_tn.conversion.convert import convert
from mumoe_tn.conversion.persistence.bounds import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_FIELDS,
    MAX_LABELS,
    MAX_LISTED_KEYS,
    MAX_MESSAGE_CHARS,
)
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted
from mumoe_tn.conversion.persistence.record import ConversionRecord

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
import hf_models  # noqa: E402  (needs transformers)

transformers.logging.set_verbosity_error()

#: Seconds a refusal may take here: a hang guard (the unchecked loads took 30 s to 4 minutes).
QUICK = 5.0


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A converted one-layer GPT-2 (width 32, 4 heads, vocabulary 50); one good load each way first."""
    folder = tmp_path_factory.mktemp("configs") / "gpt2"
    torch.manual_seed(0)
    model = hf_models.gpt2(layers=1, width=32, vocab=50)
    convert(model, expert_dims=4, mlps=r"mlp$", rank=4)
    model.save_pretrained(folder)
    load_converted(transformers.GPT2LMHeadModel, folder)
    transformers.GPT2LMHeadModel.from_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A converted two-layer Llama (4 heads over 2 key-value heads, RoPE); its model kept for comparison."""
    folder = tmp_path_factory.mktemp("configs") / "llama"
    torch.manual_seed(0)
    model = hf_models.llama().eval()
    convert(model, expert_dims=4, mlps=r"mlp$", rank=4)
    model.save_pretrained(folder)
    load_converted(transformers.LlamaForCausalLM, folder)
    transformers.LlamaForCausalLM.from_pretrained(folder)
    return folder, model


def _tampered(source, target, change=None, extra=None):
    """A copy of ``source`` with ``change`` applied to its config and ``extra`` tensors added to its weights."""
    folder = _copy(source, target)
    if change is not None:
        _rewrite(folder, "config.json", change)
    if extra is not None:
        state = safetensors_torch.load_file(str(folder / "model.safetensors"))
        safetensors_torch.save_file({**state, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _refused_quickly(load, pattern, folder):
    start = time.perf_counter()
    error = refused(load, pattern, size=_size(folder))
    elapsed = time.perf_counter() - start
    assert elapsed < QUICK, f"the refusal took {elapsed:.1f} s"
    assert len(str(error)) <= MAX_MESSAGE_CHARS, f"a message of {len(str(error)):,} characters"
    return error


def _both_paths(cls, folder, pattern):
    """``load_converted`` and stock ``from_pretrained`` both refuse ``folder`` with ``pattern``."""
    _refused_quickly(lambda: load_converted(cls, folder), pattern, folder)
    _refused_quickly(lambda: cls.from_pretrained(folder), pattern, folder)


@pytest.fixture
def blocks_built(monkeypatch):
    """How many GPT-2 and Llama layers are constructed (on any device)."""
    built = []
    for layer in (
        transformers.models.gpt2.modeling_gpt2.GPT2Block,
        transformers.models.llama.modeling_llama.LlamaDecoderLayer,
    ):

        def counting(self, *args, original=layer.__init__, **kwargs):
            built.append(type(self).__name__)
            original(self, *args, **kwargs)

        monkeypatch.setattr(layer, "__init__", counting)
    return built


# ----------------------------------------------------------------------------- layers and widths
def test_layers_are_counted_only_in_the_models_own_layer_list(gpt2_dir, tmp_path, blocks_built):
    stray = {"x.19999.y": torch.zeros(2)}  # a numbered key outside transformer.h admits no layers
    folder = _tampered(gpt2_dir, tmp_path / "stray", lambda c: c.update(n_layer=20_000), stray)
    error = _refused_quickly(
        lambda: load_converted(transformers.GPT2LMHeadModel, folder),
        r"config\.json: n_layer = 20000 is invalid: the weights hold 1 layer\(s\) of 'transformer\.h': layer\(s\) "
        r"\[1, 2, 3, 4, 5, 6, 7, 8, 9, 10\] and 19,989 more of the 20,000 the config gives have no weights",
        folder,
    )
    assert len(blocks_built) <= 3, f"{len(blocks_built)} blocks built: only the one- and two-layer probes may be"
    assert len(str(error)) < 300
    # The stock path refuses it too, when transformers has found the weight files and before it builds its skeleton
    # (a smaller count here: the 20,000 layers are loaded in a subprocess, see below).
    blocks_built.clear()
    folder = _tampered(gpt2_dir, tmp_path / "stock", lambda c: c.update(n_layer=64), {"x.63.y": torch.zeros(2)})
    _refused_quickly(
        lambda: transformers.GPT2LMHeadModel.from_pretrained(folder),
        r"config\.json: n_layer = 64 is invalid: the weights hold 1 layer\(s\) of 'transformer\.h'",
        folder,
    )
    assert len(blocks_built) <= 3, f"{len(blocks_built)} blocks built: only the one- and two-layer probes may be"


_STOCK_LOADS = """
import json, sys, time, traceback
import mumoe_tn, transformers
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
built = []
for layer in (GPT2Block, LlamaDecoderLayer):
    def counting(self, *args, original=layer.__init__, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)
    layer.__init__ = counting
transformers.logging.set_verbosity_error()
for folder in sys.argv[1:]:
    built.clear()
    start = time.perf_counter()
    try:
        transformers.AutoModelForCausalLM.from_pretrained(folder)
        outcome = {"error": None}
    except Exception as error:
        where = traceback.extract_tb(error.__traceback__)[-1].filename
        outcome = {"error": f"{type(error).__name__}: {error}", "raised_in": where}
    print(json.dumps({**outcome, "seconds": time.perf_counter() - start, "blocks": len(built)}))
"""


def test_stock_from_pretrained_refuses_20000_layers_before_building_them(gpt2_dir, llama_dir, tmp_path):
    """Weights for one or two layers under a config of 20,000: refused in well under a second, no skeleton built.

    In a subprocess with a timeout: building the 20,000-layer skeleton takes minutes, which must not stall the suite.
    """
    stray = _tampered(gpt2_dir, tmp_path / "stray", lambda c: c.update(n_layer=20_000), {"x.19999.y": torch.zeros(2)})
    layers = _tampered(llama_dir[0], tmp_path / "layers", lambda c: c.update(num_hidden_layers=20_000))
    result = subprocess.run(
        [sys.executable, "-c", _STOCK_LOADS, str(stray), str(layers), str(gpt2_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    stray_load, layers_load, genuine_load = (json.loads(line) for line in result.stdout.splitlines()[-3:])
    for load, pattern in (
        (stray_load, r"n_layer = 20000 is invalid: the weights hold 1 layer\(s\) of 'transformer\.h'"),
        (layers_load, r"num_hidden_layers = 20000 is invalid: the weights hold 2 layer\(s\) of 'model\.layers'"),
    ):
        assert re.match(r"ValueError: config\.json: " + pattern, load["error"]), load["error"]
        assert "mumoe_tn" in Path(load["raised_in"]).parts, load["raised_in"]
        assert load["seconds"] < QUICK, f"the refusal took {load['seconds']:.1f} s"
        assert load["blocks"] <= 3, f"{load['blocks']} blocks built: only the one- and two-layer probes may be"
    assert genuine_load["error"] is None, genuine_load["error"]


def test_a_weight_of_a_layer_beyond_the_count_is_refused(gpt2_dir, tmp_path):
    extra = {"transformer.h.7.ln_1.weight": torch.ones(32)}
    folder = _tampered(gpt2_dir, tmp_path / "beyond", extra=extra)
    _both_paths(
        transformers.GPT2LMHeadModel,
        folder,
        r"config\.json: n_layer = 1 is invalid: the weights hold layer\(s\) \[7\] of 'transformer\.h', so the config "
        r"gives too few layers",
    )


def test_a_zero_element_tensor_declares_no_width(gpt2_dir, tmp_path):
    extra = {"padding": torch.zeros(0, 2**31)}  # stores nothing, declares a dimension of 2**31
    folder = _tampered(gpt2_dir, tmp_path / "zero", lambda c: c.update(vocab_size=2**31), extra)
    _both_paths(
        transformers.GPT2LMHeadModel,
        folder,
        r"config\.json: vocab_size = 2147483648 is invalid: no stored tensor has a dimension above 129",
    )


@pytest.mark.parametrize(
    "field, value, key, shape",
    [
        ("vocab_size", 51, "transformer.wte.weight", r"\(51, 32\), the checkpoint holds \(50, 32\)"),
        ("n_positions", 63, "transformer.wpe.weight", r"\(63, 32\), the checkpoint holds \(64, 32\)"),
        ("n_embd", 36, "transformer.wte.weight", r"\(50, 36\), the checkpoint holds \(50, 32\)"),
    ],
)
def test_every_declared_width_equals_the_stored_shape_that_receives_it(gpt2_dir, tmp_path, field, value, key, shape):
    folder = _tampered(gpt2_dir, tmp_path / field, lambda c: c.update({field: value}))
    _both_paths(
        transformers.GPT2LMHeadModel,
        folder,
        rf"config\.json: {field} = {value} is invalid: the model it describes has '{key}' of shape {shape}",
    )


# ----------------------------------------------------------------------------- labels, names and heads
@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"num_labels": 10**7}, rf"num_labels = 10000000 is invalid: .* at most {MAX_LABELS:,}"),
        ({"num_labels": -1}, r"num_labels = -1 is invalid"),
        ({"id2label": {str(k): "x" for k in range(MAX_LABELS + 1)}}, r"id2label = '<32,769 entries>' is invalid"),
        ({"num_labels": 2, "id2label": {"0": "a", "1": "b", "2": "c"}}, r"num_labels = 2 gives as many labels"),
        ({"id2label": {"0": "a", "5": "b"}}, r"id2label = .* its keys are the ids 0 to 1, each once"),
        ({"id2label": {"0": "a"}, "label2id": {"a": 0, "b": 1}}, r"label2id = .* it must have 1 entries"),
        ({"id2label": {"0": "a", "1": "b"}, "label2id": {"a": 0, "b": 9}}, r"label2id\['b'\] = 9 is invalid"),
    ],
)
def test_label_maps_are_bounded_and_consistent(gpt2_dir, tmp_path, blocks_built, change, pattern):
    folder = _tampered(gpt2_dir, tmp_path / "labels", lambda c: c.update(change))
    _refused_quickly(lambda: load_converted(transformers.GPT2LMHeadModel, folder), pattern, folder)
    assert blocks_built == [], "a layer was built before the refusal"


def test_stock_from_pretrained_refuses_a_label_map_beyond_the_bound(gpt2_dir, tmp_path):
    folder = _tampered(gpt2_dir, tmp_path / "labels", lambda c: c.update(num_labels=MAX_LABELS + 1))
    _refused_quickly(  # transformers made the label map before any hook ran; it is refused before the model is built
        lambda: transformers.GPT2LMHeadModel.from_pretrained(folder),
        r"id2label = '<32,769 entries>' is invalid",
        folder,
    )


@pytest.mark.parametrize(
    "value", ["kernels-community/flash-attn", "kernels-community/flash-attn@main:fn", "nope", 3, {"": "org/name"}]
)
def test_attention_implementations_are_transformers_built_in_ones(gpt2_dir, tmp_path, monkeypatch, blocks_built, value):
    import transformers.integrations.hub_kernels as hub_kernels

    def never(*args, **kwargs):
        raise AssertionError("transformers' kernel loader was reached")

    monkeypatch.setattr(hub_kernels, "load_and_register_attn_kernel", never)
    folder = _tampered(gpt2_dir, tmp_path / "attention", lambda c: c.update(attn_implementation=value))
    _both_paths(
        transformers.GPT2LMHeadModel,
        folder,
        r"config\.json: attn_implementation = .* is invalid: it must be null or one of transformers' built-in "
        r"implementations \['eager', .*'sdpa'\]",
    )
    assert blocks_built == [], "a layer was built before the refusal"


def test_a_built_in_attention_implementation_still_loads(gpt2_dir, tmp_path):
    folder = _tampered(gpt2_dir, tmp_path / "eager", lambda c: c.update(attn_implementation="eager"))
    model = load_converted(transformers.GPT2LMHeadModel, folder)
    assert model.config._attn_implementation == "eager"


#: Which loads are tried: both, or ``load_converted`` alone where stock ``from_pretrained`` has transformers' config
#: class refuse the value (with its own error) before any hook of mumoe_tn runs.
BOTH, LOAD_CONVERTED = ("load_converted", "stock"), ("load_converted",)


@pytest.mark.parametrize(
    "model, change, pattern, paths",
    [
        ("gpt2", {"activation_function": "nope"}, r"activation_function = 'nope' is invalid: .* ACT2FN", BOTH),
        ("gpt2", {"activation_function": None}, r"activation_function = None is invalid", LOAD_CONVERTED),
        ("llama", {"hidden_act": "os.system"}, r"hidden_act = 'os\.system' is invalid: .* ACT2FN", BOTH),
        ("llama", {"rope_parameters": {"rope_type": "nope"}}, r"rope_parameters\['rope_type'\] = 'nope'", BOTH),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": "x"}},
            r"rope_parameters\['factor'\] = 'x' is invalid: a RoPE parameter is a number",
            BOTH,
        ),
        ("llama", {"rope_parameters": [1]}, r"rope_parameters = \[1\] is invalid: .* a mapping", LOAD_CONVERTED),
        ("gpt2", {"n_head": 0}, r"n_head = 0 is invalid: a head count is a positive int", BOTH),
        ("gpt2", {"n_head": 3}, r"n_embd = 32 is invalid: it must be a positive multiple of n_head = 3", BOTH),
        ("llama", {"num_attention_heads": 0}, r"num_attention_heads = 0 is invalid", LOAD_CONVERTED),
        ("llama", {"num_key_value_heads": 3}, r"num_key_value_heads = 3 is invalid: .* dividing", BOTH),
        ("llama", {"head_dim": 0}, r"head_dim = 0 is invalid: a head width is a positive int", BOTH),
    ],
)
def test_names_and_head_arithmetic_get_the_library_error(
    gpt2_dir, llama_dir, tmp_path, blocks_built, model, change, pattern, paths
):
    source, cls = (gpt2_dir, transformers.GPT2LMHeadModel) if model == "gpt2" else (llama_dir[0], None)
    cls = cls or transformers.LlamaForCausalLM
    folder = _tampered(source, tmp_path / "names", lambda c: c.update(change))
    loads = {"load_converted": lambda: load_converted(cls, folder), "stock": lambda: cls.from_pretrained(folder)}
    for path in paths:
        _refused_quickly(loads[path], rf"config\.json: {pattern}", folder)
    assert blocks_built == [], "a layer was built before the refusal"


def test_rope_scaling_with_an_unknown_type_is_refused_before_transformers_reads_it(llama_dir, tmp_path):
    folder = _tampered(llama_dir[0], tmp_path / "scaling", lambda c: c.update(rope_scaling={"type": "evil"}))
    _refused_quickly(
        lambda: load_converted(transformers.LlamaForCausalLM, folder),
        r"config\.json: rope_scaling\['type'\] = 'evil' is invalid: a RoPE type is one of \['default', ",
        folder,
    )


# ----------------------------------------------------------------------------- sizes, once, short messages
def test_config_entries_and_size_are_bounded(gpt2_dir, tmp_path):
    many = {f"field_{k}": k for k in range(30_000)}
    folder = _tampered(gpt2_dir, tmp_path / "fields", lambda c: c.update(many))
    _both_paths(
        transformers.GPT2LMHeadModel,
        folder,
        rf"config\.json: <fields> = '<30,0\d\d fields>' is invalid: a config has at most {MAX_CONFIG_FIELDS} fields",
    )
    folder = _tampered(gpt2_dir, tmp_path / "values", lambda c: c.update(padding=[[0] * 1000] * 200))
    _both_paths(transformers.GPT2LMHeadModel, folder, r"config\.json: <values> = '<more than 131,072 values>'")
    folder = _copy(gpt2_dir, tmp_path / "large")
    config = json.loads((folder / "config.json").read_text())
    config["padding"] = "x" * MAX_CONFIG_BYTES
    (folder / "config.json").write_text(json.dumps(config))
    _refused_quickly(
        lambda: load_converted(transformers.GPT2LMHeadModel, folder),
        rf"config\.json is [\d,]+ bytes, more than the {MAX_CONFIG_BYTES:,} it may have",
        folder,
    )


def test_the_record_is_validated_once_per_load(gpt2_dir, monkeypatch):
    parsed = []
    original = ConversionRecord.from_dict.__func__

    def counting(cls, data):
        if not isinstance(data, ConversionRecord):
            parsed.append(1)
        return original(cls, data)

    monkeypatch.setattr(ConversionRecord, "from_dict", classmethod(counting))
    load_converted(transformers.GPT2LMHeadModel, gpt2_dir)
    assert len(parsed) == 1
    transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir)
    assert len(parsed) == 2


def test_a_load_error_lists_at_most_ten_keys(gpt2_dir, tmp_path):
    extra = {f"extra.{k}": torch.zeros(1) for k in range(5_000)}
    folder = _tampered(gpt2_dir, tmp_path / "extra", extra=extra)
    error = _refused_quickly(
        lambda: load_converted(transformers.GPT2LMHeadModel, folder),
        rf"do not fit the converted model: unexpected_keys 5,000: \[.*\] and {5_000 - MAX_LISTED_KEYS:,} more",
        folder,
    )
    assert str(error).count("'extra.") == MAX_LISTED_KEYS


def test_a_load_error_quoting_huge_keys_stays_short(tmp_path):
    save_converted(_converted(), tmp_path / "good.safetensors")
    state = safetensors_torch.load_file(str(tmp_path / "good.safetensors"))
    record = safetensors_torch.safe_open(str(tmp_path / "good.safetensors"), "pt").metadata()
    huge = {f"{k}" + "k" * 1_000_000: torch.zeros(1) for k in range(5)}  # five unexpected keys of 1 MB each
    safetensors_torch.save_file({**state, **huge}, str(tmp_path / "huge.safetensors"), metadata=record)
    model = _plain()
    error = refused(
        lambda: load_converted(model, tmp_path / "huge.safetensors"),
        r"the checkpoint has 5 key\(s\) the model lacks, e\.g\. \['\dk{10}",
        model=model,
        size=(tmp_path / "huge.safetensors").stat().st_size,
    )
    assert len(str(error)) <= MAX_MESSAGE_CHARS


# ----------------------------------------------------------------------------- genuine models
def test_a_genuine_converted_llama_loads_bitwise_by_both_paths(llama_dir):
    folder, original = llama_dir
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(tokens).logits
        for model in (
            load_converted(transformers.LlamaForCausalLM, folder),
            transformers.AutoModelForCausalLM.from_pretrained(folder).eval(),
        ):
            assert torch.equal(model(tokens).logits, expected)
