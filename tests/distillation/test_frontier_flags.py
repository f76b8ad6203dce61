"""A CE-loss score outside [0, 1] is flagged in the tables like the other doubtful cells."""

import math

from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable


def _row(method, spliced, low=math.nan, high=math.nan, gap_low=0.5):
    """A row with CE clean 2 and zero-ablated 3, so its score is ``3 − spliced``; nothing else flagged."""
    return FrontierRow("mlp", method, params=100, l0=4.0, nmse=0.1, explained_variance=0.9, ce_clean=2.0,
                       ce_spliced=spliced, ce_zero=3.0, dead=0, units=16, tokens=64, score_low=low, score_high=high,
                       gap_low=gap_low, gap_high=1.5)  # fmt: skip


ROWS = {
    "above@4": (_row("above@4", 1.8, 1.1, 1.3), True),  # 1.2, its whole interval above 1
    "noisy@4": (_row("noisy@4", 1.956, 0.997, 1.095), True),  # 1.044: flagged, its interval shows the noise
    "below@4": (_row("below@4", 3.5, -0.7, -0.2), True),  # -0.5, its whole interval below 0
    "inside@4": (_row("inside@4", 2.5, 0.4, 0.6), False),
    "bare@4": (_row("bare@4", 1.9), True),  # 1.1 and no interval: the point decides
    "edge@4": (_row("edge@4", 2.0, 0.9, 1.1), False),  # exactly 1
    "no-score@4": (_row("no-score@4", 1.8, gap_low=-0.1), False),  # not meaningful: no score to flag
}


def test_a_score_outside_0_1_is_flagged():
    for name, (row, flagged) in ROWS.items():
        assert ("score" in row.flags) == flagged, (name, row.score, row.flags)
        assert row.flags == (("score",) if flagged else ()), name


def test_the_tables_mark_the_score_and_explain_it():
    table = FrontierTable(tuple(row for row, _ in ROWS.values()))
    (note,) = table.footnotes().values()
    assert note.startswith("¹ CE-loss score outside [0, 1]:")
    lines = {line.split(" | ")[1]: line for line in table.to_markdown().splitlines() if line.startswith("| mlp |")}
    assert "| 1.200 [1.100, 1.300]¹ |" in lines["above@4"] and "| -0.500 [-0.700, -0.200]¹ |" in lines["below@4"]
    assert "| 1.100¹ |" in lines["bare@4"] and "| 1.044 [0.997, 1.095]¹ |" in lines["noisy@4"]
    assert "¹" not in lines["inside@4"] + lines["edge@4"] + lines["no-score@4"]
