"""Planned factorized contractions against independent dense references."""

import opt_einsum
import pytest
import tensorly as tl
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import any_network, named_networks

from mumoe_tn.contractions import (
    OPTIMIZERS,
    dense_forward,
    expert_matrix,
    materialise,
    plan_contraction,
    plan_forward,
    run_plan,
    squared_norm,
)
from mumoe_tn.decompositions import cp, tr
from mumoe_tn.network import BATCH_LABEL

DTYPE = torch.float64


def random_cores(network, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=DTYPE) for name, shape in network.core_shapes.items()}


def random_inputs(network, batch, seed=1):
    gen = torch.Generator().manual_seed(seed)
    coefficients = [torch.rand(batch, n, generator=gen, dtype=DTYPE) for n in network.expert_dims]
    return coefficients, torch.randn(batch, network.in_features, generator=gen, dtype=DTYPE)


def einsum_reference(network, cores):
    """W from one opt_einsum call over the whole network, independent of our planner."""
    inputs, output = network.dense_equation()
    sym = {label: opt_einsum.get_symbol(k) for k, label in enumerate(network.sizes)}
    eq = ",".join("".join(sym[x] for x in labels) for labels in inputs) + "->" + "".join(sym[x] for x in output)
    return torch.from_numpy(opt_einsum.contract(eq, *[cores[c].numpy() for c in network.cores]))


@given(any_network(), st.integers(1, 6))
def test_factorized_forward_equals_dense_forward(network, batch):
    cores = random_cores(network)
    coefficients, z = random_inputs(network, batch)
    y = run_plan(plan_forward(network, batch), [*cores.values(), *coefficients, z])
    weight = materialise(network, cores)
    torch.testing.assert_close(weight, einsum_reference(network, cores))
    torch.testing.assert_close(y, dense_forward(weight, coefficients, z))


@pytest.mark.parametrize("optimize", [o for o in OPTIMIZERS if o != "cotengra"] + ["cotengra"])
@given(network=any_network(max_modes=3))
def test_every_optimizer_gives_the_same_result(optimize, network):
    if optimize == "cotengra":
        pytest.importorskip("cotengra")
    cores = random_cores(network)
    coefficients, z = random_inputs(network, 3)
    plan = plan_forward(network, 3, optimize)
    y = run_plan(plan, [*cores.values(), *coefficients, z])
    torch.testing.assert_close(y, dense_forward(materialise(network, cores), coefficients, z))


@given(any_network(), st.integers(2, 64))
def test_plan_is_pairwise_with_batch_leading(network, batch):
    plan = plan_forward(network, batch)
    for step in plan.steps:
        assert len(step.positions) <= 2
        if BATCH_LABEL in step.output:
            assert step.output[0] == BATCH_LABEL
    assert plan.steps[-1].output == (BATCH_LABEL, "o")


@given(named_networks())
def test_materialize_matches_tensorly(network):
    cores = random_cores(network)
    legs = [*network.expert_legs, "i", "o"]
    with tl.backend_context("pytorch"):
        if network.name == "cp":
            factors = [cores[f"U_{leg}"] for leg in legs]
            reference = tl.cp_to_tensor((torch.ones(network.sizes["r"], dtype=DTYPE), factors))
        elif network.name == "tr":
            reference = tl.tr_to_tensor([cores[f"G_{leg}"] for leg in legs])
        elif network.name == "tt":
            factors = [cores[f"G_{leg}"] for leg in legs]
            factors[0], factors[-1] = factors[0][None], factors[-1][..., None]
            reference = tl.tt_to_tensor(factors)
        elif network.name == "mxd":  # W[n1…nE, i, o] = D[i, o] · Π_e C_ne[ne, o], a Khatri–Rao product along o
            reference = cores["D"]
            for leg in reversed(network.expert_legs):
                reference = cores[f"C_{leg}"].reshape(-1, *[1] * (reference.ndim - 1), reference.shape[-1]) * reference
        else:
            reference = tl.tucker_to_tensor((cores["core"], [cores[f"U_{leg}"] for leg in legs]))
    torch.testing.assert_close(materialise(network, cores), reference)


@given(any_network(), st.data())
def test_expert_matrix_and_norm_without_materializing(network, data):
    cores = random_cores(network)
    weight = materialise(network, cores)
    index = tuple(data.draw(st.integers(-n, n - 1)) for n in network.expert_dims)
    torch.testing.assert_close(expert_matrix(network, cores, index), weight[index])
    torch.testing.assert_close(squared_norm(network, cores), weight.pow(2).sum())


