"""Inference's fused first product: the gate's projection and the input layers' first cores in one matrix.

The references are independent of the fused path: the dense expert tensor, the gate written out
from its formula (projection, BatchNorm with the running statistics, the ``entmax`` package's
1.5-entmax), and the general path with gradients on.
"""

import string
import warnings

import pytest
import torch
from entmax import entmax15 as reference_entmax15
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import any_network
from torch.utils._python_dispatch import TorchDispatchMode

from mumoe_tn import Gate, MuMoE, MuMoEMLP, ReLUTopKGate, TopKGate
from mumoe_tn.layers.mlp import MuMoEGatedMLP

DTYPE = torch.float64


def _warm(layer, width):
    """Move the gate's BatchNorm statistics away from their start, then switch to eval."""
    layer.train()
    for _ in range(2):
        layer(torch.randn(16, width, dtype=DTYPE) * 2 + 0.5)
    return layer.eval()


def _reference_coefficients(layer, x):
    """``entmax15(BN_eval(x Gᵀ))`` per mode, from the formula (no cached or folded weights)."""
    coefficients = []
    for leg, projection in layer.gate.projections.items():
        norm = layer.gate.norms[leg]
        logits = x @ projection.weight.T
        if projection.bias is not None:
            logits = logits + projection.bias
        logits = (logits - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps)
        coefficients.append(reference_entmax15(logits, dim=-1))
    return coefficients


def _dense_output(layer, x, coefficients):
    """``y = W ×_1 a_1 … ×_E a_E ×_{E+1} [x; 1]`` with the materialised expert tensor."""
    dense = layer.experts.to_dense()
    n_modes = len(coefficients)
    modes = string.ascii_lowercase[:n_modes]
    z = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=-1) if layer.bias else x
    equation = ",".join(f"z{m}" for m in modes) + f",zx,{modes}xy->zy"
    return torch.einsum(equation, *coefficients, z, dense)


@settings(max_examples=40, deadline=None)
@given(network=any_network(max_modes=3), batch=st.sampled_from([1, 3, 40]), seed=st.integers(0, 2**16))
def test_fused_inference_equals_the_dense_tensor_and_the_gate_formula(network, batch, seed):
    torch.manual_seed(seed)
    width = network.in_features - 1
    if width < 1:
        return
    layer = _warm(MuMoE(width, network.out_features, decomposition=network, dtype=DTYPE), width)
    x = torch.randn(batch, width, dtype=DTYPE)
    with torch.no_grad():
        y = layer(x)
        expected = _reference_coefficients(layer, x)
        torch.testing.assert_close(y, _dense_output(layer, x, expected))
    for got, want in zip(layer.last_coefficients, expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("decomposition", ["cp", "tr", "tt", "tucker", "mxd", "n1 a b, a i c, b c o"])
@pytest.mark.parametrize("dims", [(6,), (2, 3)])
def test_the_input_is_multiplied_once_by_the_gate_and_the_experts_together(decomposition, dims):
    torch.manual_seed(0)
    rank = {"a": 3, "b": 2, "c": 4} if " " in decomposition else (None if decomposition == "mxd" else 3)
    if decomposition in ("mxd", "n1 a b, a i c, b c o") and len(dims) > 1:
        dims = dims[:1]
    layer = _warm(MuMoE(7, 5, dims, decomposition, rank, dtype=DTYPE), 7)
    x = torch.randn(4, 7, dtype=DTYPE)
    with torch.no_grad(), _ProductsOf(x) as products:
        y = layer(x)
    assert products.count == 1, f"x was multiplied {products.count} times"
    torch.testing.assert_close(y, layer(x.clone().requires_grad_(True)).detach())  # the general path


class _ProductsOf(TorchDispatchMode):
    """Counts the matrix products that read ``x`` (or a view of it)."""

    def __init__(self, x):
        super().__init__()
        self.storage = x.untyped_storage().data_ptr()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm"):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() == self.storage for t in tensors):
                self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("block", ["mlp", "gated"])
def test_blocks_fuse_every_layer_that_reads_the_input(block):
    torch.manual_seed(0)
    if block == "mlp":
        layer = MuMoEMLP(6, 8, 5, 4, "cp", 3, dtype=DTYPE)
    else:
        layer = MuMoEGatedMLP(6, 8, 5, 4, "tr", 2, dtype=DTYPE)
    _warm(layer, 6)
    x = torch.randn(3, 6, dtype=DTYPE)
    with torch.no_grad(), _ProductsOf(x) as products:
        y = layer(x)
    assert products.count == 1
    torch.testing.assert_close(y, layer(x.clone().requires_grad_(True)).detach())


def test_batch_norm_folding_equals_the_unfolded_norm_and_layer_norm_gates_are_normed_after():
    torch.manual_seed(0)
    x = torch.randn(5, 6, dtype=DTYPE)
    for gate_norm in ("batch", "layer", "none"):
        layer = _warm(MuMoE(6, 4, 5, "cp", 3, gate_norm=gate_norm, dtype=DTYPE), 6)
        with torch.no_grad():
            folded = layer(x)
        unfolded = layer(x.clone().requires_grad_(True)).detach()  # norm applied as a module
        torch.testing.assert_close(folded, unfolded)


CHANGES = {
    "gate projection": lambda layer: layer.gate.projections["n1"].weight.mul_(-1.5),
    "running statistics": lambda layer: layer.gate.norms["n1"].running_var.mul_(4.0),
    "input core": lambda layer: next(iter(layer.experts.parameters())).mul_(2.0),
    "new gate projection": lambda layer: layer.gate.projections.__setitem__(
        "n1", torch.nn.Linear(6, 5, bias=False, dtype=DTYPE)
    ),
    "norm switched to training": lambda layer: layer.gate.norms["n1"].train(),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_fused_matrix_follows_every_change_of_what_it_is_made_from(change):
    torch.manual_seed(0)
    layer = _warm(MuMoE(6, 4, 5, "tt", 3, dtype=DTYPE), 6)
    x = torch.randn(5, 6, dtype=DTYPE)
    with torch.no_grad():
        before = layer(x)
        CHANGES[change](layer)
        after = layer(x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, layer(x.clone().requires_grad_(True)).detach())


def test_inputs_of_other_shapes_batches_and_dtypes_each_get_checked_programs():
    torch.manual_seed(0)
    layer = _warm(MuMoE(6, 4, 5, "cp", 3, dtype=DTYPE), 6)
    with torch.no_grad():
        for shape in [(1, 6), (2, 3, 6), (300, 6), (6,)]:
            x = torch.randn(*shape, dtype=DTYPE)
            torch.testing.assert_close(layer(x), layer(x.clone().requires_grad_(True)).detach())
        with pytest.raises(TypeError, match="dtype"):
            layer(torch.randn(2, 6))
        with pytest.raises(ValueError, match=r"\(\.\.\., 6\)"):
            layer(torch.randn(2, 5, dtype=DTYPE))


@pytest.mark.parametrize("decomposition", ["cp", "tr", "tucker", "mxd"])
@pytest.mark.parametrize("gate_norm", ["batch", "layer"])
def test_training_gradients_pass_gradcheck_in_float64(decomposition, gate_norm):
    torch.manual_seed(0)
    rank = None if decomposition == "mxd" else 2
    layer = MuMoE(4, 3, 3, decomposition, rank, gate_norm=gate_norm, activation="softmax", dtype=DTYPE).train()
    names = [name for name, _ in layer.named_parameters()]
    x = torch.randn(5, 4, dtype=DTYPE, requires_grad=True)
    parameters = tuple(p.detach().clone().requires_grad_(True) for p in layer.parameters())

    def call(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values, strict=True)), (x,))

    assert torch.autograd.gradcheck(call, (x, *parameters))


