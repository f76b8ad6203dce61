"""Padding tokens never steer a gate: statistics, running averages, losses, records and analysis skip them.

The reference for a padded batch is the same real tokens without padding: every real token of the
batch in one flat batch. Passing the padded batch with its mask must give the same outputs at real
positions, the same BatchNorm running statistics, losses and coefficient records.
"""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mumoe_tn.analysis import collect_coefficients, mean_coefficients
from mumoe_tn.conversion.convert import conversion_record, convert
from mumoe_tn.gates.records import gate_losses
from mumoe_tn.gates.specs import Gate, TopKGate
from mumoe_tn.layers import MuMoE, MuMoEMLP
from mumoe_tn.layers.mlp import MuMoEGatedMLP
from mumoe_tn.masking import token_mask

GATES = st.one_of(
    st.builds(
        Gate,
        activation=st.sampled_from(["entmax15", "sparsemax", "softmax", 1.3]),
        norm=st.sampled_from(["batch", "layer", "none"]),
        balance_loss=st.booleans(),
        z_loss=st.booleans(),
    ),
    st.builds(
        TopKGate,
        k=st.integers(1, 3),
        norm=st.sampled_from(["batch", "layer", "none"]),
        balance_loss=st.booleans(),
        z_loss=st.booleans(),
    ),
)


def _block(kind, gate):
    if kind == "layer":
        return MuMoE(10, 12, (3, 4), "cp", 5, gate=gate)
    cls = MuMoEMLP if kind == "mlp" else MuMoEGatedMLP
    return cls(10, 16, 10, 6, "tt", (2, 5), gate=gate)


@st.composite
def padded_batches(draw):
    """Sequences of random lengths, padded on the left or the right to one length, and their mask."""
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    if sum(lengths) < 2:
        lengths.append(2)
    width = max(lengths) + draw(st.integers(0, 3))
    left = draw(st.booleans())
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, length in enumerate(lengths):
        if left:
            mask[row, width - length :] = True
        else:
            mask[row, :length] = True
    return mask


def _losses(layer):
    return {key: value.detach() for key, value in layer.gate_losses().items()}


@given(
    kind=st.sampled_from(["layer", "mlp", "gated"]),
    gate=GATES,
    mask=padded_batches(),
    as_ints=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_padded_batch_with_its_mask_equals_its_real_tokens(kind, gate, mask, as_ints, seed):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    layer = _block(kind, gate)
    x = torch.randn(*mask.shape, 10, generator=generator) * 2
    x[~mask] = 100.0  # padding far out of distribution: any leak shows
    real = x[mask].reshape(1, -1, 10)
    given_mask = mask.long() if as_ints else mask
    for training in (True, False):
        padded_layer, real_layer = copy.deepcopy(layer).train(training), copy.deepcopy(layer).train(training)
        y = padded_layer(x, mask=given_mask)
        y_real = real_layer(real)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y[mask], y_real[0], rtol=1e-4, atol=1e-5)
        for name, buffer in padded_layer.named_buffers():
            torch.testing.assert_close(buffer, dict(real_layer.named_buffers())[name], rtol=1e-5, atol=1e-6)
        padded_losses, real_losses = _losses(padded_layer), _losses(real_layer)
        assert padded_losses.keys() == real_losses.keys()
        for key in padded_losses:
            torch.testing.assert_close(padded_losses[key], real_losses[key], rtol=1e-4, atol=1e-6)
        recorded = padded_layer.last_token_mask
        assert (recorded is None) if mask.all() else torch.equal(recorded, mask)
        for a, a_real in zip(padded_layer.last_coefficients, real_layer.last_coefficients, strict=True):
            torch.testing.assert_close(a[mask], a_real[0], rtol=1e-4, atol=1e-5)


def test_a_balanced_router_still_has_balance_loss_one_with_padding():
    layer = MuMoE(4, 4, 4, "cp", 2, gate=TopKGate(k=1, balance_loss=True, init="zeros"))
    torch.nn.init.eye_(layer.gate.projections.n1.weight)
    x = torch.eye(4).repeat(2, 1) * 5  # each expert wins two real tokens
    padded = torch.cat([x, torch.full((3, 4), 7.0) * torch.tensor([1.0, 0, 0, 0])])  # padding all routes to expert 0
    mask = torch.tensor([True] * 8 + [False] * 3)
    layer(padded, mask=mask)
    assert abs(layer.aux_loss().item() - 1.0) < 0.02
    layer(padded)
    assert layer.aux_loss().item() > 1.1  # without the mask the padding unbalances it


