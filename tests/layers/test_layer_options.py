"""LayerOptions: the options every μMoE layer shares, given as one object, as keywords, or both."""

import dataclasses

import pytest
import torch

from mumoe_tn import LayerOptions, MixtureOfDecoders, MuMoE, MuMoEGatedMLP, MuMoEMLP, TopKGate


def _state(module):
    return {key: value.clone() for key, value in module.state_dict().items()}


@pytest.mark.parametrize(
    "build",
    [
        lambda **kw: MuMoE(6, 5, 4, "cp", 3, **kw),
        lambda **kw: MuMoEMLP(6, 8, 6, 4, "cp", 3, **kw),
        lambda **kw: MuMoEGatedMLP(6, 8, 6, 4, "tt", (2, 3), **kw),
        lambda **kw: MixtureOfDecoders(6, 8, 6, 4, **kw),
    ],
    ids=["MuMoE", "MuMoEMLP", "MuMoEGatedMLP", "MixtureOfDecoders"],
)
def test_an_options_object_builds_what_the_same_keywords_build(build):
    shared = {"bias": False, "gate": TopKGate(k=2), "input_norm": True, "init": "linear", "dtype": torch.float64}
    torch.manual_seed(0)
    from_keywords = build(**shared)
    torch.manual_seed(0)
    from_options = build(options=LayerOptions(**shared))
    assert _state(from_keywords).keys() == _state(from_options).keys()
    for key, value in _state(from_keywords).items():
        torch.testing.assert_close(value, _state(from_options)[key], rtol=0, atol=0)
        assert value.dtype == torch.float64
    assert type(from_options.gate_spec) is TopKGate and from_options.gate_spec.k == 2


def test_keywords_win_over_the_options_object_and_builder_options_pass_through():
    options = LayerOptions(bias=True, gate=TopKGate(k=1))
    layer = MuMoE(6, 5, (2, 3), "tr", (2, 2, 2, 3), options=options, bias=False, gate=TopKGate(k=2))
    assert layer.network.in_features == 6  # no folded bias column
    assert layer.gate_spec.k == 2
    assert options.bias is True  # the object is not changed
    with pytest.raises(TypeError, match="options must be a LayerOptions, got dict"):
        MuMoE(6, 5, 4, "cp", 3, options={"bias": False})


def test_every_field_is_documented_once():
    doc = LayerOptions.__doc__
    for field in dataclasses.fields(LayerOptions):
        if field.name in ("device", "dtype"):
            assert "device, dtype" in doc
            continue
        assert f"    {field.name} :" in doc, field.name
    for layer in (MuMoE, MuMoEMLP, MuMoEGatedMLP, MixtureOfDecoders):
        assert "LayerOptions" in layer.__doc__
        assert "    gate_norm :" not in layer.__doc__, layer.__name__
