"""Registered formats and gates reach every tool: a toy format joins the design search, a toy gate reaches distill."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from mumoe_tn.decompositions import Format, normalise_ranks, unregister
from mumoe_tn.design import families, search_space
from mumoe_tn.design.space import searched_formats
from mumoe_tn.distillation.replacements import mumoe_factory, top_k_gate_names
from mumoe_tn.distillation.streaming import BlockInfo
from mumoe_tn.gates.registry import register_gate, top_k_gates, unregister_gate
from mumoe_tn.gates.specs import TopKGate
from mumoe_tn.network import ExpertNetwork, physical_sizes


@pytest.fixture
def toy_format():
    class Bridge(Format, name="toy_bridge"):
        """``n1`` meets ``i`` through one core: ``A: n1 i a, B: a o`` — a rank-``a`` bridge."""

        def network(self, expert_dims, in_features, out_features, rank, **options):
            (a,) = normalise_ranks(self.name, rank, 1)
            sizes = physical_sizes(expert_dims, in_features, out_features)
            return ExpertNetwork({"A": "n1 i a", "B": "a o"}, {**sizes, "a": a})

        def search_structures(self, expert_dims, expert_ranks):
            return [("toy bridge", 1)] if len(expert_dims) == 1 else []

    yield Bridge.get()
    unregister("toy_bridge")


@pytest.fixture
def two_mode_format():
    class TwoModes(Format, name="toy_two_modes"):
        """Written for exactly two expert modes: ``A: n1 n2 a, B: a i o``."""

        def network(self, expert_dims, in_features, out_features, rank, **options):
            (a,) = normalise_ranks(self.name, rank, 1)
            sizes = physical_sizes(expert_dims, in_features, out_features)
            return ExpertNetwork({"A": "n1 n2 a", "B": "a i o"}, {**sizes, "a": a})

    yield TwoModes.get()
    unregister("toy_two_modes")


def test_a_format_joins_the_search_where_it_builds(two_mode_format):
    shapes = search_space(8, max_modes=3, families=["toy_two_modes", "cp"])
    modes = {len(s.expert_dims) for s in shapes if s.family == "toy_two_modes"}
    assert modes == {2}
    assert {len(s.expert_dims) for s in shapes if s.family == "cp"} == {1, 2, 3}


@pytest.fixture
def hidden_format():
    class Hidden(Format, name="toy_hidden"):
        in_search = False

        def network(self, expert_dims, in_features, out_features, rank, **options):
            (a,) = normalise_ranks(self.name, rank, 1)
            sizes = physical_sizes(expert_dims, in_features, out_features)
            return ExpertNetwork({"A": "n1 a", "B": "a i o"}, {**sizes, "a": a})

    yield Hidden.get()
    unregister("toy_hidden")


def test_a_registered_format_joins_the_design_search(toy_format, hidden_format):
    assert "toy_bridge" in families()
    assert "toy_bridge" in searched_formats()
    assert "toy_hidden" not in families()
    shapes = [s for s in search_space(8, max_modes=2, families=["toy_bridge"])]
    assert [s.label for s in shapes] == ["toy bridge"]
    network = shapes[0].make(5, 3)
    assert dict(network.cores) == {"A": ("n1", "i", "a"), "B": ("a", "o")}
    assert shapes[0].scaled == ("a",)
    with pytest.raises(ValueError, match="toy_hidden"):
        search_space(8, families=["toy_hidden"])


@dataclass(frozen=True)
class HardTopKGate(TopKGate):
    """A toy top-k gate a user registers: the softmax router under another short name."""

    short_name = "hard"


@dataclass(frozen=True)
class WideTopKGate(TopKGate):
    """A subclass that names itself nothing: it must not take the softmax gate's short name."""


def test_a_subclass_does_not_inherit_a_short_name():
    register_gate(WideTopKGate)
    try:
        gates = top_k_gates()
        assert gates["softmax"] is TopKGate
        assert gates["widetopkgate"] is WideTopKGate
    finally:
        unregister_gate(WideTopKGate)


@pytest.fixture
def hard_gate():
    register_gate(HardTopKGate)
    yield HardTopKGate
    unregister_gate(HardTopKGate)


