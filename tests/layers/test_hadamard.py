"""Hadamard networks (a physical leg held by several cores) and the Mixture of Decoders layer.

References are written out independently of the planner: the dense tensor by one ``torch.einsum``
over the network's labels, the MxD forward as ``(Cᵀa) ⊙ (Dᵀz)``, parameter counts by summing the
module's parameters, FMAs by the hand count of the MxD paper's forward, ranks by
``torch.linalg.matrix_rank``.
"""

import math
import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import hadamard_networks

from mumoe_tn import ExpertNetwork, FactorizedExperts, MixtureOfDecoders, MuMoE
from mumoe_tn.conversion.fitting.upcycling import decompose_dense, upcycle_linear
from mumoe_tn.costs import collapsed_expert_modes, layer_flops, layer_parameters, match_layer, rank_bound
from mumoe_tn.decompositions import get_format, mxd
from mumoe_tn.layers import decoder_block_parameters

DTYPE = torch.float64


def _random_cores(network, seed):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(network.core_shape(name), generator=generator, dtype=DTYPE) for name in network.cores}


def _einsum_dense(network, cores):
    """W (n1…nE, i, o) by one torch.einsum over the network's own labels."""
    letters = dict(zip(sorted(network.sizes), string.ascii_letters, strict=False))
    inputs = ",".join("".join(letters[x] for x in labels) for labels in network.cores.values())
    output = "".join(letters[x] for x in (*network.expert_legs, "i", "o"))
    return torch.einsum(f"{inputs}->{output}", *cores.values())


def _experts(network, seed):
    experts = FactorizedExperts(network, dtype=DTYPE)
    with torch.no_grad():
        for name, value in _random_cores(network, seed).items():
            getattr(experts, name).copy_(value)
    return experts


@settings(deadline=None)
@given(hadamard_networks(), st.integers(0, 10_000), st.integers(1, 5))
def test_hadamard_forward_equals_dense_einsum(network, seed, batch):
    assert network.shared_legs
    experts = _experts(network, seed)
    dense = _einsum_dense(network, {name: getattr(experts, name).detach() for name in network.cores})
    torch.testing.assert_close(experts.to_dense(), dense)
    generator = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(batch, network.in_features, generator=generator, dtype=DTYPE)
    coefficients = [torch.randn(batch, n, generator=generator, dtype=DTYPE) for n in network.expert_dims]
    letters = string.ascii_lowercase[: network.n_expert_modes]
    equation = ",".join(f"z{x}" for x in letters) + f",{letters}io,zi->zo"
    torch.testing.assert_close(experts(z, coefficients), torch.einsum(equation, *coefficients, dense, z))


@settings(deadline=None)
@given(hadamard_networks(max_size=4), st.integers(0, 10_000))
def test_hadamard_rank_bound_holds_and_params_are_counted(network, seed):
    experts = _experts(network, seed)
    assert sum(p.numel() for p in experts.parameters()) == network.n_params
    dense = experts.to_dense().reshape(-1, network.in_features, network.out_features)
    measured = max(int(torch.linalg.matrix_rank(matrix)) for matrix in dense)
    assert measured <= rank_bound(network)


@pytest.mark.parametrize("dims", [(7,), (3, 4), (2, 3, 2)])
@pytest.mark.parametrize(("in_features", "out_features"), [(9, 5), (5, 9)])
def test_mxd_rank_bound_is_tight_and_no_mode_collapses(dims, in_features, out_features):
    network = mxd(dims, in_features, out_features)
    assert rank_bound(network) == min(in_features, out_features) == network.format.closed_form_rank_bound(network)
    assert collapsed_expert_modes(network) == ()
    dense = _experts(network, 0).to_dense().reshape(-1, in_features, out_features)
    assert {int(torch.linalg.matrix_rank(matrix)) for matrix in dense} == {min(in_features, out_features)}


