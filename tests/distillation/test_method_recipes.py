"""Each method at its own recipe: the recipes' settings, Gao et al.'s transcoder recipe, per-method recipes in a run."""

import math

import pytest
import torch
from torch import nn

from mumoe_tn.distillation.losses import AuxK
from mumoe_tn.distillation.method_recipes import check_method_recipes, recipe_of
from mumoe_tn.distillation.methods import BEST_RECIPES
from mumoe_tn.distillation.replacements import topk_paper_init, transcoder_factory
from mumoe_tn.distillation.streaming import select_blocks
from mumoe_tn.distillation.study import DEFAULT_METHODS, FrontierConfig, run_frontier
from mumoe_tn.distillation.trainer import RECIPES, ReplacementTrainer
from mumoe_tn.distillation.training import distill
from mumoe_tn.distillation.transcoders import Transcoder


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        return h + self.mlp(h)


def _batches(count):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (4, 16), generator=generator) for _ in range(count)]


def test_the_candidate_recipes_hold_their_sources_settings():
    warmup = 5_000 / 117_187.5
    assert (RECIPES["adam-warmup"].lr, RECIPES["adam-warmup"].optimizer) == (1e-3, "adam")
    assert RECIPES["adam-warmup"].warmup == pytest.approx(warmup)
    assert RECIPES["low-lr"].lr == 2e-4 and RECIPES["low-lr"].warmup == pytest.approx(warmup)
    topk = RECIPES["topk-paper"]
    assert (topk.lr, topk.optimizer, topk.eps, topk.warmup) == (2e-4, "adam", 6.25e-10, 0.0)
    assert topk.reference_latents == 16384


def test_topk_paper_rate_scales_with_the_latents_and_reaches_the_optimiser():
    transcoder = Transcoder(8, 512, k=4)
    trainer = ReplacementTrainer(transcoder, recipe="topk-paper")
    group = trainer.optimizer.param_groups[0]
    # 2e-4 / sqrt(512 / 2^14) = 2e-4 · sqrt(32)
    assert group["lr"] == pytest.approx(2e-4 * math.sqrt(32)) and group["eps"] == 6.25e-10
    assert group["betas"] == (0.9, 0.999) and isinstance(trainer.optimizer, torch.optim.Adam)
    assert RECIPES["topk-paper"].rate(Transcoder(8, 2**14, k=4)) == pytest.approx(2e-4)
    assert RECIPES["topk-paper"].rate(transcoder, lr=1e-4) == pytest.approx(1e-4 * math.sqrt(32))
    assert RECIPES["mxd-paper"].rate(nn.Linear(2, 2)) == 4e-4
    with pytest.raises(ValueError, match=r"scales its learning rate by the number of latents.*Linear"):
        ReplacementTrainer(nn.Linear(2, 2), recipe="topk-paper")


def test_topk_paper_init_and_factory():
    block = select_blocks(TinyLM(), "mlp$")[0]
    module = transcoder_factory(4, 2.0, recipe="topk-paper")(block)
    columns = module.decoder.weight.detach().norm(dim=0)
    torch.testing.assert_close(columns, torch.ones_like(columns))
    torch.testing.assert_close(module.encoder.weight.detach(), module.decoder.weight.detach().T)
    assert torch.count_nonzero(module.encoder.bias) == 0 and torch.count_nonzero(module.decoder.bias) == 0
    assert module.unit_norm == {"decoder.weight": 0}
    assert [type(term) for term in module.distillation_losses] == [AuxK]
    assert module.distillation_losses[0].weight == 1 / 32
    plain = transcoder_factory(4, 2.0)(block)
    assert torch.count_nonzero(plain.decoder.weight) == 0 and not hasattr(plain, "unit_norm")
    with pytest.raises(ValueError, match=r"None, .topk-paper. or .topk-transcoder., got .mxd-paper."):
        transcoder_factory(4, 2.0, recipe="mxd-paper")
    with pytest.raises(ValueError, match="equal input and output widths, got 8 and 6"):
        topk_paper_init(Transcoder(8, 16, 6, k=2))
    with pytest.raises(TypeError, match="takes a Transcoder, got Linear"):
        topk_paper_init(nn.Linear(2, 2))


