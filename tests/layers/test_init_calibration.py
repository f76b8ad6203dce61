"""The "linear" init's calibration stays within a small-batch forward's memory on any network."""

import sys
from pathlib import Path

import torch

import mumoe_tn.layers.calibration as calibration
from mumoe_tn.contractions import plan_contraction, plan_forward, squared_norm
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.layers.calibration import CALIBRATION_BATCH, CALIBRATION_FLOOR, CALIBRATION_PROBES
from mumoe_tn.network import ExpertNetwork

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contractions"))
from test_plan_reproducibility import grid_network


def _peaks_while_initialising(monkeypatch, network):
    peaks = []
    real = calibration.scaled_contract

    def recording(plan, operands):
        peaks.append(plan.largest_intermediate)
        return real(plan, operands)

    monkeypatch.setattr(calibration, "scaled_contract", recording)
    torch.manual_seed(0)
    experts = FactorizedExperts(network, init="linear", dtype=torch.float64)
    return experts, peaks


def _norm_plan(network):
    """The plan of the network contracted with its copy (what an exact calibration runs)."""
    physical = {*network.expert_legs, "i", "o"}
    copy = [tuple(x if x in physical else f"{x}'" for x in labels) for labels in network.cores.values()]
    sizes = {**network.sizes, **{f"{bond}'": network.sizes[bond] for bond in network.bonds}}
    return plan_contraction([*network.cores.values(), *copy], (), sizes)


def test_a_grid_network_calibrates_within_a_small_batch_forward(monkeypatch):
    # The norm of a 5×5 grid (bonds of 4) contracted with its copy needs an intermediate far beyond
    # a forward at batch 64: the calibration estimates from probes instead.
    network = grid_network(side=5, dim=2, rank=4, width=16)
    bound, _ = calibration.calibration_limit(network)
    assert bound <= max(plan_forward(network, CALIBRATION_BATCH).largest_intermediate, CALIBRATION_FLOOR)
    assert _norm_plan(network).largest_intermediate > 16 * bound  # what an exact calibration builds
    _, peaks = _peaks_while_initialising(monkeypatch, network)
    assert peaks and max(peaks) <= bound


def test_probes_take_fewer_rows_where_a_batch_64_forward_exceeds_the_budget(monkeypatch):
    # 7,232 parameters whose batch-64 forward builds 262,144 elements: the probes run 16 rows
    # at a time (4,096 × 16 = 65,536 elements, the minimum budget), still 256 rows in all.
    network = grid_network(side=5, dim=2, rank=4, width=16)
    bound, rows = calibration.calibration_limit(network)
    assert bound < plan_forward(network, CALIBRATION_BATCH).largest_intermediate
    assert rows < CALIBRATION_BATCH and plan_forward(network, rows).largest_intermediate <= bound
    experts, peaks = _peaks_while_initialising(monkeypatch, network)
    assert len(peaks) == CALIBRATION_PROBES // rows and max(peaks) <= bound
    mean_square = squared_norm(network, experts.cores).item() / (network.n_experts * 16 * 16)
    assert abs(mean_square * 3 * network.in_features - 1) < 0.15


def test_the_probe_estimate_is_close_to_the_exact_norm(monkeypatch):
    # Force the estimate on a small network: allow no more than a batch-64 forward needs.
    network = grid_network(side=4, dim=2, rank=3, width=6)
    monkeypatch.setattr(calibration, "CALIBRATION_FLOOR", 1)
    monkeypatch.setattr(
        calibration, "CALIBRATION_MINIMUM", plan_forward(network, CALIBRATION_BATCH).largest_intermediate
    )
    experts, peaks = _peaks_while_initialising(monkeypatch, network)
    assert len(peaks) == CALIBRATION_PROBES // CALIBRATION_BATCH  # forward passes only
    mean_square = squared_norm(network, experts.cores).item() / (network.n_experts * 6 * 6)
    assert abs(mean_square * 3 * network.in_features - 1) < 0.15  # 256 sampled experts


def test_small_networks_keep_the_exact_calibration(monkeypatch):
    network = grid_network(side=2, dim=3, rank=2, width=5)
    experts, peaks = _peaks_while_initialising(monkeypatch, network)
    assert len(peaks) == 1  # one exact contraction of the network with its copy, no probes
    mean_square = experts.to_dense().pow(2).mean().item()
    torch.testing.assert_close(mean_square, 1.0 / (3.0 * network.in_features), rtol=1e-10, atol=0)


def chain_network(length, rank, width=8):
    """An expert core ``(n1, i, b0)``, ``length`` bond-only ``rank × rank`` cores in a row, and ``(b_L, o)``."""
    cores = {"first": ("n1", "i", "b0"), **{f"m{k}": (f"b{k - 1}", f"b{k}") for k in range(1, length + 1)}}
    cores["last"] = (f"b{length}", "o")
    sizes = {"n1": 2, "i": width, "o": width, **{f"b{k}": rank for k in range(length + 1)}}
    return ExpertNetwork(cores, sizes, name="chain")


def test_a_deep_float32_network_calibrates_without_overflow():
    # Before scaling, ‖W‖² of 48 uniform 64 × 64 cores in a row is near (64/9)^48 ≈ 1e41, beyond
    # float32's range; the contraction is rescaled step by step and lands on nn.Linear's variance.
    network = chain_network(48, 64)
    torch.manual_seed(0)
    experts = FactorizedExperts(network, init="linear")
    cores = {name: core.detach().double() for name, core in experts.cores.items()}
    mean_square = squared_norm(network, cores).item() / (network.n_experts * network.in_features * 8)
    assert abs(mean_square * 3 * network.in_features - 1) < 1e-3
