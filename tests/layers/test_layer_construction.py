"""One construction spec: every layer class builds from a LayerSpec, resolved once from its arguments."""

import dataclasses

import pytest
import torch
from torch import nn

from mumoe_tn.conversion.convert import apply_conversion, conversion_record, convert
from mumoe_tn.gates.specs import TopKGate
from mumoe_tn.layers import (
    ExecutionOptions,
    MixtureOfDecoders,
    MuMoE,
    MuMoEGatedMLP,
    MuMoEMLP,
    layer_spec,
)

#: (class, constructor arguments, layer_spec's sizes, its keywords)
LAYERS = [
    (MuMoE, (8, 6, 4, "cp", 3), (8, None, 6, 4, "cp", 3), {}),
    (MuMoEMLP, (8, 12, 6, 4, "tr", (2, 3, 2)), (8, 12, 6, 4, "tr", (2, 3, 2)), {}),
    (MuMoEGatedMLP, (8, 12, None, (2, 3), "cp", 4), (8, 12, None, (2, 3), "cp", 4), {}),
    (MixtureOfDecoders, (8, 12, None, 5), (8, 12, None, 5, "mxd", None), {"gated": True}),
]


@pytest.mark.parametrize(("cls", "arguments", "sizes", "extra"), LAYERS, ids=lambda item: getattr(item, "__name__", ""))
def test_a_layer_from_its_spec_is_the_layer_its_constructor_builds(cls, arguments, sizes, extra):
    torch.manual_seed(0)
    built = cls(*arguments, input_norm=True, gate=TopKGate(k=2), **extra)
    spec = layer_spec(
        cls, *sizes, match=None, options=None, keywords={"input_norm": True, "gate": TopKGate(k=2)}, **extra
    )
    torch.manual_seed(0)
    rebuilt = cls.from_spec(spec)
    assert type(rebuilt) is cls and repr(rebuilt) == repr(built)
    assert spec.roles == tuple(role for role, _ in spec.networks) == cls.spec_roles
    expected = built.state_dict()
    assert list(rebuilt.state_dict()) == list(expected)
    for key, tensor in rebuilt.state_dict().items():
        assert torch.equal(tensor, expected[key]), key
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x), built.eval()(x))


def test_layers_built_from_one_spec_share_no_module():
    spec = layer_spec(
        MuMoEMLP, 8, 12, None, 4, "cp", 3, match=None, options=None, keywords={}, hidden_activation=nn.PReLU()
    )
    first, second = MuMoEMLP.from_spec(spec), MuMoEMLP.from_spec(spec)
    assert first.hidden_activation is not second.hidden_activation is not spec.hidden_activation
    assert isinstance(first.hidden_activation, nn.PReLU)


def test_the_spec_is_frozen_and_checked_by_the_class_it_builds():
    spec = layer_spec(MuMoE, 8, None, 6, 4, "cp", 3, match=None, options=None, keywords={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.bias = False
    with pytest.raises(ValueError, match=r"factorized layers \['layer'\] \(a MuMoE\) does not build a MuMoEMLP"):
        MuMoEMLP.from_spec(spec)
    with pytest.raises(TypeError, match="spec must be a LayerSpec, got dict"):
        MuMoE.from_spec({"networks": ()})
    with pytest.raises(ValueError, match=r"this MuMoE spec has no 'down' layer; its layers are \['layer'\]"):
        spec.network("down")


def test_the_spec_holds_what_matching_resolved():
    spec = layer_spec(MuMoE, 32, None, 24, 4, "cp", None, match="linear", options=None, keywords={})
    assert spec.target == (32 + 1) * 24  # the Linear's weight and bias
    assert spec.network("layer").in_features == 33 and spec.folded_bias
    plain = layer_spec(MuMoE, 8, None, 6, 4, "cp", 3, match=None, options=None, keywords={"bias": False})
    assert plain.target is None and plain.network("layer").in_features == 8 and not plain.folded_bias
    decoders = layer_spec(MixtureOfDecoders, 8, 12, None, 5, "mxd", None, match=None, options=None, keywords={})
    assert decoders.bias and not decoders.folded_bias and decoders.network("down").in_features == 12


def test_execution_options_go_into_the_spec_and_reach_every_factorized_layer():
    block = MuMoEGatedMLP(8, 12, None, 4, "cp", 3, chunk_size=5, recompute=True, precontract=False, pad_bonds=None)
    for experts in block.expert_layers.values():
        assert (experts.chunk_size, experts.recompute, experts.precontract, experts.pad_bonds) == (5, True, False, None)
    spec = layer_spec(MuMoE, 8, None, 6, 4, "cp", 3, match=None, options=None, keywords={})
    assert spec.execution == ExecutionOptions()
    tuned = dataclasses.replace(spec, execution=dataclasses.replace(spec.execution, chunk_size=2, max_plans=3))
    layer = MuMoE.from_spec(tuned)
    assert (layer.experts.chunk_size, layer.experts.max_plans) == (2, 3)
    whole = MuMoE.from_spec(spec)
    whole.load_state_dict(layer.state_dict())
    x = torch.randn(7, 8)  # more rows than a chunk
    assert torch.allclose(layer(x), whole(x), atol=1e-6)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int \(rows per chunk\) or None, got 0"):
        MuMoE(8, 6, 4, "cp", 3, chunk_size=0)


def test_a_named_optimizer_can_wait_until_the_layer_plans():
    layer = MuMoE(8, 6, 4, "cp", 3, optimize="optimal", lazy_optimizer=True)
    assert layer.experts.optimize == "optimal"
    with pytest.raises(ValueError, match=r"lazy_optimizer=True takes an optimizer name of \["):
        MuMoE(8, 6, 4, "cp", 3, optimize="os.system", lazy_optimizer=True)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_a_replayed_record_builds_its_layers_with_the_recorded_execution_options():
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), nn.Linear(12, 12))
    convert(model, expert_dims=4, mlps=r"^0$", linears=r"^1$", rank=3, chunk_size=6, recompute=True, pad_bonds=None)
    fresh = apply_conversion(nn.Sequential(_Block(), nn.Linear(12, 12)), conversion_record(model))
    layers = [*fresh[0].expert_layers.values(), fresh[1].experts]
    assert len(layers) == 3
    for experts in layers:
        assert (experts.chunk_size, experts.recompute, experts.pad_bonds, experts.optimize) == (6, True, None, "auto")
