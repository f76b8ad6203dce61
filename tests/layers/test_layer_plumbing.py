"""What the layers' constructors pass on, and the shared-gate plumbing, checked by hand.

Each test states an observable consequence of one argument (a matched rank counted by hand, a
mean square the init rule fixes exactly, a module type, a message) so that a constructor that
drops or swaps an argument fails here; found by mutation testing of the layers.
"""

import copy
import math
import pickle

import opt_einsum as oe
import pytest
import torch
from torch import nn

from mumoe_tn import FactorizedExperts, MuMoE
from mumoe_tn.contractions import autotune_candidates
from mumoe_tn.decompositions import build
from mumoe_tn.gates.specs import Gate
from mumoe_tn.layers import MuMoEMLP
from mumoe_tn.layers import experts as layers
from mumoe_tn.network import BATCH_LABEL

DTYPE = torch.float64


def mean_square(experts: FactorizedExperts) -> float:
    return experts.to_dense().pow(2).mean().item()


def gate_parameters(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.gate.parameters())


# ----------------------------------------------------------------------------- defaults
def test_mumoe_defaults():
    layer = MuMoE(6, 4, 5, rank=3)
    assert layer.network.name == "cp" and layer.bias and layer.network.in_features == 7
    assert isinstance(layer.input_norm, nn.Identity) and layer.gate_input == "normed"
    assert layer.expert_dims == (5,) and layer.out_features == 4
    assert layer.extra_repr() == "in_features=6, out_features=4, bias=True"
    assert "experts=5, in=7, out=4" in repr(layer.experts)


def test_mumoe_mlp_defaults():
    block = MuMoEMLP(6, 10, expert_dims=(2, 3), rank=3)
    assert block.experts1.network.name == "cp" == block.experts2.network.name
    assert block.bias and block.experts1.network.in_features == 7 and block.experts2.network.in_features == 11
    assert block.out_features == 6 and block.hidden_features == 10 and block.expert_dims == (2, 3)
    assert isinstance(block.input_norm, nn.Identity) and isinstance(block.hidden_activation, nn.GELU)
    assert block.extra_repr() == "in_features=6, hidden_features=10, out_features=6, bias=True"
    assert "experts=2×3" in repr(block.experts1)


@pytest.mark.parametrize("bias", [True, False])
def test_bias_reaches_the_networks(bias):
    assert MuMoE(6, 4, 5, "tr", 2, bias=bias).network.in_features == 6 + bias
    block = MuMoEMLP(6, 10, 3, expert_dims=5, decomposition="tt", rank=2, bias=bias)
    assert (block.experts1.network.in_features, block.experts2.network.in_features) == (6 + bias, 10 + bias)


# ----------------------------------------------------------------------------- factory and init
def test_factory_arguments_reach_every_parameter():
    for layer in (
        MuMoE(6, 4, 5, "cp", 3, device="meta", dtype=DTYPE, input_norm=True),
        MuMoEMLP(6, 10, expert_dims=5, rank=3, device="meta", dtype=DTYPE, input_norm=True),
        MuMoE(6, 4, 5, "tucker", 3, device="meta", dtype=DTYPE),  # the "linear" init rule
    ):
        assert {(p.device.type, p.dtype) for p in layer.parameters()} == {("meta", DTYPE)}


def test_linear_init_fixes_each_layers_mean_square_by_its_own_fan_in():
    # the "linear" rule makes the mean square of W's entries exactly 1 / (3 fan_in), fan_in the
    # features of the Linear the layer replaces (not the bias-widened leg)
    layer = MuMoE(6, 4, 5, "cp", 3, init="linear", dtype=DTYPE)
    assert mean_square(layer.experts) == pytest.approx(1 / 18, rel=1e-9)
    block = MuMoEMLP(6, 10, 3, expert_dims=5, rank=3, init="linear", dtype=DTYPE)
    assert mean_square(block.experts1) == pytest.approx(1 / 18, rel=1e-9)
    assert mean_square(block.experts2) == pytest.approx(1 / 30, rel=1e-9)


