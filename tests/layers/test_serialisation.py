"""Round trips: pickle, deepcopy, torch.save of the module, and state_dict with ``weights_only=True``.

EMA teachers, checkpoint callbacks, DataLoader workers and most training frameworks copy or
pickle modules. Every registered decomposition (found by introspection), a custom spec network,
hierarchical expert dims, an entmax-α gate and the MLP block must survive each round trip and
give bit-identical outputs in eval mode, from a copy that is independent of the original.
"""

import copy
import io
import pickle

import pytest
import torch
from strategies import rank_of

from mumoe_tn import ExpertNetwork, MuMoE
from mumoe_tn.decompositions import available, get_format
from mumoe_tn.layers import MuMoEMLP

SPEC = "A: n1 a b, B: n2 a c, C: b c i o"


def _layers():
    """name -> a builder of a small layer (seeded, so two builds differ only by the seed given)."""
    # The package's own formats (test modules may register formats of other shapes).
    own = [name for name in available() if type(get_format(name)).__module__.startswith("mumoe_tn.")]
    layers = {f"{name} (registered)": (lambda name=name: MuMoE(4, 3, 5, name, rank_of(name, 2))) for name in own}
    layers["custom spec network"] = lambda: MuMoE(4, 3, (3, 2), SPEC, 2)
    layers["hierarchical cp"] = lambda: MuMoE(4, 3, (3, 2), "cp", 2)
    layers["entmax alpha, layer norm, input norm"] = lambda: MuMoE(
        4, 3, 5, "tt", 2, activation=1.3, gate_norm="layer", input_norm=True
    )
    layers["MuMoEMLP"] = lambda: MuMoEMLP(4, 6, 3, (3, 2), "tr", 2)
    return layers


LAYERS = _layers()


def trained(name: str, seed: int = 0) -> torch.nn.Module:
    """A layer whose state has moved off its initial values: BatchNorm statistics, a plan cache."""
    torch.manual_seed(seed)
    layer = LAYERS[name]()
    with torch.no_grad():
        layer(torch.randn(16, 4))  # training-mode pass: running statistics and one cached plan
    return layer.eval()


def _pickle(layer):
    return pickle.loads(pickle.dumps(layer))


def _torch_save(layer):
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _state_dict(layer, name):
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    fresh = trained(name, seed=1)  # other weights and statistics, overwritten by the load
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    return fresh.eval()


def assert_same_function(original, clone):
    """Bit-identical eval outputs, and a clone that shares no parameter with the original."""
    x = torch.randn(7, 4)
    with torch.no_grad():
        expected = original(x)
        assert torch.equal(clone(x), expected)
        assert torch.equal(clone(x[:1]), original(x[:1]))  # a new batch size: a new plan in the clone
    for (key, a), (_, b) in zip(original.state_dict().items(), clone.state_dict().items(), strict=True):
        assert torch.equal(a, b), key
    if clone is not original:
        with torch.no_grad():
            next(clone.parameters()).add_(1.0)
            assert torch.equal(original(x), expected)  # the original is untouched


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_pickle_round_trip(name):
    layer = trained(name)
    assert_same_function(layer, _pickle(layer))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_deepcopy_round_trip(name):
    layer = trained(name)
    assert_same_function(layer, copy.deepcopy(layer))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_torch_save_module_round_trip(name):
    layer = trained(name)
    assert_same_function(layer, _torch_save(layer))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_state_dict_round_trip_with_weights_only(name):
    layer = trained(name)
    assert_same_function(layer, _state_dict(layer, name))


@pytest.mark.parametrize("copier", [_pickle, copy.deepcopy, copy.copy])
def test_expert_network_round_trip(copier):
    network = ExpertNetwork.from_spec(
        SPEC, expert_dims=(3, 2), in_features=5, out_features=3, ranks={"a": 2, "b": 3, "c": 4}
    )
    clone = copier(network)
    assert clone == network
    assert hash(clone) == hash(network)
    assert clone.to_spec() == network.to_spec()
    assert dict(clone.sizes) == dict(network.sizes)
