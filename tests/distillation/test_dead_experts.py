"""The load-balancing term that keeps a flat μMoE block's experts alive, and the factory's defaults."""

import pytest
import torch
from test_losses import ToyLM, one_thread  # noqa: F401 - the fixture applies here too

from mumoe_tn.distillation.codes import recording_code, recording_preactivations
from mumoe_tn.distillation.losses import GATE_BALANCE_WEIGHT, AuxK, GateBalance, LossInputs
from mumoe_tn.distillation.methods import factory_from_spec, spec_from_data
from mumoe_tn.distillation.replacements import mumoe_factory, transcoder_factory
from mumoe_tn.distillation.streaming import select_blocks
from mumoe_tn.distillation.training import distill
from mumoe_tn.gates.specs import TopKGate


def _block():
    return select_blocks(ToyLM(), "mlp$")[0]


def _balance_terms(module):
    return [term for term in getattr(module, "distillation_losses", ()) if isinstance(term, GateBalance)]


def test_the_balance_term_by_hand():
    """``N · Σ_i f_i P_i`` from the gate's weights: softmax probabilities and top-k dispatch fractions."""
    torch.manual_seed(0)
    module = mumoe_factory("cp", 8, 2, 4.0, balance=0)(_block()).train()
    x = torch.randn(32, 16)
    with recording_code(module) as codes, recording_preactivations(module) as pre:
        prediction = module(x)
    term = GateBalance(weight=0.5)
    value = term(LossInputs(module, x, x, prediction, codes[0], pre[0]))
    (projection,) = module.gate.projections.values()
    logits = x @ projection.weight.detach().T  # no bias
    probabilities = torch.softmax(logits, dim=-1).mean(0)
    chosen = torch.zeros_like(logits).scatter_(1, logits.topk(2, dim=-1).indices, 0.5).mean(0)
    assert value.item() == pytest.approx(0.5 * 8 * float((chosen * probabilities).sum()), rel=1e-5)
    # the gates' own Switch-style loss, computed by another path, agrees
    recorder = mumoe_factory("cp", 8, 2, 4.0, balance=0, gate=TopKGate(k=2, balance_loss=True))(_block())
    recorder.load_state_dict(module.state_dict())
    recorder.train()(x)
    assert value.item() == pytest.approx(0.5 * recorder.gate_losses()["balance"].item(), rel=1e-5)
    value.backward()
    assert projection.weight.grad.abs().sum() > 0  # it trains the gate


def test_the_balance_term_refuses_a_replacement_without_an_expert_gate():
    layer = transcoder_factory(2, 4.0)(_block())
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match="'gate-balance' balances a μMoE block's gate; Transcoder has no expert gate"):
        GateBalance()(LossInputs(layer, x, x, layer(x), (x,), (x,)))


def test_the_factory_balances_flat_softmax_blocks_by_default_and_nothing_else():
    block = _block()
    (flat,) = _balance_terms(mumoe_factory("cp", 8, 2, 4.0)(block))
    assert flat.weight == GATE_BALANCE_WEIGHT
    assert not any(isinstance(t, AuxK) for t in mumoe_factory("cp", 8, 2, 4.0)(block).distillation_losses)
    assert len(_balance_terms(mumoe_factory("tr", 8, 2, 4.0, top_k="softmax")(block))) == 1
    assert not _balance_terms(mumoe_factory("cp", (4, 4), 2, 4.0)(block))  # two expert modes
    assert not _balance_terms(mumoe_factory("mxd", 8, 2, 4.0)(block))  # the authors' ReLU top-k gate
    assert not _balance_terms(mumoe_factory("cp", 8, 2, 4.0, top_k="relu")(block))
    assert not _balance_terms(transcoder_factory(2, 4.0)(block))
    assert not _balance_terms(mumoe_factory("cp", 8, 2, 4.0, balance=0)(block))
    (asked,) = _balance_terms(mumoe_factory("cp", (4, 4), 2, 4.0, balance=0.5)(block))
    assert asked.weight == 0.5
    both = mumoe_factory("cp", 8, 2, 4.0, aux_k=True)(block).distillation_losses
    assert [type(term) for term in both] == [GateBalance, AuxK]
    with pytest.raises(ValueError, match="balance must be a finite number >= 0, got -1"):
        mumoe_factory("cp", 8, 2, 4.0, balance=-1)
    with pytest.raises(TypeError, match="balance must be a real number, got 'yes'"):
        mumoe_factory("cp", 8, 2, 4.0, balance="yes")


def test_the_balance_weight_travels_in_the_spec():
    block = _block()
    spec = mumoe_factory("cp", 8, 2, 4.0, balance=0.25)(block).replacement_spec
    again = spec_from_data(spec.to_data())
    assert again == spec and again.balance == 0.25
    (term,) = _balance_terms(factory_from_spec(again)(block))
    assert term.weight == 0.25
    older = {key: value for key, value in spec.to_data().items() if key != "balance"}  # written before the field
    assert spec_from_data(older).balance is None
    assert _balance_terms(factory_from_spec(spec_from_data(older))(block))[0].weight == GATE_BALANCE_WEIGHT


def _batches(count, batch=4, length=16, vocab=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, length), generator=generator) for _ in range(count)]


def _dead_experts(balance: float) -> int:
    """Experts of a flat 64-expert, k = 2 CP block that no token of the vocabulary picks after a short distillation.

    Every embedding shares an offset, so the gate's initial logits favour the same few experts
    for every token, and a top-k gate sends no gradient to the experts it does not pick.
    """
    model = ToyLM()
    with torch.no_grad():
        model.embed.weight.add_(2.0)
    methods = {"cp": mumoe_factory("cp", 64, 2, 4.0, balance=balance)}
    result = distill(model, _batches(40), methods, tokens=64 * 40, batch_size=64, buffer_tokens=512, lr=1e-2, seed=0,
                     progress=False)  # fmt: skip
    layer = result.replacements["mlp"]["cp"].eval()
    with torch.no_grad():
        (coefficients,) = layer.gate(model.embed.weight)
    return int(((coefficients != 0).sum(0) == 0).sum())


def test_the_balance_term_revives_dead_experts():
    """A case built to leave most experts unpicked: the term brings most of them back."""
    without, balanced = _dead_experts(0.0), _dead_experts(0.01)
    assert without >= 40  # 61 of 64
    assert balanced <= 20  # 9


def test_the_frontier_passes_the_balance_weight_to_every_mumoe_block(monkeypatch):
    from mumoe_tn.distillation import study

    block = _block()
    for balance, expected in [(None, {"cp@2": GATE_BALANCE_WEIGHT}), (0.0, {}), (0.5, {"cp@2": 0.5, "cp-hier@2": 0.5})]:
        factories = study.method_factories(("cp", "cp-hier", "transcoder"), (2,), 4.0, 16, balance=balance)
        weights = {name: term.weight for name, factory in factories.items() for term in _balance_terms(factory(block))}
        assert weights == expected, balance
    monkeypatch.setattr(study, "load_model", lambda config: pytest.fail("built a model first"))
    with pytest.raises(ValueError, match=r"balance must be a finite number >= 0, got -0\.1"):
        study.run_frontier(study.FrontierConfig(balance=-0.1), progress=False)
