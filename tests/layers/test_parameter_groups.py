"""Optimiser groups: gates, expert-mode cores and the rest, for every format and outside modules."""

import math

import pytest
import torch
from torch import nn

from mumoe_tn import MixtureOfDecoders, MuMoEMLP, parameter_groups
from mumoe_tn.layers import PARAMETER_KINDS


@pytest.mark.parametrize("decomposition", ["cp", "tr", "tt", "tucker"])
def test_groups_partition_the_model_by_kind(decomposition):
    block = MuMoEMLP(8, 16, 8, (3, 4), decomposition, 2)
    model = nn.Sequential(nn.Linear(5, 8), block)
    groups = {g["name"]: g for g in parameter_groups(model, 0.01, gate_lr_scale=2.0, core_lr_scale=3.0)}
    names = {id(p): n for n, p in model.named_parameters()}
    by_kind = {kind: sorted(names[id(p)] for p in g["params"]) for kind, g in groups.items()}
    assert by_kind["gates"] == sorted(f"1.gate.{n}" for n, _ in block.gate.named_parameters())
    assert "0.weight" in by_kind["rest"] and "0.bias" in by_kind["rest"]
    every = sorted(name for kind in by_kind.values() for name in kind)
    assert every == sorted(names.values())  # each parameter exactly once
    assert [g["name"] for g in parameter_groups(model, 0.01)] == list(PARAMETER_KINDS)
    assert groups["gates"]["lr"] == pytest.approx(0.02) and groups["expert cores"]["lr"] == pytest.approx(0.03)
    assert groups["rest"]["lr"] == 0.01 and groups["expert cores"]["lr_scale"] == 3.0


@pytest.mark.parametrize("decomposition", ["cp", "tr", "tt", "tucker"])
def test_expert_cores_are_the_cores_holding_an_expert_leg(decomposition):
    block = MuMoEMLP(8, 16, 8, (3, 4), decomposition, 2)
    groups = {g["name"]: g for g in parameter_groups(block, 1.0)}
    chosen = {id(p) for p in groups["expert cores"]["params"]}
    assert chosen
    for layer in (block.experts1, block.experts2):
        for name, core in layer.cores.items():
            legs = layer.network.cores[name]
            assert (id(core) in chosen) == any(label in ("n1", "n2") for label in legs), (name, legs)


def test_mixture_of_decoders_and_shared_and_frozen_parameters():
    block = MixtureOfDecoders(8, 16, 8, 6, "mxd")
    extra = nn.Linear(8, 8)
    extra.bias.requires_grad_(False)
    model = nn.ModuleDict({"a": block, "b": extra, "tied": extra})
    groups = {g["name"]: g for g in parameter_groups(model, 0.1, weight_decay=0.01, core_weight_decay=0.0)}
    core_legs = [block.decoder.network.cores[n] for n, c in block.decoder.cores.items()
                 if any(c is p for p in groups["expert cores"]["params"])]  # fmt: skip
    assert core_legs == [("n1", "o")]
    rest = groups["rest"]["params"]
    assert sum(p is extra.weight for p in rest) == 1 and not any(p is extra.bias for p in rest)
    assert groups["expert cores"]["weight_decay"] == 0.0 and groups["rest"]["weight_decay"] == 0.01


def test_a_step_moves_each_group_at_its_rate():
    torch.manual_seed(0)
    block = MuMoEMLP(6, 12, 6, 4, "cp", 3)
    groups = parameter_groups(block, 0.01, gate_lr_scale=10.0, core_lr_scale=100.0)
    before = [[p.detach().clone() for p in g["params"]] for g in groups]
    block(torch.randn(5, 6)).square().sum().backward()
    torch.optim.SGD(groups).step()
    for group, old in zip(groups, before, strict=True):
        for p, q in zip(group["params"], old, strict=True):
            torch.testing.assert_close(p.detach(), q - group["lr"] * p.grad)
    assert [g["lr"] for g in groups] == pytest.approx([0.1, 1.0, 0.01])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lr": 0.0}, ValueError, r"lr must be a finite number > 0, got 0\.0"),
        ({"lr": math.nan}, ValueError, r"lr must be a finite number > 0, got nan"),
        ({"lr": 1.0, "core_lr_scale": -1}, ValueError, r"core_lr_scale must be a finite number > 0, got -1"),
        ({"lr": 1.0, "gate_lr_scale": True}, TypeError, r"gate_lr_scale must be a real number, got True"),
        ({"lr": 1.0, "weight_decay": -0.1}, ValueError, r"weight_decay must be a finite number >= 0, got -0\.1"),
        ({"lr": 1.0, "core_weight_decay": "0"}, TypeError, r"core_weight_decay must be a real number, got '0'"),
    ],
)
def test_bad_settings_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        parameter_groups(MuMoEMLP(4, 8, 4, 2, "cp", 2), **kwargs)
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got list"):
        parameter_groups([], 1.0)
