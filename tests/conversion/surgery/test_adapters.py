"""Layer adapters, MLP-block recognition, the gated μMoE block, and conversion edge cases."""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn import dense_forward
from mumoe_tn.conversion.convert import convert, find_mlp_blocks
from mumoe_tn.conversion.surgery.adapters import LayerAdapter, adapter_for, linear_view, register_adapter
from mumoe_tn.conversion.surgery.blocks import GATED_LAYOUTS, GatedNames, mlp_parts, register_gated_names
from mumoe_tn.costs import linear
from mumoe_tn.layers import MuMoE, MuMoEMLP
from mumoe_tn.layers.mlp import MuMoEGatedMLP, gated_mlp_parameters

DTYPE = torch.float64
NAMED = ("cp", "tr", "tt", "tucker")


class Transposed(nn.Module):
    """A linear layer storing its weight (in, out) under other names: ``x @ kernel + offset``."""

    def __init__(self, n_in, n_out, bias=True):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(n_in, n_out, dtype=DTYPE) / n_in**0.5)
        self.offset = nn.Parameter(torch.randn(n_out, dtype=DTYPE)) if bias else None

    def forward(self, x):
        y = x @ self.kernel
        return y if self.offset is None else y + self.offset


register_adapter(Transposed, LayerAdapter(layout="in_out", weight="kernel", bias="offset"))


class GatedBlock(nn.Module):
    """Llama's MLP as its documentation writes it: down(act(gate(x)) * up(x))."""

    def __init__(self, n_in, hidden, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(n_in, hidden, bias=bias, dtype=DTYPE)
        self.up_proj = nn.Linear(n_in, hidden, bias=bias, dtype=DTYPE)
        self.down_proj = nn.Linear(hidden, n_in, bias=bias, dtype=DTYPE)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PackedBlock(nn.Module):
    """Phi-3's MLP: one projection holds [gate; up], then up * act(gate)."""

    def __init__(self, n_in, hidden):
        super().__init__()
        self.gate_up_proj = nn.Linear(n_in, 2 * hidden, dtype=DTYPE)
        self.down_proj = nn.Linear(hidden, n_in, dtype=DTYPE)
        self.activation_fn = nn.GELU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


def _randomize_gates(model):
    for module in model.modules():
        if isinstance(module, (MuMoE, MuMoEMLP, MuMoEGatedMLP)):
            for projection in module.gate.projections.values():
                projection.weight.data.normal_(0, 3)


# ----------------------------------------------------------------------------- adapters
@given(st.integers(1, 6), st.integers(1, 6), st.booleans(), st.integers(0, 10**6))
def test_adapter_reads_a_transposed_layer_as_the_linear_it_computes(n_in, n_out, bias, seed):
    torch.manual_seed(seed)
    layer = Transposed(n_in, n_out, bias)
    view = linear_view(layer)
    assert (view.in_features, view.out_features) == (n_in, n_out)
    x = torch.randn(3, n_in, dtype=DTYPE)
    ones = torch.ones(3, 1, dtype=DTYPE)
    # the matrix [Wᵀ; b] applied to [x; 1] is what the layer computes
    z = torch.cat([x, ones], -1) if bias else x
    torch.testing.assert_close(z @ view.matrix(), layer(x))
    torch.testing.assert_close(torch.cat([x, ones], -1) @ view.matrix(bias_row=True), layer(x))


def test_adapter_lookup_and_errors():
    assert adapter_for(nn.Linear(2, 3)).layout == "out_in"
    assert adapter_for(nn.modules.linear.NonDynamicallyQuantizableLinear(2, 3)) is adapter_for(nn.Linear(2, 3))
    assert adapter_for(nn.Conv2d(2, 3, 1)) is None and linear_view(nn.ReLU()) is None
    with pytest.raises(ValueError, match=r"layout must be one of .* got 'io'"):
        LayerAdapter(layout="io")
    with pytest.raises(TypeError, match=r"weight must be an attribute name or a function"):
        LayerAdapter(weight=3)
    with pytest.raises(TypeError, match=r"adapter must be a LayerAdapter"):
        register_adapter(nn.Linear, "out_in")
    with pytest.raises(TypeError, match=r"layer_type must be an nn.Module subclass"):
        register_adapter(int, LayerAdapter())

    class Bad(nn.Module):
        weight = None

    register_adapter(Bad, LayerAdapter())
    with pytest.raises(ValueError, match=r"the adapter for Bad reads a 2-D weight, got NoneType"):
        linear_view(Bad())


@pytest.mark.parametrize("name", NAMED)
def test_convert_upcycles_a_registered_layer_type(name):
    torch.manual_seed(0)
    model = nn.Sequential(Transposed(5, 7), nn.Tanh(), Transposed(7, 3, bias=False)).eval()
    x = torch.randn(4, 5, dtype=DTYPE)
    expected = model(x)
    report = convert(model, expert_dims=(3, 2), linears=r"^[02]$", decomposition=name, rank=8, upcycle=True)
    assert [r.kind for r in report.replacements] == ["linear", "linear"]
    assert max(r.upcycle_error for r in report.replacements) < 1e-12
    _randomize_gates(model)
    torch.testing.assert_close(model(x), expected)


# ----------------------------------------------------------------------------- recognition
def test_recognised_block_shapes():
    plain = nn.Sequential(Transposed(4, 8), nn.ReLU(), nn.Dropout(0.1), Transposed(8, 4))
    parts = mlp_parts(plain)
    assert parts.kind == "mlp" and isinstance(parts.activation, nn.ReLU)
    gated = mlp_parts(GatedBlock(4, 6))
    assert gated.kind == "gated" and gated.gate.module is not gated.up.module
    packed = PackedBlock(4, 6)
    parts = mlp_parts(packed)
    assert parts.kind == "gated"
    torch.testing.assert_close(parts.gate.weight, packed.gate_up_proj.weight[:6])  # the gate is the first half
    torch.testing.assert_close(parts.up.bias, packed.gate_up_proj.bias[6:])
    with_norm = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 4))
    assert mlp_parts(with_norm) is None  # replacing it would drop the LayerNorm
    assert mlp_parts(nn.Sequential(nn.Linear(4, 8), nn.Linear(7, 4))) is None  # sizes do not chain
    model = nn.Sequential(plain, GatedBlock(4, 6), packed, with_norm)
    assert find_mlp_blocks(model) == ["0", "1", "2"]


