"""Smoke runs of the examples, the demo and the benchmarks (a few steps, tiny sizes)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))


def test_char_gpt_smoke(examples):
    import char_gpt

    rows = char_gpt.main(["--steps", "2", "--width", "32", "--context", "16", "--batch", "4"])
    assert [r["model"] for r in rows] == list(char_gpt.VARIANTS)
    mlp = rows[0]["mlp_params"]
    for row in rows[1:]:  # every μMoE variant is parameter-matched to the MLP blocks
        assert abs(row["mlp_params"] - mlp) / mlp < 0.1
    assert all(r["val_loss"] > 0 for r in rows)


def test_mixer_digits_smoke(examples):
    pytest.importorskip("sklearn")
    import mixer_digits

    rows = mixer_digits.main(["--epochs", "1"])
    assert len(rows) == 3 and all(0 <= r["accuracy"] <= 1 for r in rows)


def test_demo_smoke(tmp_path):
    pytest.importorskip("sklearn")
    from mumoe_tn.demo import format_rows, run_demo

    rows = run_demo((4, 8), epochs=1, rank=4, plot=tmp_path / "p.png", progress=False)
    assert [r["experts"] for r in rows] == [4, 8] and (tmp_path / "p.png").exists()
    assert "| 8 |" in format_rows(rows)


def test_benchmarks_quick(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Targets" in result.stdout and (tmp_path / "benchmarks.md").exists()
    assert (tmp_path / "time_vs_experts.png").exists()
