"""Pluggable gates: descriptors, the top-k router, auxiliary losses, gate options, state and threads."""

import copy
import io
import math
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass

import entmax
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn import MuMoE
from mumoe_tn.costs import gate_fma, layer_flops, layer_parameters
from mumoe_tn.decompositions import build
from mumoe_tn.gates.records import gate_losses
from mumoe_tn.gates.specs import DEFAULT_GATE, Gate, GateSpec, ReLUTopKGate, TopKGate
from mumoe_tn.layers import MuMoEMLP

DTYPE = torch.float64


# ----------------------------------------------------------------------------- a user's own gate
class AffineSoftmax(nn.Module):
    """A gate the package does not know: one *biased* projection per mode, then softmax."""

    def __init__(self, in_features, expert_dims, device=None, dtype=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(in_features, n, device=device, dtype=dtype) for n in expert_dims)
        self.calls = 0

    def forward(self, z):
        self.calls += 1
        return tuple(torch.softmax(layer(z), dim=-1) for layer in self.layers)


@dataclass(frozen=True)
class AffineSoftmaxGate:
    """Its descriptor: written against the protocol only (no subclassing of package classes)."""

    def parameter_count(self, in_features, expert_dims):
        return (in_features + 1) * sum(expert_dims)

    def fma_per_token(self, in_features, expert_dims):
        return in_features * sum(expert_dims) + sum(expert_dims)

    def build(self, in_features, expert_dims, *, device=None, dtype=None):
        return AffineSoftmax(in_features, expert_dims, device=device, dtype=dtype)


def test_custom_gate_drives_layer_and_costs():
    spec = AffineSoftmaxGate()
    assert isinstance(spec, GateSpec)
    torch.manual_seed(0)
    layer = MuMoE(5, 3, 4, "cp", 2, gate=spec, dtype=DTYPE)
    assert isinstance(layer.gate, AffineSoftmax)
    x = torch.randn(6, 5, dtype=DTYPE)
    y = layer(x)
    # independent reference: the gate by hand, every expert's matrix from the dense tensor
    first = layer.gate.layers[0]
    a = torch.softmax(x @ first.weight.T + first.bias, dim=-1)
    weight = layer.experts.to_dense()  # (N, I + 1, O)
    z1 = torch.cat([x, torch.ones(6, 1, dtype=DTYPE)], dim=-1)
    expected = torch.einsum("bn,nio,bi->bo", a, weight, z1)
    torch.testing.assert_close(y, expected)
    counted = layer_parameters(layer.network, gate=spec)
    assert counted.gate == sum(p.numel() for p in layer.gate.parameters()) == 6 * 4
    assert counted.total == sum(p.numel() for p in layer.parameters())
    assert gate_fma(layer.network, gate=spec) == 5 * 4 + 4
    assert layer_flops(layer.network, batch=3, gate=spec).gate == 3 * 24


def test_custom_gate_counted_when_matching_a_linear_layer():
    # nn.Linear(7, 11) has 88 parameters; the biased gate's 3 extra ones tip the CP rank 4 -> 3.
    assert MuMoE(7, 11, 2, "cp", match="linear").network.sizes["r"] == 4
    spec = AffineSoftmaxGate()
    layer = MuMoE(7, 11, 2, "cp", match="linear", gate=spec)
    assert layer.network.sizes["r"] == 3
    total = sum(p.numel() for p in layer.parameters())
    assert total == layer_parameters(layer.network, gate=spec).total
    for other in (2, 4):
        resized = layer.network.with_sizes(r=other)
        assert abs(total - 88) <= abs(layer_parameters(resized, gate=spec).total - 88)


