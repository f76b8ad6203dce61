"""The frontier's figure: a title that fits, the CE-loss score's intervals as bands."""

import matplotlib.pyplot as plt
import pytest

from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable, frontier_figure, plot_frontier


def _row(method, l0, score, low, high):
    gap = 1.0
    return FrontierRow(
        block="transformer.h.0.mlp", method=method, params=1000, l0=l0, nmse=0.1, explained_variance=0.9,
        ce_clean=2.0, ce_spliced=2.0 + (1 - score) * gap, ce_zero=2.0 + gap, dead=0, units=64, tokens=512,
        score_low=low, score_high=high,
    )  # fmt: skip


@pytest.fixture
def table():
    rows = [_row(f"cp@{k}", k, 0.8 + 0.02 * k, 0.7 + 0.02 * k, 0.9 + 0.02 * k) for k in (4, 8)]
    rows += [_row(f"mxd@{k}", k, 0.75, float("nan"), float("nan")) for k in (4, 8)]
    config = {"tokens": 123_456_789, "eval_tokens": 98_765_432, "budget": 1_234_567, "note": "x" * 120}
    return FrontierTable(tuple(rows), config)


def test_the_title_stays_inside_a_one_panel_figure(table):
    title = table.title() + ", " + "a long description of the run " * 4
    figure = frontier_figure(table, title=title)
    try:
        figure.canvas.draw()
        box = next(t for t in figure.texts if t.get_text() == figure.get_suptitle()).get_window_extent()
        assert box.x0 >= 0 and box.x1 <= figure.bbox.x1, (box, figure.bbox)
        assert box.y1 <= figure.bbox.y1
    finally:
        plt.close(figure)


def test_scores_are_drawn_with_their_intervals(table, tmp_path):
    figure = frontier_figure(table)
    try:
        (panel,) = figure.axes
        bands = panel.collections
        assert len(bands) == 1  # the family with intervals; the one without has none
        (path,) = bands[0].get_paths()
        vertical = path.vertices[:, 1]
        assert min(vertical) == pytest.approx(0.78) and max(vertical) == pytest.approx(1.06)
    finally:
        plt.close(figure)
    assert plot_frontier(table, tmp_path / "frontier.png").stat().st_size > 1000
