"""The registry of distillation losses, its terms, and the auxiliary-k loss on dead units."""

import numpy as np
import pytest
import torch
from torch import nn

from mumoe_tn.distillation.codes import recording_preactivations, substituted_code
from mumoe_tn.distillation.losses import (
    FVU,
    AuxK,
    Loss,
    LossInputs,
    available_losses,
    get_loss,
    register_loss,
    resolve_losses,
    unregister_loss,
)
from mumoe_tn.distillation.replacements import mumoe_factory
from mumoe_tn.distillation.streaming import select_blocks
from mumoe_tn.distillation.training import distill
from mumoe_tn.distillation.transcoders import Transcoder


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ToyLM(nn.Module):
    def __init__(self, vocab=512, width=16, hidden=64, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        return self.head(h + self.mlp(h))


def _batches(count, batch=4, length=16, vocab=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, length), generator=generator) for _ in range(count)]


def test_the_registered_losses():
    assert {"normalised-mse", "fvu", "l1", "aux-k"} <= set(available_losses())
    assert isinstance(get_loss("FVU"), FVU)
    with pytest.raises(ValueError, match=r"unknown loss 'huber'; registered: \["):
        get_loss("huber")
    with pytest.raises(TypeError, match="a loss name must be a string"):
        get_loss(3)
    with pytest.raises(ValueError, match="each loss term may appear once"):
        resolve_losses(["fvu", FVU(weight=2.0)])
    with pytest.raises(TypeError, match="non-empty sequence"):
        resolve_losses([])
    with pytest.raises(ValueError, match="weight must be"):
        FVU(weight=-1.0)


def test_fvu_by_hand():
    prediction, target = torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    inputs = LossInputs(nn.Identity(), target, target, prediction)
    assert FVU()(inputs).item() == pytest.approx((9 + 16 + 0 + 1) / (25 + 1))


def test_a_loss_registered_in_a_test_trains():
    calls = []

    class Cosine(Loss, name="test-cosine"):
        def __call__(self, inputs):
            calls.append(inputs.prediction.shape)
            similarity = torch.cosine_similarity(inputs.prediction, inputs.target, dim=-1)
            return self.weight * (1 - similarity).mean()

    try:
        assert "test-cosine" in available_losses()
        with pytest.raises(ValueError, match="a loss is already registered as 'test-cosine'"):

            class Other(Loss, name="test-cosine"):
                pass

        model = ToyLM()
        factory = {"tc": lambda block: Transcoder(block.in_features, 64, block.out_features, k=8)}
        kwargs = dict(tokens=64 * 40, batch_size=64, buffer_tokens=512, progress=False)
        result = distill(model, _batches(48), factory, loss="test-cosine", **kwargs)
        assert len(calls) == 40 and calls[0] == (64, 16)
        x = model.embed(_batches(1, seed=5)[0]).reshape(-1, 16).detach()
        y = model.mlp(x).detach()
        trained = torch.cosine_similarity(result.replacements["mlp"]["tc"](x), y, dim=-1).mean()
        assert trained > 0.5  # the direction was learnt from the test's loss alone
        assert result.losses["mlp"]["tc"] == pytest.approx(1 - trained.item(), abs=0.15)
    finally:
        unregister_loss("test-cosine")
    assert "test-cosine" not in available_losses()
    with pytest.raises(TypeError, match="takes a subclass of Loss"):
        register_loss(dict)


def test_preactivations_and_substitution_of_a_transcoder():
    torch.manual_seed(0)
    tc = Transcoder(6, 10, 4, k=3)
    nn.init.normal_(tc.decoder.weight)
    x = torch.randn(5, 6)
    with recording_preactivations(tc) as records:
        tc(x)
    torch.testing.assert_close(records[0][0], tc.encoder(x))
    code = torch.zeros(5, 10)
    code[:, 2] = 1.0
    with substituted_code(tc, [code]):
        out = tc(x)
    torch.testing.assert_close(out, tc.decoder.weight[:, 2].expand(5, 4) + tc.decoder.bias)
    with pytest.raises(ValueError, match="substituted code has shapes"), substituted_code(tc, [code[:, :3]]):
        tc(x)