def test_registered_gated_names():
    class Mixtral(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3, self.w2 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)
            self.act = nn.SiLU()

    assert mlp_parts(Mixtral()) is None  # three linears, names unknown
    register_gated_names(GatedNames("w1", "w3", "w2", "act"))
    try:
        assert mlp_parts(Mixtral()).kind == "gated"
    finally:
        GATED_LAYOUTS.unregister(GatedNames("w1", "w3", "w2", "act"))
    assert mlp_parts(Mixtral()) is None
    with pytest.raises(TypeError, match=r"names must be a GatedNames"):
        register_gated_names(("w1", "w3", "w2", "act"))


# ----------------------------------------------------------------------------- gated block
def test_gated_block_equals_dense_reference():
    torch.manual_seed(0)
    block = MuMoEGatedMLP(5, 7, 4, (3, 2), "tr", 3, dtype=DTYPE, hidden_activation=nn.GELU()).eval()
    x = torch.randn(2, 6, 5, dtype=DTYPE)
    y = block(x)
    a = [c.reshape(12, -1) for c in block.last_coefficients]
    ones = torch.ones(12, 1, dtype=DTYPE)
    z = torch.cat([x.reshape(12, 5), ones], -1)
    gate = dense_forward(block.gate_proj.to_dense(), a, z)
    up = dense_forward(block.up_proj.to_dense(), a, z)
    expected = dense_forward(block.down_proj.to_dense(), a, torch.cat([nn.functional.gelu(gate) * up, ones], -1))
    torch.testing.assert_close(y, expected.reshape(2, 6, 4))
    assert [c.shape for c in block.last_coefficients] == [(2, 6, 3), (2, 6, 2)]  # one gate, shared
    cores = {name: core.detach().clone() for name, core in block.up_proj.cores.items()}
    block.reset_parameters()
    assert any(not torch.equal(core, block.up_proj.cores[name]) for name, core in cores.items())


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("bias", [True, False])
def test_gated_block_matching(name, bias):
    block = MuMoEGatedMLP(24, 64, 24, (4, 4), name, match="mlp", bias=bias)
    count = sum(p.numel() for p in block.parameters())
    networks = [block.gate_proj.network, block.up_proj.network, block.down_proj.network]
    assert gated_mlp_parameters(*networks, bias=bias) == count
    # independent target: three Linear layers, counted by hand
    target = 2 * (24 * 64 + 64 * bias) + 64 * 24 + 24 * bias
    assert target == 2 * linear(24, 64, bias=bias).params + linear(64, 24, bias=bias).params
    # the matched rank (the scaled bond is the last one) beats its neighbours
    rank = block.gate_proj.network.sizes[block.gate_proj.network.bonds[-1]]
    for other in (rank - 1, rank + 1):
        neighbour = MuMoEGatedMLP(24, 64, 24, (4, 4), name, other, bias=bias)
        assert abs(count - target) <= abs(sum(p.numel() for p in neighbour.parameters()) - target)