def test_default_and_no_gate_counts_by_hand():
    network = build("cp", (5, 3), 7 + 1, 4, 2)
    assert layer_parameters(network).gate == 7 * 8
    assert layer_parameters(network, gate=DEFAULT_GATE).gate == 7 * 8
    assert layer_parameters(network, gate=TopKGate(k=2)).gate == 7 * 8
    assert layer_parameters(network, gate=False).gate == 0
    assert gate_fma(network) == gate_fma(network, gate=Gate("softmax", "none")) == 7 * 8
    assert gate_fma(network, gate=False) == 0
    assert layer_flops(network, batch=2, gate=False).gate == 0


def test_bad_gate_arguments_to_costs():
    network = build("cp", 4, 6, 3, 2)
    with pytest.raises(TypeError, match=r"gate must be True.*got 'entmax15'"):
        layer_parameters(network, gate="entmax15")

    @dataclass(frozen=True)
    class Negative(AffineSoftmaxGate):
        def parameter_count(self, in_features, expert_dims):
            return -1

    with pytest.raises(ValueError, match=r"parameter_count = -1"):
        layer_parameters(network, gate=Negative())


def test_descriptors_and_costs_import_no_torch():
    code = (
        "import sys; import mumoe_tn.gates.specs, mumoe_tn.costs; "
        "from mumoe_tn.gates.specs import TopKGate; TopKGate(k=2).parameter_count(4, (3,)); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- the top-k router
def _topk_by_hand(logits, k):
    """Row by row in Python floats: the k largest logits (lower index on ties), softmax over them."""
    rows = []
    for row in logits.tolist():
        order = sorted(range(len(row)), key=lambda n: (-row[n], n))[:k]
        top = max(row[n] for n in order)
        weights = {n: math.exp(row[n] - top) for n in order}
        total = sum(weights.values())
        rows.append([weights.get(n, 0.0) / total for n in range(len(row))])
    return torch.tensor(rows, dtype=DTYPE)


@given(
    dims=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    data=st.data(),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_topk_router_equals_hand_computation(dims, data, rows, seed):
    ks = tuple(data.draw(st.integers(1, n)) for n in dims)
    torch.manual_seed(seed)
    router = TopKGate(k=ks).build(4, tuple(dims), dtype=DTYPE)
    z = torch.randn(rows, 4, dtype=DTYPE)
    coefficients = router(z)
    for a, projection, k in zip(coefficients, router.projections.values(), ks, strict=True):
        torch.testing.assert_close(a, _topk_by_hand(z @ projection.weight.T, k))
        assert ((a > 0).sum(-1) == k).all()


def test_topk_router_in_hierarchical_layer_and_validation():
    layer = MuMoE(6, 4, (5, 3), "tr", 2, gate=TopKGate(k=(2, 1)))
    layer(torch.randn(7, 6))
    a1, a2 = layer.last_coefficients
    assert ((a1 > 0).sum(-1) == 2).all() and ((a2 > 0).sum(-1) == 1).all()
    with pytest.raises(ValueError, match=r"k must be an int in \[1, N_e\].*\(5, 3\), got k=4"):
        MuMoE(6, 4, (5, 3), "tr", 2, gate=TopKGate(k=4))
    with pytest.raises(ValueError, match=r"one entry per expert mode"):
        MuMoE(6, 4, (5, 3), "tr", 2, gate=TopKGate(k=(1, 1, 1)))
    with pytest.raises(ValueError, match=r"k must be a positive int.*got 0"):
        TopKGate(k=0)


# ----------------------------------------------------------------------------- auxiliary losses
def _balance_by_hand(logits, k):
    """Switch: N · Σ_i f_i P_i with f from the top-k dispatch and P the mean softmax, in floats."""
    rows, n = len(logits), len(logits[0])
    dispatch = [0.0] * n
    probability = [0.0] * n
    for row in logits:
        for e in sorted(range(n), key=lambda e: (-row[e], e))[:k]:
            dispatch[e] += 1 / (k * rows)
        top = max(row)
        exps = [math.exp(v - top) for v in row]
        for e in range(n):
            probability[e] += exps[e] / sum(exps) / rows
    return n * sum(f * p for f, p in zip(dispatch, probability, strict=True))


def _z_by_hand(logits):
    total = 0.0
    for row in logits:
        top = max(row)
        total += (top + math.log(sum(math.exp(v - top) for v in row))) ** 2
    return total / len(logits)


def test_router_losses_equal_hand_computation_and_carry_gradients():
    torch.manual_seed(1)
    layer = MuMoE(6, 4, (5, 3), "cp", 2, gate=TopKGate(k=(2, 1), balance_loss=True, z_loss=True), dtype=DTYPE)
    x = torch.randn(9, 6, dtype=DTYPE)
    layer(x)
    losses = layer.gate_losses()
    logits = [(x @ p.weight.T).tolist() for p in layer.gate.projections.values()]
    balance = (_balance_by_hand(logits[0], 2) + _balance_by_hand(logits[1], 1)) / 2
    z = (_z_by_hand(logits[0]) + _z_by_hand(logits[1])) / 2
    assert losses["balance"].item() == pytest.approx(balance, rel=1e-12)
    assert losses["z"].item() == pytest.approx(z, rel=1e-12)
    assert layer.aux_loss() is not None and layer.z_loss() is not None
    (layer.aux_loss() + layer.z_loss()).backward()
    for projection in layer.gate.projections.values():
        assert projection.weight.grad is not None
        assert projection.weight.grad.abs().sum() > 0


def test_dense_gate_balance_uses_argmax_dispatch_and_coefficients():
    torch.manual_seed(2)
    gate = Gate("softmax", "none", balance_loss=True).build(5, (4,), dtype=DTYPE)
    z = torch.randn(8, 5, dtype=DTYPE, requires_grad=True)
    (a,) = gate(z)
    rows = a.tolist()
    dispatch = [0.0] * 4
    for row in rows:
        dispatch[max(range(4), key=lambda e: row[e])] += 1 / 8
    mean_a = [sum(row[e] for row in rows) / 8 for e in range(4)]
    expected = 4 * sum(f * p for f, p in zip(dispatch, mean_a, strict=True))
    assert gate.losses()["balance"].item() == pytest.approx(expected, rel=1e-12)
    gate.losses()["balance"].backward()
    assert gate.projections.n1.weight.grad.abs().sum() > 0


def test_losses_float32_under_autocast_summed_over_a_model_and_errors():
    model = nn.Sequential(
        MuMoE(8, 8, 4, "cp", 2, gate=TopKGate(k=2, balance_loss=True, z_loss=True)),
        nn.GELU(),
        MuMoEMLP(8, 16, 8, (3, 2), "cp", 2, gate=Gate(z_loss=True)),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(10, 8))
    first, second = model[0].gate_losses(), model[2].gate_losses()
    assert first["balance"].dtype == torch.float32 and first["z"].dtype == torch.float32
    total = gate_losses(model)
    assert set(total) == {"balance", "z"}
    torch.testing.assert_close(total["z"], first["z"] + second["z"])
    torch.testing.assert_close(total["balance"], first["balance"])
    with pytest.raises(ValueError, match=r"does not record the 'balance' loss: build it with balance_loss=True"):
        model[2].aux_loss()
    assert MuMoE(8, 8, 4, "cp", 2).gate_losses() == {}
    fresh = MuMoE(8, 8, 4, "cp", 2, gate=Gate(z_loss=True))
    with pytest.raises(ValueError, match=r"no forward pass of this gate in this thread"):
        fresh.z_loss()


# ----------------------------------------------------------------------------- gate options
@pytest.mark.parametrize(
    "spec",
    [
        Gate("entmax15", init="zeros"),
        Gate("sparsemax", "layer", "zeros"),
        Gate("softmax", "none", "zeros"),
        Gate(1.3, init="zeros"),
    ],
)
def test_zero_init_gives_uniform_coefficients(spec):
    layer = MuMoE(6, 4, (5, 3), "cp", 2, gate=spec)
    layer(torch.randn(4, 6) * 10)
    for a, n in zip(layer.last_coefficients, (5, 3), strict=True):
        torch.testing.assert_close(a, torch.full_like(a, 1 / n))
    layer.gate.projections.n1.weight.data.normal_()
    layer.reset_parameters()
    assert layer.gate.projections.n1.weight.abs().sum() == 0


def test_zero_init_top_k_picks_k_experts_at_1_over_k():
    layer = MuMoE(6, 4, 5, "cp", 2, gate=TopKGate(k=2, init="zeros"))
    layer(torch.randn(3, 6))
    (a,) = layer.last_coefficients
    assert ((a == 0.5).sum(-1) == 2).all() and ((a == 0).sum(-1) == 3).all()


@pytest.mark.parametrize("gate_input", ["normed", "raw"])
def test_gate_input_raw_or_normed(gate_input):
    torch.manual_seed(3)
    layer = MuMoE(6, 4, 5, "cp", 2, gate_norm="none", input_norm=True, gate_input=gate_input, dtype=DTYPE)
    with torch.no_grad():
        layer.input_norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(7, 6, dtype=DTYPE) * 3 + 5
    layer(x)
    weight = layer.gate.projections.n1.weight
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    normed = (x - mean) / torch.sqrt(var + 1e-5) * layer.input_norm.weight + layer.input_norm.bias
    seen = x if gate_input == "raw" else normed
    other = normed if gate_input == "raw" else x
    torch.testing.assert_close(layer.last_coefficients[0], entmax.entmax15(seen @ weight.T, dim=-1))
    assert not torch.allclose(layer.last_coefficients[0], entmax.entmax15(other @ weight.T, dim=-1))
    with pytest.raises(ValueError, match=r"gate_input must be one of \['normed', 'raw'\], got 'ln'"):
        MuMoE(6, 4, 5, "cp", 2, gate_input="ln")


# ----------------------------------------------------------------------------- validation order
@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (lambda: torch.randn(4, 6, dtype=torch.float64), TypeError, r"dtype torch.float64 but .* torch.float32"),
        (lambda: torch.randn(4, 6, dtype=torch.complex64), TypeError, r"real floating-point.*complex64"),
        (lambda: torch.ones(4, 6, dtype=torch.int64), TypeError, r"real floating-point.*int64"),
        (lambda: torch.empty(4, 6, device="meta"), ValueError, r"input is on meta but .* cpu"),
        (lambda: torch.randn(4, 5), ValueError, r"shape \(\.\.\., 6\), got \(4, 5\)"),
        (lambda: [[0.0] * 6], TypeError, r"must be a torch.Tensor, got list"),
    ],
)
def test_input_validated_before_the_gate_runs(bad, error, message):
    layer = MuMoE(6, 4, 5, "cp", 2, gate=AffineSoftmaxGate())
    with pytest.raises(error, match=message):
        layer(bad())
    assert layer.gate.calls == 0