def test_the_context_and_bad_masks():
    layer = MuMoEMLP(8, 16, 8, 4, "cp", 3)
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with token_mask(mask):
        layer(x)
    assert torch.equal(layer.last_token_mask, mask.bool())
    layer(x)
    assert layer.last_token_mask is None  # outside the context
    with pytest.raises(ValueError, match=r"token mask has shape \(2, 4\), but the input has tokens of shape \(2, 5\)"):
        layer(x, mask=mask[:, :4])
    with pytest.raises(ValueError, match=r"holds True/False or 1/0.*values such as \[2, 2, 2\]"):
        layer(x, mask=mask * 2)
    with pytest.raises(TypeError, match="a token mask must be a tensor"):
        layer(x, mask=[[1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="at least 2 real tokens"):
        layer(x, mask=torch.tensor([[1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]))


def test_analysis_skips_padding():
    torch.manual_seed(0)
    model = torch.nn.Sequential(MuMoE(6, 6, 5, "cp", 3, gate_norm="layer")).eval()
    x = torch.randn(3, 4, 6)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    padded = collect_coefficients(model, [x], forward=lambda m, b: m[0](b, mask=mask), centres=True)
    real = collect_coefficients(model, [x[mask]], centres=True)
    padded_mean = mean_coefficients(model, model[0], [x], forward=lambda m, b: m[0](b, mask=mask))
    torch.testing.assert_close(padded_mean, mean_coefficients(model, model[0], [x[mask]]))
    for ours, reference in zip(padded["0"].modes, real["0"].modes, strict=True):
        assert ours.rows == reference.rows == int(mask.sum())
        torch.testing.assert_close(ours.total, reference.total)
        torch.testing.assert_close(ours.centres(), reference.centres())
        assert torch.equal(ours.load, reference.load)


transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (needs transformers)

transformers.logging.set_verbosity_error()


def _gpt2():
    return hf_models.gpt2(width=32, heads=2, vocab=50, positions=32)


def _bert():
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertModel(config)


def _step(model, tokens, mask, loss_of):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    output = model(tokens, attention_mask=mask)
    loss = loss_of(output, mask) + 0.1 * gate_losses(model)["balance"]
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def _lm_loss(output, mask):
    logits = output.logits[:, :-1]
    return logits.logsumexp(-1)[mask[:, 1:].bool()].mean()


def _encoder_loss(output, mask):
    return output.last_hidden_state[mask.bool()].square().mean()


@pytest.mark.parametrize(("build", "loss_of"), [(_gpt2, _lm_loss), (_bert, _encoder_loss)], ids=["gpt2", "bert"])
def test_one_fine_tuning_step_on_a_padded_batch_equals_the_unpadded_step(build, loss_of):
    torch.manual_seed(0)
    model = build().train()
    mlps = r"mlp$" if isinstance(model, transformers.GPT2LMHeadModel) else r"layer\.\d+$"
    gate = Gate("entmax15", "batch", balance_loss=True)  # batch statistics: what padding would skew
    report = convert(model, expert_dims=(3, 4), mlps=mlps, gate=gate, causal=False)
    assert conversion_record(model).mask_argument == "attention_mask" and "Padding" in str(report)
    tokens = torch.randint(1, 50, (3, 7))
    padded = torch.cat([tokens, torch.zeros(3, 4, dtype=torch.long)], dim=1)  # right padding
    mask = torch.cat([torch.ones(3, 7), torch.zeros(3, 4)], dim=1).long()
    unpadded_model, padded_model = copy.deepcopy(model), copy.deepcopy(model)
    loss = _step(unpadded_model, tokens, torch.ones_like(tokens), loss_of)
    padded_loss = _step(padded_model, padded, mask, loss_of)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-5, atol=1e-6)
    padded_state = padded_model.state_dict()
    for key, value in unpadded_model.state_dict().items():
        torch.testing.assert_close(padded_state[key], value, rtol=1e-4, atol=1e-6, msg=key)
