"""Registered formats and gates reach every tool, and every registry refuses a taken name unless told to replace it."""

from dataclasses import dataclass
from functools import partial

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
    from mumoe_tn.conversion.surgery.adapters import ADAPTERS
    from mumoe_tn.conversion.surgery.blocks import GATED_LAYOUTS, PACKED_GATED_CLASSES
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
    with pytest.raises(TypeError, match=r"\.register\('rim', value\)"):
        registry["rim"] = 7
    assert "rim" not in registry


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


# ----------------------------------------------------------------------------- one rule for duplicates
#: The name every front door below registers (and removes again).
DUPLICATE = "toy_duplicate"


class _NamedFormat(Format):
    """A format whose instances carry a name without being registered by the class statement."""

    name = DUPLICATE


class _Layer(nn.Module):
    """A layer class a user teaches conversion to read."""


def _gate_class():
    """A new gate class of the same qualified name on every call (a module defining it run twice)."""

    @dataclass(frozen=True)
    class DuplicateGate(TopKGate):
        pass

    return DuplicateGate


def _function():
    def entry(*args):
        return args

    return entry


def _subclass(base, replace, **keywords):
    """A class that registers itself by the ``name=`` keyword of its class statement."""

    class Entry(base, name=DUPLICATE, replace=replace, **keywords):
        pass

    return Entry


def _registered(register, value, replace):
    register(value, replace=replace)
    return value


def _front_doors():
    """Per front door: ``register(replace) -> the new entry``, ``current() -> the entry held``, ``remove()``."""
    from mumoe_tn.conversion.surgery.adapters import ADAPTERS, LayerAdapter, register_adapter
    from mumoe_tn.conversion.surgery.blocks import GATED_LAYOUTS, PACKED_GATED_CLASSES, GatedNames, register_gated_names
    from mumoe_tn.decompositions.registry import FORMATS
    from mumoe_tn.decompositions.registry import register as register_format
    from mumoe_tn.distillation.losses import LOSSES, Loss, register_loss, unregister_loss
    from mumoe_tn.distillation.methods import METHODS, register_method, unregister_method
    from mumoe_tn.distillation.metrics import METRICS, Metric, register_metric, unregister_metric
    from mumoe_tn.gates.modules import ACTIVATIONS, GATE_NORMS
    from mumoe_tn.gates.registry import GATES, gate_class_name
    from mumoe_tn.layers.mlp_blocks import MLP_BLOCKS, register_mlp_block, unregister_mlp_block

    layout = ("toy_gate", "toy_up", "toy_down", "toy_act")
    gate_name = gate_class_name(_gate_class())
    return {
        "Format subclass name=": (
            lambda replace: _subclass(Format, replace),
            lambda: type(FORMATS[DUPLICATE]),
            lambda: unregister(DUPLICATE),
        ),
        "decompositions.register": (
            lambda replace: _registered(register_format, _NamedFormat(), replace),
            lambda: FORMATS[DUPLICATE],
            lambda: unregister(DUPLICATE),
        ),
        "register_gate": (
            lambda replace: register_gate(_gate_class(), replace=replace),
            lambda: GATES[gate_name],
            lambda: GATES.unregister(gate_name),
        ),
        "ACTIVATIONS.register": (
            lambda replace: ACTIVATIONS.register(DUPLICATE, _function(), replace=replace),
            lambda: ACTIVATIONS[DUPLICATE],
            lambda: ACTIVATIONS.unregister(DUPLICATE),
        ),
        "GATE_NORMS.register": (
            lambda replace: GATE_NORMS.register(DUPLICATE, _function(), replace=replace),
            lambda: GATE_NORMS[DUPLICATE],
            lambda: GATE_NORMS.unregister(DUPLICATE),
        ),
        "register_adapter": (
            lambda replace: _registered(partial(register_adapter, _Layer), LayerAdapter(), replace),
            lambda: ADAPTERS[_Layer],
            lambda: ADAPTERS.unregister(_Layer),
        ),
        "register_gated_names": (
            lambda replace: _registered(register_gated_names, GatedNames(*layout), replace),
            lambda: GATED_LAYOUTS[GatedNames(*layout)],
            lambda: GATED_LAYOUTS.unregister(GatedNames(*layout)),
        ),
        "PACKED_GATED_CLASSES.register": (
            lambda replace: PACKED_GATED_CLASSES.register(DUPLICATE, GatedNames(*layout), replace=replace),
            lambda: PACKED_GATED_CLASSES[DUPLICATE],
            lambda: PACKED_GATED_CLASSES.unregister(DUPLICATE),
        ),
        "register_mlp_block": (
            lambda replace: register_mlp_block(DUPLICATE, _function(), replace=replace).build,
            lambda: MLP_BLOCKS[DUPLICATE].build,
            lambda: unregister_mlp_block(DUPLICATE),
        ),
        "Loss subclass name=": (
            lambda replace: _subclass(Loss, replace),
            lambda: LOSSES[DUPLICATE],
            lambda: unregister_loss(DUPLICATE),
        ),
        "register_loss": (
            lambda replace: register_loss(type("Entry", (Loss,), {}), name=DUPLICATE, replace=replace),
            lambda: LOSSES[DUPLICATE],
            lambda: unregister_loss(DUPLICATE),
        ),
        "Metric subclass name=": (
            lambda replace: _subclass(Metric, replace, column="toy"),
            lambda: METRICS[DUPLICATE],
            lambda: unregister_metric(DUPLICATE),
        ),
        "register_metric": (
            lambda replace: register_metric(type("Entry", (Metric,), {}), name=DUPLICATE, replace=replace),
            lambda: METRICS[DUPLICATE],
            lambda: unregister_metric(DUPLICATE),
        ),
        "register_method": (
            lambda replace: register_method(DUPLICATE, _function(), replace=replace).factory,
            lambda: METHODS[DUPLICATE].factory,
            lambda: unregister_method(DUPLICATE),
        ),
    }


FRONT_DOORS = _front_doors()


@pytest.mark.parametrize("door", sorted(FRONT_DOORS))
def test_a_name_registered_twice_raises_unless_replace_is_passed(door):
    register, current, remove = FRONT_DOORS[door]
    try:
        first = register(False)
        assert current() is first
        with pytest.raises(ValueError, match=r"registered.*replace=True"):
            register(False)
        assert current() is first  # the refused entry changed nothing
        second = register(True)
        assert second is not first and current() is second
    finally:
        remove()


#: The Llama layout the library ships (layouts are tried newest first).
LLAMA_LAYOUT = ("gate_proj", "up_proj", "down_proj", "act_fn")


def test_a_layout_registered_again_with_replace_is_tried_first():
    from mumoe_tn.conversion.surgery.blocks import GATED_LAYOUTS, GatedNames, register_gated_names

    toy, llama = GatedNames("toy_gate", "toy_up", "toy_down", "toy_act"), GatedNames(*LLAMA_LAYOUT)
    register_gated_names(toy)
    try:
        register_gated_names(llama, replace=True)
        assert list(GATED_LAYOUTS)[-1] == llama and toy in GATED_LAYOUTS
    finally:
        GATED_LAYOUTS.unregister(toy)