def test_topk_paper_training_keeps_the_decoder_columns_unit_norm():
    result = distill(TinyLM(), _batches(20), {"tc": transcoder_factory(4, 2.0, recipe="topk-paper")},
                     recipe="topk-paper", tokens=640, batch_size=64, buffer_tokens=256, progress=False)  # fmt: skip
    module = result.replacements["mlp"]["tc"]
    columns = module.decoder.weight.detach().norm(dim=0)
    torch.testing.assert_close(columns, torch.ones_like(columns))


def test_a_recipe_per_method_trains_each_as_its_own_recipe_would():
    factories = {"fast": transcoder_factory(4, 2.0), "slow": transcoder_factory(4, 2.0)}
    common = {"tokens": 320, "batch_size": 64, "buffer_tokens": 256, "progress": False}
    mixed = distill(TinyLM(), _batches(10), factories, recipe={"fast": "plain", "slow": "low-lr"}, **common)
    plain = distill(TinyLM(), _batches(10), factories, recipe="plain", **common)
    low = distill(TinyLM(), _batches(10), factories, recipe="low-lr", **common)
    for name, alone in (("fast", plain), ("slow", low)):
        for key, value in mixed.replacements["mlp"][name].state_dict().items():
            assert torch.equal(value, alone.replacements["mlp"][name].state_dict()[key]), (name, key)
    slow_plain, slow_low = plain.replacements["mlp"]["slow"], low.replacements["mlp"]["slow"]
    assert not torch.equal(slow_plain.decoder.weight, slow_low.decoder.weight)
    with pytest.raises(ValueError, match=r"missing \['slow'\], not methods \['other'\]"):
        distill(TinyLM(), _batches(2), factories, recipe={"fast": "plain", "other": "plain"}, **common)
    with pytest.raises(ValueError, match=r"recipe of 'slow' must be one of .*'authors'"):
        distill(TinyLM(), _batches(2), factories, recipe={"fast": "plain", "slow": "authors"}, **common)
    with pytest.raises(TypeError, match="recipe must be a recipe's name or a mapping"):
        distill(TinyLM(), _batches(2), factories, recipe=3, **common)


def test_method_recipes_are_checked():
    assert check_method_recipes((("cp", "plain"), ["mxd", "low-lr"])) == {"cp": "plain", "mxd": "low-lr"}
    assert recipe_of("cp", (("cp", "plain"),), "mxd-paper") == "plain"
    assert recipe_of("tr", (("cp", "plain"),), "mxd-paper") == "mxd-paper"
    with pytest.raises(ValueError, match="gives 'cp' the recipe 'fast'"):
        check_method_recipes((("cp", "fast"),))
    with pytest.raises(ValueError, match="names 'cp' twice"):
        check_method_recipes((("cp", "plain"), ("cp", "low-lr")))
    with pytest.raises(TypeError, match="tuple of \\(method, recipe\\) pairs"):
        check_method_recipes("cp")
    with pytest.raises(TypeError, match="pair of strings, got \\('cp',\\)"):
        check_method_recipes((("cp",),))
    with pytest.raises(ValueError, match="unknown method 'cpp'"):  # refused before any model is built
        run_frontier(FrontierConfig(method_recipes=(("cpp", "plain"),)), progress=False)


def test_best_recipes_name_every_default_method_once_with_a_known_recipe():
    chosen = check_method_recipes(BEST_RECIPES)
    assert sorted(chosen) == sorted(DEFAULT_METHODS)


def test_topk_transcoder_recipe_clips_the_gradient_and_keeps_the_decoder_free():
    block = select_blocks(TinyLM(), "mlp$")[0]
    module = transcoder_factory(4, 2.0, recipe="topk-transcoder")(block)
    assert torch.count_nonzero(module.decoder.weight) == 0 and not hasattr(module, "unit_norm")
    assert [type(term) for term in module.distillation_losses] == [AuxK]
    assert RECIPES["topk-transcoder"].clip_norm == 1.0 and RECIPES["topk-transcoder"].eps == 6.25e-10
    trainer = ReplacementTrainer(module, recipe="topk-transcoder")
    norms = []

    class Spy:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            self.optimizer.step()

        def __getattr__(self, name):
            return getattr(self.optimizer, name)

    trainer.optimizer = Spy(trainer.optimizer)
    x = 100 * torch.randn(64, 8)  # a large target: the raw gradient's norm is far above 1
    trainer.step(x, -x)
    assert norms[0] == pytest.approx(1.0, rel=1e-4)
