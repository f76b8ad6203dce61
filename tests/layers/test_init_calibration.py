"""The "linear" init's calibration stays within a small-batch forward's memory on any network."""

import math
import sys
from pathlib import Path

import opt_einsum
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import any_network

import mumoe_tn.layers.calibration as calibration
from mumoe_tn import MuMoE
from mumoe_tn.contractions import plan_contraction, plan_forward, squared_norm
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.layers.calibration import (
    CALIBRATION_BATCH,
    CALIBRATION_MIN_PROBES,
    CALIBRATION_MINIMUM,
    CALIBRATION_PROBES,
    CALIBRATION_TOLERANCE,
)
from mumoe_tn.network import ExpertNetwork

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contractions"))
from test_plan_reproducibility import grid_network


def _peaks_while_initialising(monkeypatch, network):
    experts, plans = _plans_while_initialising(monkeypatch, network)
    return experts, [plan.largest_intermediate for plan in plans]


def _record_plans(monkeypatch):
    """The plans every scaled contraction runs from now on."""
    plans = []
    real = calibration.scaled_contract

    def recording(plan, operands, slice_elements=None):
        plans.append(plan)
        return real(plan, operands, slice_elements)

    monkeypatch.setattr(calibration, "scaled_contract", recording)
    return plans


def _plans_while_initialising(monkeypatch, network, dtype=torch.float64):
    plans = _record_plans(monkeypatch)
    torch.manual_seed(0)
    experts = FactorizedExperts(network, init="linear", dtype=dtype)
    return experts, plans


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
    assert bound <= max(plan_forward(network, CALIBRATION_BATCH).largest_intermediate, CALIBRATION_MINIMUM)
    assert _norm_plan(network).largest_intermediate > 16 * bound  # what an exact calibration builds
    _, peaks = _peaks_while_initialising(monkeypatch, network)
    assert peaks and max(peaks) <= bound


def test_probes_take_fewer_rows_where_a_batch_64_forward_exceeds_the_budget(monkeypatch):
    # 7,232 parameters whose batch-64 forward builds 262,144 elements: the probes run 16 rows
    # at a time (4,096 × 16 = 65,536 elements, the minimum budget), at most 256 rows in all.
    network = grid_network(side=5, dim=2, rank=4, width=16)
    bound, rows = calibration.calibration_limit(network)
    assert bound < plan_forward(network, CALIBRATION_BATCH).largest_intermediate
    assert rows < CALIBRATION_BATCH and plan_forward(network, rows).largest_intermediate <= bound
    experts, peaks = _peaks_while_initialising(monkeypatch, network)
    assert CALIBRATION_MIN_PROBES // rows <= len(peaks) <= CALIBRATION_PROBES // rows and max(peaks) <= bound
    mean_square = squared_norm(network, experts.cores).item() / (network.n_experts * 16 * 16)
    assert abs(mean_square * 3 * network.in_features - 1) < 0.15


def test_the_probe_estimate_is_close_to_the_exact_norm(monkeypatch):
    # Force the estimate on a small network: allow no more than a batch-64 forward needs.
    network = grid_network(side=4, dim=2, rank=3, width=6)
    forward = plan_forward(network, CALIBRATION_BATCH)
    monkeypatch.setattr(calibration, "CALIBRATION_MINIMUM", forward.largest_intermediate)
    monkeypatch.setattr(calibration, "squared_norm_plan", _no_exact_plan)
    experts, plans = _plans_while_initialising(monkeypatch, network)
    assert 1 <= len(plans) <= CALIBRATION_PROBES // CALIBRATION_BATCH
    assert all(plan.output == forward.output for plan in plans)  # forward passes only
    mean_square = squared_norm(network, experts.cores).item() / (network.n_experts * 6 * 6)
    assert abs(mean_square * 3 * network.in_features - 1) < 0.15  # 256 sampled experts


def _no_exact_plan(network, **options):
    raise ValueError("no path within the limit")


def test_the_calibration_never_searches_for_the_smallest_peak(monkeypatch):
    # A matched TT layer with six expert modes: its norm with its copy (16 operands) fits no path
    # of the usual finders; a smallest-peak search would take seconds to confirm that none fits
    # before the probes run anyway.
    import mumoe_tn.contractions.search as search

    asked = []
    real = search.find_path

    def recording(inputs, output, sizes, optimizer, memory_limit=None):
        smallest = isinstance(optimizer, opt_einsum.paths.DynamicProgramming) and optimizer.minimize == "size"
        asked.append((len(inputs), output, smallest))
        return real(inputs, output, sizes, optimizer, memory_limit)

    monkeypatch.setattr(search, "find_path", recording)
    plans = _record_plans(monkeypatch)
    MuMoE(768, 3072, (16,) * 6, "tt", match="linear")
    assert any(entry[:2] == (16, ()) for entry in asked)  # the norm with its copy was planned ...
    assert not any(smallest and output == () for _, output, smallest in asked)  # ... without it
    assert plans and all(plan.output != () for plan in plans)  # and the probes ran
    # Asked for directly, the planner still searches for the smallest peak where nothing fits.
    asked.clear()
    network = MuMoE(768, 3072, (16,) * 6, "tt", match="linear", device="meta").experts.network
    limit, _ = calibration.calibration_limit(network)
    with pytest.raises(ValueError, match="smallest peak found"):
        calibration.squared_norm_plan(network, memory_limit=limit)
    assert any(smallest for _, _, smallest in asked)


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


