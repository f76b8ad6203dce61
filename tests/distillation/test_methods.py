"""Distillation methods are registered: one parser turns a method's text into a spec; only the registry reads it."""

import ast
import pathlib

import pytest
import torch
from torch import nn

from mumoe_tn.distillation.methods import (
    DEFAULT_METHODS,
    MethodSettings,
    MethodSpec,
    factory_from_spec,
    method_factory,
    parse_method,
    parse_methods,
    reference_methods,
    register_method,
    spec_from_data,
)
from mumoe_tn.distillation.replacement_specs import ReplacementSpec
from mumoe_tn.distillation.run_files import load_frontier, read_record
from mumoe_tn.distillation.streaming import BlockInfo, select_blocks
from mumoe_tn.distillation.study import method_factories
from mumoe_tn.distillation.transcoders import Transcoder
from mumoe_tn.layers import MixtureOfDecoders, MuMoEMLP

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mumoe_tn"


def _block():
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    return BlockInfo(
        name="mlp", module=mlp, kind="mlp", in_features=8, hidden_features=32, out_features=8, bias=True,
        activation=nn.GELU(), device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("transcoder", MethodSpec("transcoder")),
        ("skip-transcoder", MethodSpec("skip-transcoder")),
        ("cp", MethodSpec("mumoe", "cp")),
        ("tr-hier", MethodSpec("mumoe", "tr", hierarchical=True)),
        ("mxd-hier", MethodSpec("mumoe", "mxd", hierarchical=True)),
    ],
)
def test_a_method_text_is_parsed_into_its_spec_and_written_back(text, spec):
    assert parse_method(text) == spec
    assert spec.text == text


def test_every_default_method_parses_and_the_transcoders_are_the_references():
    assert [spec.text for spec in parse_methods(DEFAULT_METHODS)] == list(DEFAULT_METHODS)
    assert set(reference_methods()) == {"transcoder", "skip-transcoder"}


def test_a_spec_builds_the_replacement_its_family_names():
    settings = MethodSettings(experts=16)
    name, factory = method_factory(MethodSpec("skip-transcoder", k=4, budget=2.0), settings)
    built = factory(_block())
    assert name == "skip-transcoder@4" and type(built) is Transcoder and built.skip is not None
    name, factory = method_factory(MethodSpec("mumoe", "cp", hierarchical=True, k=4, budget=2.0), settings)
    built = factory(_block())
    assert name == "cp-hier@4" and type(built) is MuMoEMLP and tuple(built.expert_dims) == (4, 4)
    name, _ = method_factory(MethodSpec("mumoe", "cp", k=4, budget=2.0), MethodSettings(experts=16, top_k="relu"))
    assert name == "cp:relu@4"


def test_a_method_recipe_wins_over_the_run_recipe():
    """The authors' recipe starts a Mixture of Decoders at output 0; ``"plain"`` keeps the block's own init."""
    x = torch.randn(5, 8)
    run = MethodSettings(experts=16, recipe="mxd-paper")
    _, authors = method_factory(MethodSpec("mumoe", "mxd", k=2, budget=2.0), run)
    _, own = method_factory(MethodSpec("mumoe", "mxd", k=2, budget=2.0, recipe="plain"), run)
    with torch.no_grad():
        assert torch.count_nonzero(authors(_block())(x)) == 0
        assert torch.count_nonzero(own(_block())(x)) > 0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: parse_method("cp-hierarchical"), ValueError, r"unknown method 'cp-hierarchical'.*"
                                                                r"'skip-transcoder', 'transcoder'.*'-hier'"),
        (lambda: parse_method(3), TypeError, "named by a str"),
        (lambda: parse_methods("cp"), ValueError, "non-empty sequence"),
        (lambda: parse_method(MethodSpec("nowhere")), ValueError, "unknown distillation method 'nowhere'"),
        (lambda: parse_method(MethodSpec("mumoe", "nope")), ValueError, "needs a registered format"),
        (lambda: parse_method(MethodSpec("transcoder", "cp")), ValueError, "takes no format and no expert modes"),
        (lambda: MethodSpec("transcoder", k=0), ValueError, "MethodSpec.k must be None or a positive int"),
        (lambda: MethodSpec("transcoder", recipe="fast"), ValueError, "MethodSpec.recipe must be None or one of"),
        (lambda: MethodSpec("mumoe", "cp", hierarchical="yes"), TypeError, "hierarchical must be a bool"),
        (lambda: method_factory(MethodSpec("transcoder")), ValueError, "'transcoder' needs its sparsity"),
        (lambda: method_factory(MethodSpec("mumoe", "cp", k=17), MethodSettings(experts=16)), ValueError,
         "L0 17 is more than the 16 experts of 'cp'"),
        (lambda: register_method("toy@8", lambda spec, settings: None), ValueError, "without '@'"),
        (lambda: register_method("toy-read", lambda s, t: None, read=spec_from_data), ValueError, "read and rebuild"),
        (lambda: register_method("transcoder", lambda s, t: None), ValueError, "already registered"),
        (lambda: spec_from_data({**ReplacementSpec("transcoder", 4).to_data(), "kind": "toy-gone"}), ValueError,
         r"kind = 'toy-gone' is invalid: it must be one of \['mumoe', 'transcoder'\]"),
    ],
)  # fmt: skip
def test_a_bad_method_is_refused_by_name(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_saved_spec_of_either_kind_written_as_before_still_rebuilds():
    written = {"k": 4, "budget": 2.0, "top_k": "auto", "aux_k": None, "experts": None, "recipe": None}
    transcoder = spec_from_data({**written, "kind": "transcoder", "skip": True, "format": None})
    assert transcoder == ReplacementSpec("transcoder", 4, 2.0, skip=True)
    assert type(factory_from_spec(transcoder)(_block())) is Transcoder
    mxd = spec_from_data({**written, "kind": "mumoe", "skip": False, "format": "mxd", "experts": [16]})
    assert type(factory_from_spec(mxd)(_block())) is MixtureOfDecoders


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module that are not docstrings."""
    documented = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    return [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documented
    ]  # fmt: skip


def test_only_the_registry_reads_a_method_text():
    names = {"-hier", "transcoder", "skip-transcoder"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "methods.py":
            continue
        for node in _strings(ast.parse(path.read_text(encoding="utf-8"))):
            if node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    # the saved data's kind of a transcoder spec is named once, where the data format is defined
    assert found == ["distillation/replacement_specs.py:41 'transcoder'"]


def test_a_run_saved_before_methods_were_registered_still_loads():
    """``tests/fixtures/frontier_run/run`` was written by its ``write_run.py`` before the method registry."""
    pytest.importorskip("transformers")
    run = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "frontier_run" / "run"
    model, replacements, table = load_frontier(run)
    built = replacements["transformer.h.0.mlp"]
    assert {method: type(module).__name__ for method, module in built.items()} == {
        "transcoder@2": "Transcoder", "skip-transcoder@2": "Transcoder", "cp-hier@2": "MuMoEMLP",
        "mxd@2": "MixtureOfDecoders",
    }  # fmt: skip
    assert sorted(row.method for row in table.rows) == sorted(built)
    # the specs the registered methods attach today are the ones the run recorded
    recorded = read_record(table.config["saved_run"]).methods
    (block,) = select_blocks(model, "mlp$")
    for name, factory in method_factories(("transcoder", "skip-transcoder", "cp-hier", "mxd"), (2,), 2.0, 16).items():
        assert factory(block).replacement_spec == recorded[name], name
