"""The kinds of replaced module are registered objects: tools ask their attributes, records keep their names."""

import ast
import copy
import json
import pathlib
import pickle

import pytest
import torch
from torch import nn

from mumoe_tn.conversion.convert import conversion_record, convert
from mumoe_tn.conversion.surgery.block_kinds import BLOCK_KINDS, GATED, LINEAR, MLP, SPLIT, block_kind
from mumoe_tn.conversion.surgery.blocks import mlp_parts
from mumoe_tn.distillation.streaming import BlockInfo

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "mumoe_tn"


def test_a_kind_says_what_it_is_and_equals_its_name():
    assert [(kind.mlp, kind.gated, kind.split) for kind in (LINEAR, MLP, GATED, SPLIT)] == [
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, False, True),
    ]
    assert GATED.roles == ("gate", "up", "down") and LINEAR.roles == ("layer",)
    assert GATED == "gated" and {GATED} == {"gated"} and json.dumps([SPLIT]) == '["split"]'
    assert pickle.loads(pickle.dumps(GATED)) is GATED and copy.deepcopy(MLP) is MLP
    assert block_kind("plain") is MLP and BLOCK_KINDS["linear"] is LINEAR
    with pytest.raises(ValueError, match=r"unknown replaced block kind 'exec'; registered: \['gated', 'linear'"):
        block_kind("exec")


def test_recognised_blocks_and_recorded_modules_carry_the_registered_kinds():
    gated = nn.Module()
    gated.gate_proj, gated.up_proj, gated.down_proj, gated.act_fn = (
        nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 6), nn.SiLU(),
    )  # fmt: skip
    assert mlp_parts(gated).kind is GATED
    model = nn.Sequential(nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6)), nn.Linear(6, 6))
    convert(model, expert_dims=4, mlps=r"^0$", linears=r"^1$", rank=2)
    kinds = {entry.paths[0]: entry.kind for entry in conversion_record(model).modules}
    assert kinds == {"0": "mlp", "1": "linear"} and kinds["0"] is MLP and kinds["1"] is LINEAR
    info = BlockInfo("0", model[0], "plain", 6, 12, 6, True, nn.GELU(), torch.device("cpu"), torch.float32)
    assert info.kind is MLP


def test_no_conversion_or_distillation_tool_compares_a_kind_with_a_kind_name():
    found = []
    for folder in ("conversion", "distillation"):
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                operands = [node.left, *node.comparators]
                kinds = any(isinstance(each, ast.Attribute) and each.attr == "kind" for each in operands)
                names = {
                    constant.value
                    for each in operands
                    for constant in ast.walk(each)
                    if isinstance(constant, ast.Constant) and constant.value in BLOCK_KINDS
                }
                if kinds and names:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []
