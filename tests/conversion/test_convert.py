"""MuMoEMLP, conversion of models, upcycling, dense decomposition, tltorch interop."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn import MuMoE, dense_forward, materialise
from mumoe_tn.conversion.convert import convert, decompose_dense, find_mlp_blocks, upcycle_linear
from mumoe_tn.conversion.fitting.interop import from_tltorch, to_tltorch
from mumoe_tn.costs import block_parameters, layer_parameters, linear, mlp
from mumoe_tn.decompositions import build, get_format
from mumoe_tn.layers import MuMoEMLP

DTYPE = torch.float64
NAMED = ("cp", "tr", "tt", "tucker")


def test_mumoe_mlp_equals_dense_reference():
    torch.manual_seed(0)
    block = MuMoEMLP(6, 10, 5, (4, 3), "tr", 3, dtype=DTYPE).eval()
    x = torch.randn(2, 7, 6, dtype=DTYPE)
    y = block(x)
    a = [c.reshape(14, -1) for c in block.last_coefficients]
    ones = torch.ones(14, 1, dtype=DTYPE)
    hidden = dense_forward(block.experts1.to_dense(), a, torch.cat([x.reshape(14, 6), ones], -1))
    expected = dense_forward(block.experts2.to_dense(), a, torch.cat([nn.functional.gelu(hidden), ones], -1))
    torch.testing.assert_close(y, expected.reshape(2, 7, 5))
    assert block.gate.expert_dims == (4, 3)  # one gate for both layers


@pytest.mark.parametrize("name", NAMED)
def test_rank_matching_in_layers(name):
    layer = MuMoE(48, 64, 16, name, match="linear")
    target = linear(48, 64).params
    count = layer_parameters(layer.network).total
    assert count == sum(p.numel() for p in layer.parameters())
    bigger = layer_parameters(layer.network.with_sizes(**dict.fromkeys(_scaled(layer.network), 10**4))).total
    assert abs(count - target) < bigger - target  # sanity: matching moved towards the target
    block = MuMoEMLP(32, 64, 32, 8, name, match="mlp")
    count = block_parameters(block.experts1.network, block.experts2.network).total
    assert count == sum(p.numel() for p in block.parameters())
    assert abs(count - mlp(32, 64, 32).params) / mlp(32, 64, 32).params < 0.1


def _scaled(network):
    return network.format.matched_bonds(network)


def test_layer_rank_errors():
    with pytest.raises(ValueError, match=r"rank must be ranks .* got the string 'best'"):
        MuMoE(8, 8, 4, "cp", "best")
    with pytest.raises(ValueError, match=r"match='linear' is not a target here; use 'mlp'"):
        MuMoEMLP(8, 16, 8, 4, "cp", match="linear")
    with pytest.raises(ValueError, match=r"match='mlp' is not a target here; use 'linear'"):
        MuMoE(4, 6, 3, "cp", match="mlp")
    assert MuMoE(8, 8, 4, "cp", 3, match="linear").network.sizes["r"] != 3  # match= rescales what rank= set
    with pytest.raises(ValueError, match=r"^MuMoE: rank must be ranks .* got the string 'linear'; use match='linear'"):
        MuMoE(8, 8, 4, "cp", "linear")
    for layer in (MuMoE, MuMoEMLP):
        with pytest.raises(TypeError, match=r"bias must be a bool, got 1"):
            layer(8, 16, 8, 4, "cp", 2, bias=1) if layer is MuMoEMLP else layer(8, 16, 4, "cp", 2, bias=1)


@given(st.sampled_from(NAMED), st.sampled_from([(5,), (3, 2), (2, 2, 2)]), st.booleans(), st.integers(0, 10**6))
def test_upcycled_layer_computes_the_linear(name, dims, bias, seed):
    torch.manual_seed(seed)
    original = nn.Linear(7, 6, bias=bias, dtype=DTYPE)
    layer, error = upcycle_linear(original, dims, name, gate_norm="layer")
    assert error < 1e-12
    x = torch.randn(4, 7, dtype=DTYPE)
    torch.testing.assert_close(layer(x), original(x))
    layer.gate.projections.n1.weight.data.normal_()  # whatever the coefficients
    torch.testing.assert_close(layer(x), original(x))


@pytest.mark.parametrize("name", NAMED)
def test_truncated_upcycling_reports_the_svd_error(name):
    torch.manual_seed(0)
    original = nn.Linear(12, 10, dtype=DTYPE)
    rank = 3 if name != "tr" else (4, 4, 3)
    _layer, error = upcycle_linear(original, 4, name, rank)
    matrix = torch.cat([original.weight.T, original.bias[None]]).detach()
    singular = torch.linalg.svdvals(matrix)
    expected = singular[3:].pow(2).sum().sqrt() / singular.pow(2).sum().sqrt()
    assert error == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize(
    ("name", "rank", "exact"),
    [
        ("cp", 3, True),
        ("tr", (1, 6, 8), True),
        ("tr", (2, 2, 3), False),
        ("tt", (2, 3), True),
        ("tucker", (2, 3, 3), True),
    ],
)
def test_decompose_dense_low_rank_tensors(name, rank, exact):
    torch.manual_seed(0)
    network = build(name, 6, 7, 8, rank)
    cores = {c: torch.randn(s, dtype=DTYPE) for c, s in network.core_shapes.items()}
    weight = materialise(network, cores).detach()
    experts, error = decompose_dense(weight, name, rank, n_iter_max=500)
    assert experts.network == network
    reconstructed = experts.to_dense().detach()
    assert (reconstructed - weight).norm() / weight.norm() == pytest.approx(error, abs=1e-9)
    if exact:  # the algorithm recovers a tensor of exactly that structure
        assert error < (1e-4 if name == "cp" else 1e-8)
    else:  # TR-SVD splits R1·R2 arbitrarily and is not exact for a ring of these ranks
        assert 0 < error < 1


def test_decompose_dense_errors():
    with pytest.raises(ValueError, match=r"at least one expert mode"):
        decompose_dense(torch.randn(4, 5), "cp", 2)
    with pytest.raises(ValueError, match=r"TR-SVD needs R1·R2 <= N1"):
        decompose_dense(torch.randn(3, 4, 5), "tr", (2, 2, 2))
    _experts, error = decompose_dense(torch.randn(3, 4, 5), "tr", (2, 2, 2), method="als")
    assert 0 <= error < 1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.0), nn.Linear(32, 16))

    def forward(self, x):
        return x + self.mlp(x + self.attn(x))


def test_convert_replaces_only_the_chosen_modules():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(16, 24))
    assert find_mlp_blocks(model) == ["0.mlp", "1.mlp"]
    attn = model[0].attn
    report = convert(model, expert_dims=8, mlps=r"mlp$", linears=lambda name, m: name == "2")
    assert isinstance(model[0].mlp, MuMoEMLP) and isinstance(model[1].mlp, MuMoEMLP)
    assert isinstance(model[2], MuMoE) and model[0].attn is attn
    assert [r.name for r in report.replacements] == ["0.mlp", "1.mlp", "2"]
    assert report.replacements[0].params_before == 16 * 32 + 32 + 32 * 16 + 16
    for r in report.replacements:  # matched to what they replace
        assert abs(r.params_after - r.params_before) / r.params_before < 0.15
    assert "| **total** |" in report.to_markdown()
    assert model(torch.randn(3, 4, 16)).shape == (3, 4, 24)


def test_convert_with_upcycling_keeps_the_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4)).double()
    x = torch.randn(5, 8, dtype=DTYPE)
    expected = model(x)
    report = convert(model, expert_dims=(4, 2), linears=r"^[02]$", decomposition="tr", rank=13, upcycle=True)
    assert all(r.upcycle_error < 1e-12 for r in report.replacements)
    torch.testing.assert_close(model(x), expected)


def test_attention_blocks_are_not_mlp_blocks():
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    assert find_mlp_blocks(nn.Sequential(layer)) == []
    report = convert(layer, expert_dims=4, linears=r"^linear[12]$")  # its two MLP linears, one by one
    assert [r.name for r in report.replacements] == ["linear1", "linear2"]
    assert layer(torch.randn(2, 3, 16)).shape == (2, 3, 16)


def test_convert_errors():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no module was selected"):
        convert(model, expert_dims=4, linears="nothing")
    with pytest.raises(TypeError, match=r"linears= must be a regex string or a callable"):
        convert(model, expert_dims=4, linears=3)


@pytest.mark.parametrize("name", ["cp", "tt", "tucker"])
def test_tltorch_round_trip(name):
    tl = pytest.importorskip("tensorly")
    rank = {"cp": 3, "tt": (2, 3, 2), "tucker": (2, 2, 3, 3)}[name]
    layer = MuMoE(6, 5, (3, 4), name, rank, dtype=DTYPE)
    before = tl.get_backend()
    factorized = to_tltorch(layer.experts)
    assert tl.get_backend() == before  # importing tltorch did not leave its global backend
    with tl.backend_context("pytorch"):
        torch.testing.assert_close(factorized.to_tensor(), layer.experts.to_dense())
    back = from_tltorch(factorized)
    torch.testing.assert_close(back.to_dense(), layer.experts.to_dense())


def test_tltorch_errors_and_new_tensors():
    tl = pytest.importorskip("tensorly")
    with pytest.raises(ValueError, match=r"'tr' network has no tensorly-torch counterpart"):
        to_tltorch(MuMoE(6, 5, 3, "tr", 3).experts)
    from mumoe_tn.decompositions.tensor_support import load_tltorch

    tltorch = load_tltorch()
    with tl.backend_context("pytorch"):
        cp_tensor = tltorch.FactorizedTensor.new((4, 3, 6, 5), rank=3, factorization="cp")
        cp_tensor.normal_()
        experts = from_tltorch(cp_tensor)
        torch.testing.assert_close(experts.to_dense(), cp_tensor.to_tensor().detach())
        with pytest.raises(ValueError, match=r"E >= 1"):
            from_tltorch(tltorch.FactorizedTensor.new((6, 5), rank=2, factorization="cp"))
    assert math.prod(experts.network.expert_dims) == 12


def _tensorly_reference(name, tensor, rank, **options):
    """The dense reconstruction of tensorly's own decomposition, called as the format documents it."""
    tl = pytest.importorskip("tensorly")
    with tl.backend_context("pytorch"):
        if name == "cp":  # parafac with random init
            return tl.cp_to_tensor(tl.decomposition.parafac(tensor, rank, init="random", **options))
        if name == "tucker":  # HOOI with random init
            return tl.tucker_to_tensor(tl.decomposition.tucker(tensor, rank=rank, init="random", **options))
        return tl.tr_to_tensor(tl.decomposition.tensor_ring_als(tensor, rank=[*rank, rank[0]], **options))


