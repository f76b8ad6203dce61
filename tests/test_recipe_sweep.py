"""benchmarks/recipe_sweep.py: each method's mean score per candidate and the choice, and how ties are broken."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import recipe_sweep  # noqa: E402
from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable  # noqa: E402


def _table(scores):
    """Rows of two blocks at L0 8 and 32 whose CE-loss score is ``scores[method]`` (clean 2, zero-ablated 3)."""
    rows = tuple(
        FrontierRow(block, f"{method}@{l0}", 1000, float(l0), 0.01, 0.9, 2.0, 3.0 - score, 3.0, 1, 64, 100)
        for block in ("h.0.mlp", "h.1.mlp")
        for method, score in scores.items()
        for l0 in (8, 32)
    )
    return FrontierTable(rows, {"methods": list(scores)})


def test_the_best_mean_score_wins_and_a_tie_goes_to_the_shared_recipe():
    tables = {
        "mxd-paper": _table({"transcoder": 0.950, "cp": 0.990}),
        "plain": _table({"transcoder": 0.970, "cp": 0.9903}),
        "low-lr": _table({"transcoder": 0.960}),
    }
    summary = recipe_sweep.summarise(tables)
    assert abs(summary["transcoder"]["plain"]["score"] - 0.970) < 1e-9
    assert summary["cp"].keys() == {"mxd-paper", "plain"}
    # cp: plain is 0.0003 above the shared recipe, within the tie margin of 0.0005
    assert recipe_sweep.choose(summary) == {"transcoder": "plain", "cp": "mxd-paper"}


def test_a_change_of_a_recipes_defaults_must_beat_the_recipe():
    tables = {
        "mxd-paper": _table({"cp": 0.950, "tr": 0.950}),
        "plain": _table({"cp": 0.9800, "tr": 0.9800}),
        "plain, balance off": _table({"cp": 0.9803, "tr": 0.9820}),
    }
    chosen = recipe_sweep.choose(recipe_sweep.summarise(tables))
    assert chosen == {"cp": "plain", "tr": "plain, balance off"}


def test_the_report_lists_every_candidate_and_the_choice(tmp_path):
    for name, scores in (("mxd-paper", {"transcoder": 0.95}), ("topk-paper", {"transcoder": 0.97})):
        path = tmp_path / recipe_sweep._file_name(name)
        path.write_text(_table(scores).to_json())
    report = recipe_sweep.write_report(tmp_path, out=tmp_path).read_text()
    assert "| transcoder | 0.9500 | **0.9700** | `topk-paper` |" in report
