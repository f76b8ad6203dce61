"""Distillation of MLP blocks: the loss, the stream and its buffer, masks, resume, seeds, splicing."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn.costs.baselines import match_transcoder, transcoder_parameters
from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.losses import AuxK
from mumoe_tn.distillation.replacements import mode_split, mumoe_factory, transcoder_factory
from mumoe_tn.distillation.streaming import ActivationBuffer, TokenWindows, one_kernel_activation, select_blocks
from mumoe_tn.distillation.training import (
    LOSS_READ_EVERY,
    ReplacementTrainer,
    distill,
    normalised_mse,
    splice,
    spliced,
)
from mumoe_tn.distillation.transcoders import Transcoder


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny steps: one thread avoids the scheduling cost of two on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ToyLM(nn.Module):
    """Embedding → residual MLP block → head; every token independent of the others."""

    def __init__(self, vocab=32, width=8, hidden=16, *, linear=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        layers = [nn.Linear(width, hidden), nn.Linear(hidden, width)]
        self.mlp = nn.Sequential(*layers) if linear else nn.Sequential(layers[0], nn.GELU(), layers[1])
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        return self.head(h + self.mlp(h))


def _batches(count=12, batch=4, length=16, vocab=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, length), generator=generator) for _ in range(count)]


def _tc(k=4, latents=32):
    return {"tc": lambda block: Transcoder(block.in_features, latents, block.out_features, k=k)}


# ----------------------------------------------------------------------------- the loss
def test_normalised_mse_by_hand():
    prediction = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    target = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    # token 1: (9 + 16) / 5 = 5 over two outputs; token 2: (0 + 1) / 1 = 1; mean over 4 entries
    assert normalised_mse(prediction, target).item() == pytest.approx((9 / 5 + 16 / 5 + 0 + 1) / 4)
    mask = torch.tensor([False, True])
    assert normalised_mse(prediction, target, mask).item() == pytest.approx(0.5)


@given(
    tokens=st.integers(1, 6),
    width=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_normalised_mse_matches_numpy(tokens, width, seed):
    rng = np.random.default_rng(seed)
    p, t = rng.normal(size=(tokens, width)), rng.normal(size=(tokens, width)) + 0.1
    expected = np.mean((p - t) ** 2 / np.linalg.norm(t, axis=-1, keepdims=True))
    assert normalised_mse(torch.tensor(p), torch.tensor(t)).item() == pytest.approx(expected, rel=1e-10)


def test_padding_stays_out_of_the_loss():
    target = torch.randn(2, 3, 4)
    prediction = target.clone()
    prediction[1, 2] = 1e6  # padding
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    assert normalised_mse(prediction, target, mask).item() == 0.0


# ----------------------------------------------------------------------------- the stream
def test_buffer_is_bounded_and_refuses_overflow():
    buffer = ActivationBuffer(10)
    buffer.add({"b": (torch.randn(6, 3), torch.randn(6, 2))})
    with pytest.raises(ValueError, match="exceeds the buffer's capacity of 10"):
        buffer.add({"b": (torch.randn(5, 3), torch.randn(5, 2))})
    taken = buffer.take(4)["b"][0]
    assert taken.shape == (4, 3) and buffer.rows == 2
    buffer.add({"b": (torch.randn(8, 3), torch.randn(8, 2))})  # wraps: the 2 held rows move to the front
    assert buffer.rows == 10 and buffer.peak_rows == 10
    assert buffer.allocated_bytes == 10 * (3 + 2) * 4


def test_streaming_never_holds_more_than_the_buffer():
    model = ToyLM()
    result = distill(model, _batches(count=40), _tc(), tokens=2048, batch_size=32, buffer_tokens=128, progress=False)
    assert result.tokens == 2048  # sixteen times the buffer went through it
    assert 64 < result.peak_buffer_rows <= 128
    assert result.buffer_bytes == 128 * (8 + 8) * 4  # storage for the capacity, nothing more


def test_masks_keep_padding_out_of_training():
    batches = _batches(count=10)
    masks = [torch.rand(b.shape, generator=torch.Generator().manual_seed(k)) > 0.3 for k, b in enumerate(batches)]
    first = [{"input_ids": b, "attention_mask": m} for b, m in zip(batches, masks, strict=True)]
    other = [
        {"input_ids": torch.where(m, b, (b + 7) % 32), "attention_mask": m} for b, m in zip(batches, masks, strict=True)
    ]
    real = int(sum(m.sum() for m in masks))
    kwargs = dict(tokens=real // 32 * 32, batch_size=32, buffer_tokens=160, progress=False)
    a = distill(ToyLM(), first, _tc(), **kwargs)
    b = distill(ToyLM(), other, _tc(), **kwargs)
    assert a.tokens == real // 32 * 32  # only the real tokens were there to train on
    for (key, left), right in zip(
        a.replacements["mlp"]["tc"].state_dict().items(), b.replacements["mlp"]["tc"].state_dict().values(), strict=True
    ):
        assert torch.equal(left, right), key
    # without the mask the padding tokens differ, and so do the weights
    c = distill(ToyLM(), [{"input_ids": o["input_ids"]} for o in other], _tc(), **{**kwargs, "tokens": 256})
    d = distill(ToyLM(), [{"input_ids": o["input_ids"]} for o in first], _tc(), **{**kwargs, "tokens": 256})
    assert not torch.equal(c.replacements["mlp"]["tc"].encoder.weight, d.replacements["mlp"]["tc"].encoder.weight)


# ----------------------------------------------------------------------------- seeds, resume
def _weights(result):
    return {f"{b}/{m}/{k}": v for b, ms in result.replacements.items() for m, mod in ms.items()
            for k, v in mod.state_dict().items()}  # fmt: skip


def test_same_seed_same_weights_and_global_rng_untouched():
    methods = {**_tc(), "cp": mumoe_factory("cp", 8, 2, 600)}
    state = torch.random.get_rng_state()
    a = distill(ToyLM(), _batches(), methods, tokens=256, batch_size=32, buffer_tokens=128, seed=3, progress=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = distill(ToyLM(), _batches(), methods, tokens=256, batch_size=32, buffer_tokens=128, seed=3, progress=False)
    c = distill(ToyLM(), _batches(), methods, tokens=256, batch_size=32, buffer_tokens=128, seed=4, progress=False)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


class _Interrupted(Exception):
    pass


class _Failing:
    """The batches, but the iteration stops with an error after ``after`` of them."""

    def __init__(self, batches, after):
        self.batches, self.after = batches, after

    def __iter__(self):
        for k, batch in enumerate(self.batches):
            if k == self.after:
                raise _Interrupted
            yield batch


def test_resume_gives_the_weights_of_an_uninterrupted_run(tmp_path):
    batches = _batches(count=30)
    methods = {
        **_tc(),
        "cp": mumoe_factory("cp", 8, 2, 600),
        "cp-aux": mumoe_factory("cp", 8, 2, 600, aux_k=AuxK(dead_after=64)),  # the dead-unit counters resume
        "mxd": mumoe_factory("mxd", 8, 2, 600),  # unit-norm expert vectors, the warm-up's state
    }
    options = dict(tokens=1280, batch_size=32, buffer_tokens=160, seed=1, progress=False)
    whole = distill(ToyLM(), batches, methods, **options)
    path = tmp_path / "distill.pt"
    with pytest.raises(_Interrupted):
        distill(ToyLM(), _Failing(batches, 13), methods, checkpoint=path, checkpoint_every=3, resume=True, **options)
    assert path.exists()
    resumed = distill(ToyLM(), batches, methods, checkpoint=path, checkpoint_every=3, resume=True, **options)
    assert resumed.tokens == whole.tokens and resumed.steps == whole.steps
    expected, got = _weights(whole), _weights(resumed)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_resume_refuses_a_different_run(tmp_path):
    path = tmp_path / "distill.pt"
    distill(ToyLM(), _batches(), _tc(), tokens=64, batch_size=32, buffer_tokens=64, checkpoint=path, progress=False)
    with pytest.raises(ValueError, match="batch_size: checkpoint 32, now 16"):
        distill(ToyLM(), _batches(), _tc(), tokens=64, batch_size=16, buffer_tokens=64, checkpoint=path, resume=True,
                progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="tokens: checkpoint 64, now 96"):
        distill(ToyLM(), _batches(), _tc(), tokens=96, batch_size=32, buffer_tokens=64, checkpoint=path, resume=True,
                progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"'tc' of 'mlp' has encoder.weight of shape \(48, 8\) now, shape \(32, 8\)"):
        distill(ToyLM(), _batches(), _tc(latents=48), tokens=64, batch_size=32, buffer_tokens=64, checkpoint=path,
                resume=True, progress=False)  # fmt: skip
    distill(ToyLM(), _batches(), _tc(), tokens=64, batch_size=32, buffer_tokens=64, checkpoint=path,
            run_config={"model": "toy", "experts": 16}, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="experts: checkpoint 16, now 32"):
        distill(ToyLM(), _batches(), _tc(), tokens=64, batch_size=32, buffer_tokens=64, checkpoint=path,
                run_config={"model": "toy", "experts": 32}, resume=True, progress=False)  # fmt: skip
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable distillation checkpoint"):
        distill(ToyLM(), _batches(), _tc(), tokens=64, batch_size=32, buffer_tokens=64, checkpoint=path, resume=True,
                progress=False)  # fmt: skip


# ----------------------------------------------------------------------------- what can be learnt
def test_transcoder_with_every_latent_active_fits_a_linear_block():
    model = ToyLM(linear=True)
    block = select_blocks(model)[0]
    assert block.activation is None
    # TopK over all 64 latents keeps each one: ReLU(u) − ReLU(−u) = u lets a wide layer be linear
    stream = TokenWindows(torch.arange(32).repeat(40), 16, 8, 200, seed=0)
    result = distill(model, stream, _tc(k=64, latents=64), tokens=20_000, batch_size=64, buffer_tokens=512,
                     lr=1e-2, progress=False)  # fmt: skip
    transcoder = result.replacements["mlp"]["tc"]
    x = model.embed.weight.detach()
    y = model.mlp(x).detach()
    with torch.no_grad():
        relative = ((transcoder(x) - y).norm() / y.norm()).item()
    assert relative < 0.02


def test_l1_penalty_makes_relu_latents_sparser():
    methods = {"relu": lambda b: Transcoder(b.in_features, 32, b.out_features)}
    kwargs = dict(tokens=1024, batch_size=32, buffer_tokens=128, lr=1e-2, progress=False)
    plain = distill(ToyLM(), _batches(count=40), methods, **kwargs).replacements["mlp"]["relu"]
    sparse = distill(ToyLM(), _batches(count=40), methods, l1=0.1, **kwargs).replacements["mlp"]["relu"]
    x = ToyLM().embed.weight.detach()
    with torch.no_grad():
        active = [(m.activation(m.encoder(x)) > 0).float().sum(-1).mean().item() for m in (plain, sparse)]
    assert active[1] < 0.5 * active[0]


# ----------------------------------------------------------------------------- splicing
def test_splice_and_restore():
    model = ToyLM()
    original = model.mlp
    x = torch.randint(0, 32, (2, 5))
    replacement = nn.Sequential(nn.Linear(8, 8))
    with spliced(model, {"mlp": replacement}):
        assert model.mlp is replacement
    assert model.mlp is original
    old = splice(model, {"mlp": replacement})
    assert old == {"mlp": original} and model.mlp is replacement
    with pytest.raises(ValueError, match="'nope' is not a module of the model"):
        splice(model, {"nope": replacement})
    assert model(x).shape == (2, 5, 32)


# ----------------------------------------------------------------------------- budgets and bad input
@given(width=st.integers(2, 40), out=st.integers(2, 40), budget=st.integers(5_000, 60_000), skip=st.booleans())
def test_matched_transcoder_is_within_one_latent_of_the_budget(width, out, budget, skip):
    latents = match_transcoder(budget, width, out, skip=skip)
    count = Transcoder(width, latents, out, skip=skip).parameter_count()
    assert count == sum(p.numel() for p in Transcoder(width, latents, out, skip=skip).parameters())
    step = width + 1 + out  # one latent more or less
    assert abs(count - budget) <= step / 2
    assert transcoder_parameters(width, latents, out, skip=skip) == count


def test_factories_meet_the_budget_and_l0():
    model = ToyLM(width=16, hidden=64)
    block = select_blocks(model)[0]
    budget = 4 * block.parameters
    modules = []
    for factory in (transcoder_factory(8, budget), transcoder_factory(8, budget, skip=True),
                    mumoe_factory("cp", 64, 8, budget), mumoe_factory("tr", (8, 8), 8, budget),
                    mumoe_factory("n1 a, a i c, c o", 64, 8, budget),  # a user's network, no format
                    mumoe_factory("n1 n2 a, a i c, c o", (8, 8), 8, budget)):  # fmt: skip
        module = factory(block)
        count = sum(p.numel() for p in module.parameters())
        assert abs(count - budget) / budget < 0.05, (module, count, budget)
        modules.append(module)
    table = evaluate_replacements(model, _batches(2), {"mlp": {str(k): m for k, m in enumerate(modules)}})
    l0s = [row.l0 for row in table.rows]
    assert all(0 < l0 <= 8 for l0 in l0s[:2])  # TopK keeps 8 latents; a ReLU may zero some of them
    assert l0s[2:] == [8.0] * 4  # 8 of 64 experts, or 4 × 2 of 8 × 8
    relu = mumoe_factory("cp", 64, 8, budget, top_k="relu")(block)
    assert type(relu.gate).__name__ == "ReLUTopKRouter"
    with pytest.raises(ValueError, match="top_k must be one of"):
        mumoe_factory("cp", 64, 8, budget, top_k="sparsemax")
    assert mode_split(8, 2) == (4, 2) and mode_split(64, 2) == (8, 8) and math.prod(mode_split(96, 3)) == 96


def test_bad_input_gets_clear_errors():
    model = ToyLM()
    with pytest.raises(TypeError, match="tokens must be a positive int"):
        distill(model, _batches(), _tc(), tokens=1.5, progress=False)
    with pytest.raises(ValueError, match="buffer_tokens must hold at least one step of batch_size=64"):
        distill(model, _batches(), _tc(), tokens=64, batch_size=64, buffer_tokens=32, progress=False)
    with pytest.raises(ValueError, match="no MLP block was selected by mlps='nothing'"):
        distill(model, _batches(), _tc(), tokens=64, mlps="nothing", progress=False)
    with pytest.raises(TypeError, match="re-iterable batches"):
        distill(model, iter(_batches()), _tc(), tokens=64, checkpoint="x.pt", resume=True, progress=False)
    with pytest.raises(ValueError, match="a batch of 64 tokens does not fit the buffer of 48"):
        distill(model, _batches(), _tc(), tokens=64, batch_size=16, buffer_tokens=48, progress=False)
    with pytest.raises(ValueError, match="k must be at most the number of latents 4, got k=5"):
        Transcoder(8, 4, k=5)
    with pytest.raises(TypeError, match="mapping of method name -> factory"):
        distill(model, _batches(), [], tokens=64, progress=False)


# ----------------------------------------------------------------------------- the step and its loss reads
class _BreaksAfter(nn.Module):
    """A linear replacement whose output turns NaN from its call ``after + 1`` on."""

    def __init__(self, block, after):
        super().__init__()
        self.linear, self.after, self.calls = nn.Linear(block.in_features, block.out_features), after, 0

    def forward(self, x):
        self.calls += 1
        out = self.linear(x)
        return out * math.nan if self.calls > self.after else out


def test_a_non_finite_loss_is_named_at_its_step_and_never_checkpointed(tmp_path):
    """The losses are read every few steps, but the error names the step that went wrong, before a checkpoint."""
    assert LOSS_READ_EVERY > 5  # the bad step is read late, not at once
    methods = {"linear": lambda block: _BreaksAfter(block, after=5), **_tc()}
    options = dict(tokens=32 * 30, batch_size=32, buffer_tokens=160, progress=False)
    with pytest.raises(FloatingPointError, match=r"'linear' on 'mlp' is nan at step 5\b"):
        distill(ToyLM(), _batches(30), methods, **options)
    path = tmp_path / "run.pt"
    with pytest.raises(FloatingPointError, match="at step 5"):
        distill(ToyLM(), _batches(30), methods, checkpoint=path, checkpoint_every=4, **options)
    state = torch.load(path, weights_only=True)
    assert state["counters"]["steps"] == 4  # the checkpoint of step 8 was refused
    assert all(torch.isfinite(t).all() for t in state["modules"]["mlp/linear"].values())


def test_reported_losses_are_the_means_of_the_last_50_steps():
    """``Distillation.losses`` is the mean of the last 50 steps' losses, whatever the cadence of the reads."""
    seen = []

    class Recording(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.linear = nn.Linear(block.in_features, block.out_features)

        def forward(self, x):
            out = self.linear(x)
            seen.append((x.detach().clone(), out.detach().clone()))
            return out

    model, steps = ToyLM(), 70  # not a multiple of the read cadence
    result = distill(model, _batches(40), {"rec": Recording}, tokens=32 * steps, batch_size=32, buffer_tokens=160,
                     recipe="plain", progress=False)  # fmt: skip
    assert result.steps == steps and len(seen) == steps
    with torch.no_grad():
        losses = []
        for x, prediction in seen[-50:]:  # the hand formula on the block's own output for those rows
            y = model.mlp(x).double().numpy()
            error = (prediction.double().numpy() - y) ** 2 / np.linalg.norm(y, axis=-1, keepdims=True)
            losses.append(error.mean())
    assert result.losses["mlp"]["rec"] == pytest.approx(np.mean(losses), rel=1e-5)


@pytest.mark.parametrize("recipe", ["plain", "mxd-paper"])
def test_replacement_trainer_step_is_one_adam_step_on_the_loss(recipe):
    """One step of a linear replacement: the loss by hand, and Adam's first update ``θ − lr·g/(|g| + ε)``."""
    torch.manual_seed(0)
    linear = nn.Linear(6, 5)
    x, y = torch.randn(40, 6), torch.randn(40, 5)
    weight, bias = linear.weight.detach().clone().requires_grad_(), linear.bias.detach().clone().requires_grad_()
    hand = ((x @ weight.T + bias - y) ** 2 / y.norm(dim=-1, keepdim=True)).mean()
    hand.backward()
    trainer = ReplacementTrainer(linear, recipe=recipe, steps=1, lr=1e-2)
    loss = trainer.step(x, y)
    assert not loss.requires_grad and loss.item() == pytest.approx(hand.item(), rel=1e-6)
    for parameter, start in ((linear.weight, weight), (linear.bias, bias)):
        expected = start - 1e-2 * start.grad / (start.grad.abs() + 1e-8)
        torch.testing.assert_close(parameter.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="recipe must be one of"):
        ReplacementTrainer(nn.Linear(2, 2), recipe="authors")
    with pytest.raises(ValueError, match="no trainable parameters"):
        ReplacementTrainer(nn.Linear(2, 2).requires_grad_(False))


@given(values=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=64))
def test_transformers_tanh_gelus_become_one_kernel_of_the_same_function(values):
    """GPT-2's ``gelu_new`` (and FastGELU) as torch's tanh GELU: the same values, checked against transformers."""
    activations = pytest.importorskip("transformers.activations")
    x = torch.tensor(values)
    for kind in (activations.NewGELUActivation, activations.FastGELUActivation):
        fast = one_kernel_activation(kind())
        assert isinstance(fast, nn.GELU) and fast.approximate == "tanh"
        torch.testing.assert_close(fast(x), kind()(x), rtol=1e-5, atol=1e-6)
    relu = nn.ReLU()
    assert one_kernel_activation(relu) is relu and one_kernel_activation(None) is None


def test_a_gpt2_block_hands_its_factories_the_one_kernel_gelu():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    (block,) = select_blocks(transformers.GPT2LMHeadModel(config), r"mlp$")
    assert isinstance(block.activation, nn.GELU) and block.activation.approximate == "tanh"