@given(st.sampled_from(NAMED), st.sampled_from([(3,), (2, 2)]), st.booleans(), st.integers(0, 10**6))
def test_upcycled_gated_block_computes_the_original(name, dims, bias, seed):
    torch.manual_seed(seed)
    original = GatedBlock(5, 6, bias=bias).eval()
    model = nn.Sequential(copy.deepcopy(original))
    report = convert(model, expert_dims=dims, mlps=".", decomposition=name, rank=7, upcycle=True, gate_norm="layer")
    assert report.replacements[0].kind == "gated" and report.replacements[0].upcycle_error < 1e-12
    assert isinstance(model[0], MuMoEGatedMLP) and isinstance(model[0].hidden_activation, nn.SiLU)
    x = torch.randn(3, 4, 5, dtype=DTYPE)
    _randomize_gates(model)
    torch.testing.assert_close(model(x), original(x))


def test_upcycled_packed_block_computes_the_original():
    torch.manual_seed(0)
    original = PackedBlock(5, 6).eval()
    model = nn.Sequential(copy.deepcopy(original))
    convert(model, expert_dims=4, mlps=".", rank=7, upcycle=True)
    x = torch.randn(3, 5, dtype=DTYPE)
    _randomize_gates(model)
    torch.testing.assert_close(model(x), original(x))


def test_gated_block_errors():
    with pytest.raises(ValueError, match=r"match='linear' is not a target here; use 'mlp'"):
        MuMoEGatedMLP(4, 8, 4, 2, "cp", match="linear")
    with pytest.raises(TypeError, match=r"bias must be a bool, got 1"):
        MuMoEGatedMLP(4, 8, 4, 2, "cp", 2, bias=1)
    with pytest.raises(TypeError, match=r"hidden_activation must be an nn.Module"):
        MuMoEGatedMLP(4, 8, 4, 2, "cp", 2, hidden_activation=torch.relu)
    with pytest.raises(ValueError, match=r"input must have shape \(\.\.\., 4\), got \(2, 5\)"):
        MuMoEGatedMLP(4, 8, 4, 2, "cp", 2)(torch.randn(2, 5))


