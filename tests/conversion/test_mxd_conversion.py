"""Converting Hugging Face MLPs into Mixture of Decoders blocks: exact upcycling, reload, training."""

import pytest
import torch

from mumoe_tn.conversion.convert import conversion_record, convert
from mumoe_tn.conversion.persistence.checkpoints import load_converted
from mumoe_tn.layers import MixtureOfDecoders

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (needs transformers)

transformers.logging.set_verbosity_error()

VOCAB = 100
FAMILIES = {
    "gpt2": (lambda: hf_models.gpt2(vocab=VOCAB, bos_token_id=0, eos_token_id=0), transformers.GPT2LMHeadModel),
    "llama": (lambda: hf_models.llama(vocab=VOCAB, bos_token_id=0, eos_token_id=0), transformers.LlamaForCausalLM),
}


def _tokens(batch=2, length=10, seed=0):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dims", [8, (4, 3)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_upcycled_mxd_conversion_computes_what_the_model_did(family, dims):
    build, _ = FAMILIES[family]
    torch.manual_seed(0)
    original = build().eval()
    converted = build().eval()
    converted.load_state_dict(original.state_dict())
    report = convert(converted, mlps=r"mlp$", expert_dims=dims, decomposition="mxd", upcycle=True)
    blocks = [m for m in converted.modules() if isinstance(m, MixtureOfDecoders)]
    assert len(blocks) == 2 and all(block.gated == (family == "llama") for block in blocks)
    assert all(r.upcycle_error < 1e-5 for r in report.replacements)  # float32 rounding of D = W₂ᵀ
    assert any("keep the MLP's hidden width" in note for note in report.notes)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(converted(tokens).logits, original(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mxd_conversion_trains_saves_and_reloads_bitwise(family, tmp_path):
    build, cls = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    convert(model, mlps=r"mlp$", expert_dims=(4, 4), decomposition="mxd", upcycle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    tokens = _tokens(4, 12, seed=1)
    model.train()
    for _ in range(2):
        loss = model(tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(tmp_path)
    loaded = load_converted(cls, tmp_path)
    assert conversion_record(loaded) == conversion_record(model)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
    stock = cls.from_pretrained(tmp_path).eval()  # the registered hook rebuilds the decoder blocks
    assert [type(m) for m in stock.modules()] == [type(m) for m in model.modules()]
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
        assert torch.equal(stock(tokens).logits, model(tokens).logits)


def test_matched_mxd_conversion_narrows_the_hidden_layer():
    build, _ = FAMILIES["gpt2"]
    model = build()
    before = sum(p.numel() for p in model.parameters())
    convert(model, mlps=r"mlp$", expert_dims=8, decomposition="mxd")
    after = sum(p.numel() for p in model.parameters())
    assert abs(after - before) <= 0.05 * before
    block = model.transformer.h[0].mlp
    assert isinstance(block, MixtureOfDecoders) and block.hidden_features < 256
