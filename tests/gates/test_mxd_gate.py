"""The Mixture of Decoders gate: top-k of ReLU'd biased logits, kept as they are (not renormalised)."""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn import functional as F

from mumoe_tn import MuMoE
from mumoe_tn.costs import gate_fma, layer_parameters
from mumoe_tn.decompositions import build
from mumoe_tn.gates import ReLUTopKGate as ExportedFromGates
from mumoe_tn.gates.specs import GateSpec, ReLUTopKGate

DTYPE = torch.float64


def _reference(z, weights, biases, ks, norm):
    """Written out: per mode, logits (+ bias), the norm, ReLU, then the k largest scattered back into zeros."""
    out = []
    for weight, bias, k in zip(weights, biases, ks, strict=True):
        logits = z @ weight.T
        if bias is not None:
            logits = logits + bias
        if norm == "layer":
            logits = F.layer_norm(logits, logits.shape[-1:])
        elif norm == "batch":  # training-mode statistics of the batch, biased variance
            mean = logits.mean(0)
            var = logits.var(0, unbiased=False)
            logits = (logits - mean) / torch.sqrt(var + 1e-5)
        positive = torch.relu(logits)
        values, indices = torch.topk(positive, k, dim=-1)
        out.append(torch.zeros_like(positive).scatter(-1, indices, values))
    return out


def _params(gate):
    weights = [p.weight for p in gate.projections.values()]
    biases = [p.bias for p in gate.projections.values()]
    return weights, biases


@st.composite
def _configs(draw):
    dims = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    per_mode = draw(st.booleans())
    ks = tuple(draw(st.integers(1, n)) for n in dims) if per_mode else None
    k = ks if per_mode else draw(st.integers(1, min(dims)))
    return dims, k


