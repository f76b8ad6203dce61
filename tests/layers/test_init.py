"""Initialisation: the paper's rule for CP/TR, the variance-targeted rule for every network."""

import math

import pytest
import torch
from hypothesis import given
from strategies import custom_networks, named_networks

from mumoe_tn import FactorizedExperts, init_cores
from mumoe_tn.decompositions import cp, tr, tt, tucker


def mean_square_stats(build, draws=16):
    values = []
    for seed in range(draws):
        torch.manual_seed(seed)
        values.append(FactorizedExperts(build()).to_dense().pow(2).mean().item())
    values = torch.tensor(values, dtype=torch.float64)
    return values.mean().item(), values.std().item() / math.sqrt(draws)


@pytest.mark.parametrize("n_modes", [1, 2, 3])
def test_cp_paper_rule_variance(n_modes):
    # Entries U_n ~ N(1, σ) (σ = 1 on mode 1, 0 after), U_i ~ U(±1/√I), U_o ~ U(±1/√R):
    # E[W²] = R · (1 + 1) · 1/(3I) · 1/(3R) = 2 / (9 I).
    in_features = 48
    mean, stderr = mean_square_stats(lambda: cp((16,) * n_modes, in_features, 40, 24))
    expected = 2 / (9 * in_features)
    assert abs(mean - expected) < 4 * stderr + 1e-12, (mean, expected, stderr)


@pytest.mark.parametrize(("r1", "r2"), [(4, 4), (4, 2), (2, 4)])
def test_tr_paper_rule_variance(r1, r2):
    # Diagonal slices N(1, σ) keep min(R1, R2) terms; G_i ~ U(±1/√I), G_o ~ U(±1/√(R3·R1)):
    # E[W²] = min(R1, R2) · R3 · 2 · 1/(3I) · 1/(3 R3 R1).
    in_features, r3 = 48, 16
    mean, stderr = mean_square_stats(lambda: tr(16, in_features, 40, (r1, r2, r3)))
    expected = min(r1, r2) * 2 / (9 * in_features * r1)
    assert abs(mean - expected) < 4 * stderr + 1e-12, (mean, expected, stderr)


@given(named_networks(names=("tt", "tucker")))
def test_linear_rule_named(network):
    experts = FactorizedExperts(network)
    expected = 1 / (3 * network.in_features)
    torch.testing.assert_close(experts.to_dense().double().pow(2).mean().item(), expected, rtol=1e-4, atol=0)


@given(custom_networks())
def test_linear_rule_custom_and_fan_in(network):
    experts = FactorizedExperts(network, dtype=torch.float64, fan_in=7)
    torch.testing.assert_close(experts.to_dense().pow(2).mean().item(), 1 / 21, rtol=1e-6, atol=0)


@given(custom_networks())
def test_all_experts_start_as_one_linear_map(network):
    cores = {name: torch.empty(shape, dtype=torch.float64) for name, shape in network.core_shapes.items()}
    init_cores(network, cores, expert_noise=[0.0] * network.n_expert_modes)
    from mumoe_tn import materialise

    weight = materialise(network, cores).reshape(network.n_experts, network.in_features, network.out_features)
    torch.testing.assert_close(weight, weight[:1].expand_as(weight))


@pytest.mark.parametrize("builder", [cp, tr, tt, tucker])
def test_default_noise_only_on_first_mode(builder):
    network = builder((4, 3, 2), 6, 5, 3)
    weight = FactorizedExperts(network, dtype=torch.float64).to_dense()
    # Experts that share the first-mode index are equal; the first mode carries the noise.
    torch.testing.assert_close(weight, weight[:, :1, :1].expand_as(weight))
    assert not torch.allclose(weight[0], weight[1])


def test_init_errors():
    network = cp((4, 3), 6, 5, 3)
    with pytest.raises(ValueError, match=r"expert_noise needs 2 value\(s\), one per expert mode, got 1"):
        FactorizedExperts(network, expert_noise=[1.0])
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match=r"expert_noise\[0\] must be a finite number >= 0"):
            FactorizedExperts(network, expert_noise=[bad, 0.0])
    with pytest.raises(ValueError, match=r"unknown init rule 'xavier'"):
        FactorizedExperts(network, init="xavier")


def test_generator_makes_init_reproducible():
    network = tt(4, 6, 5, 3)
    first, second = FactorizedExperts(network), FactorizedExperts(network)
    first.reset_parameters(torch.Generator().manual_seed(5))
    second.reset_parameters(torch.Generator().manual_seed(5))
    torch.testing.assert_close(first.to_dense(), second.to_dense())


def test_default_expert_noise_has_one_value_per_mode():
    from mumoe_tn.layers.init import default_expert_noise

    assert default_expert_noise(1) == (1.0,)
    assert default_expert_noise(3) == (1.0, 0.0, 0.0)


def test_paper_rule_bound_of_a_core_without_input_or_output():
    # core C carries two bonds only: it multiplies what came through b and c, fan_in = 10·10
    from mumoe_tn import ExpertNetwork

    network = ExpertNetwork.from_spec(
        "A: n1 a, B: a i b, C: b c, D: c o", expert_dims=3, in_features=4, out_features=5, ranks=10
    )
    cores = {name: torch.empty(shape, dtype=torch.float64) for name, shape in network.core_shapes.items()}
    init_cores(network, cores, rule="paper", generator=torch.Generator().manual_seed(0))
    assert 0.09 < cores["C"].abs().max() <= 0.1  # U(±1/√100), 100 draws
    assert 0.45 < cores["B"].abs().max() <= 0.5  # the input core: U(±1/√I)
    assert 1 / math.sqrt(10) * 0.9 < cores["D"].abs().max() <= 1 / math.sqrt(10)  # the output core: its bond c