def test_aux_k_by_hand_on_a_transcoder():
    """Dead latents reconstruct the residual: ê = W_dec TopK_aux(ReLU(pre) of the dead), against numpy."""
    torch.manual_seed(1)
    tc = Transcoder(4, 6, 3, k=2)
    nn.init.normal_(tc.decoder.weight)
    with torch.no_grad():  # latents 0 and 1 always win the top 2; the others are positive but never kept
        tc.encoder.weight.mul_(0.1)
        tc.encoder.bias.copy_(torch.tensor([5.0, 4.0, 1.0, 2.0, 3.0, 0.5]))
    x, y = torch.randn(7, 4), torch.randn(7, 3)
    term = AuxK(weight=0.5, k_aux=2, dead_after=8)
    state = {"idle": torch.tensor([0, 7, 0, 1, 100, 3])}
    with recording_preactivations(tc) as pre:
        prediction = tc(x)
    code = (tc.activation(pre[0][0]),)
    value = term(LossInputs(tc, x, y, prediction, code, pre[0], state))
    active = (code[0] != 0).any(0).numpy()
    idle = np.where(active, 0, np.array([0, 7, 0, 1, 100, 3]) + 7)
    np.testing.assert_array_equal(idle >= 8, [False, False, False, True, True, True])
    np.testing.assert_array_equal(state["idle"].numpy(), idle)
    dead = idle >= 8
    z = np.maximum(pre[0][0].detach().numpy(), 0) * dead
    keep = np.argsort(-z, axis=1)[:, :2]
    aux = np.zeros_like(z)
    np.put_along_axis(aux, keep, np.take_along_axis(z, keep, 1), 1)
    e_hat = aux @ tc.decoder.weight.detach().numpy().T
    e = (y - prediction).detach().numpy()
    expected = 0.5 * np.mean((e_hat - e) ** 2 / np.linalg.norm(e, axis=1, keepdims=True))
    assert value.item() == pytest.approx(expected, rel=1e-5)
    value.backward()
    assert tc.encoder.weight.grad is not None and tc.decoder.weight.grad.abs().sum() > 0
    fresh = {}
    assert term(LossInputs(tc, x, y, tc(x), code, pre[0], fresh)).item() == 0.0  # nothing dead yet


def test_aux_k_reduces_dead_latents():
    """A TopK transcoder (256 latents, k = 4) where many latents die: aux-k brings some back (seeded)."""
    model = ToyLM()
    x = model.embed(torch.arange(512)).detach()

    def dead_after_training(aux_k):
        def factory(block):
            layer = Transcoder(block.in_features, 256, block.out_features, k=4)
            if aux_k is not None:
                layer.distillation_losses = (aux_k,)
            return layer

        result = distill(model, _batches(820), {"tc": factory}, tokens=64 * 800, batch_size=64, buffer_tokens=1024,
                         progress=False)  # fmt: skip
        layer = result.replacements["mlp"]["tc"]
        with torch.no_grad():
            return int(((layer.activation(layer.encoder(x)) != 0).sum(0) == 0).sum())

    without, with_aux = dead_after_training(None), dead_after_training(AuxK())
    assert without >= 30  # the case: latents die (39 of 256)
    assert with_aux <= without - 4  # 34


def test_aux_k_is_attached_by_the_factory_when_asked():
    block = select_blocks(ToyLM(), "mlp$")[0]

    def aux_terms(module):
        return [term for term in getattr(module, "distillation_losses", ()) if isinstance(term, AuxK)]

    assert not aux_terms(mumoe_factory("cp", 8, 2, 4.0)(block))  # off by default
    assert not aux_terms(mumoe_factory("mxd", 8, 2, 4.0)(block))
    assert not aux_terms(mumoe_factory("cp", 8, 2, 4.0, aux_k=False)(block))
    assert not aux_terms(mumoe_factory("cp", (4, 4), 2, 4.0)(block))
    assert len(aux_terms(mumoe_factory("tr", (4, 4), 2, 4.0, aux_k=True)(block))) == 1
    term = AuxK(weight=0.1)
    assert aux_terms(mumoe_factory("cp", 8, 2, 4.0, aux_k=term)(block)) == [term]
    assert len(aux_terms(mumoe_factory("mxd", 8, 2, 4.0, aux_k=True)(block))) == 1
    with pytest.raises(TypeError, match="aux_k must be a bool or an AuxK"):
        mumoe_factory("cp", 8, 2, 4.0, aux_k="yes")


def test_the_frontier_factories_attach_the_aux_k_term_as_configured():
    from mumoe_tn.distillation.study import method_factories

    block = select_blocks(ToyLM(), "mlp$")[0]
    for aux_k, expected in [(None, False), (True, True), (False, False)]:
        factories = method_factories(("cp", "cp-hier"), (2,), 4.0, 16, aux_k=aux_k)
        for name, factory in factories.items():
            terms = getattr(factory(block), "distillation_losses", ())
            assert any(isinstance(term, AuxK) for term in terms) == expected, (aux_k, name)


def test_a_bad_aux_k_setting_is_refused_before_any_model_is_built(monkeypatch):
    from mumoe_tn.distillation import study

    monkeypatch.setattr(study, "load_model", lambda config: pytest.fail("built a model first"))
    with pytest.raises(TypeError, match=r"aux_k must be None \(the factory's default\), True or False, got 'yes'"):
        study.run_frontier(study.FrontierConfig(aux_k="yes"), progress=False)
    with pytest.raises(TypeError, match="aux_k must be None"):
        study.method_factories(("cp",), (2,), 4.0, 16, aux_k=1)
