"""A converted model saves and loads as itself: Hugging Face directories, safetensors files, plain state dicts."""

import copy
import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from mumoe_tn.conversion.convert import apply_conversion, conversion_record, convert
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted
from mumoe_tn.conversion.persistence.record import ConversionRecord
from mumoe_tn.gates.registry import register_gate
from mumoe_tn.gates.specs import Gate, TopKGate
from mumoe_tn.layers import MuMoE, MuMoEMLP
from mumoe_tn.layers.mlp import MuMoEGatedMLP

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (needs transformers)

transformers.logging.set_verbosity_error()

VOCAB = 100


def _gpt2(layers=2, width=64):
    return hf_models.gpt2(layers=layers, width=width, vocab=VOCAB, bos_token_id=0, eos_token_id=0)


def _llama():
    return hf_models.llama(vocab=VOCAB, bos_token_id=0, eos_token_id=0)


FAMILIES = {
    "gpt2": (_gpt2, transformers.GPT2LMHeadModel, {"mlps": r"mlp$", "linears": r"c_attn$"}),
    "llama": (_llama, transformers.LlamaForCausalLM, {"mlps": r"mlp$"}),
}


def _tokens(batch=3, length=12, seed=0):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _train(model, steps=3, lr=1e-2):
    """A few optimizer steps, so every weight and the gates' running statistics differ from their start."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    tokens = _tokens(4, 16, seed=1)
    losses = []
    for _ in range(steps):
        loss = model(tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.eval(), losses


def _converted(family, dtype=None, **options):
    build, cls, selection = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    if dtype is not None:  # the same weights, in a model built in dtype
        weights, model = model.state_dict(), cls._from_config(model.config, dtype=dtype)
        model.load_state_dict(weights)
    convert(model, expert_dims=(4, 4), **selection, **options)
    return _train(model)[0]


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stock_from_pretrained_and_load_converted_give_bitwise_equal_logits_and_generations(
    family, dtype, shard, tmp_path
):
    model = _converted(family, dtype=None if dtype == torch.float32 else dtype, gate=Gate("entmax15", "batch"))
    _, cls, _ = FAMILIES[family]
    model.save_pretrained(tmp_path, **({"max_shard_size": "40KB"} if shard else {}))
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert ("model.safetensors.index.json" in saved) == shard and "config.json" in saved
    tokens = _tokens()
    prompt = tokens[:1, :5]
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model(tokens).logits
    generated = model.generate(prompt, **options)
    loaders = {
        "AutoModelForCausalLM.from_pretrained": transformers.AutoModelForCausalLM.from_pretrained,
        f"{cls.__name__}.from_pretrained": cls.from_pretrained,
        "load_converted": lambda path: load_converted(cls, path),
        "load_converted(AutoModelForCausalLM)": lambda path: load_converted(transformers.AutoModelForCausalLM, path),
    }
    for name, load in loaders.items():
        loaded = load(tmp_path)
        assert type(loaded) is cls and not loaded.training, name
        assert conversion_record(loaded) == conversion_record(model), name
        assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()], name
        assert {p.dtype for p in loaded.parameters()} == {dtype}, name
        with torch.no_grad():
            assert torch.equal(loaded(tokens).logits, expected), name
        assert torch.equal(loaded.generate(prompt, **options), generated), name


_WITHOUT_AND_WITH = """
import logging, sys, warnings
import transformers
{first}
transformers.logging.set_verbosity_warning()
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
transformers.logging.get_logger().addHandler(Keep())
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(type(model.transformer.h[0].mlp).__name__)
print(any("Unknown quantization type, got mumoe_tn" in message for message in records))
"""


@pytest.mark.parametrize("first", ["", "import mumoe_tn"], ids=["not imported", "imported first"])
def test_without_mumoe_tn_from_pretrained_warns_and_is_dense_and_importing_it_first_is_enough(first, tmp_path):
    import subprocess
    import sys

    _converted("gpt2").save_pretrained(tmp_path)
    script = _WITHOUT_AND_WITH.format(first=first)
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    block, warned = result.stdout.split()[-2:]
    assert (block, warned) == (("GPT2MLP", "True") if not first else ("MuMoEMLP", "False"))


def test_load_converted_casts_but_keeps_gate_statistics_in_float32_and_the_record_selects_the_hook(tmp_path):
    model = _converted("gpt2", gate_norm="batch", causal=False)
    model.save_pretrained(tmp_path)
    half = load_converted(transformers.GPT2LMHeadModel, tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    stats = [b for name, b in half.named_buffers() if "running" in name]
    assert stats and all(b.dtype == torch.float32 for b in stats)  # the gates' statistics stay float32
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "mumoe_conversion" in saved and saved["quantization_config"] == {"quant_method": "mumoe_tn"}
    stock = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)  # the hook rebuilds the converted model
    assert isinstance(stock.transformer.h[0].mlp, MuMoEMLP) and not stock.is_quantized
    assert conversion_record(stock) == conversion_record(model)
    with pytest.raises(ValueError, match="already converted"):
        apply_conversion(stock, conversion_record(model))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_converted_model_runs_forward_generate_and_trains_in_bfloat16(family, tmp_path):
    # built in bfloat16 as from_pretrained builds it (a Llama cast with .to() also rounds its rotary buffers)
    model = _converted(family, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens = _tokens()
    with torch.no_grad():
        logits = model(tokens).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    generated = model.generate(tokens[:1, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 10)
    before = [p.detach().clone() for p in model.parameters()]
    _, losses = _train(model, steps=2, lr=0.1)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)
    assert sum(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)) > len(before) // 2
    model.save_pretrained(tmp_path)
    loaded = load_converted(FAMILIES[family][1], tmp_path)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_load_converted_refuses_a_checkpoint_without_a_record(tmp_path):
    torch.manual_seed(0)
    _gpt2().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no mumoe_tn conversion record.*GPT2LMHeadModel\.from_pretrained"):
        load_converted(transformers.GPT2LMHeadModel, tmp_path)


def test_load_converted_takes_auto_classes_and_refuses_a_model_type_they_cannot_load(tmp_path):
    model = _converted("gpt2")
    model.save_pretrained(tmp_path)
    loaded = load_converted(transformers.AutoModelForCausalLM, tmp_path)
    assert type(loaded) is transformers.GPT2LMHeadModel
    assert conversion_record(loaded) == conversion_record(model)
    with pytest.raises(ValueError, match=r"model_type = 'gpt2' is invalid for AutoModelForImageClassification"):
        load_converted(transformers.AutoModelForImageClassification, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for model_type, named in (("no-such-model", "'no-such-model'"), (["gpt2"], r"\['gpt2'\]"), (None, "None")):
        (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        with pytest.raises(ValueError, match=rf"config\.json: model_type = {named} is invalid: it names no model"):
            load_converted(transformers.AutoModelForCausalLM, tmp_path)
    with pytest.raises(TypeError, match=r"a Hugging Face model class \(or auto class\) or a freshly built nn\.Module"):
        load_converted(transformers.GPT2Config, tmp_path)


def test_a_record_from_another_configuration_changes_nothing(tmp_path):
    record = conversion_record(_converted("gpt2"))
    other = _gpt2(layers=1)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\.[a-z_.]+', which this GPT2LMHeadModel does not have"):
        apply_conversion(other, record)
    narrow = _gpt2(width=32)
    with pytest.raises(ValueError, match=r"does not fit the model at 'transformer\.h\.0\.attn\.c_attn'"):
        apply_conversion(narrow, record)
    assert conversion_record(other) is None and conversion_record(narrow) is None
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_weights_that_do_not_fit_the_record_are_refused_before_loading(tmp_path):
    model = _converted("gpt2")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    up, down = (network for _, network in config["mumoe_conversion"]["modules"][1]["networks"])
    down["sizes"]["r"] += 1  # the record's layers no longer agree with each other
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not fit the model at 'transformer\.h\.0\.mlp': its 'down' layer"):
        apply_conversion(_gpt2(), config["mumoe_conversion"])  # no weights to hold it against
    with pytest.raises(  # with the weights, the cheap check against them comes first
        ValueError, match=r"record\.modules\[1\] implies 'transformer\.h\.0\.mlp\.experts2\.\w+' of shape"
    ):
        load_converted(transformers.GPT2LMHeadModel, tmp_path)
    up["sizes"]["r"] += 1  # they agree, but not with the saved cores
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"record\.modules\[1\] implies 'transformer\.h\.0\.mlp\.experts1\.\w+' of shape"
    ):
        load_converted(transformers.GPT2LMHeadModel, tmp_path)


# ----------------------------------------------------------------------------- plain PyTorch models
class Block(nn.Module):
    def __init__(self, width=12):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _plain():
    torch.manual_seed(0)
    shared = Block()
    return nn.Sequential(Block(), shared, nn.Linear(12, 12), shared)  # one block at two paths


@register_gate
@dataclass(frozen=True)
class WideTopK(TopKGate):
    """A user's own gate descriptor (a registered dataclass), recorded by its class name."""