class _OneTensor(AffineSoftmaxGate):
    def build(self, in_features, expert_dims, *, device=None, dtype=None):
        return nn.Linear(in_features, sum(expert_dims), device=device, dtype=dtype)


def test_gate_returning_a_tensor_instead_of_a_tuple():
    layer = MuMoE(6, 4, 5, "cp", 2, gate=_OneTensor())
    with pytest.raises(TypeError, match=r"the gate Linear must return a tuple of tensors.*got Tensor"):
        layer(torch.randn(3, 6))


def test_batch_of_one_with_batch_norm():
    layer = MuMoE(6, 4, 5, "cp", 2)
    with pytest.raises(ValueError, match=r"at least 2 tokens.*got 1: use gate_norm='layer'.*layer.eval\(\)"):
        layer(torch.randn(1, 6))
    assert layer.eval()(torch.randn(1, 6)).shape == (1, 4)
    assert MuMoE(6, 4, 5, "cp", 2, gate_norm="layer")(torch.randn(1, 6)).shape == (1, 4)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"activation": math.nan}, ValueError, r"finite number > 1.*got nan"),
        ({"activation": math.inf}, ValueError, r"finite number > 1.*got inf"),
        ({"activation": 0.5}, ValueError, r"finite number > 1.*got 0.5"),
        ({"activation": True}, TypeError, r"name or a float alpha, got True"),
        ({"activation": "relu"}, ValueError, r"unknown activation 'relu'"),
        ({"activation": ["softmax"]}, TypeError, r"name or a float alpha, got \['softmax'\]"),
        ({"gate_norm": "group"}, ValueError, r"unknown gate norm 'group'"),
        ({"gate_init": "ones"}, ValueError, r"unknown gate init 'ones'"),
        ({"gate": "softmax"}, TypeError, r"gate must be a gate descriptor.*got 'softmax'"),
        ({"gate": Gate(), "gate_norm": "layer"}, TypeError, r"either gate= or gate_norm"),
    ],
)
def test_bad_gate_options_rejected_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        MuMoE(6, 4, 5, "cp", 2, **kwargs)