def test_buckets_whose_cached_core_steps_overlap_each_get_all_their_steps():
    # The block's second layer at 64 rows caches one core-only product; at 1 row a larger
    # intermediate built on that same product: the second bucket must still compute its own chain.
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # matching reports how close it came
        block = MuMoEMLP(64, 256, 64, (4, 4), "cp", match="mlp", dtype=DTYPE)
    _warm(block, 64)
    for rows in (64, 1):
        x = torch.randn(rows, 64, dtype=DTYPE)
        with torch.no_grad():
            y = block(x)
        torch.testing.assert_close(y, block(x.clone().requires_grad_(True)).detach())


def test_a_hook_on_the_gate_sees_every_inference_call():
    layer = MuMoE(8, 6, 4, "cp", 3).eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        lean = layer(x)
    seen = []
    handle = layer.gate.register_forward_hook(lambda module, args, output: seen.append(output))
    with torch.no_grad():
        hooked = layer(x)
    handle.remove()
    assert len(seen) == 1, "the fused inference path skipped the gate's hook"
    torch.testing.assert_close(hooked, lean, rtol=1e-5, atol=1e-6)


SHIPPED_GATES = {
    "entmax15 batch-norm, losses": Gate(balance_loss=True, z_loss=True),
    "sparsemax layer-norm": Gate(activation="sparsemax", norm="layer"),
    "softmax, losses": Gate(activation="softmax", norm="none", balance_loss=True, z_loss=True),
    "1.3-entmax": Gate(activation=1.3),
    "top-k batch-norm, losses": TopKGate(k=(2, 1), norm="batch", balance_loss=True),
    "relu top-k layer-norm": ReLUTopKGate(k=(1, 2), bias=False, norm="layer"),
}


@pytest.mark.parametrize("gate", list(SHIPPED_GATES))
@pytest.mark.parametrize("block", ["moe", "gated"])
def test_the_fused_call_records_what_the_general_call_records(gate, block):
    torch.manual_seed(0)
    spec = SHIPPED_GATES[gate]
    if block == "moe":
        layer = MuMoE(6, 4, (3, 2), "cp", 3, gate=spec, dtype=torch.float32)
    else:
        layer = MuMoEGatedMLP(6, 8, 5, (3, 2), "tucker", 2, gate=spec, dtype=torch.float32)
    layer(torch.randn(16, 6) * 2 + 0.5)  # running statistics away from their start
    layer.eval()
    x = torch.randn(2, 3, 6)
    general = layer(x.clone().requires_grad_(True)).detach()
    expected = layer.last_coefficients, layer.last_token_mask, dict(layer.gate_losses())
    with torch.no_grad():
        layer(torch.randn(2, 3, 6))  # the entry, and other records
        with _ProductsOf(x) as products:
            fused = layer(x)
    assert products.count == 1, f"x was multiplied {products.count} times: the call was not fused"
    torch.testing.assert_close(fused, general, rtol=1e-5, atol=1e-6)
    coefficients, token_mask, losses = layer.last_coefficients, layer.last_token_mask, layer.gate_losses()
    assert token_mask is None and expected[1] is None
    assert len(coefficients) == len(expected[0]) == 2
    for got, want in zip(coefficients, expected[0], strict=True):
        assert got.shape == want.shape == (2, 3, want.shape[-1]) and got.dtype == want.dtype
        assert not got.requires_grad
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert set(losses) == set(expected[2])
    for name, loss in losses.items():
        torch.testing.assert_close(loss, expected[2][name].detach(), rtol=1e-5, atol=1e-6)
