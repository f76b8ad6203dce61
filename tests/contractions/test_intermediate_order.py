"""The order of a plan's intermediates: each laid out as the step that reads it takes it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import named_networks
from test_planning import DTYPE, random_call, sweep_reference

from mumoe_tn.contractions import run_plan
from mumoe_tn.contractions.pairwise import batched_product, broadcast_product, matrix_product
from mumoe_tn.contractions.plan import plan_contraction, plan_forward
from mumoe_tn.decompositions import build
from mumoe_tn.network import BATCH_LABEL


def permuted_intermediates(plan) -> list[tuple[int, int | str]]:
    """``(step, operand)`` for every batch-sized intermediate a step permutes before its product.

    Read from the executor's own forms (``mumoe_tn.contractions.pairwise``); ``(step, "out")`` where a
    batched product's result is permuted.
    """
    n_inputs = len(plan.inputs)
    current = list(range(n_inputs))
    found: list[tuple[int, int | str]] = []
    for number, step in enumerate(plan.steps):
        refs = [current.pop(k) for k in step.positions]
        current.append(n_inputs + number)
        if len(refs) != 2:
            continue
        first, second = step.operands
        aligned = broadcast_product(first, second, step.output)
        product = matrix_product(first, second, step.output)
        batched = batched_product(first, second, step.output)
        if aligned is not None:
            orders = [aligned[0][0], aligned[1][0]]
        elif product is not None:
            orders = (
                [product.right_order, product.left_order] if product.swap else [product.left_order, product.right_order]
            )
        elif batched is not None:
            orders = [batched.left_order, batched.right_order]
            if batched.output_order is not None:
                found.append((number, "out"))
        else:
            continue
        for k, (ref, labels, order) in enumerate(zip(refs, step.operands, orders, strict=True)):
            if ref >= n_inputs and BATCH_LABEL in labels and order is not None:
                found.append((number, k))
    return found


def _ring_plan(lead: str | None):
    # a·G_n1 first, then z·G_i: the batched product then takes z's intermediate first, and with
    # the labels in the order the operands bring them it reads both intermediates transposed
    network = build("tr", 8, 6, 5, (2, 3, 4))
    inputs, output = network.forward_equation()
    sizes = {**network.sizes, BATCH_LABEL: 32}
    return plan_contraction(inputs, output, sizes, [(3, 0), (2, 0), (2, 1), (1, 0)], lead=lead)


def test_a_ring_reads_both_batch_sized_intermediates_as_they_are_made():
    plan = _ring_plan(BATCH_LABEL)
    ring = plan.steps[2]
    assert set(ring.output) == {BATCH_LABEL, "r1", "r3"} and all(BATCH_LABEL in x for x in ring.operands)
    assert permuted_intermediates(plan) == []
    # the same path with the labels as the operands bring them: the batched product transposes both
    assert len(permuted_intermediates(_ring_plan(None))) >= 2


@pytest.mark.parametrize(
    ("name", "dims", "rank"),
    [("tr", 256, 16), ("tt", 256, 16), ("tt", (16, 16), 8), ("tucker", (4, 4), (2, 2, 8, 8)), ("cp", (16, 16), 64)],
)
@pytest.mark.parametrize("batch", [1, 256])
def test_the_planned_layer_steps_permute_no_batch_sized_intermediate(name, dims, rank, batch):
    plan = plan_forward(build(name, dims, 65, 64, rank), batch)
    assert permuted_intermediates(plan) == []


@settings(max_examples=25, deadline=None)
@given(network=named_networks(max_modes=3), batch=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_ordered_intermediates_hold_the_path_labels_and_compute_the_same_result(network, batch, seed):
    plan = plan_forward(network, batch, "greedy")
    natural = plan_contraction(plan.inputs, plan.output, plan.sizes, plan.path)
    assert plan.fma == natural.fma and plan.largest_intermediate == natural.largest_intermediate
    for step, other in zip(plan.steps, natural.steps, strict=True):
        assert sorted(step.output) == sorted(other.output)
        assert BATCH_LABEL not in step.output or step.output[0] == BATCH_LABEL
    gen = torch.Generator().manual_seed(seed)
    cores = {name: torch.randn(shape, generator=gen, dtype=DTYPE) for name, shape in network.core_shapes.items()}
    coefficients, z = random_call(network, batch, seed)
    expected = sweep_reference(network, cores, coefficients, z)
    torch.testing.assert_close(run_plan(plan, [*cores.values(), *coefficients, z]), expected)
