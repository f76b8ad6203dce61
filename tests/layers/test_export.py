"""Deployment paths: torch.export and torch.compile with a dynamic batch match eager; torch.jit.trace is refused."""

import pytest
import torch
from torch import nn

from mumoe_tn.layers import MuMoE, MuMoEMLP
from mumoe_tn.layers.mlp import MuMoEGatedMLP

BLOCKS = {
    "layer": lambda: MuMoE(12, 10, (3, 4), "tr", 4),
    "mlp": lambda: MuMoEMLP(12, 16, 12, 6, "cp", 8),
    "gated": lambda: MuMoEGatedMLP(12, 16, 12, 6, "tucker", (3, 4, 5), gate_norm="layer"),
}


def _model(block):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), BLOCKS[block]())
    model(torch.randn(64, 12))  # moves the BatchNorm gate's running statistics
    return model.eval()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_torch_jit_trace_is_refused_with_the_alternatives_named(block):
    model = _model(block)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace.*torch\.export\.export.*torch\.compile"):
        torch.jit.trace(model, torch.randn(4, 12))
    assert torch.isfinite(model(torch.randn(4, 12))).all()  # the refusal left the model usable


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_torch_export_with_a_dynamic_batch_matches_eager(block):
    model = _model(block)
    batch = torch.export.Dim("batch", min=2, max=1024)
    exported = torch.export.export(model, (torch.randn(8, 12),), dynamic_shapes={"input": {0: batch}})
    program = exported.module()
    for rows in (2, 5, 33):
        x = torch.randn(rows, 12)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x), rtol=1e-5, atol=1e-6)


def test_torch_compile_with_a_dynamic_batch_matches_eager():
    model = _model("mlp")
    compiled = torch.compile(model, dynamic=True, fullgraph=True)
    for rows in (3, 17, 40):
        x = torch.randn(rows, 12)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