def test_a_registered_top_k_gate_is_offered_to_distill(hard_gate):
    assert top_k_gates()["hard"] is HardTopKGate
    assert "hard" in top_k_gate_names()
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    block = BlockInfo(
        name="mlp", module=mlp, kind="plain", in_features=8, hidden_features=16, out_features=8, bias=True,
        activation=nn.GELU(), device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    replacement = mumoe_factory("cp", 4, 2, 1.0, top_k="hard")(block)
    assert type(replacement.gate_spec) is HardTopKGate
    assert replacement.gate_spec.k == 2
    assert type(mumoe_factory("cp", 4, 2, 1.0)(block).gate_spec) is TopKGate
    with pytest.raises(ValueError, match="hard"):
        mumoe_factory("cp", 4, 2, 1.0, top_k="nope")
    unregister_gate(HardTopKGate)
    assert "hard" not in top_k_gate_names()
    with pytest.raises(ValueError, match="hard"):
        mumoe_factory("cp", 4, 2, 1.0, top_k="hard")


def test_auto_takes_the_formats_top_k_gate():
    from mumoe_tn.decompositions.registry import get_format

    assert get_format("mxd").top_k_gate == "relu"
    assert get_format("cp").top_k_gate == "softmax"


def test_every_extension_point_is_a_registry():
    from mumoe_tn.conversion.adapters import ADAPTERS
    from mumoe_tn.conversion.blocks import GATED_LAYOUTS, PACKED_GATED_CLASSES
    from mumoe_tn.decompositions.registry import FORMATS
    from mumoe_tn.gates.modules import ACTIVATIONS, GATE_NORMS
    from mumoe_tn.gates.registry import GATES
    from mumoe_tn.layers.mlp_blocks import MLP_BLOCKS
    from mumoe_tn.registry import Registry

    registries = (ADAPTERS, GATED_LAYOUTS, PACKED_GATED_CLASSES, FORMATS, ACTIVATIONS, GATE_NORMS, GATES, MLP_BLOCKS)
    for registry in registries:
        assert isinstance(registry, Registry), registry
    assert {"cp", "tr", "tt", "tucker", "mxd"} <= set(FORMATS)
    assert {"entmax15", "sparsemax", "softmax"} <= set(ACTIVATIONS)
    assert {"mumoe", "decoders"} <= set(MLP_BLOCKS)


def test_a_registry_registers_looks_up_and_refuses_clearly():
    from mumoe_tn.registry import Registry

    seen = []
    registry = Registry("widget", normalise=str.lower, check=lambda key, value: seen.append((key, value)))
    assert registry.register("Spoke", 1) == 1
    assert registry["spoke"] == 1 and "SPOKE" in registry and 3 not in registry
    assert seen == [("spoke", 1)]

    @registry.register("hub")
    def hub():
        return 2

    assert registry.lookup("HUB") is hub
    assert registry.names() == ["hub", "spoke"]
    with pytest.raises(ValueError, match=r"already registered as 'spoke'.*replace=True"):
        registry.register("spoke", 5)
    registry.register("spoke", 5, replace=True)
    assert registry["spoke"] == 5
    with pytest.raises(ValueError, match=r"unknown widget 'rim'; registered: \['hub', 'spoke'\]"):
        registry.lookup("rim")
    registry.unregister("spoke")
    registry.unregister("spoke")
    assert list(registry) == ["hub"] and len(registry) == 1
    with pytest.warns(DeprecationWarning, match=r"\.register\('rim', value\)"):
        registry["rim"] = 7
    assert registry.lookup("rim") == 7


def test_a_registered_activation_is_a_gate_activation():
    from mumoe_tn.gates.modules import ACTIVATIONS, resolve_activation

    def halve(x):
        return torch.softmax(x, dim=-1) * 0 + 1 / x.shape[-1]

    ACTIVATIONS.register("uniform_test", halve)
    try:
        assert resolve_activation("uniform_test") is halve
    finally:
        ACTIVATIONS.unregister("uniform_test")
    with pytest.raises(ValueError, match="uniform_test"):
        resolve_activation("uniform_test")
