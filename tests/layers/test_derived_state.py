"""Where a layer's derived state lives: one holder per layer, one key, and the plans' own executors.

References are cache-free: the same layer called with gradients on (the training path keeps
nothing derived from the weights).
"""

import copy
import gc
import pickle
import weakref

import torch

from mumoe_tn import MuMoE, MuMoEMLP
from mumoe_tn.caching import DerivedValues
from mumoe_tn.contractions import plan_forward
from mumoe_tn.contractions.backward import plan_program
from mumoe_tn.contractions.executor import plan_executor
from mumoe_tn.decompositions import cp
from mumoe_tn.layers.experts import FactorizedExperts

DTYPE = torch.float64


def _eval_output(module, *args, **options):
    with torch.no_grad():
        return module(*args, **options)


def _reference(layer, x):
    """The layer's output with gradients on: nothing derived is reused."""
    return layer(x).detach()


def _layer(seed=0):
    torch.manual_seed(seed)
    layer = MuMoEMLP(6, 10, expert_dims=4, rank=3, gate_norm="batch", dtype=DTYPE)
    layer.train()
    layer(torch.randn(16, 6, dtype=DTYPE) * 3 + 1)  # running statistics that are not the identity
    return layer.eval()


def test_a_layers_gate_and_experts_keep_their_derived_values_in_its_program():
    layer = _layer()
    x = torch.randn(3, 6, dtype=DTYPE)
    handle = layer.gate.register_forward_hook(lambda module, args, out: None)  # the path that calls every child
    _eval_output(layer, x)
    handle.remove()
    _eval_output(layer, x)  # the fused path
    names = set(layer._program._values)
    assert (id(layer.gate), ("projection", DTYPE)) in names
    for experts in (layer.experts1, layer.experts2):
        assert (id(experts), ("prepared", experts.pad_bonds)) in names
        assert experts._derived._values == {}
    assert layer.gate._derived._values == {}
    assert any(name[0] == "entry" for name in names if isinstance(name[0], str))


def test_a_gate_or_experts_taken_out_of_its_layer_keys_its_values_by_its_own_state():
    layer = _layer()
    x = torch.randn(3, 6, dtype=DTYPE)
    _eval_output(layer, x)
    experts, gate = layer.experts2, layer.gate
    layer.experts2 = copy.deepcopy(experts)  # the original now stands on its own
    z = torch.randn(5, 10, dtype=DTYPE)
    coefficients = (torch.rand(5, 4, dtype=DTYPE),)
    before = _eval_output(experts, z, coefficients, append_one=True)
    with torch.no_grad():
        for core in experts.parameters():
            core.mul_(2.0)
    torch.testing.assert_close(
        _eval_output(experts, z, coefficients, append_one=True),
        experts(z, coefficients, append_one=True).detach(),
    )
    assert not torch.allclose(before, _eval_output(experts, z, coefficients, append_one=True))
    assert experts._derived._values  # kept in its own holder
    _eval_output(layer, x)  # the layer's new state: what it kept for the old experts is gone
    assert (id(experts), ("prepared", experts.pad_bonds)) not in layer._program._values
    torch.testing.assert_close(_eval_output(gate, x), gate(x))  # the gate, still held, follows the layer's key


def test_clearing_an_expert_layer_clears_the_program_that_holds_its_values():
    # An edit through .data is the one change PyTorch does not track; clearing the experts alone must do.
    layer = _layer()
    x = torch.randn(3, 6, dtype=DTYPE)
    _eval_output(layer, x)
    for core in layer.experts1.parameters():
        core.data.mul_(3.0)
    layer.experts1.clear_inference_cache()
    torch.testing.assert_close(_eval_output(layer, x), _reference(layer, x))


