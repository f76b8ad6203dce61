"""Zero-padded bonds: exact for any network (values and gradients), which bonds a layer pads, its option."""

import copy
import pickle
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import any_network

import mumoe_tn.layers.experts as experts_module
from mumoe_tn import MuMoE
from mumoe_tn.contractions import plan_forward, run_plan
from mumoe_tn.contractions.padding import MIN_PADDED_SIZE, PAD_MULTIPLE, bond_padding, pad_cores
from mumoe_tn.contractions.plan import einsum_equation
from mumoe_tn.decompositions import build
from mumoe_tn.layers import FactorizedExperts

DTYPE = torch.float64


def _operands(network, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    cores = [torch.randn(shape, generator=gen, dtype=DTYPE) for shape in network.core_shapes.values()]
    rows = [torch.rand(batch, n, generator=gen, dtype=DTYPE) for n in network.expert_dims]
    rows.append(torch.randn(batch, network.in_features, generator=gen, dtype=DTYPE))
    return cores, rows


@given(network=any_network(), extra=st.lists(st.integers(0, 3), min_size=8, max_size=8), batch=st.integers(1, 4))
def test_padded_bonds_give_the_einsum_result_and_gradients(network, extra, batch):
    # Any bonds padded by any amount: the planned contraction over the padded cores equals one
    # torch.einsum over the true cores, and the cores' gradients equal the einsum's.
    padding = {bond: network.sizes[bond] + more for bond, more in zip(network.bonds, extra, strict=False) if more}
    cores, rows = _operands(network, batch, seed=len(padding))
    inputs, output = network.forward_equation()
    leaves = [core.clone().requires_grad_() for core in cores]
    padded = pad_cores(leaves, list(network.cores.values()), padding)
    for core, labels in zip(padded, network.cores.values(), strict=True):
        assert [network.sizes[x] + (padding[x] - network.sizes[x] if x in padding else 0) for x in labels] == list(
            core.shape
        )
    y = run_plan(plan_forward(network, batch, "auto"), [*padded, *rows])
    reference_leaves = [core.clone().requires_grad_() for core in cores]
    expected = torch.einsum(einsum_equation(inputs, output), *reference_leaves, *rows)
    torch.testing.assert_close(y, expected)
    weight = torch.randn(expected.shape, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((y * weight).sum(), leaves)
    expected_grads = torch.autograd.grad((expected * weight).sum(), reference_leaves)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_padded_slices_are_zero_and_the_rest_is_the_core():
    core = torch.arange(6.0).reshape(2, 3)
    (padded,) = pad_cores([core], [("r", "s")], {"r": 4, "s": 5})
    expected = torch.zeros(4, 5)
    expected[:2, :3] = core
    assert torch.equal(padded, expected)
    untouched = pad_cores([core], [("r", "s")], {"t": 9})
    assert untouched[0] is core  # nothing to pad: no copy


def test_which_bonds_are_padded():
    # Bonds of at least MIN_PADDED_SIZE (256) go up to the next multiple; smaller or aligned ones stay.
    assert MIN_PADDED_SIZE == 256 and PAD_MULTIPLE == 16
    tr = build("tr", [3, 2], 2, 2, [255, 256, 257, 529])
    bonds = dict(zip(tr.bonds, (255, 256, 257, 529), strict=True))
    assert {tr.sizes[b] for b in tr.bonds} == {255, 256, 257, 529}
    expected16 = {b: {257: 272, 529: 544}[size] for b, size in bonds.items() if size in (257, 529)}
    assert bond_padding(tr, 16) == expected16
    expected8 = {b: {257: 264, 529: 536}[size] for b, size in bonds.items() if size in (257, 529)}
    assert bond_padding(tr, 8) == expected8
    expected3 = {b: {256: 258, 257: 258, 529: 531}[size] for b, size in bonds.items() if size >= 256}
    assert bond_padding(tr, 3) == expected3  # 256 itself is large enough
    assert bond_padding(tr, 1) == {} and bond_padding(tr, None) == {}
    assert bond_padding(build("cp", [3], 2, 2, 38), 16) == {}


def test_pad_cores_refuses_mismatched_labels_and_shrinking():
    core = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"^got 1 cores for 2 label tuples$"):
        pad_cores([core], [("r", "s"), ("s",)], {})
    with pytest.raises(ValueError, match=re.escape("a core of shape (2, 3) cannot carry the labels ('r',)")):
        pad_cores([core], [("r",)], {})
    with pytest.raises(ValueError, match=r"^bond 's' of size 3 cannot be padded to 2$"):
        pad_cores([core], [("r", "s")], {"s": 2})


def _cp_with_large_rank(**options):
    torch.manual_seed(0)
    return FactorizedExperts(build("cp", [3], 4, 5, 300), dtype=DTYPE, **options)


def test_a_layer_pads_its_large_bond_and_gives_the_unpadded_result(monkeypatch):
    padded_layer = _cp_with_large_rank()
    plain_layer = _cp_with_large_rank(pad_bonds=None)
    assert padded_layer.pad_bonds == PAD_MULTIPLE
    seen = []
    real_run_plan = run_plan

    def spy(plan, operands, **kwargs):
        seen.append([tuple(t.shape) for t in operands[:3]])
        return real_run_plan(plan, operands, **kwargs)

    monkeypatch.setattr("mumoe_tn.layers.experts.run_plan", spy)
    z = torch.randn(6, 3, dtype=DTYPE, requires_grad=True)
    a = [torch.rand(6, 3, dtype=DTYPE)]
    for recompute in (False, True):
        padded_layer.recompute = plain_layer.recompute = recompute
        seen.clear()
        y = padded_layer(z, a, append_one=True)
        assert seen[0] == [(3, 304), (4, 304), (5, 304)]  # U_n1, U_i, U_o with R = 300 → 304
        seen.clear()
        expected = plain_layer(z, a, append_one=True)
        assert seen[0] == [(3, 300), (4, 300), (5, 300)]
        torch.testing.assert_close(y, expected)
        weight = torch.randn_like(y)
        got = torch.autograd.grad((y * weight).sum(), [z, *padded_layer.parameters()])
        want = torch.autograd.grad((expected * weight).sum(), [z, *plain_layer.parameters()])
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w)