# ----------------------------------------------------------------------------- convert
def test_upcycle_is_honoured_for_mlp_blocks():
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6)).double().eval()
    model = nn.Sequential(copy.deepcopy(original))
    report = convert(model, expert_dims=(3, 3), mlps=".", decomposition="tt", rank=7, upcycle=True)
    assert report.replacements[0].kind == "mlp" and report.replacements[0].upcycle_error < 1e-12
    x = torch.randn(5, 6, dtype=DTYPE)
    _randomize_gates(model)
    torch.testing.assert_close(model(x), original(x))
    # a rank too small for the matrices: the error is the best rank-2 fit of the worse layer
    model = nn.Sequential(copy.deepcopy(original))
    error = convert(model, expert_dims=3, mlps=".", rank=2, upcycle=True).replacements[0].upcycle_error
    fits = []
    for layer in (original[0], original[2]):
        s = torch.linalg.svdvals(torch.cat([layer.weight.T, layer.bias[None]]).detach())
        fits.append((s[2:].pow(2).sum() / s.pow(2).sum()).sqrt().item())
    assert error == pytest.approx(max(fits), rel=1e-6)


def test_invalid_regex_names_the_pattern():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"mlps= is not a valid regular expression: '\(mlp'"):
        convert(model, expert_dims=2, mlps="(mlp")
    with pytest.raises(ValueError, match=r"linears= is not a valid regular expression: '\[0'"):
        convert(model, expert_dims=2, linears="[0")


def test_frozen_layers_stay_frozen_and_modes_are_kept():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3), nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3)))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    model[1].eval()
    convert(model, expert_dims=2, linears=r"^[01]$", mlps=r"^2$", rank=2)
    assert not any(p.requires_grad for p in model[0].parameters())
    assert not any(p.requires_grad for p in model[2].parameters())
    assert all(p.requires_grad for p in model[1].parameters())
    assert model[0].training and not model[1].training and model[2].training


def test_a_shared_module_is_replaced_at_every_path():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = convert(model, expert_dims=2, linears=r"^0$")
    assert isinstance(model[0], MuMoE) and model[2] is model[0]
    assert [(r.name, r.aliases) for r in report.replacements] == [("0", ("2",))]
    assert "| 0 (= 2) | linear |" in report.to_markdown()
    block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    model = nn.ModuleDict({"a": block, "b": block})
    convert(model, expert_dims=2, mlps=".")
    assert isinstance(model["a"], MuMoEMLP) and model["b"] is model["a"]


def test_meta_models_convert_and_refuse_upcycling():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    report = convert(copy.deepcopy(model), expert_dims=(2, 2), linears=".", rank=2)
    assert report.params_after > 0
    converted = nn.Sequential(copy.deepcopy(model))
    convert(converted, expert_dims=2, mlps=".", rank=2)
    assert all(p.is_meta for p in converted.parameters())
    with pytest.raises(ValueError, match=r"cannot upcycle '0': its weights are on the meta device"):
        convert(model, expert_dims=2, linears=".", upcycle=True)


def test_non_finite_weights_are_refused_before_any_change():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight.data[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"cannot upcycle '1': its weights contain NaN or inf"):
        convert(model, expert_dims=2, linears=".", upcycle=True)
    assert isinstance(model[0], nn.Linear)  # nothing replaced: the conversion failed as a whole
    model[1].weight.data[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"NaN or inf"):
        convert(model, expert_dims=2, linears="1", upcycle=True)
    with pytest.raises(ValueError, match=r"cannot convert '0': target of \d+ parameters is below"):
        convert(nn.Sequential(nn.Linear(2, 2)), expert_dims=2, linears=".")  # too small to match
    quantized = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    quantized[0][2].weight = nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)
    with pytest.raises(TypeError, match=r"cannot convert '0': its down layer's weight has dtype torch.int8"):
        convert(quantized, expert_dims=2, mlps=".", rank=2)
    with pytest.raises(ValueError, match=r"no module was selected.*wrap it, e.g. nn.Sequential\(model\)"):
        convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), expert_dims=2, mlps=".")
    with pytest.raises(TypeError, match=r"upcycle must be a bool, got 1"):
        convert(model, expert_dims=2, linears="0", upcycle=1)
