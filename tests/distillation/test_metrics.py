"""Metrics that say when they mean nothing (the bootstrap interval, the CE-score guard, flags); registered metrics."""

import copy
import io
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from mumoe_tn.distillation.faithfulness import ZeroBlock, evaluate_replacements, next_token_loss
from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable, bootstrap_ce_score, ce_loss_score
from mumoe_tn.distillation.metrics import (
    L0,
    Dead,
    Metric,
    Units,
    available_metrics,
    register_metric,
    resolve_metrics,
    unregister_metric,
)
from mumoe_tn.distillation.training import spliced


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ToyLM(nn.Module):
    """Embedding → residual MLP block → head: the next token depends on the current one only."""

    def __init__(self, vocab=16, width=8, hidden=16, *, block_scale=1.0, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.head = nn.Linear(width, vocab)
        with torch.no_grad():
            self.mlp[2].weight.mul_(block_scale)
            self.mlp[2].bias.mul_(block_scale)
            self.head.weight.mul_(3.0)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        return self.head(h + self.mlp(h))


def _sampled(model, sequences=48, length=16, batch=8, seed=3):
    """Text drawn from the model itself: its clean loss is its entropy, and any change of the block costs."""
    vocab = model.embed.num_embeddings
    with torch.no_grad():
        table = model(torch.arange(vocab)[None])[0].softmax(-1)  # next-token distribution after each token
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sequences, 1), generator=generator)
    for _ in range(length - 1):
        ids = torch.cat([ids, torch.multinomial(table[ids[:, -1]], 1, generator=generator)], 1)
    return list(ids.split(batch))


# ----------------------------------------------------------------------------- the bootstrap interval
def test_bootstrap_interval_covers_the_true_score_at_about_the_nominal_rate():
    """Sequences with known expected losses: the 95 % interval holds the true score in ≈ 95 % of the draws."""
    rng = np.random.default_rng(0)
    true_score = (0.5 - 0.1) / 0.5  # E[zero − spliced] / E[zero − clean] per token
    trials, sequences, hits = 300, 60, 0
    for trial in range(trials):
        tokens = rng.integers(8, 33, sequences)
        clean = tokens * rng.normal(2.0, 0.3, sequences)
        zero = clean + tokens * rng.normal(0.5, 0.4, sequences)
        spliced = clean + tokens * rng.normal(0.1, 0.2, sequences)
        interval = bootstrap_ce_score(clean, spliced, zero, tokens, resamples=400, seed=trial)
        hits += interval.score_low <= true_score <= interval.score_high
    assert 0.90 <= hits / trials <= 0.985, hits / trials


def test_bootstrap_by_hand_and_seeded():
    clean, spliced, zero, tokens = [10.0, 12.0], [11.0, 13.0], [14.0, 16.0], [5, 5]
    interval = bootstrap_ce_score(clean, spliced, zero, tokens, resamples=200, seed=1)
    # every resample of these two sequences has score 0.75 (both have (z − s) / (z − c) = 3 / 4) and gap 0.8
    assert interval.score_low == pytest.approx(0.75) and interval.score_high == pytest.approx(0.75)
    assert interval.gap_low == pytest.approx(0.8) and interval.gap_high == pytest.approx(0.8)
    rng = np.random.default_rng(5)
    data = [rng.normal(size=30) + offset for offset in (2.0, 2.5, 3.0)] + [np.full(30, 10)]
    assert bootstrap_ce_score(*data, seed=4) == bootstrap_ce_score(*data, seed=4)
    assert bootstrap_ce_score(*data, seed=4) != bootstrap_ce_score(*data, seed=5)
    with pytest.raises(ValueError, match="must be 1-D of one length"):
        bootstrap_ce_score([1.0], [1.0, 2.0], [1.0], [1])
    with pytest.raises(ValueError, match="level must be in"):
        bootstrap_ce_score(*data, level=95)


def _row(**changes):
    values = dict(block="b", method="cp@8", params=10, l0=8.0, nmse=0.2, explained_variance=0.8, ce_clean=2.0,
                  ce_spliced=2.1, ce_zero=2.5, dead=0, units=64, tokens=100)  # fmt: skip
    return FrontierRow(**{**values, **changes})