def test_mxd_network_costs_are_the_hand_counts():
    network = mxd((64, 32), 33, 24)
    assert network.to_spec() == "D: i o, C_n1: n1 o, C_n2: n2 o"
    assert network.n_params == 33 * 24 + 64 * 24 + 32 * 24
    flops = layer_flops(network, batch=16)
    # Dᵀz, C_1ᵀa_1, C_2ᵀa_2, and two elementwise products of length O, per token.
    assert flops.planned == 16 * (33 * 24 + 64 * 24 + 32 * 24 + 2 * 24)
    assert flops.hand_order == flops.planned
    assert flops.closed_form == 16 * 24 * (33 + 64 + 32)
    counted = layer_parameters(network)
    # leg i holds the folded bias column: the gate reads the 32 features
    assert counted.gate == 32 * (64 + 32) and sum(counted.cores.values()) == network.n_params


def test_mxd_layer_forward_is_the_papers_formula():
    torch.manual_seed(0)
    layer = MuMoE(12, 8, (5, 3), "mxd", bias=False, dtype=DTYPE)
    x = torch.randn(6, 12, dtype=DTYPE)
    y = layer(x)
    a1, a2 = (a.to(DTYPE) for a in layer.last_coefficients)
    experts = layer.experts
    expected = (x @ experts.D) * (a1 @ experts.C_n1) * (a2 @ experts.C_n2)
    torch.testing.assert_close(y, expected)


def test_mxd_block_forward_is_the_papers_formula_plain_and_glu():
    torch.manual_seed(0)
    block = MixtureOfDecoders(10, 16, 6, expert_dims=(4, 3), dtype=DTYPE)
    with torch.no_grad():
        block.output_bias.normal_()
    x = torch.randn(5, 10, dtype=DTYPE)
    y = block(x)
    a1, a2 = (a.to(DTYPE) for a in block.last_coefficients)
    hidden = torch.nn.functional.gelu(x @ block.up_proj.weight.T + block.up_proj.bias)
    decoder = block.decoder
    expected = (hidden @ decoder.D) * (a1 @ decoder.C_n1) * (a2 @ decoder.C_n2) + block.output_bias
    torch.testing.assert_close(y, expected)

    glu = MixtureOfDecoders(10, 16, 6, expert_dims=5, gated=True, bias=False, dtype=DTYPE)
    y = glu(x)
    (a,) = (a.to(DTYPE) for a in glu.last_coefficients)
    hidden = torch.nn.functional.silu(x @ glu.gate_proj.weight.T) * (x @ glu.up_proj.weight.T)
    torch.testing.assert_close(y, (hidden @ glu.decoder.D) * (a @ glu.decoder.C_n1))


def test_mxd_block_parameters_match_the_module():
    block = MixtureOfDecoders(10, 16, 6, expert_dims=(4, 3), gated=True, input_norm=True)
    counted = decoder_block_parameters(block.network, 10, gated=True, input_norm=True)
    assert counted == sum(p.numel() for p in block.parameters())
    assert counted == 2 * (10 * 16 + 16) + 16 * 6 + (4 + 3) * 6 + 6 + 10 * (4 + 3) + 2 * 10


def test_mxd_block_matched_to_the_mlp_narrows_its_hidden_layer():
    block = MixtureOfDecoders(64, 256, expert_dims=32, match="mlp")
    mlp = 64 * 256 + 256 + 256 * 64 + 64
    total = sum(p.numel() for p in block.parameters())
    assert abs(total - mlp) <= 0.05 * mlp
    assert block.hidden_features < 256 and block.up_proj.out_features == block.network.in_features


