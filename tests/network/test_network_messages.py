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


def test_structure_messages_in_full():
    with raises(TypeError, "sizes must be a mapping of label -> int, got list"):
        ExpertNetwork({"A": "n1 i o"}, [("n1", 2), ("i", 3), ("o", 4)])
    with raises(ValueError, "the network has no input leg 'i'; cores are {'A': ('n1', 'o')}"):
        ExpertNetwork({"A": "n1 o"}, {"n1": 2, "o": 4})
    with raises(ValueError, "the network has no output leg 'o'; cores are {'A': ('n1', 'i')}"):
        ExpertNetwork({"A": "n1 i"}, {"n1": 2, "i": 3})
    with raises(
        ValueError,
        "unknown expert leg(s) ['n3']: expert legs must be numbered n1..nE without gaps, found ['n1', 'n3']",
    ):
        ExpertNetwork({"A": "n1 n3 i o"}, {**PHYS, "n3": 2})
    with raises(
        ValueError,
        "bond 'x' appears only in core 'A' (dangling); a bond must join two or more cores, and physical legs "
        "are named 'i', 'o', 'n1'..'nE'",
    ):
        ExpertNetwork({"A": "n1 i o x"}, {**PHYS, "x": 2})


def test_lookup_messages_in_full():
    net = ExpertNetwork({"A": "n1 a", "B": "a i o"}, {**PHYS, "a": 5})
    with raises(ValueError, "unknown label 'z'; the network has labels ['a', 'i', 'n1', 'o']"):
        net.cores_with("z")
    with raises(ValueError, "'a' is not a physical leg; physical legs are 'i', 'o', 'n1'..'nE'"):
        net.core_of("a")
    assert net.core_of("i") == "B" and net.core_of("n1") == "A"
    with raises(ValueError, "unknown core 'C'; the cores are ['A', 'B']"):
        net.core_shape("C")
    with raises(ValueError, "unknown label(s) ['q', 'z']; the network has labels ['a', 'i', 'n1', 'o']"):
        net.with_sizes(z=2, q=3)


def test_spec_messages_in_full():
    with raises(TypeError, "spec must be a string such as 'n1 a b, a i c, b c o', got list"):
        ExpertNetwork.from_spec(["n1 i o"], expert_dims=2, in_features=3, out_features=4, ranks=1)
    # the core name ends at the first colon: the rest are labels, and 'x:' is not one
    with raises(
        ValueError, "core 'A': label 'x:' is not a valid name; labels are identifiers such as 'n1', 'i', 'o', 'r', 'a1'"
    ):
        ExpertNetwork.from_spec("A: x: n1 i o", expert_dims=2, in_features=3, out_features=4, ranks=1)
    with raises(ValueError, "expert_dims has 1 mode(s) but the spec 'A: i o' has no leg ['n1']"):
        ExpertNetwork.from_spec("A: i o", expert_dims=2, in_features=3, out_features=4, ranks=1)
    with raises(ValueError, "in_features must be a positive int, got 0"):
        ExpertNetwork.from_spec("A: n1 i o", expert_dims=2, in_features=0, out_features=4, ranks=1)
    with raises(ValueError, "out_features must be a positive int, got -1"):
        ExpertNetwork.from_spec("A: n1 i o", expert_dims=2, in_features=3, out_features=-1, ranks=1)


def test_names_survive_copies_and_default_to_the_format():
    from mumoe_tn.decompositions import build, get_format

    assert build("cp", 2, 3, 4, 2).name == "cp"
    cores = {"U_n1": "n1 r", "U_i": "i r", "U_o": "o r"}
    assert ExpertNetwork(cores, {**PHYS, "r": 2}, format=get_format("cp")).name == "cp"
    net = ExpertNetwork({"A": "n1 a", "B": "a i o"}, {**PHYS, "a": 5}, name="mine")
    resized = net.with_sizes(a=7)
    assert resized.name == "mine" and resized.sizes["a"] == 7
    assert net.with_format(None, name="other").name == "other"
    assert net.with_format(None).name == "custom"


def test_graph_edges_by_hand():
    # a hyperedge over three cores (three pairs), parallel bonds a, b between A and B, and c between B and C
    net = ExpertNetwork({"A": "n1 h a b", "B": "h a b c i", "C": "h c o"}, {**PHYS, "h": 2, "a": 3, "b": 5, "c": 7})
    edges = sorted((*sorted((u, v)), d["label"], d["size"]) for u, v, d in net.graph().edges(data=True))
    assert edges == [
        ("A", "B", "a", 3),
        ("A", "B", "b", 5),
        ("A", "B", "h", 2),
        ("A", "C", "h", 2),
        ("B", "C", "c", 7),
        ("B", "C", "h", 2),
    ]


def test_repr_in_full():
    net = ExpertNetwork({"A": "n1 n2 a", "B": "a i o b", "C": "b"}, {"n1": 2, "n2": 3, "i": 4, "o": 5, "a": 6, "b": 7})
    assert repr(net) == (
        "ExpertNetwork('custom', 'A: n1 n2 a, B: a i o b, C: b', experts=2×3, i=4, o=5, bonds=(a=6, b=7), params=883)"
    )
    named = net.with_format(None, name="mine")
    assert repr(named).startswith("ExpertNetwork('mine' (no format), 'A: n1 n2 a")
    from mumoe_tn.decompositions import build

    assert repr(build("cp", 2, 3, 4, 2)).startswith("ExpertNetwork('cp', ")


def test_cores_are_parsed_copied_and_read_only():
    given = {"A": "n1 a", "B": ["a", "i", "o"]}
    net = ExpertNetwork(given, {**PHYS, "a": 5})
    assert dict(net.cores) == {"A": ("n1", "a"), "B": ("a", "i", "o")}
    given["C"] = "x"  # the caller's dict is not the network's
    assert list(net.cores) == ["A", "B"]
    with pytest.raises(TypeError):
        net.cores["A"] = ("n1",)
