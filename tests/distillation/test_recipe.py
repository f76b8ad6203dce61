"""The Mixture of Decoders authors' recipe: unit-norm expert vectors, their init, schedule and budget."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mumoe_tn.costs.baselines import transcoder_parameters
from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.replacements import mumoe_factory, mxd_paper_init, paper_budget, transcoder_factory
from mumoe_tn.distillation.streaming import select_blocks
from mumoe_tn.distillation.training import (
    RECIPES,
    distill,
    project_column_gradients,
    renormalise_columns,
    unit_norm_parameters,
)
from mumoe_tn.layers.decoders import MixtureOfDecoders


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ReLUTeacher(nn.Module):
    """Embedding → a random ReLU MLP block (the teacher) → head."""

    def __init__(self, vocab=512, width=16, hidden=64, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        return self.head(h + self.mlp(h))


def _batches(count, batch=4, length=16, vocab=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, length), generator=generator) for _ in range(count)]


# ----------------------------------------------------------------------------- the projection
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 6),
    dim=st.sampled_from([0, 1, -1]),
    seed=st.integers(0, 10_000),
)
def test_projection_keeps_unit_norm_and_removes_the_parallel_gradient(rows, cols, dim, seed):
    rng = np.random.default_rng(seed)
    weight, grad = rng.normal(size=(rows, cols)), rng.normal(size=(rows, cols))
    parameter = nn.Parameter(torch.tensor(weight))
    renormalise_columns(parameter, dim)
    axis = dim % 2
    unit = weight / np.linalg.norm(weight, axis=axis, keepdims=True)  # by hand
    np.testing.assert_allclose(parameter.detach().numpy(), unit, rtol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(parameter.detach().numpy(), axis=axis), 1.0, rtol=1e-12)
    parameter.grad = torch.tensor(grad)
    project_column_gradients(parameter, dim)
    expected = grad - (grad * unit).sum(axis=axis, keepdims=True) * unit  # g − (gᵀc) c for every slice c
    np.testing.assert_allclose(parameter.grad.numpy(), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose((parameter.grad.numpy() * unit).sum(axis=axis), 0.0, atol=1e-12)


def test_projection_of_one_column_by_hand():
    parameter = nn.Parameter(torch.tensor([[0.6, 0.8]]))
    parameter.grad = torch.tensor([[1.0, 0.0]])
    project_column_gradients(parameter, 1)
    # gᵀc = 0.6; g − 0.6·c = (1 − 0.36, −0.48)
    assert parameter.grad[0].tolist() == pytest.approx([0.64, -0.48])


def test_unit_norm_declarations_are_checked():
    module = nn.Linear(3, 2)
    module.unit_norm = {"weight": 1}
    assert [(name, dim) for name, _, dim in unit_norm_parameters(module)] == [("weight", 1)]
    module.unit_norm = {"weights": 1}
    with pytest.raises(ValueError, match="unit_norm names 'weights', not a parameter"):
        unit_norm_parameters(module)
    module.unit_norm = {"weight": 2}
    with pytest.raises(ValueError, match="unit_norm dim of 'weight' must be an int in"):
        unit_norm_parameters(module)
    module.unit_norm = ["weight"]
    with pytest.raises(TypeError, match="must map parameter names to dims"):
        unit_norm_parameters(module)


def test_sgd_steps_move_unit_columns_along_the_sphere():
    """With plain SGD the step is −lr·(projected gradient): orthogonal to every column, then renormalised."""
    model = ReLUTeacher()
    block = select_blocks(model, "mlp$")[0]
    seen = {}

    def factory(info):
        layer = mumoe_factory("mxd", 8, 2, 4.0)(info)
        seen["start"] = layer.decoder.C_n1.detach().clone()
        return layer

    result = distill(model, _batches(4), {"mxd": factory}, tokens=128, batch_size=64, buffer_tokens=256,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05), recipe="plain", progress=False)  # fmt: skip
    assert block.name == "mlp"
    c = result.replacements["mlp"]["mxd"].decoder.C_n1.detach()
    np.testing.assert_allclose(c.norm(dim=1).numpy(), 1.0, rtol=1e-6)
    start = seen["start"]
    # two steps; the first leaves C (D starts at zero, so C has no gradient); the second moves it to
    # c' = (c − lr·g⊥)/‖c − lr·g⊥‖ with g⊥ ⟂ c, so ⟨c', c⟩ = 1/‖c − lr·g⊥‖ ≤ 1
    cosine = (c * start).sum(1)
    assert torch.all(cosine <= 1 + 1e-6) and torch.all(cosine > 0.5)
    assert not torch.allclose(c, start)


# ----------------------------------------------------------------------------- the init
def test_mxd_paper_init():
    torch.manual_seed(0)
    block = mxd_paper_init(MixtureOfDecoders(8, 32, expert_dims=(4, 6), gate=None))
    assert torch.count_nonzero(block.decoder.D) == 0 and torch.count_nonzero(block.output_bias) == 0
    for name in ("C_n1", "C_n2"):
        np.testing.assert_allclose(getattr(block.decoder, name).detach().norm(dim=1).numpy(), 1.0, rtol=1e-6)
    assert block.unit_norm == {"decoder.C_n1": 1, "decoder.C_n2": 1}
    assert torch.count_nonzero(block(torch.randn(5, 8))) == 0  # starts at output 0
    bound = 1 / np.sqrt(8)  # nn.Linear's init of the encoder: U(−1/√I, 1/√I)
    assert block.up_proj.weight.abs().max() <= bound and block.up_proj.weight.std() > bound / 3
    with pytest.raises(ValueError, match="needs a decoder with expert vectors"):
        mxd_paper_init(MixtureOfDecoders(8, 32, expert_dims=4, decomposition="cp", rank=2))


def test_factory_recipes():
    block = select_blocks(ReLUTeacher(), "mlp$")[0]
    paper = mumoe_factory("mxd", 16, 2, 4.0)(block)
    plain = mumoe_factory("mxd", 16, 2, 4.0, recipe="plain")(block)
    assert torch.count_nonzero(paper.decoder.D) == 0 and paper.unit_norm
    assert torch.count_nonzero(plain.decoder.D) > 0 and not hasattr(plain, "unit_norm")
    with pytest.raises(ValueError, match="recipe='mxd-paper' initialises a Mixture of Decoders"):
        mumoe_factory("cp", 16, 2, 4.0, recipe="mxd-paper")
    with pytest.raises(ValueError, match="recipe must be one of"):
        mumoe_factory("mxd", 16, 2, 4.0, recipe="authors")


def test_paper_budget_and_solved_expert_count():
    block = select_blocks(ReLUTeacher(width=16, hidden=64), "mlp$")[0]
    assert paper_budget(block) == transcoder_parameters(16, 32 * 16, 16) == 17 * 512 + 512 * 16 + 16
    layer = mumoe_factory("mxd", None, 4)(block)
    experts = layer.network.expert_dims[0]
    # the block holds E (16·64 + 64), D (64·16), b_out 16 and I + 1 + O = 33 per expert (gate row, bias, c_n)
    fixed = 16 * 64 + 64 + 64 * 16 + 16
    assert abs(experts - (paper_budget(block) - fixed) / 33) <= 1
    assert sum(p.numel() for p in layer.parameters()) == fixed + 33 * experts
    assert layer.hidden_features == 64
    tc = transcoder_factory(4)(block)
    assert tc.latents == 32 * 16
    with pytest.raises(ValueError, match="expert_dims=None"):
        mumoe_factory("cp", None, 4)


# ----------------------------------------------------------------------------- the schedule
def test_recipes_and_warmup():
    paper, plain = RECIPES["mxd-paper"], RECIPES["plain"]
    assert paper.lr == 4e-4 and paper.optimizer == "adamw" and paper.weight_decay == 0.0
    assert paper.warmup == pytest.approx(5000 / 117_187.5)
    assert plain.lr == 1e-3 and plain.warmup == 0.0
    model = ReLUTeacher()
    rates = []

    def factory(info):
        return mumoe_factory("mxd", 8, 2, 4.0)(info)

    class Spy(torch.optim.AdamW):
        def step(self, closure=None):
            rates.append(self.param_groups[0]["lr"])
            return super().step(closure)

    distill(model, _batches(60), {"mxd": factory}, tokens=64 * 47, batch_size=64, buffer_tokens=256,
            optimizer=lambda p: Spy(p, lr=4e-4, weight_decay=0.0), progress=False)  # fmt: skip
    # 47 steps: round(0.0427 · 47) = 2 warm-up steps at 1/2 and 2/2 of the rate, then constant
    assert rates[:3] == pytest.approx([2e-4, 4e-4, 4e-4]) and rates[-1] == pytest.approx(4e-4)
    with pytest.raises(ValueError, match="recipe must be one of"):
        distill(model, _batches(2), {"mxd": factory}, tokens=64, recipe="authors", progress=False)


# ----------------------------------------------------------------------------- the recipe end to end
@pytest.mark.parametrize("k", [2, 8])
def test_mxd_with_the_recipe_never_exceeds_nmse_one_and_keeps_k(k):
    """A random ReLU MLP distilled into MxD with the authors' recipe: nMSE ≤ 1 all along, L0 = k."""
    model = ReLUTeacher()
    held_out = _batches(4, seed=99)
    factories = {"mxd": mumoe_factory("mxd", 64, k, 4.0)}
    errors = []
    for steps in (1, 20, 300):
        result = distill(model, _batches(steps + 8), factories, tokens=64 * steps, batch_size=64,
                         buffer_tokens=512, progress=False)  # fmt: skip
        row = evaluate_replacements(model, held_out, result.replacements).rows[0]
        errors.append(row.nmse)
        assert row.l0 == k  # every token keeps exactly k experts
        assert row.nmse <= 1.0
        layer = result.replacements["mlp"]["mxd"]
        np.testing.assert_allclose(layer.decoder.C_n1.detach().norm(dim=1).numpy(), 1.0, rtol=1e-5)
    assert errors[-1] < 0.5 * errors[0]  # and it learns