def test_inference_constants_come_from_the_unpadded_cores(monkeypatch):
    # Tucker 2×2 experts: its core and coefficient factors are contracted once in eval mode.
    torch.manual_seed(0)
    layer = MuMoE(4, 5, (2, 2), "tucker", [2, 2, 2, 260], dtype=DTYPE).eval()
    assert bond_padding(layer.network, 16)  # one bond of 260 → 272
    seen = []
    real = experts_module.PreparedPlan

    def spy(plan, cores, constants=None, **kwargs):
        seen.append((constants, [tuple(t.shape) for t in cores]))
        return real(plan, cores, constants, **kwargs)

    monkeypatch.setattr(experts_module, "PreparedPlan", spy)
    x = torch.randn(3, 4, dtype=DTYPE)
    with torch.no_grad():
        cached = layer(x)
        (constants, shapes), *_ = seen
        assert constants  # the cached core-only intermediates are used…
        assert shapes == list(layer.network.core_shapes.values())  # …with the cores as they are
        layer.experts.precontract = False
        every_call = layer(x)
        assert 272 not in {size for shape in seen[-1][1] for size in shape}  # a few rows: never padded
        layer(torch.randn(300, 4, dtype=DTYPE))
        assert 272 in {size for shape in seen[-1][1] for size in shape}  # large batches: padded
        layer.experts.pad_bonds = None
        plain = layer(x)
    torch.testing.assert_close(cached, plain)
    torch.testing.assert_close(every_call, plain)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "pad_bonds must be a positive int, got 0"),
        (True, TypeError, "pad_bonds must be a positive int, got True (bool)"),
        ("16", TypeError, "pad_bonds must be a positive int, got '16' (str)"),
    ],
)
def test_pad_bonds_is_checked(value, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        FactorizedExperts(build("cp", [3], 4, 5, 2), pad_bonds=value)
    layer = FactorizedExperts(build("cp", [3], 4, 5, 2))
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        layer.pad_bonds = value  # set later, as the cookbook shows
    assert layer.pad_bonds == PAD_MULTIPLE
    layer.pad_bonds = None
    assert layer.pad_bonds is None


@pytest.mark.parametrize("multiple", [0, -16, 2.5, True])
def test_bond_padding_refuses_a_bad_multiple(multiple):
    network = build("cp", [3], 4, 5, 300)
    with pytest.raises(
        ValueError, match=f"^pad_bonds must be a positive int or None, got {re.escape(repr(multiple))}$"
    ):
        bond_padding(network, multiple)


def test_chunks_share_one_padded_copy_of_the_cores(monkeypatch):
    calls = []
    real_pad_cores = pad_cores

    def counted(*args):
        calls.append(1)
        return real_pad_cores(*args)

    monkeypatch.setattr("mumoe_tn.layers.experts.pad_cores", counted)
    layer = _cp_with_large_rank()
    expected = _cp_with_large_rank(pad_bonds=None)
    layer.chunk_size = expected.chunk_size = 4
    z, a = torch.randn(10, 3, dtype=DTYPE), [torch.rand(10, 3, dtype=DTYPE)]
    torch.testing.assert_close(layer(z, a, append_one=True), expected(z, a, append_one=True))
    assert len(calls) == 1  # three chunks, one padding


def test_pickles_and_copies_keep_the_padding_option():
    layer = _cp_with_large_rank(pad_bonds=8)
    for clone in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert clone.pad_bonds == 8


def test_the_compiled_layer_pads_and_matches_the_unpadded_eager_layer(monkeypatch):
    torch.manual_seed(0)
    layer = MuMoE(4, 5, 3, "cp", 300)
    assert bond_padding(layer.network, layer.experts.pad_bonds) == {"r": 304}
    x = torch.randn(6, 4)
    layer.experts.pad_bonds = None
    expected = layer(x)
    layer.experts.pad_bonds = PAD_MULTIPLE
    padded_shapes = []
    real_pad_cores = pad_cores

    def noted(cores, labels, padding):
        padded_shapes.append(dict(padding))
        return real_pad_cores(cores, labels, padding)

    monkeypatch.setattr("mumoe_tn.layers.experts.pad_cores", noted)
    compiled = torch.compile(layer, fullgraph=True)(x)
    assert padded_shapes and padded_shapes[0] == {"r": 304}  # traced through the padding
    torch.testing.assert_close(compiled, expected, rtol=1e-4, atol=1e-5)
