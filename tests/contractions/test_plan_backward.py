"""The planned contraction as one autograd node: gradients equal autograd through the einsum steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from live_tensors import live_peak_bytes

from mumoe_tn.contractions import backward, plan_contraction, plan_forward, run_plan
from mumoe_tn.contractions.backward import PlanFunction, plan_program, use_plan_function
from mumoe_tn.decompositions import build
from tests.strategies import any_network

DTYPE = torch.float64


@pytest.fixture(autouse=True)
def small_plans_run_as_one_node(monkeypatch):
    """The tests use small networks: let every plan take the one-node path."""
    monkeypatch.setattr(backward, "MIN_ELEMENTS", 0)


def _operands(network, batch, seed, *, folded, requires):
    gen = torch.Generator().manual_seed(seed)
    cores = [torch.randn(shape, generator=gen, dtype=DTYPE) for shape in network.core_shapes.values()]
    coefficients = [torch.rand(batch, n, generator=gen, dtype=DTYPE) for n in network.expert_dims]
    z = torch.randn(batch, network.in_features - int(folded), generator=gen, dtype=DTYPE)
    operands = [*cores, *coefficients, z]
    for tensor, flag in zip(operands, requires, strict=False):
        tensor.requires_grad_(flag)
    return operands


def _gradients(plan, operands, grad, folded, one_node):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in operands]
    ones = "i" if folded else None
    if one_node:  # every plan the program expresses, whether or not run_plan would choose it
        out = PlanFunction.apply(plan_program(plan, ones), ones, *leaves)
    else:
        out = run_plan(plan, leaves, ones_appended=ones, memory_saving=False)
    wanted = [t for t in leaves if t.requires_grad]
    return out, torch.autograd.grad(out, wanted, grad)


@given(
    network=any_network(max_modes=3),
    batch=st.integers(1, 4),
    folded=st.booleans(),
    optimize=st.sampled_from(["auto", "greedy"]),
    data=st.data(),
)
def test_gradients_equal_autograd_through_the_steps(network, batch, folded, optimize, data):
    if folded and network.in_features < 2:
        network = network.with_sizes(i=2)
    n_operands = len(network.cores) + network.n_expert_modes + 1
    requires = data.draw(st.lists(st.booleans(), min_size=n_operands, max_size=n_operands).filter(any))
    operands = _operands(network, batch, 0, folded=folded, requires=requires)
    plan = plan_forward(network, batch, optimize)
    assume(len(plan.steps) > 1 and plan_program(plan, "i" if folded else None) is not None)
    grad = torch.randn(batch, network.out_features, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    kept = grad.clone()
    out, grads = _gradients(plan, operands, grad, folded, one_node=True)
    out_ref, grads_ref = _gradients(plan, operands, grad, folded, one_node=False)
    torch.testing.assert_close(out, out_ref)
    for ours, reference in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad, kept, rtol=0, atol=0)  # the caller's gradient is never written to


def test_cp_runs_as_one_node_and_its_hadamard_product_is_recomputed():
    network = build("cp", 16, 9, 7, 5)
    plan = plan_forward(network, 4)
    operands = _operands(network, 4, 0, folded=True, requires=[True] * 5)
    program = use_plan_function(plan, operands, "i")
    assert program is not None and len(program.dropped) == 1  # the (… r) · (… r) product
    out = run_plan(plan, operands, ones_appended="i")
    assert type(out.grad_fn).__name__ == f"{PlanFunction.__name__}Backward"
    with torch.no_grad():
        assert use_plan_function(plan, operands, "i") is None


def test_small_plans_run_as_plain_steps(monkeypatch):
    network = build("cp", 16, 9, 7, 5)
    operands = _operands(network, 4, 0, folded=False, requires=[True] * 5)
    plan = plan_forward(network, 4)
    monkeypatch.setattr(backward, "MIN_ELEMENTS", plan.largest_intermediate + 1)
    assert use_plan_function(plan, operands, None) is None
    monkeypatch.setattr(backward, "MIN_ELEMENTS", plan.largest_intermediate)
    assert use_plan_function(plan, operands, None) is not None


def test_a_retained_graph_can_be_differentiated_twice():
    network = build("tr", (3, 2), 5, 4, (2, 3, 2, 3))
    plan = plan_forward(network, 3)
    operands = _operands(network, 3, 2, folded=True, requires=[True] * (len(network.cores) + 3))
    out = run_plan(plan, operands, ones_appended="i")
    first = torch.autograd.grad(out.sum(), operands, retain_graph=True)
    second = torch.autograd.grad(out.sum(), operands)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("context", ["checkpoint", "autocast"])
def test_plain_steps_under_checkpoint_and_autocast(context):
    network = build("cp", 4, 6, 5, 3)
    plan = plan_forward(network, 2)
    operands = _operands(network, 2, 0, folded=False, requires=[True] * 5)
    operands = [t.float().detach().requires_grad_() for t in operands]
    if context == "checkpoint":
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with hooks:
            assert use_plan_function(plan, operands, None) is None
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert use_plan_function(plan, operands, None) is None


def test_an_elementwise_last_step_leaves_the_callers_gradient_alone():
    # [(x) ⊙ (x)] ⊙ [(x y) · (y)]: the last step multiplies elementwise, against the caller's gradient
    inputs, sizes = [("x",), ("x",), ("x", "y"), ("y",)], {"x": 5, "y": 3}
    plan = plan_contraction(inputs, ("x",), sizes, ((0, 1), (0, 1), (0, 1)))
    gen = torch.Generator().manual_seed(3)
    shapes = [tuple(sizes[x] for x in labels) for labels in inputs]
    operands = [torch.randn(shape, generator=gen, dtype=DTYPE, requires_grad=True) for shape in shapes]
    assert use_plan_function(plan, operands, None) is not None
    grad = torch.randn(5, generator=gen, dtype=DTYPE)
    kept = grad.clone()
    out = run_plan(plan, operands)
    ours = torch.autograd.grad(out, operands, grad)
    torch.testing.assert_close(grad, kept, rtol=0, atol=0)
    reference = torch.autograd.grad(run_plan(plan, operands, memory_saving=False), operands, grad)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b)


def test_plans_without_an_elementwise_step_keep_autograd():
    network = build("tr", 4, 6, 5, (2, 2, 3))
    plan = plan_forward(network, 4)
    operands = _operands(network, 4, 0, folded=False, requires=[True] * 5)
    assert not any(step.output == operand for step in plan.steps for operand in step.operands)
    assert use_plan_function(plan, operands, None) is None


def test_cp_backward_holds_one_batch_by_rank_buffer_less():
    batch, rank = 64, 48
    network = build("cp", 8, 17, 40, rank)
    plan = plan_forward(network, batch)
    operands = _operands(network, batch, 0, folded=True, requires=[True] * 5)
    grad = torch.randn(batch, 40, dtype=DTYPE)
    peaks = {}
    for memory_saving in (True, False):

        def step(memory_saving=memory_saving):
            out = run_plan(plan, operands, ones_appended="i", memory_saving=memory_saving)
            torch.autograd.grad(out, operands, grad)

        peaks[memory_saving] = live_peak_bytes(step)
    # autograd keeps the Hadamard product (… r) and both its factors' gradients at once
    assert peaks[True] <= peaks[False] - batch * rank * 8


def test_double_backward_equals_autograd_through_the_steps():
    # a gradient penalty: ‖∂ Σ y / ∂ z‖² differentiated again with respect to every operand
    network = build("cp", 6, 5, 4, 3)
    plan = plan_forward(network, 3)
    operands = _operands(network, 3, 4, folded=True, requires=[True] * 5)
    results = []
    for memory_saving in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in operands]
        out = run_plan(plan, leaves, ones_appended="i", memory_saving=memory_saving)
        (dz,) = torch.autograd.grad((out**2).sum(), leaves[-1], create_graph=True)
        results.append(torch.autograd.grad((dz**2).sum(), leaves))
    for ours, reference in zip(*results, strict=True):
        torch.testing.assert_close(ours, reference)


def test_a_folded_bias_that_needs_its_column_of_ones_keeps_the_plain_steps():
    # tt(6, 3, 10, (2, 7)) under "optimal" contracts z's leg i in a step with two other legs
    plan = plan_forward(build("tt", 6, 3, 10, (2, 7)), 4, "optimal")
    assert plan_program(plan, "i") is None
    assert plan_program(plan, None) is not None


def test_one_factor_of_a_product_without_gradient():
    # only the input path needs gradients: the coefficient projection (… r) is a constant factor
    network = build("cp", 8, 7, 6, 5)
    plan = plan_forward(network, 4)
    requires = [False, True, True, False, True]  # U_n1, U_i, U_o, a, z
    operands = _operands(network, 4, 5, folded=True, requires=requires)
    grad = torch.randn(4, 6, dtype=DTYPE, generator=torch.Generator().manual_seed(6))
    _, ours = _gradients(plan, operands, grad, True, one_node=True)
    _, reference = _gradients(plan, operands, grad, True, one_node=False)
    assert len(ours) == 3
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["cp", "tr"])
def test_batch_sized_gradients_come_back_contiguous(name):
    """A coefficient's gradient goes on to the gate's backward: it must not arrive transposed.

    The expert-mode factor spans fewer entries than the batch, so the rows-first orientation used
    for weight gradients would return ``(batch, experts)`` as a transposed view.
    """
    network = build(name, 8, 6, 5, 4)
    plan = plan_forward(network, 64)
    operands = _operands(network, 64, 0, folded=True, requires=[True] * (len(network.cores) + 2))
    out = PlanFunction.apply(plan_program(plan, "i"), "i", *operands)
    grads = torch.autograd.grad(out, operands, torch.randn_like(out))
    coefficients, z = grads[len(network.cores)], grads[-1]
    assert coefficients.is_contiguous() and z.is_contiguous()
