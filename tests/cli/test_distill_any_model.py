"""``mumoe-tn distill`` on GPT-2, Llama and GPT-NeoX models with their own text; checkpoints, signals, resume."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hf_models

from mumoe_tn.cli import main
from mumoe_tn.cli.distill_command import checkpoint_steps

ROOT = Path(__file__).resolve().parents[2]
WORDS = {
    "gpt2": "river stone bridge water flows under the old mill wheel",
    "llama": "the cat sat on a mat and then it ran to the red door",
    "neox": "seven bright stars rise over quiet hills before dawn",
}
#: The blocks each family's MLPs are found at, and whether they are gated.
BLOCKS = {
    "gpt2": (["transformer.h.0.mlp", "transformer.h.1.mlp"], "mlp"),
    "llama": (["model.layers.0.mlp", "model.layers.1.mlp"], "gated"),
    "neox": (["gpt_neox.layers.0.mlp", "gpt_neox.layers.1.mlp"], "mlp"),
    "gemma": (["model.layers.0.mlp", "model.layers.1.mlp"], "gated"),
}
QUICK = ["--quick", "--methods", "transcoder", "mxd", "--l0", "2", "--eval-tokens", "256", "--no-progress"]


def _text(path, family, words=2_000):
    """A text of ``words`` words drawn from the family's own vocabulary (seeded)."""
    vocabulary = WORDS[family].split()
    picks = torch.randint(0, len(vocabulary), (words,), generator=torch.Generator().manual_seed(len(family)))
    path.write_text(" ".join(vocabulary[i] for i in picks.tolist()) + "\n", encoding="utf-8")
    return path