def test_a_gap_within_its_noise_or_negative_leaves_no_score():
    assert _row().score == pytest.approx(ce_loss_score(2.0, 2.1, 2.5)) == pytest.approx(0.8)
    assert _row(gap_low=0.1, gap_high=0.9).meaningful
    assert not _row(gap_low=-0.01, gap_high=0.9).meaningful and math.isnan(_row(gap_low=-0.01).score)
    assert not _row(ce_zero=1.9).meaningful  # removing the block lowers the loss
    row = _row(ce_zero=1.9, kl_spliced=0.02, kl_zero=0.1)
    assert row.kl_score == pytest.approx(0.8) and row.loss_increase == pytest.approx(0.1)
    table = FrontierTable((_row(ce_zero=2.001, gap_low=-0.004, gap_high=0.006),))
    markdown = table.to_markdown()
    cells = markdown.splitlines()[2].split("|")
    assert cells[10].strip() == ""  # the score's cell is empty
    assert "No CE-loss score for b" in markdown


# ----------------------------------------------------------------------------- the guard on a real evaluation
def test_guard_fires_when_the_ablation_does_nothing_and_is_silent_when_it_matters():
    matters = ToyLM(block_scale=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not one warning
        table = evaluate_replacements(matters, _sampled(matters), {"mlp": {"zero": ZeroBlock(8)}})
    (row,) = table.rows
    assert row.meaningful and row.gap_low > 0 and row.score == 0.0
    idle = ToyLM(block_scale=0.0)  # the block's output is 0: removing it changes nothing
    with pytest.warns(UserWarning, match=r"^mlp: CE-loss score not meaningful — zero-ablating"):
        table = evaluate_replacements(idle, _sampled(idle), {"mlp": {"zero": ZeroBlock(8)}})
    assert not table.rows[0].meaningful and math.isnan(table.rows[0].score)


def test_score_and_interval_against_an_independent_computation():
    model = ToyLM(block_scale=4.0)
    batches = _sampled(model)
    half = copy.deepcopy(model.mlp)
    with torch.no_grad():
        half[2].weight.mul_(0.5)
        half[2].bias.mul_(0.5)
    (row,) = evaluate_replacements(model, batches, {"mlp": {"half": half}}, seed=2).rows
    totals = {}
    for label, module in (("clean", model.mlp), ("spliced", half), ("zero", ZeroBlock(8))):
        with torch.no_grad(), spliced(model, {"mlp": module}):
            totals[label] = [next_token_loss(model(b), b, None)[0] for b in batches]
    tokens = sum(b.shape[0] * (b.shape[1] - 1) for b in batches)
    c, s, z = (sum(totals[k]) for k in ("clean", "spliced", "zero"))
    assert row.ce_clean == pytest.approx(c / tokens, rel=1e-5) and row.ce_spliced == pytest.approx(s / tokens, rel=1e-5)
    assert row.score == pytest.approx((z - s) / (z - c), rel=1e-4)
    assert row.score_low < row.score < row.score_high


# ----------------------------------------------------------------------------- flags
def test_flags_mark_the_cells_with_footnotes():
    rows = (
        _row(method="mxd@32", nmse=1.3, l0=14.1),  # worse than zero, and L0 below k
        _row(method="cp@8", dead=20, units=64),  # 31 % dead
        _row(method="tc@8"),  # nothing to flag
    )
    assert rows[0].flags == ("nmse", "l0") and rows[1].flags == ("dead",) and rows[2].flags == ()
    markdown = FrontierTable(rows).to_markdown()
    lines = markdown.splitlines()
    assert "| 1.3000¹ |" in lines[2] and "| 14.1² |" in lines[2]
    assert "| 20³ |" in lines[3] and "¹" not in lines[4] and "²" not in lines[4] and "³" not in lines[4]
    assert "¹ normalised MSE above 1" in markdown and "² L0 below the requested k" in markdown
    assert "³ more than 10% of the units never fired" in markdown


def test_piped_tables_are_markdown_and_the_table_plots(tmp_path):
    table = FrontierTable((_row(gap_low=0.1, gap_high=0.6, score_low=0.7, score_high=0.9),), {"tokens": 1000})
    piped = io.StringIO()  # not a terminal
    table.show(piped)
    text = piped.getvalue()
    assert text.splitlines()[2].startswith("| block | method |") and "0.800 [0.700, 0.900]" in text

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    table.show(terminal)
    assert "┃" in terminal.getvalue() or "│" in terminal.getvalue()  # rich's box
    assert table.plot(tmp_path / "frontier.png").stat().st_size > 1000
    again = FrontierTable.from_json(table.to_json())
    assert again.rows == table.rows


# ----------------------------------------------------------------------------- registered metrics
class _Coded(nn.Module):
    """A block stand-in with a known sparse code: ``code = relu(x W)`` (8 units), output ``code V``."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.encode, self.code_module, self.decode = nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 8)

    def forward(self, x):
        return self.decode(self.code_module(self.encode(x)))


def _by_hand(model, batches, replacement):
    """The block's input and output and the replacement's output and code at every token (float64)."""
    xs = torch.cat([model.embed(b).reshape(-1, 8) for b in batches]).detach()
    with torch.no_grad():
        target, prediction = model.mlp(xs).double(), replacement(xs).double()
        code = torch.relu(replacement.encode(xs))
    return target, prediction, code


@pytest.fixture
def mae():
    class MeanAbsoluteError(Metric, name="test-mae", column="mean absolute error"):
        def __init__(self):
            self.total, self.count = 0.0, 0

        def update(self, prediction, target, codes):
            self.total += float((prediction - target).abs().sum())
            self.count += target.numel()

        def value(self):
            return self.total / self.count

    yield MeanAbsoluteError
    unregister_metric("test-mae")


def test_a_registered_metric_appears_in_the_rows_and_every_table(mae):
    model = ToyLM(block_scale=4.0)
    batches, replacement = _sampled(model, sequences=16), _Coded()
    assert "test-mae" in available_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = evaluate_replacements(model, batches, {"mlp": {"coded": replacement}})
    target, prediction, _ = _by_hand(model, batches, replacement)
    (row,) = table.rows
    assert row.extra == {"test-mae": pytest.approx(float((prediction - target).abs().mean()), rel=1e-12)}
    header, rule, cells = table.to_markdown().splitlines()[:3]
    assert header.endswith("| units | mean absolute error |") and rule.endswith("---:|---:|")
    assert cells.split("|")[-2].strip() == f"{row.extra['test-mae']:.3f}"
    csv_header, csv_row = table.to_csv().splitlines()
    assert csv_header.endswith(",kl_zero,test-mae") and float(csv_row.rsplit(",", 1)[1]) == row.extra["test-mae"]
    again = FrontierTable.from_json(table.to_json())
    assert again.rows == table.rows and again.headers == {"test-mae": "mean absolute error"}
    assert again.to_markdown() == table.to_markdown()
    chosen = evaluate_replacements(model, batches, {"mlp": {"coded": replacement}}, metrics=["nmse"])
    assert chosen.rows[0].extra == {} and chosen.rows[0].nmse == row.nmse


def test_an_unregistered_metric_is_gone_and_bad_choices_are_refused(mae):
    unregister_metric("test-mae")
    assert "test-mae" not in available_metrics()
    model = ToyLM(block_scale=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = evaluate_replacements(model, _sampled(model, sequences=16), {"mlp": {"zero": ZeroBlock(8)}})
    assert table.rows[0].extra == {} and "mean absolute error" not in table.to_markdown()
    with pytest.raises(ValueError, match="unknown metric 'test-mae'"):
        resolve_metrics(["test-mae"])
    with pytest.raises(TypeError, match="sequence of metric names"):
        resolve_metrics("nmse")
    with pytest.raises(TypeError, match="subclass of Metric"):
        register_metric(dict, name="not-a-metric")


def test_the_shipped_metrics_equal_hand_computations():
    model = ToyLM(block_scale=4.0)
    batches, replacement = _sampled(model, sequences=16), _Coded(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (row,) = evaluate_replacements(model, batches, {"mlp": {"coded": replacement}}).rows
    target, prediction, code = _by_hand(model, batches, replacement)
    error = float((prediction - target).pow(2).sum())
    assert row.nmse == pytest.approx(error / float(target.pow(2).sum()), rel=1e-9)
    assert row.explained_variance == pytest.approx(1 - error / float((target - target.mean(0)).pow(2).sum()), rel=1e-9)
    assert row.l0 == pytest.approx(float((code != 0).sum(-1).double().mean()), rel=1e-12)
    assert row.units == 8 and row.dead == int(((code != 0).sum(0) == 0).sum())


def test_l0_and_dead_units_on_a_known_code():
    two_modes = (torch.tensor([[1.0, 0, 2], [0, 0, 3]]), torch.tensor([[1.0, 1], [0, 4]]))
    l0, dead, units = L0(), Dead(), Units()
    for metric in (l0, dead, units):
        metric.update(torch.zeros(2, 1), torch.zeros(2, 1), two_modes)
    assert l0.value() == (2 * 2 + 1 * 1) / 2  # per token, the product of the modes' active counts
    assert dead.value() == 1 and units.value() == 5  # unit 1 of the first mode never fires
    nothing = L0()
    nothing.update(torch.zeros(2, 1), torch.zeros(2, 1), None)
    assert math.isnan(nothing.value())
