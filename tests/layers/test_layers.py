"""FactorizedExperts and MuMoE: dense equivalence, gradients, PyTorch conventions, errors."""

import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import any_network, named_networks

from mumoe_tn import ExpertNetwork, FactorizedExperts, MuMoE, MuMoEMLP, dense_forward
from mumoe_tn.decompositions import tr

DTYPE = torch.float64


def reference_output(layer, x):
    """The layer's output recomputed from its materialised W and its last coefficients."""
    z = layer.input_norm(x)
    if layer.bias:
        z = torch.cat([z, torch.ones(*z.shape[:-1], 1, dtype=z.dtype)], dim=-1)
    z = z.reshape(-1, z.shape[-1])
    a = [c.reshape(-1, c.shape[-1]) for c in layer.last_coefficients]
    return dense_forward(layer.experts.to_dense(), a, z).reshape(*x.shape[:-1], layer.out_features)


@given(
    named_networks(),
    st.sampled_from([(), (3,), (2, 3)]),
    st.booleans(),
    st.sampled_from(["batch", "layer", "none"]),
)
def test_mumoe_equals_dense_reference(network, lead, bias, gate_norm):
    in_features = network.in_features
    layer = MuMoE(
        in_features,
        network.out_features,
        network.expert_dims,
        network.name,
        rank=network.format.ranks_of(network),
        bias=bias,
        gate_norm=gate_norm,
        input_norm=True,
        dtype=DTYPE,
    ).eval()
    x = torch.randn(*lead, in_features, dtype=DTYPE)
    y = layer(x)
    assert y.shape == (*lead, network.out_features)
    torch.testing.assert_close(y, reference_output(layer, x))


@given(any_network(max_modes=3))
def test_custom_network_in_layer_and_state_dict(network):
    network = network.with_sizes(i=network.in_features + 1)  # leave room for the folded bias
    layer = MuMoE(network.in_features - 1, network.out_features, decomposition=network, dtype=DTYPE).eval()
    x = torch.randn(4, network.in_features - 1, dtype=DTYPE)
    torch.testing.assert_close(layer(x), reference_output(layer, x))
    assert sum(p.numel() for p in layer.experts.parameters()) == network.n_params
    assert {k.removeprefix("experts.") for k in layer.state_dict() if k.startswith("experts.")} == set(network.cores)


def test_spec_string_and_builder_decompositions():
    spec = MuMoE(10, 12, 6, "A: n1 a b, B: a i c, C: b c o", {"a": 2, "b": 3, "c": 4})
    assert list(spec.network.cores) == ["A", "B", "C"] and spec.network.in_features == 11
    built = MuMoE(10, 12, (3, 2), tr, 5, expert_rank=2)
    assert [built.network.sizes[b] for b in built.network.bonds] == [2, 2, 2, 5]
    assert MuMoE(10, 12, 6, "TR", 5).network.name == "tr"


def test_gradcheck_factorized_experts():
    experts = FactorizedExperts(tr((3, 2), 4, 5, (2, 3, 2, 3)), dtype=DTYPE)
    z = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
    a = [torch.rand(3, n, dtype=DTYPE, requires_grad=True) for n in (3, 2)]
    cores = list(experts.cores.values())

    def fn(z, a1, a2, *core_values):
        params = dict(zip(experts.network.cores, core_values, strict=True))
        return torch.func.functional_call(experts, params, (z, [a1, a2]))

    inputs = (z, *a, *(c.detach().clone().requires_grad_(True) for c in cores))
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("decomposition", ["cp", "tr", "tucker"])
def test_gradcheck_mumoe(decomposition):
    torch.manual_seed(0)
    layer = MuMoE(5, 4, (3, 2), decomposition, 2, dtype=DTYPE, activation="softmax")
    x = torch.randn(6, 5, dtype=DTYPE, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))


def test_state_dict_round_trip_weights_only(tmp_path):
    layer = MuMoE(8, 6, (4, 3), "tr", 4)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    clone = MuMoE(8, 6, (4, 3), "tr", 4)
    clone.load_state_dict(torch.load(buffer, weights_only=True))
    x = torch.randn(5, 8)
    torch.testing.assert_close(clone.eval()(x), layer.eval()(x))
    assert {"experts.G_n1", "experts.G_i", "experts.G_o", "gate.projections.n2.weight"} <= set(layer.state_dict())


def test_plan_cache_is_bounded_and_reused():
    experts = FactorizedExperts(tr(4, 3, 2, 2), max_plans=3)
    for batch in (1, 2, 3, 4, 5, 9, 17, 33):
        experts(torch.randn(batch, 3), [torch.rand(batch, 4)])
        assert len(experts._plans) <= 3
    assert experts.plan(33) is experts.plan(40)  # same power-of-two bucket, same plan


def test_expert_matrix_method():
    layer = MuMoE(6, 5, (3, 4), "cp", 3, dtype=DTYPE)
    torch.testing.assert_close(layer.experts.expert((2, 1)), layer.experts.to_dense()[2, 1])