def test_mxd_matching_chooses_the_number_of_experts():
    network = mxd(1, 33, 24)
    budget = 40_000
    matched = match_layer(network, budget)
    assert matched.bonds == ("n1",)
    n = matched.networks[0].expert_dims[0]
    assert abs(layer_parameters(matched.networks[0]).total - budget) <= 0.05 * budget
    assert layer_parameters(mxd(n, 33, 24)).total == layer_parameters(matched.networks[0]).total
    with pytest.raises(ValueError, match=r"below the smallest possible count for a mxd layer scaling \('n1',\)"):
        MuMoE(768, 3072, 64, "mxd", match="linear")
    custom = ExpertNetwork.from_spec("D: i o, C: n1 i", expert_dims=1, in_features=33, out_features=24, ranks={})
    assert match_layer(custom, budget).bonds == ("n1",)  # no bond: the expert leg is scaled


def test_mxd_takes_no_rank():
    with pytest.raises(ValueError, match=r"mxd has no bond, so it takes no rank, got 4"):
        MuMoE(8, 8, 4, "mxd", rank=4)
    assert MuMoE(8, 8, 4, "mxd").network == get_format("mxd").build(4, 9, 8, None)
    with pytest.raises(TypeError, match=r"rank is required for decomposition 'cp'"):
        MuMoE(8, 8, 4, "cp")


@pytest.mark.parametrize("spec", ["mxd", "D: i o, C: n1 i", "A: n1 i r, B: r o, C: n1 o"])
def test_upcycling_a_linear_into_a_hadamard_network_is_exact(spec):
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 7).double()
    rank = None if spec != "A: n1 i r, B: r o, C: n1 o" else 7
    layer, error = upcycle_linear(linear, expert_dims=5, decomposition=spec, rank=rank)
    assert error < 1e-6  # closed form for mxd, alternating least squares for the others
    x = torch.randn(4, 12, dtype=DTYPE)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)


def test_decompose_dense_fits_a_hadamard_tensor_exactly():
    generator = torch.Generator().manual_seed(3)
    c, d = torch.randn(6, 1, 4, generator=generator), torch.randn(1, 5, 4, generator=generator)
    weight = (c * d).double()
    experts, error = decompose_dense(weight, "D: i o, C: n1 o")
    assert error < 1e-6
    torch.testing.assert_close(experts.to_dense(), weight)


def test_mxd_block_after_training_eval_batch_one_bf16_mask_and_reload(tmp_path):
    torch.manual_seed(0)
    block = MixtureOfDecoders(16, 32, expert_dims=(4, 4), gate_norm="layer")
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    x = torch.randn(4, 6, 16, requires_grad=True)
    for _ in range(2):
        loss = block(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(p.grad is not None for p in block.parameters())
    block.eval()
    with torch.no_grad():
        full = block(x)
        one = block(x[:1, :1])
        torch.testing.assert_close(one, full[:1, :1])
        mask = torch.ones(4, 6, dtype=torch.bool)
        mask[:, -2:] = False
        torch.testing.assert_close(block(x, mask)[mask], full[mask])
    torch.save(block.state_dict(), tmp_path / "block.pt")
    again = MixtureOfDecoders(16, 32, expert_dims=(4, 4), gate_norm="layer")
    again.load_state_dict(torch.load(tmp_path / "block.pt"))
    again.eval()
    with torch.no_grad():
        assert torch.equal(again(x), full)
        half = again.to(torch.bfloat16)(x.to(torch.bfloat16)).float()
    assert (half - full).abs().max() <= 0.05 * full.abs().max()


def test_hierarchical_mxd_has_a_million_experts_at_the_gate_cost_of_two_thousand():
    network = mxd((1024, 1024), 769, 768)
    assert network.n_experts == 2**20
    assert layer_parameters(network).gate == 768 * 2048
    assert math.isclose(rank_bound(network), 768)


def test_a_decoder_with_bonds_is_matched_by_its_ranks_not_its_width():
    block = MixtureOfDecoders(16, 32, expert_dims=4, decomposition="tr", match="mlp")
    mlp = 16 * 32 + 32 + 32 * 16 + 16
    assert block.hidden_features == 32 and block.network.sizes["r3"] > 1
    assert abs(sum(p.numel() for p in block.parameters()) - mlp) <= 0.05 * mlp
