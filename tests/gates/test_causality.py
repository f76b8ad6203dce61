"""A μMoE gate must never let a position see later tokens: every gate option, every block, converted LMs.

The property: in train and in eval mode, the output at position ``t`` does not change when only the
tokens after ``t`` change. A gate that declares ``mixes_tokens`` (batch statistics) must break it in
training — so the declaration is checked both ways.
"""

import copy
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn.conversion.convert import convert, is_causal_model
from mumoe_tn.gates.specs import CausalityWarning, Gate, ReLUTopKGate, TopKGate
from mumoe_tn.layers import MuMoE, MuMoEMLP
from mumoe_tn.layers.mlp import MuMoEGatedMLP

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (needs transformers)

transformers.logging.set_verbosity_error()

NORMS = ("batch", "layer", "none")
GATES = st.one_of(
    st.builds(
        Gate,
        activation=st.sampled_from(["entmax15", "sparsemax", "softmax", 1.3]),
        norm=st.sampled_from(NORMS),
        init=st.sampled_from(["default", "zeros"]),
        balance_loss=st.booleans(),
        z_loss=st.booleans(),
    ),
    st.builds(TopKGate, k=st.integers(1, 3), norm=st.sampled_from(NORMS), balance_loss=st.booleans()),
    st.builds(ReLUTopKGate, k=st.integers(1, 2), norm=st.sampled_from(NORMS), bias=st.booleans()),
)


def _block(kind, gate, input_norm, gate_input):
    options = {"gate": gate, "input_norm": input_norm, "gate_input": gate_input}
    if kind == "layer":
        return MuMoE(10, 12, (3, 4), "cp", 5, **options)
    cls = MuMoEMLP if kind == "mlp" else MuMoEGatedMLP
    return cls(10, 16, 10, 6, "tr", (2, 2, 5), **options)


def _later_tokens_change(module, x, t, generator):
    """Outputs for ``x`` and for ``x`` with every token after ``t`` redrawn (from the same module state)."""
    changed = x.clone()
    changed[:, t + 1 :] = torch.randn(changed[:, t + 1 :].shape, generator=generator) * 3
    first = copy.deepcopy(module)  # training updates running statistics: both calls start alike
    return first(x), module(changed)


@given(
    kind=st.sampled_from(["layer", "mlp", "gated"]),
    gate=GATES,
    input_norm=st.booleans(),
    gate_input=st.sampled_from(["normed", "raw"]),
    t=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_no_position_sees_later_tokens_unless_the_gate_says_it_mixes_tokens(
    kind, gate, input_norm, gate_input, t, seed
):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    block = _block(kind, gate, input_norm, gate_input)
    x = torch.randn(3, 6, 10, generator=generator)
    for training in (False, True):
        block.train(training)
        y, y_changed = _later_tokens_change(block, x, t, generator)
        leaked = (y[:, : t + 1] - y_changed[:, : t + 1]).abs().max().item()
        if training and gate.mixes_tokens and gate.init != "zeros":  # zero logits have no statistics to leak
            assert leaked > 1e-6, f"{gate} declares it mixes tokens, but position {t} did not change"
        else:
            assert leaked < 1e-6, f"{gate}, {'train' if training else 'eval'}: position {t} moved by {leaked:.2e}"


_gpt2, _llama = hf_models.gpt2, hf_models.llama


MODELS = {"gpt2": (_gpt2, {"mlps": r"mlp$", "linears": r"c_attn$"}), "llama": (_llama, {"mlps": r"mlp$"})}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_converted_causal_lm_with_default_options_is_causal_in_training(family):
    build, selection = MODELS[family]
    torch.manual_seed(0)
    model = build()
    report = convert(model, expert_dims=16, **selection)
    assert report.causal and "gate_norm='layer'" in str(report)
    model.train()
    tokens = torch.randint(0, 100, (4, 12))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 100  # only the last token of every sequence
    logits, logits_changed = model(tokens).logits, model(changed).logits
    assert torch.allclose(logits[:, :-1], logits_changed[:, :-1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_cached_generation_equals_the_full_sequence_forward_token_by_token(family):
    build, selection = MODELS[family]
    torch.manual_seed(0)
    model = build()
    convert(model, expert_dims=16, **selection)
    model.eval()
    prompt = torch.randint(0, 100, (2, 5))
    out = model.generate(
        prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    with torch.no_grad():
        full = model(out.sequences).logits
    for step, scores in enumerate(out.scores):
        position = prompt.shape[1] + step - 1  # the logits that chose token prompt_length + step
        torch.testing.assert_close(scores, full[:, position], rtol=1e-4, atol=1e-5)
        assert torch.equal(full[:, position].argmax(-1), out.sequences[:, position + 1])


def test_causal_models_are_recognised_and_a_batch_norm_gate_is_warned_about():
    assert is_causal_model(_gpt2()) and is_causal_model(_llama())
    bert = transformers.BertModel(
        transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    )
    assert not is_causal_model(bert) and not is_causal_model(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CausalityWarning)
        report = convert(bert, expert_dims=4, mlps=r"layer\.\d+$")
    assert not report.causal and not any("Causal" in note for note in report.notes)
    assert bert.encoder.layer[0].intermediate.gate_spec.norm == "batch"  # the paper's default elsewhere
    with pytest.warns(CausalityWarning, match=r"see the future while training.*gate_norm='layer'"):
        convert(_gpt2(), expert_dims=4, mlps=r"mlp$", gate_norm="batch")
    with pytest.warns(CausalityWarning, match="later positions included"):
        convert(_llama(), expert_dims=4, mlps=r"mlp$", gate=TopKGate(k=2, norm="batch"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CausalityWarning)
        model = _gpt2()
        convert(model, expert_dims=4, mlps=r"mlp$", activation="sparsemax")  # norm not given: made causal
        assert model.transformer.h[0].mlp.gate_spec == Gate("sparsemax", "layer")
        convert(_gpt2(), expert_dims=4, mlps=r"mlp$", causal=False)  # the user's word
    plain = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
    report = convert(plain, expert_dims=4, mlps=r"^0$", causal=True, rank=3)
    assert report.causal and plain[0].gate_spec.norm == "layer"
    with pytest.raises(TypeError, match="causal must be a bool or None"):
        convert(_gpt2(), expert_dims=4, mlps=r"mlp$", causal="yes")
