"""Execution options of FactorizedExperts: inference pre-contraction, row chunks, recomputation.

All are exact: each is compared with the plain contraction and with a dense reference.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import any_network, named_networks

import mumoe_tn.layers.experts as layers
from mumoe_tn.contractions import (
    constant_steps,
    dense_forward,
    per_call_cost,
    per_call_fma,
    plan_forward,
    plan_inference,
)
from mumoe_tn.decompositions import build
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.network import BATCH_LABEL

DTYPE = torch.float64


def call(network, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    coefficients = [torch.rand(batch, n, generator=gen, dtype=DTYPE) for n in network.expert_dims]
    return coefficients, torch.randn(batch, network.in_features, generator=gen, dtype=DTYPE)


def reference(module, coefficients, z):
    with torch.no_grad():
        return dense_forward(module.to_dense(), coefficients, z)


# ---------------------------------------------------------------- inference pre-contraction
@settings(max_examples=25, deadline=None)
@given(named_networks(max_modes=3), st.sampled_from([1, 3, 64, 300]))
def test_inference_plan_costs_no_more_per_call_and_is_exact(network, batch):
    plan, steps = plan_inference(network, batch)
    assert steps == constant_steps(plan, len(network.cores))
    # FMAs plus a launch per step: never more than running every step of the forward plan each call.
    assert per_call_cost(plan, steps) <= per_call_cost(plan_forward(network, batch), frozenset())
    module = FactorizedExperts(network, dtype=DTYPE).eval()
    coefficients, z = call(network, batch)
    with torch.no_grad():
        torch.testing.assert_close(module(z, coefficients), reference(module, coefficients, z))


def test_small_batches_trade_fmas_for_fewer_steps_and_large_batches_do_not():
    # CP, N = 16, R = 22, I = 65, O = 64: reusing V = U_n ⊙ U_o (16 × 22 × 64, computed once)
    # spares one step per call for 21,770 more FMAs per row: less than one step's charge
    # (LAUNCH_FMA = 65,536) at one row, far more at 64.
    network = build("cp", (16,), 65, 64, (22,))
    forward_steps = len(plan_forward(network, 1).steps)
    small, small_cached = plan_inference(network, 1)
    large, large_cached = plan_inference(network, 64)
    assert len(small.steps) - len(small_cached) == forward_steps - 1
    assert per_call_fma(small, small_cached) == 65 * 22 + 22 * 16 * 64 + 16 * 64  # z·U_i, then ·V, then ·a
    assert len(large.steps) - len(large_cached) == forward_steps
    assert per_call_fma(large, large_cached) == 64 * (65 * 22 + 16 * 22 + 22 + 22 * 64)
    module = FactorizedExperts(network, dtype=DTYPE).eval()
    for batch in (1, 64):
        coefficients, z = call(network, batch)
        with torch.no_grad():
            torch.testing.assert_close(module(z, coefficients), reference(module, coefficients, z))


def test_inference_saves_fmas_where_core_ranks_exceed_expert_counts():
    # Expert factors (2, 8) feed an 8×8×4×4 core: contracting them once (2×2×4×4 result)
    # beats lifting every row's coefficients to rank 8.
    network = build("tucker", (2, 2), 16, 16, (8, 8, 4, 4))
    plan, steps = plan_inference(network, 16, launch_fma=0)  # FMAs alone (by default launches count too)
    assert steps
    assert per_call_fma(plan, steps) < plan_forward(network, 16).fma


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_cached_intermediates_follow_in_place_updates_and_load_state_dict(context):
    network = build("tucker", (2, 2), 6, 5, (4, 4, 3, 3))
    module = FactorizedExperts(network, dtype=DTYPE).eval()
    assert plan_inference(network, 16)[1], "the test needs a network with core-only steps"
    other = FactorizedExperts(network, dtype=DTYPE)
    coefficients, z = call(network, 16)
    with context():
        torch.testing.assert_close(module(z, coefficients), reference(module, coefficients, z))
        before = module(z, coefficients)
    with torch.no_grad():
        module.core.mul_(-2.0)  # in place: same storage, new version
    with context():
        after = module(z, coefficients)
    torch.testing.assert_close(after, reference(module, coefficients, z))
    assert not torch.allclose(after, before)
    module.load_state_dict(other.state_dict())
    with context():
        torch.testing.assert_close(module(z, coefficients), reference(other, coefficients, z))


def test_inference_contracts_core_only_steps_once_per_version(monkeypatch):
    computed, passed = [], []
    original_constants, original_run = layers.constant_intermediates, layers.run_plan

    def counting_constants(plan, operands, steps):
        computed.append(plan.sizes[BATCH_LABEL])
        return original_constants(plan, operands, steps)

    def recording_run(plan, operands, **kwargs):
        passed.append(sorted(kwargs.get("constants") or {}))
        return original_run(plan, operands, **kwargs)

    monkeypatch.setattr(layers, "constant_intermediates", counting_constants)
    monkeypatch.setattr(layers, "run_plan", recording_run)
    network = build("tucker", (2, 2), 6, 5, (4, 4, 3, 3))
    module = FactorizedExperts(network, dtype=DTYPE).eval()
    _, steps = plan_inference(network, 16)
    with torch.no_grad():
        for batch in (16, 9, 16, 32, 16):  # buckets 16, 16, 16, 32, 16
            coefficients, z = call(network, batch)
            torch.testing.assert_close(module(z, coefficients), reference(module, coefficients, z))
        assert computed == [16]  # once, then reused: bucket 32's core-only steps are bucket 16's
        assert all(used == sorted(steps) for used in passed[:3])
        module.core.mul_(2.0)  # a new version of a core: computed again
        coefficients, z = call(network, 16)
        torch.testing.assert_close(module(z, coefficients), reference(module, coefficients, z))
    assert computed == [16, 16]


def test_training_mode_and_gradients_never_use_cached_intermediates():
    network = build("tucker", (4, 3), 6, 5, 3)
    module = FactorizedExperts(network, dtype=DTYPE).eval()
    coefficients, z = call(network, 8)
    with torch.no_grad():
        module(z, coefficients)  # fills the cache
    y = module(z, coefficients)  # eval, but gradients on: must reach the cores
    y.sum().backward()
    assert all(core.grad is not None and core.grad.abs().sum() > 0 for core in module.cores.values())


# ---------------------------------------------------------------- chunks
@settings(max_examples=15, deadline=None)
@given(named_networks(max_modes=2), st.integers(1, 40), st.integers(1, 16), st.booleans())
def test_chunked_forward_and_gradients_equal_the_whole_batch(network, batch, chunk, append_one):
    whole = FactorizedExperts(network, dtype=DTYPE)
    chunked = FactorizedExperts(network, dtype=DTYPE, chunk_size=chunk)
    chunked.load_state_dict(whole.state_dict())
    coefficients, z = call(network, batch)
    if append_one:
        z = z[:, :-1]
    z = z.reshape(batch, 1, -1).requires_grad_()
    coefficients = [a.reshape(batch, 1, -1) for a in coefficients]
    y_whole = whole(z, coefficients, append_one=append_one)
    grads_whole = torch.autograd.grad(y_whole.square().sum(), [z, *whole.cores.values()])
    y_chunked = chunked(z, coefficients, append_one=append_one)
    grads_chunked = torch.autograd.grad(y_chunked.square().sum(), [z, *chunked.cores.values()])
    torch.testing.assert_close(y_chunked, y_whole)
    for got, expected in zip(grads_chunked, grads_whole, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("chunk_size", [0, -1, 2.0, True])
def test_chunk_size_must_be_a_positive_int(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        FactorizedExperts(build("cp", 3, 4, 5, 2), chunk_size=chunk_size)


# ---------------------------------------------------------------- recomputation
@pytest.mark.parametrize("name", ["cp", "tr"])
def test_recompute_gives_exact_gradients(name):
    network = build(name, (3, 2), 4, 5, 2)
    module = FactorizedExperts(network, dtype=DTYPE, recompute=True)
    coefficients, z = call(network, 4)
    cores = list(module.cores.values())
    names = list(module.cores)

    def forward(z, *tensors):
        return torch.func.functional_call(module, dict(zip(names, tensors, strict=True)), (z, coefficients))

    assert torch.autograd.gradcheck(forward, (z.requires_grad_(), *[c.detach().requires_grad_() for c in cores]))
    plain = FactorizedExperts(network, dtype=DTYPE)
    plain.load_state_dict(module.state_dict())
    for m in (module, plain):
        m(z, coefficients).sin().sum().backward()
    for a, b in zip(module.cores.values(), plain.cores.values(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_recompute_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="recompute"):
        FactorizedExperts(build("cp", 3, 4, 5, 2), recompute=1)


@settings(max_examples=25, deadline=None)
@given(any_network(max_modes=3), st.sampled_from([1, 5, 64]))
def test_inference_pre_contraction_with_the_folded_bias(network, batch):
    # The input omits the last entry of leg i (the bias column): pre-contracted steps that come
    # before the input's step must not lose track of where the input sits.
    if network.in_features < 2:
        network = network.with_sizes(i=2)
    module = FactorizedExperts(network, dtype=DTYPE).eval()
    coefficients, z = call(network, batch)
    short = z[:, :-1]
    ones = torch.ones(batch, 1, dtype=DTYPE)
    expected = reference(module, coefficients, torch.cat([short, ones], -1))
    with torch.no_grad():
        torch.testing.assert_close(module(short, coefficients, append_one=True), expected)
    torch.testing.assert_close(module(short, coefficients, append_one=True).detach(), expected)