def _saved_model(directory, family):
    torch.manual_seed(0)
    if family == "gpt2":
        model = hf_models.gpt2(layers=2, width=16, heads=2, vocab=256, positions=32)
    elif family == "llama":  # 100 ids: too few for bytes, so its own tokenizer is saved beside it
        model = hf_models.llama(vocab=100)
        hf_models.char_tokenizer(WORDS["llama"]).save_pretrained(directory)
    else:
        model = hf_models.gpt_neox()
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", ["gpt2", "llama", "neox"])
def test_distill_runs_on_each_family_with_its_own_text(tmp_path, capsys, family):
    model = str(_saved_model(tmp_path / "model", family))
    text = _text(tmp_path / f"{family}.txt", family)
    assert main(["distill", *QUICK, "--model", model, "--text", str(text), "--tokens", "256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names, _ = BLOCKS[family]
    assert [(row["block"], row["method"]) for row in data["rows"]] == [
        (name, method) for name in names for method in ("transcoder@2", "mxd@2")
    ]
    assert data["config"]["text"] == [str(text)] and data["config"]["trained_tokens"] == 256
    assert data["config"]["model"].endswith("(byte tokens)") == (family != "llama")
    for row in data["rows"]:
        assert row["ce_clean"] > 0 and row["ce_zero"] > 0 and row["params"] > 0, row


@pytest.mark.parametrize("family", ["llama", "neox", "gemma"])
def test_the_blocks_of_each_family_are_found_as_they_compute(family):
    import transformers

    from mumoe_tn.distillation.streaming import select_blocks

    if family == "gemma":
        settings = transformers.GemmaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
        model = transformers.GemmaForCausalLM(settings)
    else:
        model = hf_models.llama() if family == "llama" else hf_models.gpt_neox()
    names, kind = BLOCKS[family]
    blocks = select_blocks(model)
    assert [block.name for block in blocks] == names and {block.kind for block in blocks} == {kind}
    assert (blocks[0].in_features, blocks[0].hidden_features, blocks[0].out_features) == (32, 64, 32)


def test_the_text_given_is_the_text_read(tmp_path, capsys):
    model = str(_saved_model(tmp_path / "model", "neox"))
    short = tmp_path / "short.txt"
    short.write_text("a few words, not enough for a held-out window\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["distill", *QUICK, "--model", model, "--text", str(short)])
    assert exit_info.value.code == 2
    assert "the text is 46 tokens long" in capsys.readouterr().err  # 46 bytes of its own, not pydoc_data
    with pytest.raises(SystemExit):
        main(["distill", *QUICK, "--model", model, "--text", str(tmp_path / "missing.txt")])
    assert f"the text path {str(tmp_path / 'missing.txt')!r} does not exist" in capsys.readouterr().err


def test_a_model_too_small_for_bytes_without_a_tokenizer_is_refused(tmp_path, capsys):
    torch.manual_seed(0)
    hf_models.llama(vocab=100).save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit) as exit_info:
        main(["distill", *QUICK, "--model", str(tmp_path / "model"), "--text", str(_text(tmp_path / "t.txt", "gpt2"))])
    assert exit_info.value.code == 2
    assert "byte tokens need a vocabulary of at least 256, the model has 100" in capsys.readouterr().err


def test_resume_and_checkpoint_options_are_checked_first(tmp_path, capsys):
    missing = tmp_path / "nothing-here.pt"
    with pytest.raises(SystemExit) as exit_info:
        main(["distill", "--quick", "--checkpoint", str(missing), "--resume"])
    assert exit_info.value.code == 2
    assert f"there is no checkpoint file at {str(missing)!r}" in capsys.readouterr().err
    for every, message in (("10", "--checkpoint-every needs --checkpoint FILE"), ("ten", "got 'ten'")):
        argv = ["distill", "--quick", "--checkpoint-every", every]
        with pytest.raises(SystemExit):
            main(argv if every == "10" else [*argv, "--checkpoint", str(missing)])
        assert message in capsys.readouterr().err
    assert checkpoint_steps(None, 128) == 100 and checkpoint_steps("3", 128) == 3
    assert checkpoint_steps("500tok", 128) == 4 and checkpoint_steps("512 tokens", 128) == 4


def test_sigint_writes_a_checkpoint_prints_the_resume_command_and_resume_completes(tmp_path, capsys):
    model = str(_saved_model(tmp_path / "model", "neox"))
    text, checkpoint = _text(tmp_path / "neox.txt", "neox"), tmp_path / "run.pt"
    argv = ["distill", *QUICK, "--model", model, "--text", str(text), "--tokens", "4096", "--json",
            "--checkpoint", str(checkpoint), "--checkpoint-every", "1"]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "mumoe_tn.cli", *argv], cwd=tmp_path, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and out == ""
    assert "mumoe-tn distill: stopped by SIGINT" in err
    command = "mumoe-tn " + " ".join(argv) + " --resume"
    assert f"mumoe-tn distill: resume with: {command}" in err
    state = torch.load(checkpoint, weights_only=True)
    assert 0 < state["counters"]["trained"] < 4096
    assert main([*argv[:-1], "1000", "--resume"]) == 0  # in-process: the same command line
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["trained_tokens"] == 4096 and len(data["rows"]) == 4


def test_a_stop_during_the_evaluation_keeps_the_finished_distillation_to_resume(tmp_path, monkeypatch):
    from mumoe_tn.distillation import study
    from mumoe_tn.distillation.interruption import DistillationStopped

    model = str(_saved_model(tmp_path / "model", "neox"))
    text = (str(_text(tmp_path / "t.txt", "neox")),)
    config = dataclasses.replace(study.FrontierConfig.quick(), model_dir=model, text=text, methods=("transcoder",),
                                 l0s=(2,), tokens=256, eval_tokens=256)  # fmt: skip
    evaluating = [False]
    evaluate = study.evaluate_replacements

    def evaluate_and_flag(*args, **kwargs):
        evaluating[0] = True
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(study, "evaluate_replacements", evaluate_and_flag)
    path = tmp_path / "run.pt"
    with pytest.raises(DistillationStopped, match="stopped after 256 of 256 tokens") as info:
        study.run_frontier(config, progress=False, checkpoint=path, stop=lambda: evaluating[0])
    assert info.value.checkpoint == path and torch.load(path, weights_only=True)["counters"]["trained"] == 256
    evaluating[0] = False
    table = study.run_frontier(config, progress=False, checkpoint=path, resume=True, stop=lambda: False)
    assert [row.method for row in table.rows] == ["transcoder@2", "transcoder@2"]
    _text(Path(text[0]), "gpt2")  # other words at the same path: not the text the checkpoint was trained on
    with pytest.raises(ValueError, match=r"written by a different distillation \(text_digest: checkpoint '\d+ tokens"):
        study.run_frontier(config, progress=False, checkpoint=path, resume=True)
    with pytest.raises(ValueError, match=r"there is no checkpoint to resume from at '.*missing.pt'"):
        study.run_frontier(config, checkpoint=tmp_path / "missing.pt", resume=True)


@pytest.mark.parametrize("family", ["gpt2", "llama", "neox"])
def test_each_family_is_interrupted_resumed_saved_and_reloaded(tmp_path, capsys, monkeypatch, family):
    import transformers

    from mumoe_tn.distillation import interruption
    from mumoe_tn.distillation.run_files import load_frontier

    model = str(_saved_model(tmp_path / "model", family))
    text, checkpoint, saved = _text(tmp_path / f"{family}.txt", family), tmp_path / "run.pt", tmp_path / "saved"
    argv = ["distill", *QUICK, "--model", model, "--text", str(text), "--tokens", "1024", "--json",
            "--checkpoint", str(checkpoint), "--checkpoint-every", "1"]  # fmt: skip

    def stop_once_checkpointed(self):  # what SIGINT does, once the first checkpoint is on disk
        if self.signal is None and checkpoint.exists():
            self.signal = signal.SIGINT
        return self.signal is not None

    with monkeypatch.context() as patched:
        patched.setattr(interruption.StopOnSignals, "__call__", stop_once_checkpointed)
        assert main(argv) == 130
    err = capsys.readouterr().err
    assert "stopped by SIGINT" in err and "--resume" in err
    trained = torch.load(checkpoint, weights_only=True)["counters"]["trained"]
    assert 0 < trained < 1024
    assert main([*argv, "--resume", "--save", str(saved)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["trained_tokens"] == 1024
    with pytest.raises(ValueError, match="the run saved no model"):
        load_frontier(saved)
    distilled = transformers.AutoModelForCausalLM.from_pretrained(model, local_files_only=True)
    _, replacements, table = load_frontier(saved, model=distilled)
    names, _ = BLOCKS[family]
    assert sorted(replacements) == sorted(names)
    assert all(sorted(replacements[name]) == ["mxd@2", "transcoder@2"] for name in names)
    rows = [(row["block"], row["method"], row["nmse"]) for row in printed["rows"]]
    assert [(row.block, row.method, pytest.approx(row.nmse)) for row in table.rows] == rows


def test_the_recipe_options_reach_the_frontier_config():
    import argparse

    from mumoe_tn.cli.distill_command import config_from, configure
    from mumoe_tn.distillation.methods import BEST_RECIPES

    parser = configure(argparse.ArgumentParser(exit_on_error=False))
    config = config_from(parser.parse_args([*QUICK[1:], "--quick", "--per-method-recipes", "--recipe", "adam-warmup"]))
    assert config.method_recipes == BEST_RECIPES and config.recipe == "adam-warmup"
    assert config_from(parser.parse_args(QUICK)).method_recipes == ()
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser.parse_args([*QUICK, "--recipe", "no-such-recipe"])