def test_init_expert_noise_and_optimize_reach_both_layers_of_a_block():
    with pytest.raises(ValueError, match="bogus"):
        MuMoE(6, 4, 5, "cp", 3, init="bogus")
    with pytest.raises(ValueError, match="bogus"):
        MuMoEMLP(6, 10, expert_dims=5, rank=3, init="bogus")
    block = MuMoEMLP(6, 10, expert_dims=5, rank=3, optimize="greedy", expert_noise=(0.0,), init="paper")
    assert block.experts1.optimize == "greedy" == block.experts2.optimize
    for experts in (block.experts1, block.experts2):
        # no expert noise under the paper's rule: every expert is the same matrix
        dense = experts.to_dense()
        torch.testing.assert_close(dense, dense[:1].expand_as(dense))


# ----------------------------------------------------------------------------- matching
def closest_rank(target: int, per_rank: int, fixed: int, multiple: int = 1) -> int:
    candidates = range(multiple, 4 * target // per_rank + multiple, multiple)
    return min(candidates, key=lambda r: (abs(fixed + r * per_rank - target), r))


# sizes where dropping the bias from the reference or from the count changes the matched rank
@pytest.mark.parametrize(
    ("sizes", "bias", "input_norm", "multiple"),
    [((16, 24, 256), False, False, 1), ((8, 256, 128), True, False, 1), ((8, 256, 128), False, True, 1),
     ((8, 256, 128), True, True, 4)],
)  # fmt: skip
def test_match_linear_counted_by_hand(sizes, bias, input_norm, multiple):
    n, i, o = sizes
    layer = MuMoE(i, o, n, match="linear", bias=bias, input_norm=input_norm, rank_multiple=multiple)
    target = i * o + (o if bias else 0)
    fixed = gate_parameters(layer) + (2 * i if input_norm else 0)
    rank = closest_rank(target, n + i + bias + o, fixed, multiple)
    assert layer.network.sizes["r"] == rank
    assert sum(p.numel() for p in layer.parameters()) == fixed + rank * (n + i + bias + o)


@pytest.mark.parametrize(
    ("sizes", "bias", "gate", "multiple"),
    [((16, 32, 96), False, "plain", 1), ((8, 96, 192), True, "softmax", 1), ((8, 96, 192), False, "softmax", 1),
     ((8, 96, 192), True, "softmax", 4)],
)  # fmt: skip
def test_match_mlp_counted_by_hand(sizes, bias, gate, multiple):
    n, i, h = sizes
    spec = _PlainGateSpec() if gate == "plain" else Gate(activation="softmax", norm="layer")
    block = MuMoEMLP(i, h, expert_dims=n, match="mlp", bias=bias, gate=spec, rank_multiple=multiple)
    target = 2 * i * h + ((h + i) if bias else 0)
    per_rank = (n + i + bias + h) + (n + h + bias + i)  # one rank for both layers
    rank = closest_rank(target, per_rank, gate_parameters(block), multiple)
    assert block.experts1.network.sizes["r"] == rank == block.experts2.network.sizes["r"]


def test_match_bonds_reach_both_layers_of_a_block():
    # TR's own choice is the input-output bond r3; asking for r1 must scale r1 alone
    block = MuMoEMLP(24, 48, expert_dims=8, decomposition="tr", rank=(2, 2, 3), match="mlp", match_bonds=["r1"])
    for experts in (block.experts1, block.experts2):
        sizes = experts.network.sizes
        assert (sizes["r2"], sizes["r3"]) == (2, 3) and sizes["r1"] > 2


LAYER_MAKERS = {
    "MuMoE": lambda **options: MuMoE(6, 4, 5, **options),
    "MuMoEMLP": lambda **options: MuMoEMLP(6, 10, expert_dims=5, **options),
}


@pytest.mark.parametrize("name", sorted(LAYER_MAKERS))
def test_matching_messages_name_the_layer(name):
    make = LAYER_MAKERS[name]
    with pytest.raises(ValueError, match=rf"^{name}: match='other' is not a target here"):
        make(match="other")
    with pytest.raises(ValueError, match=rf"^{name}: rank must be ranks .* got the string 'match'; use match='match'"):
        make(rank="match", match=100)


# ----------------------------------------------------------------------------- the gate plumbing
class _PlainGate(nn.Module):
    """A gate module without ``reset_parameters`` or ``losses``, returning float64 coefficients."""

    def __init__(self, in_features, expert_dims, device=None, dtype=None):
        super().__init__()
        self.proj = nn.Linear(in_features, sum(expert_dims), device=device, dtype=dtype)
        self.softmax = nn.Softmax(dim=-1)  # a submodule without reset_parameters
        self.expert_dims = tuple(expert_dims)

    def forward(self, z):
        return tuple(self.softmax(p).double() for p in self.proj(z).split(self.expert_dims, dim=-1))


class _PlainGateSpec:
    def __init__(self, returns=None):
        self.returns = returns

    def parameter_count(self, in_features, expert_dims):
        return (in_features + 1) * sum(expert_dims)

    def fma_per_token(self, in_features, expert_dims):
        return in_features * sum(expert_dims)

    def build(self, in_features, expert_dims, *, device=None, dtype=None):
        if self.returns is not None:
            return self.returns
        return _PlainGate(in_features, expert_dims, device=device, dtype=dtype)

    def __repr__(self):
        return "_PlainGateSpec()"


def test_reset_parameters_reaches_the_gates_submodules_and_the_input_norm():
    layer = MuMoE(6, 4, (2, 3), "cp", 3, gate=_PlainGateSpec(), input_norm=True)
    assert layer.gate_spec.__class__ is _PlainGateSpec
    with torch.no_grad():
        layer.gate.proj.weight.zero_()
        layer.input_norm.weight.fill_(2.0)
        layer.experts.U_i.zero_()
    layer.reset_parameters()
    assert layer.gate.proj.weight.abs().sum() > 0
    assert torch.equal(layer.input_norm.weight, torch.ones(6))
    assert layer.experts.U_i.abs().sum() > 0


def test_gate_without_losses_and_coefficients_cast_to_the_input_dtype():
    layer = MuMoE(6, 4, (2, 3), "cp", 3, gate=_PlainGateSpec())
    assert layer.gate_losses() == {}
    with pytest.raises(ValueError, match=r"has no z_loss option, so it records no 'z' loss: use a gate that has"):
        layer.z_loss()
    with pytest.raises(ValueError, match=r"_PlainGateSpec\(\) has no balance_loss option.*TopKGate with balance_loss"):
        layer.aux_loss()
    x = torch.randn(5, 6)
    y = layer(x)
    assert y.dtype == torch.float32 and layer.last_coefficients[0].dtype == torch.float64
    a1, a2 = (a.float() for a in layer.last_coefficients)
    expected = layer.experts(x, [a1, a2], append_one=True)
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("returns", [lambda z: None, lambda z: {"n1": z}, lambda z: 3])
def test_gate_returning_no_sequence_is_rejected(returns):
    class Odd(nn.Module):
        def forward(self, z):
            return returns(z)

    layer = MuMoE(6, 4, 5, "cp", 3, gate=_PlainGateSpec(returns=Odd()))
    with pytest.raises(TypeError, match=r"the gate Odd must return a tuple of tensors, one per expert mode"):
        layer(torch.randn(3, 6))


def test_gate_descriptor_building_no_module_is_rejected():
    with pytest.raises(TypeError, match=r"the gate descriptor _PlainGateSpec\(\) built function, not an nn.Module"):
        MuMoE(6, 4, 5, "cp", 3, gate=_PlainGateSpec(returns=lambda z: z))


def test_input_norm_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^input_norm must be a bool, got 'yes'"):
        MuMoE(6, 4, 5, "cp", 3, input_norm="yes")


@pytest.mark.parametrize("shape", [(6,), (2, 3, 6), (3, 1, 2, 6)])
def test_any_number_of_leading_dimensions(shape):
    layer = MuMoE(6, 4, 5, "cp", 3, dtype=DTYPE).eval()
    x = torch.randn(shape, dtype=DTYPE)
    y = layer(x)
    assert y.shape == (*shape[:-1], 4)
    torch.testing.assert_close(y.reshape(-1, 4), layer(x.reshape(-1, 6)))
    with pytest.raises(ValueError, match=r"input must have shape \(\.\.\., 6\), got \(\)"):
        layer(torch.tensor(1.0, dtype=DTYPE))


# ----------------------------------------------------------------------------- the MLP block
def test_hidden_activation_is_used_and_checked():
    block = MuMoEMLP(6, 10, 4, expert_dims=5, rank=3, hidden_activation=nn.ReLU(), dtype=DTYPE).eval()
    x = torch.randn(7, 6, dtype=DTYPE)
    y = block(x)
    (a,) = block.last_coefficients
    hidden = torch.relu(block.experts1(x, [a], append_one=True))
    torch.testing.assert_close(y, block.experts2(hidden, [a], append_one=True))
    with pytest.raises(TypeError, match=r"hidden_activation must be an nn.Module instance such as nn.GELU\(\)"):
        MuMoEMLP(6, 10, expert_dims=5, rank=3, hidden_activation=torch.relu)


def test_gate_init_reaches_the_blocks_gate():
    block = MuMoEMLP(6, 10, expert_dims=5, rank=3, gate_init="zeros", gate_norm="none", activation="softmax")
    block(torch.randn(3, 6))
    (a,) = block.last_coefficients
    torch.testing.assert_close(a, torch.full((3, 5), 0.2))


# ----------------------------------------------------------------------------- copies
@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_copies_start_with_an_empty_plan_cache(copier):
    layer = MuMoE(6, 4, 5, "cp", 3)
    layer(torch.randn(4, 6))
    layer.eval()(torch.randn(4, 6))
    assert len(layer.experts._plans) > 0
    clone = copier(layer)
    assert len(clone.experts._plans) == 0 and len(layer.experts._plans) > 0
    assert math.isfinite(clone(torch.randn(4, 6)).sum().item())


# ----------------------------------------------------------------------------- FactorizedExperts
def test_from_tensors_builds_on_the_tensors_device():
    tensors = {"A": torch.empty(4, 2, device="meta"), "B": torch.empty(2, 5, 6, device="meta")}
    module = FactorizedExperts.from_tensors({"A": "n1 a", "B": "a i o"}, tensors)
    assert {p.device.type for p in module.parameters()} == {"meta"}


def test_deferred_initialisation_on_meta_then_materialised():
    layer = MuMoE(6, 4, 5, "tucker", 3, init="linear", device="meta", dtype=DTYPE)
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert mean_square(layer.experts) == pytest.approx(1 / 18, rel=1e-9)


def test_recompute_with_the_folded_bias_is_exact():
    gen = torch.Generator().manual_seed(0)
    network = MuMoE(5, 4, (2, 3), "tr", 2).network
    plain = FactorizedExperts(network, dtype=DTYPE)
    again = FactorizedExperts(network, recompute=True, dtype=DTYPE)
    again.load_state_dict(plain.state_dict())
    z = torch.randn(6, 5, generator=gen, dtype=DTYPE)
    a = [torch.rand(6, n, generator=gen, dtype=DTYPE) for n in (2, 3)]
    results = []
    for module in (plain, again):
        y = module(z, a, append_one=True)
        y.pow(2).sum().backward()
        results.append((y, [p.grad for p in module.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0])
    for mine, theirs in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(mine, theirs)


# ----------------------------------------------------------------------------- plans, cache, recompute
def spy(monkeypatch, attribute, note):
    """Wrap ``layers.<attribute>`` so every call first appends ``note(*args, **kwargs)`` to the returned list."""
    notes, original = [], getattr(layers, attribute)

    def wrapper(*args, **kwargs):
        notes.append(note(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(layers, attribute, wrapper)
    return notes


def test_each_batch_bucket_gets_its_own_plan_and_the_cache_keeps_the_newest():
    experts = FactorizedExperts(MuMoE(5, 4, (2, 3), "tr", 2).network, max_plans=3)
    plans = {bucket: experts.plan(bucket) for bucket in (1, 2, 4, 8)}
    assert {bucket: plan.sizes[BATCH_LABEL] for bucket, plan in plans.items()} == {1: 1, 2: 2, 4: 4, 8: 8}
    assert len(experts._plans) == 3  # exactly max_plans: the oldest (bucket 1) went
    assert experts.plan(8) is plans[8] and experts.plan(2) is plans[2]
    assert experts.plan(1) is not plans[1]


def test_inference_constants_survive_a_full_cache_and_are_shared_by_buckets(monkeypatch):
    computed = spy(monkeypatch, "constant_intermediates", lambda plan, *_: plan.sizes[BATCH_LABEL])
    network = build("tucker", (2, 2), 6, 5, (4, 4, 3, 3))
    experts = FactorizedExperts(network, max_plans=3, dtype=DTYPE).eval()
    with torch.no_grad():
        for batch in (1, 2, 4, 8, 8):
            experts(torch.randn(batch, 6, dtype=DTYPE), [torch.rand(batch, 2, dtype=DTYPE)] * 2)
        # Every bucket's plan contracts the same core-only sub-network: computed once, for bucket 1.
        assert computed == [1]
        assert len(experts._plans) == 3
        next(iter(experts.parameters())).mul_(2)  # a changed core: computed again, once
        for batch in (8, 4):
            experts(torch.randn(batch, 6, dtype=DTYPE), [torch.rand(batch, 2, dtype=DTYPE)] * 2)
    assert computed == [1, 8]


class _SequentialPath(oe.paths.PathOptimizer):
    """A user's path optimizer: always contract the first two operands."""

    def __call__(self, inputs, output, size_dict, memory_limit=None):
        return [(0, 1)] * (len(inputs) - 1)


def test_a_user_path_optimizer_plans_every_bucket():
    network = MuMoE(5, 4, (2, 3), "tr", 2).network
    experts = FactorizedExperts(network, optimize=_SequentialPath())
    assert experts.plan(16).path == tuple((0, 1) for _ in range(len(network.cores) + 2))


def test_autotune_times_the_candidates_on_the_calls_operands(monkeypatch):
    seen = []

    def last_candidate(plans, operands, *, ones_appended=None):
        seen.append(([p.path for p in plans], [tuple(t.shape) for t in operands], ones_appended))
        return plans[-1]

    monkeypatch.setattr(layers, "fastest_plan", last_candidate)
    network = MuMoE(5, 4, (2, 3), "tr", 2).network
    experts = FactorizedExperts(network, optimize="autotune", dtype=DTYPE)
    z, a = torch.randn(7, 5, dtype=DTYPE), [torch.rand(7, 2, dtype=DTYPE), torch.rand(7, 3, dtype=DTYPE)]
    y = experts(z, a, append_one=True)
    candidates = autotune_candidates(network, 8)
    shapes = [tuple(c.shape) for c in experts.cores.values()] + [(7, 2), (7, 3), (7, 5)]
    assert seen == [([p.path for p in candidates], shapes, "i")]
    assert experts.plan(7).path == candidates[-1].path
    torch.testing.assert_close(y, FactorizedExperts.from_tensors(network.cores, experts.cores)(z, a, append_one=True))


def test_recompute_checkpoints_only_when_asked_and_gradients_are_on(monkeypatch):
    calls = spy(monkeypatch, "checkpoint", lambda *_, **__: 1)
    network = MuMoE(5, 4, (2, 3), "tr", 2).network
    z, a = torch.randn(7, 5), [torch.rand(7, 2), torch.rand(7, 3)]
    FactorizedExperts(network)(z, a, append_one=True)
    assert calls == []
    again = FactorizedExperts(network, recompute=True)
    with torch.no_grad():
        again(z, a, append_one=True)
    assert calls == []
    again(z, a, append_one=True)
    assert calls == [1]


def test_each_call_runs_the_plan_of_its_own_bucket(monkeypatch):
    buckets = spy(monkeypatch, "run_plan", lambda plan, *_, **__: plan.sizes[BATCH_LABEL])
    experts = FactorizedExperts(MuMoE(5, 4, (2, 3), "tr", 2).network)
    for batch in (1, 2, 3, 5):
        experts(torch.randn(batch, 5), [torch.rand(batch, 2), torch.rand(batch, 3)], append_one=True)
    assert buckets == [1, 2, 4, 8]


def test_reset_parameters_draws_from_the_given_generator():
    experts = FactorizedExperts(MuMoE(5, 4, (2, 3), "tr", 2).network, dtype=DTYPE)
    drawn = []
    for _ in range(2):
        experts.reset_parameters(generator=torch.Generator().manual_seed(7))
        drawn.append({name: core.detach().clone() for name, core in experts.cores.items()})
    assert all(torch.equal(drawn[0][name], drawn[1][name]) for name in drawn[0])


# ----------------------------------------------------------------------------- FactorizedExperts: arguments and inputs
def test_factorized_experts_defaults_and_limits():
    network = build("cp", 3, 4, 5, 2)
    assert FactorizedExperts(network).max_plans == 64
    assert FactorizedExperts(network, max_plans=1).max_plans == 1  # one plan is a valid cache
    largest = (1 << 40) - 1
    assert FactorizedExperts(network, fan_in=largest, device="meta").fan_in == largest


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"network": "cp"}, TypeError, r"^network must be an ExpertNetwork, got str$"),
        ({"max_plans": True}, ValueError, r"^max_plans must be a positive int, got True$"),
        ({"max_plans": 0}, ValueError, r"^max_plans must be a positive int, got 0$"),
        ({"max_plans": 2.0}, ValueError, r"^max_plans must be a positive int, got 2\.0$"),
        ({"recompute": "yes"}, TypeError, r"^recompute must be a bool, got 'yes' \(str\)$"),
        ({"precontract": "yes"}, TypeError, r"^precontract must be a bool, got 'yes' \(str\)$"),
        ({"fan_in": "7"}, TypeError, r"^fan_in must be a positive int, got '7' \(str\)$"),
        (
            {"fan_in": 1 << 40},
            ValueError,
            r"^fan_in=1099511627776 is too large \(at most 1,099,511,627,775\); it is a layer's input width$",
        ),
    ],
)
def test_factorized_experts_argument_messages(options, error, message):
    options = {"network": build("cp", 3, 4, 5, 2), **options}
    with pytest.raises(error, match=message):
        FactorizedExperts(**options)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, z, a: m([0.0] * 4, a), TypeError, r"^input must be a torch\.Tensor, got list$"),
        (
            lambda m, z, a: m(z, a, append_one=True),
            ValueError,
            r"^input must have shape \(\.\.\., 3\) \(leg 'i' of 'cp' with append_one=True\), got \(2, 4\)$",
        ),
        (lambda m, z, a: m(z[:, :3], a), ValueError, r"leg 'i' of 'cp'\), got \(2, 3\)$"),
        # a single tensor is not a sequence of tensors, even when its length is the number of modes
        (lambda m, z, a: m(z[:1], a[0][:1]), TypeError, r"^coefficients must be a sequence of 1 tensors"),
        (lambda m, z, a: m(z, (t for t in a)), TypeError, r"^coefficients must be a sequence of 1 tensors"),
        (lambda m, z, a: m(z, [[0.0] * 3]), TypeError, r"^coefficients\[0\] must be a torch\.Tensor, got list$"),
    ],
)
def test_factorized_experts_input_messages(call, error, message):
    module = FactorizedExperts(build("cp", 3, 4, 5, 2))
    z, a = torch.randn(2, 4), [torch.rand(2, 3)]
    with pytest.raises(error, match=message):
        call(module, z, a)


