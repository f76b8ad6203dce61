"""The one executor of a plan's steps: what it records, what it skips, the folded bias in every form."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch_calls import AtenCalls

from mumoe_tn.contractions import plan_forward, plan_inference
from mumoe_tn.contractions.executor import FoldedBias, PlanExecutor, affine_einsum, plan_executor
from mumoe_tn.contractions.plan import ContractionStep
from mumoe_tn.contractions.prepared import COLUMN_MAJOR_ROWS, PreparedPlan
from mumoe_tn.decompositions import build

DTYPE = torch.float64
NETWORKS = {
    "cp": lambda: build("cp", 6, 7, 5, 4),
    "tr": lambda: build("tr", (3, 2), 5, 4, (2, 3, 2, 3)),
    "tucker": lambda: build("tucker", 4, 6, 5, (3, 2, 3)),
}


def _call(network, batch, seed=0):
    """Cores, coefficients and an input without its trailing 1, and the input with it."""
    gen = torch.Generator().manual_seed(seed)
    cores = [torch.randn(shape, generator=gen, dtype=DTYPE) for shape in network.core_shapes.values()]
    coefficients = [torch.rand(batch, n, generator=gen, dtype=DTYPE) for n in network.expert_dims]
    z = torch.randn(batch, network.in_features - 1, generator=gen, dtype=DTYPE)
    full = torch.cat([z, torch.ones(batch, 1, dtype=DTYPE)], dim=-1)
    return cores, coefficients, z, full


def _reference(network, cores, coefficients, full):
    """The contraction by one ``torch.einsum`` over the whole network, the ones column explicit."""
    inputs, output = network.forward_equation()
    symbols = {label: chr(ord("A") + k) for k, label in enumerate(sorted({x for xs in inputs for x in xs}))}
    terms = ["".join(symbols[x] for x in labels) for labels in inputs]
    equation = ",".join(terms) + "->" + "".join(symbols[x] for x in output)
    return torch.einsum(equation, *cores, *coefficients, full)


@pytest.mark.parametrize("name", list(NETWORKS))
def test_a_plain_call_lets_every_intermediate_go_and_a_recording_one_keeps_them(name):
    network = NETWORKS[name]()
    cores, coefficients, z, full = _call(network, 3)
    plan = plan_forward(network, 3)
    executor = plan_executor(plan, "i")
    operands = [*cores, *coefficients, z]
    n_inputs, n_steps = len(operands), len(plan.steps)
    plain = executor.run(executor.start(operands))
    kept = executor.run(executor.start(operands), record=True)
    intermediates = range(n_inputs, n_inputs + n_steps)
    assert [plain[k] is None for k in intermediates] == [k != executor.result for k in intermediates]
    assert all(kept[k] is not None for k in intermediates)
    expected = _reference(network, cores, coefficients, full)
    torch.testing.assert_close(plain[executor.result], expected)
    torch.testing.assert_close(kept[executor.result], expected)


def test_a_register_filled_before_the_loop_skips_the_step_that_writes_it():
    network = NETWORKS["cp"]()
    cores, coefficients, z, full = _call(network, 4)
    plan = plan_forward(network, 4)
    executor = plan_executor(plan, "i")
    first = executor.instructions[0].out
    registers = executor.start([*cores, *coefficients, z])
    registers[first] = torch.zeros_like(executor.instructions[0](registers))
    # CP's steps multiply: a zero product in place of the first step's zeroes the result
    assert torch.count_nonzero(executor.run(registers)[executor.result]) == 0
    recorded = executor.run(executor.start([*cores, *coefficients, z]), record=True)
    registers = executor.start([*cores, *coefficients, z])
    registers[first] = recorded[first]
    torch.testing.assert_close(executor.run(registers)[executor.result], _reference(network, cores, coefficients, full))


def test_only_the_core_only_steps_run_when_the_constants_are_computed():
    network = NETWORKS["tr"]()
    cores, *_ = _call(network, 2)
    plan, steps = plan_inference(network, 2)
    assert steps, "the TR network has core-only steps to cache"
    executor = plan_executor(plan)
    registers = executor.constants(plan, cores, steps)
    ran = {k - executor.n_inputs for k in range(executor.n_inputs, len(registers)) if registers[k] is not None}
    assert ran == set(steps)
    outside = min(set(range(len(plan.steps))) - set(steps))
    with pytest.raises(ValueError, match=f"step {outside} of the plan depends on operands beyond the 4 given"):
        executor.constants(plan, cores, {outside})


@pytest.mark.parametrize("name", list(NETWORKS))
def test_the_folded_bias_gives_the_explicit_ones_column_in_each_of_its_forms(name):
    network = NETWORKS[name]()
    cores, coefficients, z, full = _call(network, 5, seed=3)
    plan = plan_forward(network, 5)
    executor = plan_executor(plan, "i")
    (position,) = [k for k, step in enumerate(executor.instructions) if isinstance(step, FoldedBias)]
    folded = executor.instructions[position]
    assert folded.plain and folded.weight is None  # T narrowed and its last slice added
    expected = _reference(network, cores, coefficients, full)
    operands = [*cores, *coefficients, z]
    torch.testing.assert_close(executor(operands), expected)
    # the column of ones appended, then the step as planned
    ones = (*executor.instructions[:position], replace(folded, plain=False), *executor.instructions[position + 1 :])
    torch.testing.assert_close(
        PlanExecutor(ones, executor.n_inputs, executor.result, executor.registers)(operands), expected
    )
    # one addmm over the prepared core, where the other factor is a core
    prepared = PreparedPlan(plan, cores, ones_appended="i")
    torch.testing.assert_close(prepared([*coefficients, z]), expected)


def test_a_prepared_plan_runs_its_folded_bias_as_one_addmm_and_skips_a_product_given_to_it():
    network = NETWORKS["cp"]()
    cores, coefficients, z, full = _call(network, 2)
    prepared = PreparedPlan(plan_forward(network, 2), cores, ones_appended="i")
    projection = prepared.input_projection
    assert projection is not None and projection.bias is not None  # the folded bias's row
    head = torch.addmm(projection.bias, z, projection.matrix)
    expected = _reference(network, cores, coefficients, full)
    torch.testing.assert_close(prepared([*coefficients, z], (projection.position, head)), expected)
    # the product handed in is used as it is: the step that computes it does not run
    zero = torch.zeros_like(head)
    assert torch.count_nonzero(prepared([*coefficients, z], (projection.position, zero))) == 0


@pytest.mark.parametrize("core_labels", [("i", "r"), ("r", "i")], ids=["(I+1, K)", "(K, I+1)"])
def test_a_two_way_core_takes_its_folded_bias_in_one_addmm_with_the_same_gradients(core_labels):
    step = ContractionStep((0, 1), "", ("b", "r"), 0, (("b", "i"), core_labels))
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(5, 3, generator=gen, dtype=DTYPE, requires_grad=True)
    core = torch.randn([4 if x == "i" else 6 for x in core_labels], generator=gen, dtype=DTYPE, requires_grad=True)
    with AtenCalls() as calls:
        ours = affine_einsum(step, [z, core], 0, "i")
    assert dict(calls.kernels) == {"addmm": 1}  # the product and the bias row in one kernel
    full = torch.cat([z, torch.ones(5, 1, dtype=DTYPE)], dim=-1)
    reference = torch.einsum(f"bi,{''.join(core_labels)}->br", full, core)
    torch.testing.assert_close(ours, reference)
    grad = torch.randn(5, 6, generator=gen, dtype=DTYPE)
    torch.testing.assert_close(
        torch.autograd.grad(ours, (z, core), grad), torch.autograd.grad(reference, (z, core), grad)
    )


def test_a_folded_bias_that_keeps_a_label_of_z_is_no_matrix_product():
    # z (b, i) against T (b, i + 1) summed over i: the result keeps b from both sides, no addmm form
    step = ContractionStep((0, 1), "", ("b",), 0, (("b", "i"), ("b", "i")))
    gen = torch.Generator().manual_seed(5)
    z, core = torch.randn(5, 3, generator=gen, dtype=DTYPE), torch.randn(5, 4, generator=gen, dtype=DTYPE)
    full = torch.cat([z, torch.ones(5, 1, dtype=DTYPE)], dim=-1)
    torch.testing.assert_close(affine_einsum(step, [z, core], 0, "i"), torch.einsum("bi,bi->b", full, core))


class _RightFactors(TorchDispatchMode):
    """Records the right factor of every ``mm`` run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.factors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.factors.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(NETWORKS))
@pytest.mark.parametrize("batch", [1, 2, COLUMN_MAJOR_ROWS, 8])
def test_a_prepared_plan_reads_its_wide_right_factors_by_columns_from_its_column_major_batch(name, batch):
    network = NETWORKS[name]()
    cores, coefficients, z, full = _call(network, batch)
    derived: dict = {}
    prepared = PreparedPlan(plan_forward(network, batch), cores, ones_appended="i", derived=derived)
    with _RightFactors() as seen:
        result = prepared([*coefficients, z])
    torch.testing.assert_close(result, _reference(network, cores, coefficients, full))
    stored = {(m.data_ptr(), m.shape, m.stride()) for m in derived.values()}
    factors = [m for m in seen.factors if (m.data_ptr(), m.shape, m.stride()) in stored and min(m.shape) > 1]
    assert factors  # every plan here multiplies per-call rows by a prepared core
    assert name != "cp" or any(m.shape[1] >= m.shape[0] for m in factors)  # CP's output factor is wide
    for m in factors:  # wide factors by columns from the column-major batch on, all others by rows
        assert m.stride() == (
            (1, m.shape[0]) if batch >= COLUMN_MAJOR_ROWS and m.shape[1] >= m.shape[0] else (m.shape[1], 1)
        )
