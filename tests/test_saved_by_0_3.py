"""What mumoe_tn 0.3 saved still loads: pickled layers, ``torch.save`` of whole layers, converted checkpoints.

The files under ``tests/fixtures/v0_3/`` were written by 0.3 (``write_fixtures.py`` beside them),
with each one's outputs on a fixed input stored in ``expected.pt`` at the same time. Loading them
with today's classes must give those outputs, and the loaded layers must train and infer as new ones.
"""

import pathlib
import pickle

import pytest
import torch
from torch import nn

from mumoe_tn.conversion.persistence.checkpoints import load_converted
from mumoe_tn.layers import MixtureOfDecoders, MuMoE, MuMoEBase, MuMoEMLP

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "v0_3"
LAYERS = {"mumoe": MuMoE, "mumoe_topk": MuMoE, "mumoe_mlp": MuMoEMLP, "mixture_of_decoders": MixtureOfDecoders}


def _expected():
    return torch.load(FIXTURES / "expected.pt", weights_only=True)


def _close(actual, expected):
    # The same weights and arithmetic as when the fixture was written; only another machine's
    # rounding may differ.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_the_fixtures_were_written_by_0_3():
    assert (FIXTURES / "VERSION").read_text().startswith("0.3.")


def _load(path):
    if path.suffix == ".pkl":
        return pickle.loads(path.read_bytes())
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("suffix", [".pkl", ".pt"], ids=["pickle", "torch.save"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_layer_pickled_by_0_3_loads_and_gives_its_outputs(name, suffix):
    layer = _load(FIXTURES / f"{name}{suffix}")
    expected = _expected()
    assert type(layer) is LAYERS[name] and not layer.training
    with torch.no_grad():
        _close(layer(expected["layer_input"]), expected[name])
        _close(layer(expected["layer_input"][:3]), expected[name][:3])  # another batch: a new plan


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_layer_pickled_by_0_3_trains_and_its_inference_follows_the_new_weights(name):
    layer = _load(FIXTURES / f"{name}.pkl")
    x = _expected()["layer_input"]
    layer.train()
    layer(x).square().sum().backward()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.01)
    layer.eval()
    fresh = _load(FIXTURES / f"{name}.pkl")
    fresh.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert torch.equal(layer(x), fresh.eval()(x))
    assert isinstance(layer, MuMoEBase)


def test_a_plain_model_checkpoint_saved_by_0_3_loads_with_its_conversion():
    torch.manual_seed(0)
    model = load_converted(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), FIXTURES / "plain.safetensors")
    expected = _expected()
    assert isinstance(model[0], MuMoE) and isinstance(model[2], nn.Linear)
    with torch.no_grad():
        _close(model(expected["plain_input"]), expected["plain"])


def test_a_hugging_face_checkpoint_saved_by_0_3_loads_with_its_conversion():
    transformers = pytest.importorskip("transformers")
    model = load_converted(transformers.GPT2LMHeadModel, FIXTURES / "gpt2")
    expected = _expected()
    assert isinstance(model.transformer.h[0].mlp, MuMoEBase)
    with torch.no_grad():
        _close(model(expected["gpt2_tokens"]).logits, expected["gpt2_logits"])
