"""The "linear" init's calibration stays within a small-batch forward's memory on any network."""

import sys
from pathlib import Path

import torch

import mumoe_tn.contractions.dense
import mumoe_tn.layers.init as init
from mumoe_tn.contractions import plan_contraction, plan_forward, squared_norm
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.layers.init import CALIBRATION_BATCH, CALIBRATION_FLOOR, CALIBRATION_PROBES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contractions"))
from test_plan_reproducibility import grid_network


def _peaks_while_initialising(monkeypatch, network):
    peaks = []
    real = init.run_plan

    def recording(plan, operands, **options):
        peaks.append(plan.largest_intermediate)
        return real(plan, operands, **options)

    monkeypatch.setattr(init, "run_plan", recording)
    monkeypatch.setattr(mumoe_tn.contractions.dense, "run_plan", recording)
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
    bound = max(plan_forward(network, CALIBRATION_BATCH).largest_intermediate, CALIBRATION_FLOOR)
    assert _norm_plan(network).largest_intermediate > 16 * bound  # what an exact calibration builds
    _, peaks = _peaks_while_initialising(monkeypatch, network)
    assert peaks and max(peaks) <= bound


def test_the_probe_estimate_is_close_to_the_exact_norm(monkeypatch):
    monkeypatch.setattr(init, "CALIBRATION_FLOOR", 1)  # force the estimate on a small network
    network = grid_network(side=4, dim=2, rank=3, width=6)
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
