"""benchmarks/frontier.py: the report written from a frontier table, and merging a second run."""

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