# ----------------------------------------------------------------------------- state
def _round_trips(module):
    yield pickle.loads(pickle.dumps(module))
    yield copy.deepcopy(module)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    yield torch.load(buffer, weights_only=False)


@pytest.mark.parametrize(
    "spec",
    [
        Gate(),
        Gate(1.7, "layer"),
        Gate("sparsemax", "none", balance_loss=True),
        TopKGate(k=2, z_loss=True),
        ReLUTopKGate(k=2, norm="batch"),
    ],
)
def test_gate_modules_pickle_deepcopy_and_save(spec):
    gate = spec.build(6, (4, 3))
    z = torch.randn(5, 6)
    gate(z)  # leaves recorded losses (with grad) and BatchNorm statistics behind
    gate.eval()
    expected = gate(z)
    for copied in _round_trips(gate):
        assert type(copied) is type(gate)
        for a, b in zip(copied(z), expected, strict=True):
            torch.testing.assert_close(a, b)


def test_full_layer_pickles_deepcopies_and_saves():
    layer = MuMoE(6, 4, (3, 2), "tr", 2, gate=TopKGate(k=1, balance_loss=True)).eval()
    x = torch.randn(5, 6)
    expected = layer(x)
    for copied in _round_trips(layer):
        torch.testing.assert_close(copied(x), expected)
        assert copied.last_coefficients is not None


