"""Every analysis tool works on every block type: MuMoE, MuMoEMLP and MuMoEGatedMLP."""

import pytest
import torch
from torch import nn

from mumoe_tn.analysis import (
    ablate,
    blind_threshold,
    class_polysemanticity,
    collect_coefficients,
    mean_coefficients,
    mumoe_layers,
    rewrite,
    steer,
)
from mumoe_tn.contractions import expert_matrix
from mumoe_tn.layers import MuMoE, MuMoEGatedMLP, MuMoEMLP

BLOCKS = {
    "layer": lambda: MuMoE(6, 6, 4, "cp", 3, gate_norm="layer"),
    "mlp": lambda: MuMoEMLP(6, 12, 6, 4, "cp", 3, gate_norm="layer"),
    "gated": lambda: MuMoEGatedMLP(6, 12, 6, 4, "cp", 3, gate_norm="layer"),
}


def _model(kind):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), BLOCKS[kind](), nn.Linear(6, 3)).eval()


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_every_analysis_tool_accepts_every_block(kind):
    model = _model(kind)
    block = model[1]
    x = torch.randn(20, 5)
    assert mumoe_layers(model) == {"1": block}

    stats = collect_coefficients(model, [x], centres=True)["1"].modes[0]
    assert stats.rows == 20 and stats.centres().shape == (4, 6)

    with torch.no_grad():
        before = model(x)
        with ablate(block, [0, 1, 2, 3]):  # every expert off: the block outputs zeros
            assert torch.allclose(block(torch.randn(3, 6)), torch.zeros(3, 6), atol=1e-6)
        assert torch.equal(model(x), before)  # restored

    labels = before.argmax(-1)
    result = class_polysemanticity(model, block, x, labels, n_classes=3)
    assert result.ablated.shape == (4, 3)

    handle = steer(block, stats.centres()[0], strength=2.0)
    with torch.no_grad():
        steered = model(x)
    handle.remove()
    assert not torch.allclose(steered, before)

    mean = mean_coefficients(model, block, [x])
    assert mean.shape == (4,) and torch.isclose(mean.sum(), torch.tensor(1.0, dtype=mean.dtype))
    for handle in (rewrite(block, 0, mean, 4.0), blind_threshold(block, 0)):
        with torch.no_grad():
            assert torch.isfinite(model(x)).all()
        handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_ablating_an_expert_of_a_gated_block_equals_zeroing_its_weights():
    block = BLOCKS["gated"]().eval()
    z = torch.randn(5, 6)
    with torch.no_grad():
        with ablate(block, [2]):
            ablated = block(z)
        for experts in (block.gate_proj, block.up_proj, block.down_proj):
            assert expert_matrix(experts.network, experts.cores, 2).abs().sum() > 0
        coefficients = block.gate(z)
        (a,) = coefficients
        a = a.clone()
        a[:, 2] = 0
        expected = block._contract(
            block.down_proj,
            block.hidden_activation(block._contract(block.gate_proj, z, (a,)))
            * block._contract(block.up_proj, z, (a,)),
            (a,),
        )
    torch.testing.assert_close(ablated, expected)


def test_polysemanticity_prints_a_summary_not_its_tensors():
    model = _model("mlp")
    x = torch.randn(20, 5)
    with torch.no_grad():
        labels = model(x).argmax(-1)
    result = class_polysemanticity(model, model[1], x, labels, n_classes=3)
    text = repr(result)
    assert text.startswith("Polysemanticity(experts=4, classes=3, changed=") and "tensor" not in text
    assert len(text) < 120
