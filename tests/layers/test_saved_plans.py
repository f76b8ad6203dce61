"""A layer's plans written down and loaded into another layer: same steps, no search, checked."""

import json

import pytest
import torch

import mumoe_tn.layers.experts
from mumoe_tn.contractions import plan_forward
from mumoe_tn.decompositions import build
from mumoe_tn.layers import FactorizedExperts

DTYPE = torch.float64


def _layer(network, **options):
    torch.manual_seed(0)
    return FactorizedExperts(network, dtype=DTYPE, **options)


def test_exported_plans_load_into_another_layer_which_then_never_searches(monkeypatch):
    network = build("tucker", (3, 2), 6, 5, 2)
    first = _layer(network)
    z, a = torch.randn(40, 6, dtype=DTYPE), [torch.rand(40, 3, dtype=DTYPE), torch.rand(40, 2, dtype=DTYPE)]
    first.plan(40)
    first.plan(7)
    with torch.no_grad():
        first.eval()
        expected = first(z, a)
    saved = json.loads(json.dumps(first.export_plans()))  # JSON-able
    assert {(entry["kind"], entry["batch"]) for entry in saved["plans"]} >= {("train", 64), ("train", 8)}

    second = _layer(network)
    second.load_state_dict(first.state_dict())
    second.load_plans(saved)
    searched = []
    monkeypatch.setattr(mumoe_tn.layers.experts, "plan_forward", lambda *a, **k: searched.append(a))
    monkeypatch.setattr(mumoe_tn.layers.experts, "plan_inference", lambda *a, **k: searched.append(a))
    assert second.plan(40) == first.plan(40) == plan_forward(network, 64)
    assert second.plan(5) == first.plan(5)
    with torch.no_grad():
        second.eval()
        torch.testing.assert_close(second(z, a), expected)
    assert searched == []


def test_plans_of_another_network_or_batch_are_refused():
    first = _layer(build("cp", (3,), 6, 5, 2))
    first.plan(16)
    saved = first.export_plans()
    other = _layer(build("cp", (3,), 6, 5, 3))
    with pytest.raises(ValueError, match="saved plan 0 contracts another network or batch than this layer's"):
        other.load_plans(saved)
    saved["plans"][0]["batch"] = 32
    with pytest.raises(ValueError, match="saved plan 0 contracts another network or batch"):
        _layer(build("cp", (3,), 6, 5, 2)).load_plans(saved)
    saved["plans"][0]["batch"] = 12
    with pytest.raises(ValueError, match="saved plan 0 is for batch 12; plans are kept per power-of-two batch"):
        _layer(build("cp", (3,), 6, 5, 2)).load_plans(saved)
    with pytest.raises(ValueError, match=r"saved plans are a dict written by export_plans\(\)"):
        first.load_plans({"plans": []})


def test_an_inference_plan_may_reuse_only_core_only_steps():
    network = build("tucker", (2, 2), 16, 16, (8, 8, 4, 4))
    layer = _layer(network).eval()
    with torch.no_grad():
        layer(torch.randn(16, 16, dtype=DTYPE), [torch.rand(16, 2, dtype=DTYPE), torch.rand(16, 2, dtype=DTYPE)])
    saved = layer.export_plans()
    inference = [entry for entry in saved["plans"] if entry["kind"] == "inference"]
    assert inference and inference[0]["constant"]
    inference[0]["constant"] = list(range(len(inference[0]["plan"]["steps"])))  # the last step takes the input
    with pytest.raises(ValueError, match=r"reuses steps .* that involve the input"):
        _layer(network).load_plans(saved)
