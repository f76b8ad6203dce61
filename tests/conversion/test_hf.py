"""Round trips in the models' own ecosystems: Hugging Face transformers and timm (optional extras).

Every model is built from a small config object (no downloads); the text is Python's own
``pydoc_data`` topics, as byte tokens.
"""

import copy
from pydoc_data.topics import topics

import pytest
import torch

from mumoe_tn.conversion.convert import convert, find_mlp_blocks
from mumoe_tn.layers import MuMoE, MuMoEMLP
from mumoe_tn.layers.mlp import MuMoEGatedMLP

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (needs transformers)

transformers.logging.set_verbosity_error()

DTYPE = torch.float64
VOCAB = 256


def _batch(batch=4, length=24, seed=0):
    data = torch.tensor(list(" ".join(topics[k] for k in sorted(topics))[:20000].encode()))
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([data[s : s + length] for s in starts.tolist()])


def _gpt2():
    return hf_models.gpt2(width=32, heads=2, vocab=VOCAB, bos_token_id=0, eos_token_id=0)


def _llama():
    return hf_models.llama(vocab=VOCAB, bos_token_id=0, eos_token_id=0)


# (model factory, block class, conversion arguments): ranks hold every matrix (exact upcycling)
MODELS = {
    "gpt2": (_gpt2, MuMoEMLP, {"mlps": r"mlp$", "linears": r"c_attn$", "rank": 33}),
    "llama": (_llama, MuMoEGatedMLP, {"mlps": r"mlp$", "rank": 33}),
}


def _convert(model, arguments, upcycle):
    return convert(model, expert_dims=(4, 4), decomposition="cp", upcycle=upcycle, gate_norm="layer", **arguments)


def _randomize_gates(model):
    for module in model.modules():
        if isinstance(module, (MuMoE, MuMoEMLP, MuMoEGatedMLP)):
            for projection in module.gate.projections.values():
                projection.weight.data.normal_(0, 3)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_converted_model_upcycles_trains_saves_loads_and_generates(family, tmp_path):
    build, block, arguments = MODELS[family]
    torch.manual_seed(0)
    original = build().to(DTYPE).eval()
    assert (
        find_mlp_blocks(original) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
        if family == "gpt2"
        else [
            "model.layers.0.mlp",
            "model.layers.1.mlp",
        ]
    )
    tokens = _batch()
    with torch.no_grad():
        expected = original(tokens).logits
    model = copy.deepcopy(original)
    report = _convert(model, arguments, upcycle=True)
    assert all(r.upcycle_error < 1e-12 for r in report.replacements)
    assert sum(isinstance(m, block) for m in model.modules()) == 2
    _randomize_gates(model)  # experts equal the pretrained weights: any gate gives the same outputs
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, expected)

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()

    torch.save(model.state_dict(), tmp_path / "converted.pt")
    fresh = build().to(DTYPE)
    _convert(fresh, arguments, upcycle=False)  # the same conversion, then the saved weights
    fresh.load_state_dict(torch.load(tmp_path / "converted.pt", weights_only=True))
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens).logits, model(tokens).logits)
    prompt = tokens[:1, :8]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 14) and torch.equal(generated[:, :8], prompt)
    assert torch.equal(fresh.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), generated)


def test_save_pretrained_of_a_converted_model_loads_into_a_converted_model(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = _gpt2().eval()
    _convert(model, MODELS["gpt2"][2], upcycle=False)
    model.save_pretrained(tmp_path)
    fresh = _gpt2().eval()
    _convert(fresh, MODELS["gpt2"][2], upcycle=False)
    keys = fresh.load_state_dict(safetensors.load_file(tmp_path / "model.safetensors"), strict=False)
    assert keys.unexpected_keys == [] and keys.missing_keys == ["lm_head.weight"]  # tied to the embedding
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    tokens = _batch(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens).logits, model(tokens).logits)


def test_bert_split_mlps_upcycle_exactly():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    original = transformers.BertModel(config).to(DTYPE).eval()
    assert find_mlp_blocks(original) == ["encoder.layer.0", "encoder.layer.1"]
    tokens = _batch(2, 16)
    with torch.no_grad():
        expected = original(tokens).last_hidden_state
    model = copy.deepcopy(original)
    report = _convert(model, {"mlps": r"layer\.\d+$", "linears": r"attention\.self\.query$", "rank": 33}, True)
    assert [r.kind for r in report.replacements].count("split") == 2
    layer = model.encoder.layer[0]
    assert isinstance(layer.intermediate, MuMoEMLP) and isinstance(layer.output.dense, torch.nn.Identity)
    assert isinstance(layer.attention.self.query, MuMoE)  # inside the layer, outside its MLP
    _randomize_gates(model)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).last_hidden_state, expected)


def test_timm_mixer_converts_and_trains():
    pytest.importorskip("timm", exc_type=ImportError)  # timm imports torchvision at import time
    torch.manual_seed(0)
    from timm.models.mlp_mixer import MlpMixer

    model = MlpMixer(num_classes=4, img_size=32, patch_size=8, num_blocks=2, embed_dim=32)
    blocks = find_mlp_blocks(model)
    assert blocks == [f"blocks.{k}.{mlp}" for k in range(2) for mlp in ("mlp_tokens", "mlp_channels")]
    convert(model, expert_dims=(4, 4), mlps=r"mlp_channels$")
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 4, (8,))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("layer", ["Mlp", "GluMlp", "SwiGLU", "SwiGLUPacked"])
def test_timm_mlps_upcycle_exactly(layer):
    pytest.importorskip("timm", exc_type=ImportError)
    from timm.layers import mlp

    torch.manual_seed(0)
    original = getattr(mlp, layer)(8, 16).to(DTYPE).eval()
    model = torch.nn.Sequential(copy.deepcopy(original))
    report = convert(model, expert_dims=4, mlps=".", rank=17, upcycle=True)
    assert report.replacements[0].kind == ("mlp" if layer == "Mlp" else "gated")
    _randomize_gates(model)
    x = torch.randn(3, 8, dtype=DTYPE)
    with torch.no_grad():
        torch.testing.assert_close(model(x), original(x))