def test_expert_index_errors():
    network = cp((3, 4), 5, 6, 2)
    cores = random_cores(network)
    with pytest.raises(ValueError, match=r"one int per expert mode \('n1', 'n2'\), got \(1,\)"):
        expert_matrix(network, cores, 1)
    with pytest.raises(ValueError, match=r"expert index 4 is out of range for leg 'n2' of size 4"):
        expert_matrix(network, cores, (0, 4))
    for bad in ((0, 1.5), (0, "1"), (True, 0)):
        with pytest.raises(ValueError, match=r"one int per expert mode \('n1', 'n2'\), got \("):
            expert_matrix(network, cores, bad)


def test_dense_forward_needs_one_coefficient_tensor_per_expert_mode():
    weight = torch.randn(3, 4, 5, 6, dtype=DTYPE)
    a = torch.rand(2, 3, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"^W has 2 expert modes but 1 coefficient tensors were given$"):
        dense_forward(weight, [a], torch.randn(2, 5, dtype=DTYPE))


# The paper's appendix "Fast μMoE implementations", transcribed with torch.einsum. The paper
# stores CP factors as (R × leg) matrices G; ours are (leg × R), so G = U.T.
def paper_cp(cores, a, z):
    legs = [f"n{k + 1}" for k in range(len(a))]
    terms = [aa @ cores[f"U_{leg}"] for aa, leg in zip(a, legs, strict=False)] + [z @ cores["U_i"]]
    equation = "ro," + ",".join("btr" for _ in terms) + "->bto"
    return torch.einsum(equation, cores["U_o"].T, *terms)


def paper_tr(cores, a, z):
    if len(a) == 1:
        f1 = torch.einsum("btn,anc->btac", a[0], cores["G_n1"])
        f2 = torch.einsum("bti,cid->btcd", z, cores["G_i"])
        fout = torch.einsum("btac,btcd->btad", f1, f2)
        return torch.einsum("doa,btad->bto", cores["G_o"], fout)
    f1 = torch.einsum("btn,anc->btac", a[0], cores["G_n1"])
    f2 = torch.einsum("btn,cnd->btcd", a[1], cores["G_n2"])
    f3 = torch.einsum("bti,die->btde", z, cores["G_i"])
    fout = torch.einsum("btac,btcd->btad", f1, f2)
    fout = torch.einsum("btad,btde->btae", fout, f3)
    return torch.einsum("eoa,btae->bto", cores["G_o"], fout)


@pytest.mark.parametrize("n_modes", [1, 2])
@pytest.mark.parametrize(("builder", "paper"), [(cp, paper_cp), (tr, paper_tr)])
def test_matches_paper_einsum_pseudocode(n_modes, builder, paper):
    dims = (5, 3)[:n_modes]
    rank = 6 if builder is cp else (2, 3, 4, 5)[: n_modes + 2]
    network = builder(dims, 7, 8, rank)
    cores = random_cores(network)
    gen = torch.Generator().manual_seed(3)
    a = [torch.rand(2, 4, n, generator=gen, dtype=DTYPE) for n in dims]
    z = torch.randn(2, 4, 7, generator=gen, dtype=DTYPE)
    ours = run_plan(plan_forward(network, 8), [*cores.values(), *(x.reshape(8, -1) for x in a), z.reshape(8, -1)])
    torch.testing.assert_close(ours.reshape(2, 4, 8), paper(cores, a, z))


def test_optimizer_errors():
    with pytest.raises(ValueError, match=r"unknown optimizer 'fastest'"):
        plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), {"a": 2, "b": 3, "c": 4}, "fastest")
    with pytest.raises(TypeError, match=r"optimize must be"):
        plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), {"a": 2, "b": 3, "c": 4}, 3.5)


@given(any_network(), st.integers(1, 5))
def test_folded_bias_without_concatenation(network, batch):
    network = network.with_sizes(i=network.in_features + 1)
    cores = random_cores(network)
    coefficients, z = random_inputs(network, batch)
    short = z[:, :-1]
    full = torch.cat([short, torch.ones(batch, 1, dtype=DTYPE)], dim=-1)
    plan = plan_forward(network, batch)
    expected = run_plan(plan, [*cores.values(), *coefficients, full])
    torch.testing.assert_close(run_plan(plan, [*cores.values(), *coefficients, short], ones_appended="i"), expected)