@pytest.mark.parametrize(
    ("name", "rank", "tensorly_rank", "extra"),
    [
        ("cp", 3, 3, {}),
        ("tucker", (2, 3, 4), [2, 3, 4], {}),
        ("tr", (2, 3, 4), [2, 3, 4], {"method": "als"}),
    ],
)
def test_iterative_decompositions_run_tensorly_with_the_documented_options(name, rank, tensorly_rank, extra):
    # a tensor of no low-rank structure: the result depends on the seed and the iteration count
    weight = torch.randn(5, 6, 7, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    defaults = decompose_dense(weight, name, rank, **extra)[0].to_dense().detach()
    expected = _tensorly_reference(name, weight, tensorly_rank, n_iter_max=100, random_state=0)
    torch.testing.assert_close(defaults, expected)
    chosen = decompose_dense(weight, name, rank, n_iter_max=3, random_state=5, **extra)[0].to_dense().detach()
    torch.testing.assert_close(chosen, _tensorly_reference(name, weight, tensorly_rank, n_iter_max=3, random_state=5))
    assert not torch.allclose(chosen, defaults)
    # the format's own defaults, for callers of Format.decompose (decompose_dense passes its own)
    network = build(name, 5, 6, 7, rank)
    values = get_format(name).decompose(weight, network, **extra)
    torch.testing.assert_close(materialise(network, dict(zip(network.cores, values, strict=True))), expected)


def test_tucker_ranks_above_a_mode_size_are_clipped_with_a_warning():
    # ranks (3, 3, 3) on modes of size (2, 3, 4): s_n1 cannot use more than 2
    network = build("tucker", 2, 3, 4, (3, 3, 3))
    cores = {
        c: torch.randn(s, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
        for c, s in network.core_shapes.items()
    }
    weight = materialise(network, cores).detach()
    with pytest.warns(UserWarning, match="were clipped: s_n1 3 → 2"):
        experts, error = decompose_dense(weight, "tucker", (3, 3, 3))
    assert experts.network == network.with_sizes(s_n1=2) and error < 1e-8
    torch.testing.assert_close(experts.to_dense().detach(), weight)


@pytest.mark.parametrize(
    ("rank", "options", "message"),
    [
        ((2, 3, 4), {"method": "hooi"}, r"^tr method must be 'svd' or 'als', got 'hooi'$"),
        (
            (2, 3, 4),
            {},
            r"^TR-SVD needs R1·R2 <= N1, got 2·3 > 5; lower the expert ranks or use method='als'$",
        ),
    ],
)
def test_tr_decomposition_messages(rank, options, message):
    with pytest.raises(ValueError, match=message):
        decompose_dense(torch.randn(5, 6, 7, dtype=DTYPE), "tr", rank, **options)


def test_cp_weights_of_a_tltorch_tensor_are_kept():
    tl = pytest.importorskip("tensorly")
    from mumoe_tn.decompositions.tensor_support import load_tltorch

    tltorch = load_tltorch()
    with tl.backend_context("pytorch"):
        cp_tensor = tltorch.FactorizedTensor.new((4, 3, 6, 5), rank=3, factorization="cp")
        cp_tensor.normal_()
        with torch.no_grad():
            cp_tensor.weights.copy_(torch.tensor([0.5, 2.0, 3.0]))
        torch.testing.assert_close(from_tltorch(cp_tensor).to_dense(), cp_tensor.to_tensor().detach())


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda fmt: fmt.network(2, 3, 4, 1), r"^format 'bare' must implement network\(\)$"),
        (lambda fmt: fmt.upcycle(None, {}, None, None), r"^format 'bare' has no closed-form upcycling$"),
        (lambda fmt: fmt.to_tltorch(None, {}), r"^format 'bare' has no tensorly-torch counterpart$"),
        (lambda fmt: fmt.from_tltorch(None), r"^format 'bare' has no tensorly-torch counterpart$"),
    ],
)
def test_a_format_without_its_methods_says_which_is_missing(call, message):
    from mumoe_tn.decompositions.format import Format

    class Bare(Format):  # not registered: no name given to the class statement
        pass

    bare = Bare()
    bare.name = "bare"
    with pytest.raises(NotImplementedError, match=message):
        call(bare)