def test_factory_kwargs_and_repr():
    layer = MuMoE(6, 5, 4, "tt", 3, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    assert "'tt'" in repr(layer) and "experts=4" in repr(layer)


def test_autocast_bf16_close_to_fp32():
    torch.manual_seed(0)
    layer = MuMoE(32, 16, 64, "tr", 8).eval()
    x = torch.randn(64, 32)
    reference = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert layer.last_coefficients[0].dtype == torch.float32
    assert (y.float() - reference).abs().max() <= 0.05 * reference.abs().max()


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    layer = MuMoE(16, 8, (4, 4), "tr", 4)
    x = torch.randn(8, 16)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    torch.manual_seed(0)
    layer = MuMoE(16, 8, (4, 4), "cp", 4).eval()
    x = torch.randn(8, 16)
    expected = layer(x)
    y = layer.cuda()(x.cuda())
    torch.testing.assert_close(y.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decomposition", ["cp", "tr", "tucker"])
@pytest.mark.parametrize("activation", ["entmax15", "sparsemax"])
def test_cuda_training_step_never_waits_for_the_device(decomposition, activation):
    # A host read of a device value (item, nonzero, any) stalls the queue of kernels: none may occur.
    layer = MuMoEMLP(32, 64, 32, (4, 4), decomposition, match="mlp", activation=activation).cuda()
    x = torch.randn(2, 8, 32, device="cuda", requires_grad=True)
    layer(x).sum().backward()  # the first call plans the contraction
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).sum().backward()
        with torch.no_grad():
            layer.eval()(x[:1, :1])
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------- errors
@pytest.fixture
def experts():
    return FactorizedExperts(tr((3, 2), 4, 5, 2))


def test_wrong_input_width(experts):
    with pytest.raises(ValueError, match=r"input must have shape \(\.\.\., 4\) \(leg 'i' of 'tr'\), got \(2, 5\)"):
        experts(torch.randn(2, 5), [torch.rand(2, 3), torch.rand(2, 2)])
    with pytest.raises(ValueError, match=r"input must have shape \(\.\.\., 7\), got \(2, 6\)"):
        MuMoE(7, 3, 4, "cp", 2)(torch.randn(2, 6))


def test_wrong_coefficients(experts):
    z = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"expected 2 coefficient tensor\(s\) for expert legs \('n1', 'n2'\), got 1"):
        experts(z, [torch.rand(2, 3)])
    with pytest.raises(
        ValueError, match=r"coefficients\[1\] \(expert leg 'n2'\) must have shape \(2, 2\), got \(2, 3\)"
    ):
        experts(z, [torch.rand(2, 3), torch.rand(2, 3)])
    with pytest.raises(TypeError, match=r"coefficients must be a sequence of 2 tensors"):
        experts(z, torch.rand(2, 3))


def test_dtype_and_device_mismatch(experts):
    with pytest.raises(TypeError, match=r"input has dtype torch.float64 but the expert cores have dtype torch.float32"):
        experts(torch.randn(2, 4, dtype=DTYPE), [torch.rand(2, 3), torch.rand(2, 2)])
    with pytest.raises(ValueError, match=r"coefficients\[0\] is on meta but the expert cores are on cpu"):
        experts(torch.randn(2, 4), [torch.rand(2, 3, device="meta"), torch.rand(2, 2)])


def test_layer_construction_errors():
    network = ExpertNetwork.from_spec("n1 a, a i o", expert_dims=4, in_features=6, out_features=3, ranks=2)
    with pytest.raises(
        ValueError, match=r"legs \{'n1': 4, 'i': 5, 'o': 3\} do not match the requested \{'n1': 4, 'i': 6"
    ):
        MuMoE(5, 3, decomposition=network.with_sizes(i=5))
    with pytest.raises(ValueError, match=r"do not match the requested \{'n1': 8"):
        MuMoE(5, 3, 8, decomposition=network)
    with pytest.raises(ValueError, match=r"unknown decomposition 'ttt'"):
        MuMoE(5, 3, 4, "ttt", 2)
    with pytest.raises(TypeError, match=r"rank is required for decomposition 'cp'"):
        MuMoE(5, 3, 4, "cp")
    with pytest.raises(ValueError, match=r"core name 'forward' clashes"):
        FactorizedExperts(ExpertNetwork({"forward": "n1 i o"}, {"n1": 2, "i": 2, "o": 2}))
    with pytest.raises(ValueError, match=r"bond size mismatch: label 'a' has size 2 in core 'A' but 3 in core 'B'"):
        FactorizedExperts.from_tensors({"A": "n1 a", "B": "a i o"}, {"A": torch.ones(4, 2), "B": torch.ones(3, 5, 6)})


def test_from_tensors_keeps_the_given_cores_dtype_name_and_optimizer():
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "A": torch.randn(4, 2, generator=gen, dtype=torch.float64),
        "B": torch.randn(2, 5, 6, generator=gen, dtype=torch.float64),
    }
    module = FactorizedExperts.from_tensors({"A": "n1 a", "B": "a i o"}, tensors, name="pair", optimize="greedy")
    assert module.network.name == "pair" and module.optimize == "greedy"
    assert module.network.cores == {"A": ("n1", "a"), "B": ("a", "i", "o")}
    for core, tensor in tensors.items():
        parameter = getattr(module, core)
        assert parameter.dtype == torch.float64 and parameter.device == tensor.device
        assert torch.equal(parameter, tensor) and parameter.data_ptr() != tensor.data_ptr()
    a, z = torch.rand(3, 4, generator=gen, dtype=torch.float64), torch.randn(3, 5, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(module(z, [a]), torch.einsum("bn,na,aio,bi->bo", a, tensors["A"], tensors["B"], z))
    assert FactorizedExperts.from_tensors({"A": "n1 a", "B": "a i o"}, tensors).network.name == "custom"
    assert FactorizedExperts.from_tensors({"A": "n1 a", "B": "a i o"}, tensors).optimize == "auto"


@pytest.mark.parametrize("index", [True, "a", 1.5, None])
def test_an_expert_index_that_is_not_ints_gets_the_library_error(index):
    layer = MuMoE(4, 4, 3, "cp", 2)
    with pytest.raises(TypeError, match=r"an expert index is an int or one int per expert mode \('n1',\)"):
        layer.experts.expert(index)
