"""The GPT-2 upcycling example (--quick) does what it claims."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_gpt2_upcycle_quick(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import gpt2_upcycle

    dense, mumoe, exact = gpt2_upcycle.main(["--quick", "--ranks", "match", "exact"])
    assert (dense["model"], mumoe["model"], exact["model"]) == ("dense", "μMoE rank=match", "μMoE rank=exact")
    # exact: every expert is the pretrained block, so the model computes what the dense one did
    assert exact["upcycle_error"] < 1e-5 and exact["logits_moved"] < 1e-5
    assert abs(exact["loss_before"] - dense["loss_before"]) < 1e-4
    assert exact["mlp_params"] > mumoe["mlp_params"] and mumoe["logits_moved"] > 1e-3
    assert mumoe["experts"] == 32**4 == 1_048_576
    # equal parameters: the μMoE blocks are matched to the MLP blocks (within one rank step)
    assert abs(mumoe["mlp_params"] - dense["mlp_params"]) / dense["mlp_params"] < 0.02
    assert 0 < mumoe["upcycle_error"] < 1  # the best fit of the matched rank, not exact
    # upcycled: it starts near the pretrained model's loss (far below the uniform ln 256 = 5.55)
    assert abs(mumoe["loss_before"] - dense["loss_before"]) < 0.25 and dense["loss_before"] < 4.5
    assert mumoe["loss_after"] < mumoe["loss_before"]  # fine-tuning helps
    assert dense["loss_after"] < dense["loss_before"]
    assert mumoe["tokens_per_s"] > 0


def test_gpt2_upcycle_from_local_weights(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import gpt2_upcycle

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)  # a local checkpoint, no tokenizer
    dense, mumoe = gpt2_upcycle.main(["--quick", "--weights", str(tmp_path), "--experts", "4", "4"])
    assert mumoe["experts"] == 16 and abs(mumoe["params"] - dense["params"]) / dense["params"] < 0.02
