"""A format names the block an MLP becomes; every tool that builds a block asks it (a toy block kind proves it)."""

import ast
import pathlib

import pytest
import torch
from torch import nn

from mumoe_tn.conversion.convert import convert
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted
from mumoe_tn.decompositions import unregister
from mumoe_tn.decompositions.cp import CPFormat
from mumoe_tn.distillation.replacements import mumoe_factory
from mumoe_tn.distillation.streaming import BlockInfo
from mumoe_tn.layers import MixtureOfDecoders, MuMoEGatedMLP, MuMoEMLP
from mumoe_tn.layers.mlp_blocks import mlp_block_for, register_mlp_block, unregister_mlp_block

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mumoe_tn"


class ToyBlock(MuMoEMLP):
    """A plain μMoE block of its own class, to see which builder a tool called."""


def build_toy(in_features, hidden_features, out_features, expert_dims, decomposition, *, gated=False, **options):
    return ToyBlock(in_features, hidden_features, out_features, expert_dims, decomposition, **options)


@pytest.fixture
def toy_format():
    register_mlp_block("toy_block", build_toy)

    class ToyCP(CPFormat, name="toy_cp_blocks"):
        mlp_block = "toy_block"

    yield "toy_cp_blocks"
    unregister("toy_cp_blocks")
    unregister_mlp_block("toy_block")


def _mlp(width=6, hidden=12):
    return nn.Sequential(nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)))


def test_the_builtin_formats_name_their_blocks():
    assert mlp_block_for("cp").build(4, 8, 4, 3, "cp", rank=2, gated=True).__class__ is MuMoEGatedMLP
    assert mlp_block_for("tucker").build(4, 8, 4, 3, "tucker", rank=2).__class__ is MuMoEMLP
    assert mlp_block_for("mxd").build(4, 8, 4, 3, "mxd").__class__ is MixtureOfDecoders
    assert mlp_block_for("n1 a, a i, a o").key == "mumoe"  # a spec has no format: the generic block


def test_convert_and_reload_build_the_block_a_registered_format_names(toy_format, tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    convert(model, expert_dims=4, mlps=r"^0$", decomposition=toy_format, rank=2)
    assert type(model[0]) is ToyBlock
    save_converted(model, tmp_path / "toy.safetensors")
    fresh = load_converted(_mlp(), tmp_path / "toy.safetensors")
    assert type(fresh[0]) is ToyBlock
    x = torch.randn(3, 6)
    torch.testing.assert_close(fresh(x), model.eval()(x))


def test_distillation_builds_the_block_a_registered_format_names(toy_format):
    model = _mlp()
    info = BlockInfo(
        name="0", module=model[0], kind="mlp", in_features=6, hidden_features=12, out_features=6, bias=True,
        activation=nn.GELU(), device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    assert type(mumoe_factory(toy_format, 4, 1, 0.5)(info)) is ToyBlock


def test_an_unregistered_block_kind_is_refused_by_name(toy_format):
    unregister_mlp_block("toy_block")
    with pytest.raises(ValueError, match="'toy_block', which is not registered"):
        convert(_mlp(), expert_dims=4, mlps=r"^0$", decomposition=toy_format, rank=2)


def test_no_tool_compares_a_format_block_kind_with_a_string():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(each, ast.Attribute) and each.attr == "mlp_block" for each in operands):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []
