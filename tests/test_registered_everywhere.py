"""A block kind and a distillation method registered in a test reach every tool, with no other edit.

The block kind is a format's MLP block (registered with ``register_mlp_block`` and named by a
format's ``mlp_block``); the method is a transcoder of its own class (registered with
``register_method``). Both are registered inside fixtures and removed after.
"""

import json

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import hf_models

from mumoe_tn.cli import main
from mumoe_tn.conversion.convert import convert
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted
from mumoe_tn.decompositions import unregister
from mumoe_tn.decompositions.cp import CPFormat
from mumoe_tn.design import families, search_space
from mumoe_tn.distillation import DistillOptions, distill, evaluate_replacements
from mumoe_tn.distillation.methods import (
    MethodSettings,
    MethodSpec,
    available_methods,
    parse_method,
    register_method,
    unregister_method,
)
from mumoe_tn.distillation.replacement_specs import ReplacementSpec, transcoder_spec_from_data
from mumoe_tn.distillation.run_files import load_frontier, save_frontier
from mumoe_tn.distillation.streaming import TokenWindows
from mumoe_tn.distillation.study import method_factories
from mumoe_tn.distillation.transcoders import Transcoder
from mumoe_tn.layers import MuMoEMLP
from mumoe_tn.layers.mlp_blocks import mlp_block_for, register_mlp_block, unregister_mlp_block

FORMAT, BLOCK, METHOD = "toy_everywhere", "toy_everywhere_block", "toy-wide"


class ToyBlock(MuMoEMLP):
    """The toy block kind's block: a plain μMoE block of its own class, to see which builder a tool called."""


class ToyReplacement(Transcoder):
    """The toy method's replacement: a TopK transcoder of its own class with 2·I latents."""


def build_toy_block(in_features, hidden_features, out_features, expert_dims, decomposition, *, gated=False, **options):
    return ToyBlock(in_features, hidden_features, out_features, expert_dims, decomposition, **options)


def toy_factory(spec, settings):
    """The toy method: ``factory(spec, settings)`` as every registered method is."""

    def build(block):
        module = ToyReplacement(block.in_features, 2 * block.in_features, block.out_features, k=spec.k,
                                device=block.device, dtype=block.dtype)  # fmt: skip
        size = sum(parameter.numel() for parameter in module.parameters())
        module.replacement_spec = ReplacementSpec(METHOD, spec.k, size)  # what a saved run rebuilds it from
        return module

    return build


def rebuild_toy(spec):
    return toy_factory(MethodSpec(METHOD, k=spec.k), MethodSettings())


@pytest.fixture
def toy_block_kind():
    register_mlp_block(BLOCK, build_toy_block)

    class ToyEverywhere(CPFormat, name=FORMAT):
        mlp_block = BLOCK

    yield FORMAT
    unregister(FORMAT)
    unregister_mlp_block(BLOCK)


@pytest.fixture
def toy_method():
    register_method(METHOD, toy_factory, read=transcoder_spec_from_data, rebuild=rebuild_toy)
    yield METHOD
    unregister_method(METHOD)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6)))


def _gpt2():
    torch.manual_seed(0)
    return hf_models.gpt2(layers=1, width=16, heads=2, vocab=256, positions=32).eval()


def test_the_block_kind_reaches_the_layers_conversion_and_its_replay(toy_block_kind, tmp_path):
    assert type(mlp_block_for(toy_block_kind).build(6, 12, 6, 4, toy_block_kind, rank=2)) is ToyBlock
    model = _mlp()
    convert(model, expert_dims=4, mlps=r"^0$", decomposition=toy_block_kind, rank=2)
    assert type(model[0]) is ToyBlock
    save_converted(model, tmp_path / "toy.safetensors")
    replayed = load_converted(_mlp(), tmp_path / "toy.safetensors")
    assert type(replayed[0]) is ToyBlock
    x = torch.randn(3, 6)
    torch.testing.assert_close(replayed(x), model.eval()(x))


def test_the_block_kind_joins_the_design_search(toy_block_kind):
    assert toy_block_kind in families()
    assert {shape.family for shape in search_space(8, max_modes=1, families=[toy_block_kind])} == {toy_block_kind}


def test_the_method_and_the_block_kind_reach_distill_and_saved_runs(toy_block_kind, toy_method, tmp_path):
    assert toy_method in available_methods()
    assert parse_method(toy_method) == MethodSpec(toy_method)
    assert parse_method(f"{toy_block_kind}-hier") == MethodSpec("mumoe", toy_block_kind, hierarchical=True)
    factories = method_factories([toy_method, toy_block_kind], (2,), 2.0, 4)
    assert sorted(factories) == [f"{toy_method}@2", f"{toy_block_kind}@2"]
    model = _gpt2()
    text = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    options = DistillOptions(tokens=128, batch_size=64, buffer_tokens=128, recipe="plain", progress=False)
    result = distill(model, TokenWindows(text, 32, 2, 8), factories, options=options)
    trained = result.replacements["transformer.h.0.mlp"]
    assert type(trained[f"{toy_method}@2"]) is ToyReplacement and type(trained[f"{toy_block_kind}@2"]) is ToyBlock
    table = evaluate_replacements(model, TokenWindows(text, 32, 2, 1, seed=1), result.replacements, resamples=10)
    save_frontier(tmp_path / "run", table, result.replacements, model)
    _, loaded, _ = load_frontier(tmp_path / "run")
    for method, module in trained.items():
        again = loaded["transformer.h.0.mlp"][method]
        assert type(again) is type(module)
        for (name, a), (_, b) in zip(module.state_dict().items(), again.state_dict().items(), strict=True):
            assert torch.equal(a, b), (method, name)


def test_the_command_line_takes_them_by_name(toy_block_kind, toy_method, tmp_path, capsys):
    import transformers

    model = tmp_path / "model"
    _gpt2().save_pretrained(model)
    text = tmp_path / "text.txt"
    text.write_text("the toy method and the toy block kind reach the command line\n" * 60, encoding="utf-8")
    run = tmp_path / "run"
    argv = ["distill", "--quick", "--model", str(model), "--text", str(text), "--methods", toy_method, toy_block_kind,
            "--l0", "2", "--tokens", "128", "--batch-size", "64", "--eval-tokens", "256", "--no-progress", "--json",
            "--save", str(run)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [row["method"] for row in rows] == [f"{toy_method}@2", f"{toy_block_kind}@2"]
    _, loaded, _ = load_frontier(run, model=transformers.GPT2LMHeadModel.from_pretrained(model))
    built = loaded["transformer.h.0.mlp"]
    assert type(built[f"{toy_method}@2"]) is ToyReplacement and type(built[f"{toy_block_kind}@2"]) is ToyBlock


def test_an_unregistered_method_is_refused_by_name_with_the_registered_ones(capsys):
    with pytest.raises(ValueError, match=r"unknown method 'toy-gone'.*'skip-transcoder', 'transcoder'"):
        parse_method("toy-gone")
    with pytest.raises(SystemExit):
        main(["distill", "--quick", "--methods", "toy-gone", "--no-progress"])
    assert "unknown method 'toy-gone'" in capsys.readouterr().err