@given(
    config=_configs(),
    in_features=st.integers(1, 9),
    rows=st.integers(2, 12),
    bias=st.booleans(),
    norm=st.sampled_from(["none", "layer", "batch"]),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_equal_relu_topk_scatter_by_hand(config, in_features, rows, bias, norm, seed):
    dims, k = config
    torch.manual_seed(seed)
    gate = ReLUTopKGate(k=k, bias=bias, norm=norm).build(in_features, dims, dtype=DTYPE)
    if bias:  # nn.Linear's bias init is small: spread it so both signs and ReLU cuts occur
        with torch.no_grad():
            for projection in gate.projections.values():
                projection.bias.normal_()
    z = torch.randn(rows, in_features, dtype=DTYPE)
    ks = k if isinstance(k, tuple) else (k,) * len(dims)
    coefficients = gate(z)
    assert len(coefficients) == len(dims)
    weights, biases = _params(gate)
    expected = _reference(z, weights, biases, ks, norm)
    for a, e, n, kk in zip(coefficients, expected, dims, ks, strict=True):
        assert a.shape == (rows, n) and a.dtype == DTYPE
        torch.testing.assert_close(a, e)
        assert ((a != 0).sum(-1) <= kk).all() and (a >= 0).all()
    # gradients reach G and b exactly as through the hand-written ReLU + top-k
    probe = [torch.randn_like(a) for a in coefficients]
    sum((a * p).sum() for a, p in zip(coefficients, probe, strict=True)).backward()
    leaves = [w.detach().clone().requires_grad_() for w in weights]
    offsets = [None if b is None else b.detach().clone().requires_grad_() for b in biases]
    again = _reference(z, leaves, offsets, ks, norm)
    sum((a * p).sum() for a, p in zip(again, probe, strict=True)).backward()
    for w, leaf in zip(weights, leaves, strict=True):
        torch.testing.assert_close(w.grad, leaf.grad)
    for b, leaf in zip(biases, offsets, strict=True):
        assert (b is None) == (leaf is None)
        if b is not None:
            torch.testing.assert_close(b.grad, leaf.grad)


def test_coefficients_are_not_renormalised():
    torch.manual_seed(0)
    gate = ReLUTopKGate(k=3).build(6, (10,), dtype=DTYPE)
    with torch.no_grad():
        gate.projections.n1.weight.mul_(5)
    z = torch.randn(64, 6, dtype=DTYPE)
    (a,) = gate(z)
    sums = a.sum(-1)
    assert (sums - 1).abs().max() > 0.5  # a softmax router's rows would all sum to 1
    logits = gate.projections.n1(z)
    kept = a != 0
    torch.testing.assert_close(a[kept], logits[kept])  # kept entries are the logits themselves
    assert (logits[kept] > 0).all()


@given(
    in_features=st.integers(1, 40),
    dims=st.lists(st.integers(1, 30), min_size=1, max_size=3).map(tuple),
    bias=st.booleans(),
)
def test_costs_equal_hand_formulas_and_the_built_module(in_features, dims, bias):
    spec = ReLUTopKGate(k=1, bias=bias)
    assert isinstance(spec, GateSpec)
    total = sum(dims)
    assert spec.parameter_count(in_features, dims) == in_features * total + (total if bias else 0)
    assert spec.fma_per_token(in_features, dims) == in_features * total
    module = spec.build(in_features, dims)
    assert sum(p.numel() for p in module.parameters()) == spec.parameter_count(in_features, dims)


@pytest.mark.parametrize("bias", [True, False])
def test_cost_model_and_layer_agree(bias):
    spec = ReLUTopKGate(k=2, bias=bias)
    network = build("cp", (4, 6), 8 + 1, 5, 3)  # leg i holds the bias column
    counted = layer_parameters(network, gate=spec)
    assert counted.gate == 8 * 10 + (10 if bias else 0)
    assert gate_fma(network, gate=spec) == 8 * 10
    layer = MuMoE(8, 5, (4, 6), "cp", 3, gate=spec)
    assert counted.total == sum(p.numel() for p in layer.parameters())
    assert layer_parameters(layer.network, gate=spec) == counted


def test_layer_forward_backward_eval_batch_one_and_half_precision():
    torch.manual_seed(0)
    spec = ReLUTopKGate(k=(2, 1))
    layer = MuMoE(8, 5, (4, 3), "cp", 3, gate=spec, dtype=DTYPE)
    assert type(layer.gate).__name__ == "ReLUTopKRouter"
    x = torch.randn(2, 7, 8, dtype=DTYPE)
    y = layer(x)
    assert y.shape == (2, 7, 5)
    y.pow(2).sum().backward()
    assert layer.gate.projections.n1.weight.grad.abs().sum() > 0
    assert layer.gate.projections.n1.bias.grad.abs().sum() > 0
    # eval, no_grad, one token: the inference path gives what the training path gave
    layer.eval()
    with torch.no_grad():
        one = layer(x[:1, :1])
    torch.testing.assert_close(one, y[:1, :1].detach())
    # bfloat16 weights: the gate still computes in float32, the layer runs
    half = MuMoE(8, 5, (4, 3), "cp", 3, gate=spec, dtype=torch.bfloat16)
    out = half(torch.randn(3, 8, dtype=torch.bfloat16))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert half.gate.projections.n1.bias.grad is not None
    assert half.last_coefficients[0].dtype == torch.float32


@pytest.mark.parametrize("norm", ["none", "layer", "batch"])
def test_inference_path_folds_bias_and_norm(norm):
    torch.manual_seed(1)
    layer = MuMoE(6, 4, 5, "cp", 2, gate=ReLUTopKGate(k=2, norm=norm), dtype=DTYPE)
    with torch.no_grad():
        layer.gate.projections.n1.bias.normal_()
    for _ in range(3):  # running statistics for the batch norm
        layer(torch.randn(16, 6, dtype=DTYPE))
    layer.eval()
    x = torch.randn(10, 6, dtype=DTYPE)
    full = layer(x)  # grad enabled: the full path
    with torch.no_grad():
        folded = layer(x)  # the inference path, norm folded into the projection and its bias
    torch.testing.assert_close(folded, full.detach())


def test_token_mask_keeps_padding_out_of_batch_statistics():
    torch.manual_seed(2)
    layer = MuMoE(6, 4, 5, "cp", 2, gate=ReLUTopKGate(k=2, norm="batch"), dtype=DTYPE)
    real = torch.randn(5, 6, dtype=DTYPE)
    padded = torch.cat([real, 100 * torch.ones(3, 6, dtype=DTYPE)])
    mask = torch.tensor([True] * 5 + [False] * 3)
    alone = copy.deepcopy(layer)(real)
    masked = layer(padded, mask=mask)
    torch.testing.assert_close(masked[:5], alone)


def test_state_dict_round_trip():
    torch.manual_seed(3)
    spec = ReLUTopKGate(k=2)
    layer = MuMoE(6, 4, (3, 4), "cp", 2, gate=spec)
    state = layer.state_dict()
    assert {"gate.projections.n1.bias", "gate.projections.n2.bias"} <= set(state)
    fresh = MuMoE(6, 4, (3, 4), "cp", 2, gate=spec)
    fresh.load_state_dict(state)
    x = torch.randn(5, 6)
    torch.testing.assert_close(fresh(x), layer(x))


def test_zero_init_starts_k_experts_at_one_over_k_and_trains():
    gate = ReLUTopKGate(k=3, init="zeros").build(5, (8,), dtype=DTYPE)
    z = torch.randn(4, 5, dtype=DTYPE)
    (a,) = gate(z)
    assert ((a != 0).sum(-1) == 3).all()
    torch.testing.assert_close(a.sum(-1), torch.ones(4, dtype=DTYPE))
    (a * torch.randn_like(a)).sum().backward()
    assert gate.projections.n1.weight.grad.abs().sum() > 0


def test_causality_declaration():
    assert ReLUTopKGate(norm="batch").mixes_tokens is True
    assert ReLUTopKGate().mixes_tokens is False
    assert ReLUTopKGate(norm="layer").mixes_tokens is False


def test_exported_and_per_mode_k_normalised():
    import mumoe_tn

    assert ExportedFromGates is ReLUTopKGate is mumoe_tn.ReLUTopKGate
    assert ReLUTopKGate(k=[1, 2]).k == (1, 2)
    assert ReLUTopKGate(k=[1, 2]) == ReLUTopKGate(k=(1, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"k": 0}, ValueError, "k must be a positive int"),
        ({"k": -2}, ValueError, "-2"),
        ({"k": True}, ValueError, "True"),
        ({"k": 1.5}, ValueError, "1.5"),
        ({"k": ()}, ValueError, "non-empty"),
        ({"k": (1, "2")}, ValueError, "'2'"),
        ({"bias": "yes"}, TypeError, "bias must be a bool"),
        ({"norm": ""}, TypeError, "norm"),
        ({"norm": 3}, TypeError, "norm"),
        ({"init": "ones"}, ValueError, "unknown gate init 'ones'"),
        ({"init": "zeros", "bias": False}, ValueError, "needs bias=True"),
    ],
)
def test_bad_options_rejected_by_the_descriptor(kwargs, error, message):
    with pytest.raises(error, match=message):
        ReLUTopKGate(**kwargs)


@pytest.mark.parametrize(
    ("spec", "dims", "message"),
    [
        (ReLUTopKGate(k=5), (4,), r"k=5 for expert mode 1 is more than its N_e=4"),
        (ReLUTopKGate(k=(1, 4)), (3, 3), r"k=4 for expert mode 2 is more than its N_e=3"),
        (ReLUTopKGate(k=(1, 2)), (3, 3, 3), r"one entry per expert mode"),
        (ReLUTopKGate(norm="group"), (3,), r"unknown gate norm 'group'"),
    ],
)
def test_bad_options_for_the_expert_dims_rejected_when_built(spec, dims, message):
    with pytest.raises(ValueError, match=message):
        MuMoE(6, 4, dims, "cp", 2, gate=spec)


def test_relu_top_k_layer_says_its_gate_has_no_balance_loss():
    layer = MuMoE(6, 4, 8, "cp", 3, gate=ReLUTopKGate(k=2))
    layer(torch.randn(5, 6))
    with pytest.raises(ValueError, match=r"ReLUTopKGate\(.*\) has no balance_loss option, so it records no 'balance'"):
        layer.aux_loss()
