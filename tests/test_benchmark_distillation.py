"""benchmarks/distillation.py: the floor's FLOP count by hand, and the report of a smoke run."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import distillation  # noqa: E402


def test_quick_run_reports_every_replacement_against_its_floor(tmp_path):
    assert distillation.main(["--quick", "--methods", "transcoder", "cp", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "distillation-cpu.json").read_text())
    rows = {row["replacement"]: row for row in result["rows"]}
    assert set(rows) == {"transcoder@2", "transcoder@4", "cp@2", "cp@4"}
    # a TopK transcoder 32 -> 128 latents -> 32 (the quick budget): forward 2·(32·128 + 128·32) FLOPs per token;
    # backward: both weight gradients and the decoder's input gradient (the rows need none)
    assert rows["transcoder@2"]["params"] == 32 * 128 + 128 + 128 * 32 + 32
    assert rows["transcoder@2"]["flops_per_token"] == 2 * 32 * 128 * 2 + 2 * 128 * 32 * 3
    for row in rows.values():
        assert row["floor_tokens_per_s"] == pytest.approx(result["gemm_flops"] / row["flops_per_token"])
        assert row["of_floor"] == pytest.approx(row["cpu_tokens_per_s"] / row["floor_tokens_per_s"])
    report = (tmp_path / "distillation-cpu.md").read_text()
    assert "of its floor** in CPU time (target ≥ 30%" in report and "| transcoder@2 | 8,352 | 40,960 |" in report


def test_the_recorded_products_are_the_ones_the_floor_counts():
    """Replaying a step's matrix products: their 2·m·n·k, counted by hand, is the FlopCounterMode floor's count."""
    import torch

    from mumoe_tn.distillation.transcoders import Transcoder

    x, y = torch.randn(16, 6), torch.randn(16, 5)
    step = distillation.Step(Transcoder(6, 12, 5, k=3), x, y, "plain", None, 10)
    flops = step.flops()
    calls = step.products()
    by_hand = 0
    for _, operands in calls:
        a, b = operands[-2:]  # mm(a, b), addmm(bias, a, b), bmm(a, b), baddbmm(c, a, b)
        by_hand += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
    assert by_hand == flops == 2 * 16 * (6 * 12 + 12 * 5) + 2 * 16 * (12 * 5 * 2 + 6 * 12)
    assert distillation.products_seconds(calls, repeats=2) > 0
