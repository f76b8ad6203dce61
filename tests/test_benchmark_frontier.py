"""benchmarks/frontier.py: the report written from a frontier table, and merging a second run."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import frontier  # noqa: E402
from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable  # noqa: E402


def _table(methods, clean=2.0):
    rows = tuple(
        FrontierRow(
            block, f"{method}@{l0}", 1000, float(l0), 0.1 / l0, 0.9, clean, clean + 1 / l0, clean + 1.0, 3, 64, 100
        )
        for block in ("h.0.mlp", "h.1.mlp")
        for method in methods
        for l0 in (8, 16)
    )
    return FrontierTable(rows, {"methods": list(methods), "seconds": 12.0, "budget": 1000, "tokens": 5})


def test_report_and_merge(tmp_path):
    (tmp_path / "frontier-cpu.json").write_text(_table(["transcoder", "cp"]).to_json())
    assert frontier.main(["--report-only", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "frontier-cpu.md").read_text()
    # mean score over the two blocks: (CE_zero − CE_spliced) / (CE_zero − CE_clean) = 1 − 1/L0
    assert "| transcoder | 0.875 | 0.938 |" in report
    assert (tmp_path / "frontier-cpu.png").stat().st_size > 1000
    (tmp_path / "more.json").write_text(_table(["mxd"]).to_json())
    assert frontier.main(["--merge", str(tmp_path / "more.json"), "--out", str(tmp_path)]) == 0
    merged = FrontierTable.from_json((tmp_path / "frontier-cpu.json").read_text())
    assert len(merged.rows) == 3 * 2 * 2 and merged.config["methods"] == ["transcoder", "cp", "mxd"]
    assert "| mxd | 0.875 | 0.938 |" in (tmp_path / "frontier-cpu.md").read_text()
    (tmp_path / "other.json").write_text(_table(["tr"], clean=2.5).to_json())
    with pytest.raises(SystemExit, match="measured another model"):
        frontier.main(["--merge", str(tmp_path / "other.json"), "--out", str(tmp_path)])


def _seed_table(seed):
    """Block scores: transcoder 0.9 + 0.01·seed, mxd 0.02 above it at L0 8 and 0.01·(seed − 1) at L0 16."""
    rows = []
    for block in ("h.0.mlp", "h.1.mlp"):
        for method, l0, score in (
            ("transcoder", 8, 0.9 + 0.01 * seed),
            ("transcoder", 16, 0.9 + 0.01 * seed),
            ("mxd", 8, 0.92 + 0.01 * seed),
            ("mxd", 16, 0.9 + 0.01 * seed + 0.01 * (seed - 1)),
        ):
            # CE clean 2, CE zero 3, so the score is 3 − CE spliced
            rows.append(
                FrontierRow(block, f"{method}@{l0}", 1000, float(l0), 0.01, 0.9, 2.0, 3.0 - score, 3.0, 1, 8, 9)
            )
    return FrontierTable(tuple(rows), {"seed": seed})


def test_report_over_seeds_gives_paired_t_intervals(tmp_path):
    from scipy import stats

    runs = {str(seed): json.loads(_seed_table(seed).to_json()) for seed in (0, 1, 2)}
    config = {"seconds": 61.5, "jobs": 2, "seeds": [0, 1, 2]}
    (tmp_path / "frontier-cpu.json").write_text(json.dumps({"config": config, "runs": runs}))
    assert frontier.main(["--report-only", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "frontier-cpu.md").read_text()
    assert "61.5 s from start to table" in report
    # transcoder scores 0.90, 0.91, 0.92: mean 0.91 ± t(0.975, 2)·0.01/√3
    half = stats.t.ppf(0.975, 2) * 0.01 / 3**0.5
    assert f"| transcoder | 0.910 [{0.91 - half:.3f}, {0.91 + half:.3f}] |" in report
    # paired: mxd − transcoder is exactly 0.02 at L0 8 (a zero-width interval, excluding 0), −0.01/0/+0.01 at 16
    half16 = stats.t.ppf(0.975, 2) * 0.01 / 3**0.5
    assert f"| mxd | +0.020 [+0.020, +0.020] * | +0.000 [{-half16:+.3f}, {half16:+.3f}] |" in report
    assert "| mxd, `h.0.mlp` | +0.020 [+0.020, +0.020] * |" in report
    with pytest.raises(SystemExit, match="holds a run over seeds"):
        frontier.main(["--merge", str(tmp_path / "frontier-cpu.json"), "--out", str(tmp_path)])


def test_one_command_over_seeds(tmp_path):
    """A tiny run from start to table: two seeds, two methods, one L0."""
    argv = ["--quick", "--seeds", "0", "1", "--jobs", "1", "--methods", "transcoder", "mxd", "--l0", "2",
            "--tokens", "512", "--out", str(tmp_path)]  # fmt: skip
    assert frontier.main(argv) == 0
    data = json.loads((tmp_path / "frontier-cpu.json").read_text())
    assert sorted(data["runs"]) == ["0", "1"] and data["config"]["seconds"] > 0
    first = FrontierTable.from_json(json.dumps(data["runs"]["0"]))
    assert {row.method for row in first.rows} == {"transcoder@2", "mxd@2"}
    assert first.config["recipe"] == "mxd-paper" and first.config["trained_tokens"] == 512
    report = (tmp_path / "frontier-cpu.md").read_text()
    assert "method − transcoder" in report and "| mxd |" in report


@pytest.mark.parametrize(("flag", "expected"), [("auto", None), ("on", True), ("off", False)])
def test_the_aux_k_flag_reaches_every_seeds_config(tmp_path, monkeypatch, flag, expected):
    seen = []

    def run_seeds(config, seeds, jobs=1):
        seen.append(config.aux_k)
        raise SystemExit(0)  # the configuration is all this test reads

    monkeypatch.setattr(frontier, "run_seeds", run_seeds)
    with pytest.raises(SystemExit):
        frontier.main(["--quick", "--aux-k", flag, "--out", str(tmp_path)])
    assert seen == [expected]


def test_the_per_method_recipes_flag_gives_every_seed_the_chosen_table(tmp_path, monkeypatch):
    from mumoe_tn.distillation.methods import BEST_RECIPES

    seen = []

    def run_seeds(config, seeds, jobs=1):
        seen.append(config.method_recipes)
        return {seed: _table(["transcoder", "cp"]) for seed in seeds}

    monkeypatch.setattr(frontier, "run_seeds", run_seeds)
    argv = ["--quick", "--seeds", "0", "1", "--per-method-recipes", "--out", str(tmp_path)]
    assert frontier.main(argv) == 0
    assert seen == [BEST_RECIPES]
    assert (tmp_path / "frontier-best-cpu.json").is_file() and not (tmp_path / "frontier-cpu.json").exists()
    assert frontier._recipes_line({"recipe": "mxd-paper", "methods": ["cp", "transcoder"],
                                   "method_recipes": [["transcoder", "topk-paper"], ["tr", "plain"]]}) == (
        "recipe `mxd-paper`, but transcoder `topk-paper`"
    )  # fmt: skip