@pytest.mark.parametrize(
    "options",
    [
        {"decomposition": "tr", "rank": (2, 2, 4, 4)},
        {"decomposition": "A: n1 a b, B: n2 a c, C: b c i d, D: d o", "rank": {"a": 2, "b": 3, "c": 2, "d": 6}},
        {"decomposition": "tucker", "rank": (2, 3, 4, 5), "gate": WideTopK(k=2, norm="layer"), "input_norm": True},
    ],
)
def test_safetensors_round_trip_of_any_network_gate_and_a_shared_module(options, tmp_path):
    model = _plain()
    convert(model, expert_dims=(3, 4), mlps=r"^[01]$", linears=r"^2$", **options)
    assert model[1] is model[3] and isinstance(model[1], MuMoEMLP) and isinstance(model[2], MuMoE)
    x = torch.randn(6, 12)
    model(x)
    model.eval()
    save_converted(model, tmp_path / "converted.safetensors")
    loaded = load_converted(_plain(), tmp_path / "converted.safetensors")
    assert loaded[1] is loaded[3] and conversion_record(loaded) == conversion_record(model)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_a_record_as_json_replays_before_load_state_dict(tmp_path):
    model = _plain()
    convert(model, expert_dims=5, mlps=r"^0$", rank=4, upcycle=True, optimize="greedy")
    record = conversion_record(model)
    torch.save({"record": record.to_json(), "state": model.state_dict()}, tmp_path / "converted.pt")
    saved = torch.load(tmp_path / "converted.pt", weights_only=True)
    fresh = apply_conversion(_plain(), saved["record"])
    fresh.load_state_dict(saved["state"])
    assert fresh[0].experts1.optimize == fresh[0].experts2.optimize == "greedy"
    assert ConversionRecord.from_dict(json.loads(record.to_json())) == record
    x = torch.randn(4, 12)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), model.eval()(x))