def test_chunks_hold_at_most_chunk_size_rows(monkeypatch):
    experts = FactorizedExperts(build("cp", 3, 4, 5, 2), chunk_size=3, dtype=DTYPE)
    z, a = torch.randn(8, 4, dtype=DTYPE), [torch.rand(8, 3, dtype=DTYPE)]
    expected = FactorizedExperts.from_tensors(experts.network.cores, experts.cores)(z, a)
    sizes = []
    original = FactorizedExperts._contract_rows

    def recorded(self, rows, ones, cores):
        sizes.append(rows[-1].shape[0])
        return original(self, rows, ones, cores)

    monkeypatch.setattr(FactorizedExperts, "_contract_rows", recorded)
    torch.testing.assert_close(experts(z, a), expected)
    assert sizes == [3, 3, 2]


def test_the_compile_branch_runs_the_plan_made_at_construction(monkeypatch):
    # While torch.compile traces, forward runs the plan made in __init__ with the layer's own optimizer.
    network = build("tr", (3, 2), 4, 5, 2)
    made = spy(monkeypatch, "plan_forward", lambda net, batch, optimize, **options: (batch, optimize))
    experts = FactorizedExperts(network, optimize="greedy", dtype=DTYPE)
    assert made == [(layers.COMPILE_PLAN_BATCH, "greedy")]
    z = torch.randn(6, 3, dtype=DTYPE)
    a = [torch.rand(6, 3, dtype=DTYPE), torch.rand(6, 2, dtype=DTYPE)]
    eager = experts(z, a, append_one=True)
    ran = spy(monkeypatch, "run_plan", lambda plan, operands, **options: (plan, options["ones_appended"]))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(experts(z, a, append_one=True), eager)
    assert ran == [(experts._compile_plan, "i")]
