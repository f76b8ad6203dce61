"""The inference path: what it prepares once, that it follows every change of the weights, and that it
computes exactly what training mode computes.

References are independent of the inference path: the same layer with gradients on (the training
path, which caches nothing), and the dense expert tensor contracted with ``torch.einsum``.
"""

import copy
import io
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import any_network

import mumoe_tn.contractions.plan as planning
import mumoe_tn.layers.experts as experts_module
from mumoe_tn import MuMoE, MuMoEMLP
from mumoe_tn.contractions import plan_forward, plan_inference
from mumoe_tn.contractions.execute import run_plan
from mumoe_tn.contractions.prepared import PreparedPlan
from mumoe_tn.layers.experts import FactorizedExperts

DTYPE = torch.float64


def _random_call(network, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    coefficients = [torch.rand(batch, network.sizes[leg], generator=gen, dtype=DTYPE) for leg in network.expert_legs]
    return coefficients, torch.randn(batch, network.in_features, generator=gen, dtype=DTYPE)


def _dense_reference(module, coefficients, z):
    """``W ×_1 a_1 … ×_E a_E ×_{E+1} z`` from the materialised expert tensor (independent of any plan)."""
    w = module.to_dense()
    letters = "abcdefgh"[: len(coefficients)]
    equation = ",".join(f"z{c}" for c in letters) + f",zi,{letters}io->zo"
    return torch.einsum(equation, *coefficients, z, w)


# ----------------------------------------------------------------- prepared plans against run_plan
@settings(deadline=None, max_examples=40)
@given(network=any_network(max_modes=3), batch=st.integers(1, 9), append_one=st.booleans(), seed=st.integers(0, 99))
def test_a_prepared_plan_equals_the_dense_contraction(network, batch, append_one, seed):
    gen = torch.Generator().manual_seed(seed)
    cores = [torch.randn(shape, generator=gen, dtype=DTYPE) for shape in network.core_shapes.values()]
    coefficients, z = _random_call(network, batch, seed)
    plan, steps = plan_inference(network, batch)
    ones = "i" if append_one and network.in_features > 1 else None
    if ones is not None:
        z = z[:, :-1]
    full = torch.cat([z, torch.ones(batch, 1, dtype=DTYPE)], dim=-1) if ones else z
    expected = run_plan(plan, [*cores, *coefficients, full])
    from mumoe_tn.contractions.execute import constant_intermediates

    constants = constant_intermediates(plan, cores, steps) if steps else None
    prepared = PreparedPlan(plan, cores, constants, ones_appended=ones)
    torch.testing.assert_close(prepared([*coefficients, z]), expected)
    plain = PreparedPlan(plan_forward(network, batch), cores, ones_appended=ones)
    torch.testing.assert_close(plain([*coefficients, z]), expected)


def test_a_prepared_plan_names_its_operand_count():
    network = MuMoE(4, 3, 5, "cp", 2).network
    prepared = PreparedPlan(plan_forward(network, 2), [torch.randn(s) for s in network.core_shapes.values()])
    with pytest.raises(ValueError, match="takes 2 operands per call, got 1"):
        prepared([torch.randn(2, 5)])


# ----------------------------------------------------------------- eval equals training, every format
@settings(deadline=None, max_examples=30)
@given(network=any_network(max_modes=3), batch=st.integers(1, 12), seed=st.integers(0, 99))
def test_inference_equals_the_training_path_and_the_dense_tensor(network, batch, seed):
    torch.manual_seed(seed)
    module = FactorizedExperts(network, dtype=DTYPE)
    coefficients, z = _random_call(network, batch, seed)
    trained = module(z, coefficients)  # gradients on: the training path, nothing cached
    module.eval()
    with torch.no_grad():
        first, second = module(z, coefficients), module(z, coefficients)
    torch.testing.assert_close(first, trained.detach())
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(first, _dense_reference(module, coefficients, z))


@pytest.mark.parametrize("decomposition", ["cp", "tr", "tt", "tucker", "n1 a b, a i c, b c o"])
@pytest.mark.parametrize("dims", [7, (3, 3)])
def test_layers_and_blocks_in_eval_match_their_train_mode_outputs(decomposition, dims):
    torch.manual_seed(0)
    custom = " " in decomposition
    if custom and not isinstance(dims, int):
        decomposition = "n1 n2 a b, a i c, b c o"
    # CP's bond and the custom network's bond b of 300 are padded to 304 in execution.
    rank = {"a": 3, "b": 300, "c": 5} if custom else 300 if decomposition == "cp" else 3
    options = {"gate_norm": "batch", "dtype": DTYPE}
    layer = MuMoE(6, 5, dims, decomposition, rank, **options)
    for block in (layer, MuMoEMLP(6, 4, 5, dims, decomposition, rank, **options)):
        x = torch.randn(9, 6, dtype=DTYPE)
        block.train()
        block(x)  # moves the BatchNorm statistics away from their initial values
        block.eval()
        with_grad = block(x)  # eval, gradients on: nothing cached
        with torch.no_grad():
            cached = block(x)
            again = block(x[:1])
        torch.testing.assert_close(cached, with_grad.detach())
        torch.testing.assert_close(again, with_grad.detach()[:1])


# ----------------------------------------------------------------- the cache follows the weights
def _eval_output(layer, x):
    with torch.no_grad():
        return layer(x)


def _fresh_reference(layer, x):
    """The output recomputed with gradients on (no cache involved)."""
    return layer(x).detach()


CHANGES = {
    "optimizer step": lambda layer: _sgd_step(layer),
    "load_state_dict": lambda layer: layer.load_state_dict(
        {k: v + 0.25 if v.is_floating_point() else v for k, v in layer.state_dict().items()}
    ),
    "in-place edit under no_grad": lambda layer: _in_place(layer),
    "new parameter object": lambda layer: setattr(
        layer.experts,
        layer.network.cores.__iter__().__next__(),
        torch.nn.Parameter(2 * getattr(layer.experts, next(iter(layer.network.cores)))),
    ),
    "param.data assigned": lambda layer: _assign_data(layer),
    "gate statistics in training": lambda layer: _train_call(layer),
}


def _sgd_step(layer):
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(torch.randn(4, layer.in_features, dtype=DTYPE)).square().sum().backward()
    optimizer.step()


def _in_place(layer):
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.mul_(1.5)


def _assign_data(layer):
    for parameter in layer.parameters():
        parameter.data = parameter.data * 0.5


def _train_call(layer):
    layer.train()
    layer(torch.randn(16, layer.in_features, dtype=DTYPE) * 3 + 1)
    layer.eval()


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("decomposition", ["cp", "tucker", "n1 a b, a i c, b c o"])
def test_the_inference_cache_follows_every_tracked_change_of_the_weights(change, decomposition):
    torch.manual_seed(0)
    rank = {"a": 3, "b": 2, "c": 4} if " " in decomposition else 3
    layer = MuMoE(6, 5, (4,), decomposition, rank, gate_norm="batch", dtype=DTYPE)
    _train_call(layer)
    x = torch.randn(3, 6, dtype=DTYPE)
    before = _eval_output(layer, x)
    CHANGES[change](layer)
    layer.eval()
    after = _eval_output(layer, x)
    assert not torch.allclose(after, before)  # the change shows…
    torch.testing.assert_close(after, _fresh_reference(layer, x))  # …exactly as without any cache


def test_dtype_and_device_moves_rebuild_the_cache():
    torch.manual_seed(0)
    layer = MuMoE(6, 5, 4, "tr", 2, gate_norm="batch").eval()
    x = torch.randn(3, 6)
    _eval_output(layer, x)
    layer.double()
    torch.testing.assert_close(_eval_output(layer, x.double()), _fresh_reference(layer, x.double()))
    layer.float()
    torch.testing.assert_close(_eval_output(layer, x), _fresh_reference(layer, x))


def test_edits_through_data_need_clear_inference_cache():
    # PyTorch does not track in-place edits of .data (autograd does not either): documented, and clearable.
    torch.manual_seed(0)
    layer = MuMoE(6, 5, 4, "tr", 2, gate_norm="batch", dtype=DTYPE)
    _train_call(layer)
    x = torch.randn(3, 6, dtype=DTYPE)
    _eval_output(layer, x)
    for parameter in layer.parameters():
        parameter.data.mul_(3.0)
    layer.clear_inference_cache()
    torch.testing.assert_close(_eval_output(layer, x), _fresh_reference(layer, x))


def test_copies_and_pickles_carry_no_cached_weights():
    torch.manual_seed(0)
    layer = MuMoE(6, 5, 4, "tucker", 3, gate_norm="batch", dtype=DTYPE).eval()
    x = torch.randn(3, 6, dtype=DTYPE)
    _eval_output(layer, x)
    clone = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    restored = pickle.loads(pickle.dumps(layer))
    for other in (clone, loaded, restored):
        with torch.no_grad():
            for parameter in other.parameters():
                parameter.add_(0.5)
        torch.testing.assert_close(_eval_output(other, x), _fresh_reference(other, x))


# ----------------------------------------------------------------- serving: a steady state without planning
def test_serving_any_64_batch_sizes_reaches_a_state_without_path_searches(monkeypatch):
    searches = []
    original = planning.plan_contraction

    def counting(*args, **kwargs):
        searches.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(planning, "plan_contraction", counting)
    layer = MuMoE(6, 5, 8, "tucker", 3, gate_norm="batch", dtype=DTYPE).eval()
    sizes = [1 << k for k in range(40)] + list(range(3, 100, 4))  # 64 distinct sizes over 40 buckets
    sizes = sizes[:64]
    assert len(set(sizes)) == 64
    x = torch.randn(1, 6, dtype=DTYPE)
    with torch.no_grad():
        for size in sizes:  # the first round plans each bucket once
            layer.experts.plan(size) if size > 4096 else layer(x.expand(size, 6))
        first_round = len(searches)
        for size in reversed(sizes):
            layer.experts.plan(size) if size > 4096 else layer(x.expand(size, 6))
    assert first_round > 0
    assert len(searches) == first_round  # steady state: no call searched for a path


def test_max_plans_is_settable_from_every_constructor():
    for block in (
        MuMoE(6, 5, 4, "cp", 2, max_plans=5),
        MuMoEMLP(6, 8, 5, 4, "cp", 2, max_plans=5),
    ):
        assert {experts.max_plans for experts in block._expert_layers()} == {5}
    with pytest.raises(ValueError, match="max_plans must be a positive int"):
        MuMoE(6, 5, 4, "cp", 2, max_plans=0)


def test_inference_prepares_each_core_layout_once(monkeypatch):
    made = []
    original = experts_module.PreparedPlan

    def counting(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(experts_module, "PreparedPlan", counting)
    layer = MuMoE(6, 5, 4, "tr", 2, gate_norm="batch", dtype=DTYPE).eval()
    x = torch.randn(3, 6, dtype=DTYPE)
    with torch.no_grad():
        for _ in range(5):
            layer(x)
    assert made == [1]  # bound once, reused by every later call of the bucket


def test_inference_mode_then_gradients_through_frozen_weights():
    # What inference_mode prepares (inference tensors) never meets a call that records gradients.
    torch.manual_seed(0)
    layer = MuMoE(6, 5, 4, "tr", 2, gate_norm="batch", dtype=DTYPE)
    _train_call(layer)
    x = torch.randn(3, 6, dtype=DTYPE)
    with torch.inference_mode():
        first = layer(x)
    layer.requires_grad_(False)
    x.requires_grad_()
    y = layer(x)
    (grad,) = torch.autograd.grad(y.sum(), x)  # input attribution through frozen weights
    torch.testing.assert_close(y.detach(), first)
    assert grad.abs().sum() > 0


def test_training_mode_without_gradients_keeps_masked_batch_statistics():
    # No gradient but training mode (a validation loop that forgot eval()): the gate's BatchNorm
    # still learns its statistics from the real tokens only, as with gradients on.
    torch.manual_seed(0)
    layer = MuMoE(6, 5, 4, "cp", 3, gate_norm="batch", dtype=DTYPE)
    twin = copy.deepcopy(layer)
    x = torch.randn(2, 5, 6, dtype=DTYPE)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    with torch.no_grad():
        y = layer(x, mask=mask)
    expected = twin(x, mask=mask)
    torch.testing.assert_close(y[mask], expected.detach()[mask])
    for name, buffer in layer.gate.named_buffers():
        torch.testing.assert_close(buffer, dict(twin.gate.named_buffers())[name])