# ----------------------------------------------------------------------------- threads
def test_last_coefficients_are_per_thread():
    torch.manual_seed(4)
    layer = MuMoE(16, 8, (6, 4), "cp", 3).eval()
    inputs = [torch.randn(32, 16) for _ in range(8)]
    with torch.no_grad():
        expected = [layer.gate(x) for x in inputs]
    barrier = threading.Barrier(len(inputs))
    failures = []

    def work(k):
        barrier.wait()
        with torch.no_grad():
            for _ in range(20):
                layer(inputs[k])
                got = layer.last_coefficients
                # The layer computes the gate's logits in one product with its experts' first: same up to rounding.
                if not all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(got, expected[k], strict=True)):
                    failures.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert layer.last_coefficients is None  # the main thread ran no forward pass


ODD_VALUES = st.one_of(
    st.sampled_from(["entmax15", "softmax", "batch", "layer", "none", "zeros", "default", "", "relu", "BATCH"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 2), max_size=2),
)


@given(activation=ODD_VALUES, gate_norm=ODD_VALUES, gate_init=ODD_VALUES)
def test_odd_gate_options_give_only_library_errors(activation, gate_norm, gate_init):
    try:
        layer = MuMoE(4, 3, 3, "cp", 2, activation=activation, gate_norm=gate_norm, gate_init=gate_init)
    except (TypeError, ValueError) as error:
        assert any(repr(v) in str(error) for v in (activation, gate_norm, gate_init) if v is not None), error
        return
    assert layer(torch.randn(5, 4)).shape == (5, 3)
