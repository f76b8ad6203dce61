"""Every float dtype a user casts a layer to runs forward, backward and inference; gates stay in float32.

The reference for a layer in dtype ``d`` is the same layer cast back to float64: same (rounded)
weights, same running statistics, the input rounded to ``d`` first. The gate computes in float32
(or wider) whatever the weights are, so the coefficients of the two must agree to float32
rounding; the outputs differ only by the contraction's arithmetic in ``d``.
"""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mumoe_tn.gates.specs import Gate, TopKGate
from mumoe_tn.layers import MuMoE, MuMoEMLP
from mumoe_tn.layers.mlp import MuMoEGatedMLP

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]

#: Largest relative error of a layer's output in each dtype against its float64 copy.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}

GATES = {
    "entmax15-batch": Gate("entmax15", "batch"),
    "sparsemax-layer": Gate("sparsemax", "layer"),
    "alpha1.3-none": Gate(1.3, "none"),
    "softmax-batch": Gate("softmax", "batch"),
    "top2-layer": TopKGate(k=2, norm="layer"),
}
DECOMPOSITIONS = {
    "cp": ("cp", 6),
    "tr": ("tr", (2, 2, 3)),
    "tt": ("tt", (3, 2)),
    "tucker": ("tucker", (3, 4, 5)),
    "custom": ("A: n1 a b, B: a i c, C: b c o", {"a": 2, "b": 3, "c": 4}),
}
BLOCKS = ("layer", "mlp", "gated")


def _build(block, decomposition, gate, **factory):
    kind, rank = DECOMPOSITIONS[decomposition]
    options = {"gate": GATES[gate], **factory}
    if block == "layer":
        return MuMoE(12, 10, 5, kind, rank, **options)
    cls = MuMoEMLP if block == "mlp" else MuMoEGatedMLP
    return cls(12, 16, 12, 5, kind, rank, **options)


def _cast(module, dtype, how):
    if how == "to":
        return module.to(dtype)
    return {torch.float16: module.half, torch.bfloat16: module.bfloat16, torch.float64: module.double}.get(
        dtype, module.float
    )()


def _check_against_float64(layer, dtype, device, generator):
    """Forward (train and eval), backward and no-grad inference of ``layer`` in ``dtype``."""
    reference = copy.deepcopy(layer).double()
    x = torch.randn(7, 3, 12, generator=generator).to(device=device, dtype=dtype)
    x64 = x.double()
    tolerance = TOLERANCE[dtype]
    for train in (True, False):
        layer.train(train)
        reference.train(train)
        x.requires_grad_(train)
        y, y64 = layer(x), reference(x64)
        assert y.dtype == dtype and y.shape == (7, 3, layer.out_features)
        for a, a64 in zip(layer.last_coefficients, reference.last_coefficients, strict=True):
            assert a.dtype in (torch.float32, torch.float64)  # the gate's compute dtype, not the weights'
            torch.testing.assert_close(a.double(), a64, rtol=0, atol=1e-5)
        error = (y.double() - y64).norm() / y64.norm()
        assert error <= tolerance, f"{dtype}: relative error {error:.2e} > {tolerance:.0e}"
        if train:
            y.float().square().mean().backward()
            grads = [p.grad for p in layer.parameters() if p.requires_grad]
            assert grads and all(g is not None and g.dtype == dtype and torch.isfinite(g).all() for g in grads)
            assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    layer.eval()
    with torch.no_grad():
        y = layer(x.detach())
    with torch.inference_mode():
        y_inference = layer(x.detach())
    assert torch.equal(y, y_inference) and torch.isfinite(y).all()


@pytest.mark.parametrize("device", DEVICES)
@given(
    block=st.sampled_from(BLOCKS),
    decomposition=st.sampled_from(sorted(DECOMPOSITIONS)),
    gate=st.sampled_from(sorted(GATES)),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
    how=st.sampled_from(["to", "method", "construct"]),
    seed=st.integers(0, 2**16),
)
def test_every_block_format_gate_and_dtype_runs_and_matches_float64(
    device, block, decomposition, gate, dtype, how, seed
):
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if how == "construct":
        layer = _build(block, decomposition, gate, dtype=dtype, device=device)
    else:
        layer = _cast(_build(block, decomposition, gate, device=device), dtype, how)
    assert all(p.dtype == dtype for p in layer.parameters())
    _check_against_float64(layer, dtype, device, generator)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batch_norm_statistics_stay_float32_through_casts_and_checkpoints(dtype):
    torch.manual_seed(0)
    layer = MuMoE(12, 10, (3, 4), "cp", 6)
    layer(torch.randn(32, 12))  # running statistics move away from their start
    stats = {k: v.clone() for k, v in layer.state_dict().items() if "running" in k}
    half = copy.deepcopy(layer).to(dtype)
    for key, value in half.state_dict().items():
        if "running" in key:
            assert value.dtype == torch.float32 and torch.equal(value, stats[key]), key
    assert half.gate.projections.n1.weight.dtype == dtype
    rebuilt = MuMoE(12, 10, (3, 4), "cp", 6, dtype=dtype)
    rebuilt.load_state_dict(half.state_dict())
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in stats.items())
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(torch.ones(2, 12, dtype=dtype)), half.eval()(torch.ones(2, 12, dtype=dtype)))


def test_a_layer_built_under_a_half_precision_default_dtype_runs():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what loaders such as transformers do for dtype=bfloat16
    try:
        layer = MuMoEMLP(12, 16, 12, 4, "cp", 4)
    finally:
        torch.set_default_dtype(previous)
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    y = layer(torch.randn(5, 12, dtype=torch.bfloat16))
    assert torch.isfinite(y).all()