def _estimate_and_exact(monkeypatch, network, seed):
    """The probe estimate of ``log ‖W‖²`` (the exact path refused), its passes, and the exact value."""
    torch.manual_seed(seed)
    experts = FactorizedExperts(network, init="linear", dtype=torch.float64)
    plans = _record_plans(monkeypatch)
    monkeypatch.setattr(calibration, "squared_norm_plan", _no_exact_plan)
    generator = torch.Generator().manual_seed(seed)
    estimate = calibration.log_squared_norm(network, dict(experts.cores), generator)
    exact = math.log(squared_norm(network, experts.cores).item())
    return estimate, len(plans), exact


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_estimate_stops_after_one_pass_where_rows_agree(monkeypatch, seed):
    # A wide CP layer of rank 1024 at init: the probe rows agree within a few per cent.
    network = MuMoE(1024, 1024, 16, "cp", rank=1024, device="meta").experts.network
    estimate, passes, exact = _estimate_and_exact(monkeypatch, network, seed)
    assert passes == 1  # 64 rows ≥ CALIBRATION_MIN_PROBES, within the tolerance
    assert abs(math.exp(estimate - exact) - 1) < 5 * CALIBRATION_TOLERANCE


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_low_rank_layer_takes_more_probes_and_stays_close(monkeypatch, seed):
    # Rank 2: a probe row's squared output spreads widely around ‖W‖² (its relative standard
    # deviation is near 1); the estimate takes every probe and lands within a few standard errors.
    network = MuMoE(64, 64, 16, "cp", rank=2, device="meta").experts.network
    estimate, passes, exact = _estimate_and_exact(monkeypatch, network, seed)
    assert passes == CALIBRATION_PROBES // CALIBRATION_BATCH
    assert abs(math.exp(estimate - exact) - 1) < 0.3


def test_the_exact_norm_is_taken_where_it_fits_and_costs_less_than_the_probes(monkeypatch):
    # Tucker with a 28⁴ core: its norm with its copy fits in a sixth of the parameters.
    network = MuMoE(64, 256, (4, 4), "tucker", rank=28, device="meta").experts.network
    limit, _ = calibration.calibration_limit(network)
    assert limit <= network.n_params // 6
    _, plans = _plans_while_initialising(monkeypatch, network)
    assert [plan.output for plan in plans] == [()]  # one exact contraction
    # With a single probe row allowed, the exact norm costs more than the estimate: probes run.
    monkeypatch.setattr(calibration, "CALIBRATION_PROBES", 1)
    _, plans = _plans_while_initialising(monkeypatch, network)
    assert plans and all(plan.output != () for plan in plans)


@settings(deadline=None)
@given(network=any_network(max_modes=3), rows=st.integers(1, 5), step_slice=st.integers(1, 64), data=st.data())
def test_a_sliced_scaled_contraction_equals_the_einsum(network, rows, step_slice, data):
    # Every step whose operand exceeds STEP_SLICE elements runs in slices (of a kept label, else a
    # summed one): the scaled result times its scale is the plain einsum of the operands.
    seed = data.draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    cores = [torch.randn(network.core_shape(name), dtype=torch.float64, generator=generator) for name in network.cores]
    inputs = [
        torch.randn(rows, network.sizes[leg], dtype=torch.float64, generator=generator)
        for leg in (*network.expert_legs, "i")
    ]
    for plan, operands in (
        (plan_forward(network, rows), cores + inputs),
        (calibration.squared_norm_plan(network), cores + cores),
    ):
        result, log_scale = calibration.scaled_contract(plan, operands, step_slice)
        expected = torch.einsum(_equation(plan), *operands)
        torch.testing.assert_close(result * math.exp(log_scale), expected, rtol=1e-10, atol=1e-12)


def _equation(plan):
    letters = {label: chr(ord("a") + k) for k, label in enumerate(plan.sizes)}
    inputs = ",".join("".join(letters[x] for x in labels) for labels in plan.inputs)
    return inputs + "->" + "".join(letters[x] for x in plan.output)