def test_gated_blocks_record_every_role():
    model = _llama()
    convert(model, expert_dims=4, mlps=r"layers\.0\.mlp$", rank=5)
    (entry,) = conversion_record(model).modules
    assert entry.kind == "gated" and [role for role, _ in entry.networks] == ["gate", "up", "down"]
    fresh = apply_conversion(_llama(), conversion_record(model))
    assert isinstance(fresh.model.layers[0].mlp, MuMoEGatedMLP)


def test_bad_records_and_files_get_the_library_messages(tmp_path):
    model = _plain()
    convert(model, expert_dims=3, mlps=r"^0$", rank=2)
    data = conversion_record(model).to_dict()
    with pytest.raises(ValueError, match="reads versions up to 1: upgrade mumoe_tn"):
        apply_conversion(_plain(), {**data, "version": 99})
    unknown = copy.deepcopy(data)
    unknown["modules"][0]["gate"]["class"] = "not_imported_anywhere.MyGate"
    with pytest.raises(
        ValueError, match=r"gate\.class = 'not_imported_anywhere\.MyGate' is invalid: it is not a registered"
    ):
        apply_conversion(_plain(), unknown)
    unregistered = copy.deepcopy(data)
    unregistered["modules"][0]["networks"][0][1]["format"] = "no_such_format"
    with pytest.raises(ValueError, match=r"format = 'no_such_format' is invalid: it names no format registered"):
        apply_conversion(_plain(), unregistered)
    with pytest.raises(ValueError, match=r"record = \{'modules': 3\} is invalid: it lacks the key\(s\) \['version'\]"):
        apply_conversion(_plain(), {"modules": 3})
    from safetensors.torch import save_model

    save_model(_plain(), str(tmp_path / "dense.safetensors"))
    with pytest.raises(ValueError, match="holds no mumoe_tn conversion record"):
        load_converted(_plain(), tmp_path / "dense.safetensors")
    with pytest.raises(ValueError, match="was not converted by mumoe_tn"):
        save_converted(_plain(), tmp_path / "x.safetensors")


def test_a_gate_that_cannot_be_recorded_warns_at_conversion():
    class Opaque:
        def __init__(self):
            self.inner = Gate()

        def parameter_count(self, i, dims):
            return self.inner.parameter_count(i, dims)

        def fma_per_token(self, i, dims):
            return self.inner.fma_per_token(i, dims)

        def build(self, i, dims, **factory):
            return self.inner.build(i, dims, **factory)

    model = _plain()
    with pytest.warns(UserWarning, match="cannot be recorded.*not a dataclass"):
        convert(model, expert_dims=3, mlps=r"^0$", rank=2, gate=Opaque())
    assert conversion_record(model) is None


def test_a_record_with_invalid_execution_options_is_refused_before_any_change():
    model = _plain()
    convert(model, expert_dims=3, mlps=r"^0$", rank=2)
    data = conversion_record(model).to_dict()
    data["modules"][0]["execution"]["max_plans"] = -1
    fresh = _plain()
    with pytest.raises(ValueError, match=r"record\.modules\[0\]\.execution\['max_plans'\] = -1 is invalid"):
        apply_conversion(fresh, data)
    assert conversion_record(fresh) is None and not isinstance(fresh[0], MuMoEMLP)


def test_a_directory_saved_before_the_record_selected_the_hook_still_loads(tmp_path):
    model = _converted("llama", causal=False)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("quantization_config") == {"quant_method": "mumoe_tn"}
    assert config["mumoe_conversion"]["version"] == 1  # the record's layout is unchanged
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_converted(transformers.LlamaForCausalLM, tmp_path)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    stock = transformers.LlamaForCausalLM.from_pretrained(tmp_path)  # the record selects the hook by itself
    assert any(isinstance(m, MuMoEGatedMLP) for m in stock.modules())
    with torch.no_grad():
        assert torch.equal(stock.eval()(tokens).logits, model(tokens).logits)
