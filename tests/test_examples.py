"""The examples do what they claim, in their --quick mode (seconds, one thread)."""

from pathlib import Path

import pytest


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "examples"))


def test_char_gpt_mumoe_learns_like_the_mlp(examples, capsys):
    import char_gpt

    variants = ["MLP", "CP μMoE (64 experts)", "CP μMoE (32×32×32×32 experts)"]
    rows = char_gpt.main(["--quick", "--threads", "1", "--variants", *variants])
    assert [r["model"] for r in rows] == variants
    mlp = rows[0]
    for row in rows:
        # every model learns: the training loss falls by at least 20 % within the 40 quick steps
        assert row["train_loss"] <= 0.8 * row["first_loss"], row
        # the μMoE blocks are parameter-matched to the MLP blocks and reach about its validation loss
        assert abs(row["mlp_params"] - mlp["mlp_params"]) <= 0.1 * mlp["mlp_params"]
        assert row["val_loss"] <= 1.1 * mlp["val_loss"], row
    out = capsys.readouterr().out
    assert "| model | seed | params |" in out and all(f"| {name} |" in out for name in variants)


def test_char_gpt_prints_each_row_when_its_variant_finishes(examples, monkeypatch, capsys):
    import char_gpt

    before_training = []  # what had been printed when each variant started training

    def train(name, make_mlp, data, args, seed=0):
        before_training.append(capsys.readouterr().out)
        fields = {"params": 1, "mlp_params": 1, "first_loss": 1.0, "train_loss": 1.0, "val_loss": 1.0}
        return {"model": name, "seed": seed, **fields, "step_ms": 2.0, "seconds": 1.0}

    monkeypatch.setattr(char_gpt, "train", train)
    char_gpt.main(["--quick", "--variants", "MLP", "TR μMoE (64 experts)"])
    assert "| model |" in before_training[0] and "| MLP |" not in before_training[0]
    assert "| MLP |" in before_training[1]
    assert "| TR μMoE (64 experts) |" in capsys.readouterr().out


def test_mixer_digits_mumoe_learns_like_the_mlp(examples):
    pytest.importorskip("sklearn")
    import mixer_digits

    rows = mixer_digits.main(["--quick", "--threads", "1", "--variants", "MLP", "CP μMoE (16 experts)"])
    mlp = rows[0]
    for row in rows:
        assert row["epoch_losses"][-1] <= 0.25 * row["epoch_losses"][0], row  # loss falls 4× in 3 epochs
        assert row["accuracy"] >= 0.85, row  # chance is 0.1
        assert row["accuracy"] >= mlp["accuracy"] - 0.05, row
        assert abs(row["params"] - mlp["params"]) <= 0.05 * mlp["params"]


def test_demo_smoke(tmp_path):
    pytest.importorskip("sklearn")
    from mumoe_tn.cli.demo_command import format_rows, run_demo

    rows = run_demo((4, 8), epochs=1, rank=4, plot=tmp_path / "p.png", progress=False)
    assert [r["experts"] for r in rows] == [4, 8] and (tmp_path / "p.png").exists()
    assert "| 8 |" in format_rows(rows)


def test_train_base_model_is_the_model_distill_builds(examples, tmp_path):
    pytest.importorskip("transformers")
    import torch
    import train_base_model

    from mumoe_tn.distillation.study import FrontierConfig, load_model, pretrain

    result = train_base_model.main(["--quick", "--out", str(tmp_path / "base")])
    assert result["after"] < result["before"] - 0.5  # it learns (uniform bytes: 5.545 nats)
    config = FrontierConfig.quick()
    built, tokens, _ = load_model(config)
    pretrain(built, tokens[: int(0.9 * tokens.numel())], config, progress=False)
    saved, _, description = load_model(FrontierConfig(model_dir=str(tmp_path / "base")))
    assert "byte tokens" in description
    for (name, mine), theirs in zip(saved.state_dict().items(), built.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name
