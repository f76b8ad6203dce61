"""Exact error messages and small behaviours of ExpertNetwork's declaration paths.

Written against the survivors of a mutation run over ``mumoe_tn/network.py`` (tests/README.md):
every message states the rule and quotes the offending core, label or value, in full.
"""

import re

import pytest

from mumoe_tn import ExpertNetwork

PHYS = {"n1": 2, "i": 3, "o": 4}


def raises(kind, message):
    return pytest.raises(kind, match="^" + re.escape(message) + "$")


def test_label_messages_in_full():
    with raises(
        ValueError, "core 'A': label '1a' is not a valid name; labels are identifiers such as 'n1', 'i', 'o', 'r', 'a1'"
    ):
        ExpertNetwork({"A": ("n1", "i", "o", "1a")}, PHYS)
    with raises(
        ValueError,
        "core 'A': label 'n01' looks like an expert leg but is not one; expert legs are 'n1', 'n2', … "
        "(ASCII digits, no leading zero, no 'n0')",
    ):
        ExpertNetwork({"A": "n1 i o n01"}, PHYS)
    with raises(
        ValueError,
        "core 'A' has label 'i' twice in ('n1', 'i', 'o', 'i'); a label may appear at most once per core "
        "(traces are not supported)",
    ):
        ExpertNetwork({"A": "n1 i o i"}, PHYS)


def test_only_dunder_labels_are_reserved():
    for label in ("__x", "x__"):  # a leading or a trailing double underscore alone is an ordinary label
        net = ExpertNetwork({"A": f"n1 i {label}", "B": f"{label} o"}, {**PHYS, label: 2})
        assert label in net.bonds
    with raises(ValueError, "core 'A': label '__x__' is reserved (dunder labels such as '__batch__')"):
        ExpertNetwork({"A": "n1 i __x__", "B": "__x__ o"}, {**PHYS, "__x__": 2})


def test_from_shapes_messages_and_name():
    with raises(TypeError, "cores and shapes must be mappings of core name -> labels / shape"):
        ExpertNetwork.from_shapes({"A": "n1 i o"}, [(2, 3, 4)])
    with raises(TypeError, "cores and shapes must be mappings of core name -> labels / shape"):
        ExpertNetwork.from_shapes(["n1 i o"], {"A": (2, 3, 4)})
    with raises(ValueError, "shapes are given for cores ['B'] but the cores are ['A']"):
        ExpertNetwork.from_shapes({"A": "n1 i o"}, {"B": (2, 3, 4)})
    with raises(ValueError, "core 'A' has labels ('n1', 'i', 'o') (3 legs) but a tensor of shape (2, 3) (2 dims)"):
        ExpertNetwork.from_shapes({"A": "n1 i o"}, {"A": (2, 3)})
    with raises(
        ValueError, "core 'A': label '1x' is not a valid name; labels are identifiers such as 'n1', 'i', 'o', 'r', 'a1'"
    ):
        ExpertNetwork.from_shapes({"A": "n1 i o 1x"}, {"A": (2, 3, 4, 5)})
    net = ExpertNetwork.from_shapes({"A": "n1 a", "B": "a i o"}, {"A": (2, 5), "B": (5, 3, 4)}, name="mine")
    assert net.name == "mine" and net.sizes["a"] == 5
    assert ExpertNetwork.from_shapes({"A": "n1 i o"}, {"A": (2, 3, 4)}).name == "custom"