def test_changing_pad_bonds_after_inference_gives_the_layers_output():
    torch.manual_seed(0)
    layer = MuMoE(6, 5, 4, "cp", 300, dtype=DTYPE).eval()  # a bond of at least 256: padded
    x = torch.randn(300, 6, dtype=DTYPE)
    _eval_output(layer, x)
    for pad in (None, 64, 16):
        layer.experts.pad_bonds = pad
        torch.testing.assert_close(_eval_output(layer, x), _reference(layer, x))


def test_a_copy_derives_its_own_values_and_follows_its_own_weights():
    layer = _layer()
    x = torch.randn(3, 6, dtype=DTYPE)
    _eval_output(layer, x)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone._program._values == {}
        with torch.no_grad():
            for parameter in clone.parameters():
                parameter.add_(0.5)
        torch.testing.assert_close(_eval_output(clone, x), _reference(clone, x))
        torch.testing.assert_close(_eval_output(layer, x), _reference(layer, x))
        assert layer.gate._derived.adopted_by(layer._program)
        assert clone.gate._derived.adopted_by(clone._program)


def test_a_holder_forgets_its_values_when_its_module_changes():
    module = torch.nn.Linear(3, 2)
    holder, made = DerivedValues(), []

    def make():
        made.append(1)
        return module.weight.sum().item()

    assert holder.get(module, "sum", make) == holder.get(module, "sum", make)
    assert len(made) == 1
    with torch.no_grad():
        module.weight.add_(1.0)
    holder.get(module, "sum", make)
    module.register_forward_hook(lambda *args: None)
    holder.get(module, "sum", make)
    module.train(False)
    holder.get(module, "sum", make)
    assert len(made) == 4


def test_a_plan_keeps_its_executors_and_frees_them_with_it():
    plan = plan_forward(cp((4,), 6, 5, 3), 8)
    executor = plan_executor(plan, "i")
    assert plan_executor(plan, "i") is executor and plan_executor(plan) is not executor
    for other in (copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        assert other == plan and plan_executor(other, "i") is not executor
    gone = weakref.ref(executor)
    del plan, executor, other
    gc.collect()
    assert gone() is None


def test_a_plan_keeps_its_backward_program_beside_its_executors():
    plan = plan_forward(cp((4,), 6, 5, 3), 8)
    program = plan_program(plan, None)
    assert program is not None and plan_program(plan, None) is program
    assert program.executor is plan_executor(plan)  # one executor per plan, the backward's included
    assert plan_program(copy.deepcopy(plan), None) is not program


def test_a_standalone_expert_layer_uses_the_holder_class_of_layers():
    torch.manual_seed(0)
    experts = FactorizedExperts(cp((4,), 6, 5, 3), dtype=DTYPE)
    z, coefficients = torch.randn(2, 6, dtype=DTYPE), (torch.rand(2, 4, dtype=DTYPE),)
    _eval_output(experts, z, coefficients)
    assert isinstance(experts._derived, DerivedValues)
    assert (("prepared", experts.pad_bonds)) in experts._derived._values


def test_calls_that_take_the_module_path_follow_every_change_of_the_gate_and_experts():
    # A token mask sends the call down the module path, which checks the children's values itself.
    layer = _layer()
    x = torch.randn(3, 6, dtype=DTYPE)
    mask = torch.ones(3, dtype=torch.bool)
    _eval_output(layer, x, mask)
    for module in (layer.experts1, layer.gate, layer.experts2):
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.mul_(1.5)
        torch.testing.assert_close(_eval_output(layer, x, mask), layer(x, mask).detach())


def test_a_holder_keeps_one_state_while_the_key_holds_and_follows_hooks_and_parameters_below():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    holder = DerivedValues()
    first = holder.state(module)
    assert holder.state(module) is first and not first.hooked
    handle = module[1].register_forward_hook(lambda *args: None)
    hooked = holder.state(module)
    assert hooked.hooked and hooked.key != first.key
    handle.remove()
    assert not holder.state(module).hooked
    module[0].weight = torch.nn.Parameter(torch.zeros(2, 3))
    replaced = holder.state(module)
    assert replaced.key != first.key and any(t is module[0].weight for t in replaced.tensors)