@pytest.mark.parametrize(("name", "rank"), [("tr", (3, 4, 5, 6)), ("tt", (3, 4, 5))])
def test_expert_cores_pass_every_bond_index_through(name, rank):
    # an expert mode of 2 below bond sizes 3 and 4: every slice (r, ·, r') is the rectangular identity
    from mumoe_tn.decompositions._ring import pass_through_expert_cores

    network = build(name, (2, 2), 6, 7, rank)
    cores = {c: torch.randn(s, dtype=DTYPE) for c, s in network.core_shapes.items()}
    pass_through_expert_cores(network, cores)
    for leg in network.expert_legs:
        core = cores[f"G_{leg}"]
        if core.ndim == 2:  # the first core of a train: ones in column 0
            expected = torch.zeros_like(core)
            expected[:, 0] = 1
        else:
            expected = torch.eye(core.shape[0], core.shape[2], dtype=DTYPE)[:, None].expand_as(core)
        torch.testing.assert_close(core, expected, msg=f"core G_{leg} of shape {tuple(core.shape)}")


@pytest.mark.parametrize(("name", "rank"), [("cp", 6), ("tt", (2, 6)), ("tr", (2, 2, 6)), ("tucker", (2, 6, 6))])
def test_upcycling_into_more_components_than_the_linear_has_is_exact(name, rank):
    # Linear(3, 4) with bias: a 4 × 4 matrix, at most 4 singular components for 6 slots
    torch.manual_seed(0)
    original = nn.Linear(3, 4, dtype=DTYPE)
    layer, error = upcycle_linear(original, 2, name, rank, gate_norm="layer")
    assert error < 1e-12
    x = torch.randn(5, 3, dtype=DTYPE)
    torch.testing.assert_close(layer(x), original(x))


def test_mumoe_tn_convert_is_always_the_function():
    import sys

    import mumoe_tn
    import mumoe_tn.conversion.convert  # importing the submodule must not shadow the function
    from mumoe_tn import convert as top
    from mumoe_tn.conversion import convert as package

    module = sys.modules["mumoe_tn.conversion.convert"]
    assert callable(top) and top is package is mumoe_tn.convert is mumoe_tn.conversion.convert is module.convert
