"""Paired comparisons: point estimates from the paper's score formula, intervals that pair the noise."""

import json
import math
import warnings

import numpy as np
import pytest
import torch
from hf_models import gpt2
from torch import nn

from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.frontier import FrontierRow, FrontierTable, bootstrap_ce_score, ce_loss_score
from mumoe_tn.distillation.paired import SequenceLosses, paired_against, paired_difference

BLOCK = "h.0.mlp"


def _table(spliced: dict[str, np.ndarray], clean, zero, tokens) -> FrontierTable:
    """A table whose rows are made from per-sequence sums by the paper's formula, not by the code under test."""
    total = tokens.sum()
    rows = tuple(
        FrontierRow(
            block=BLOCK, method=m, params=1, l0=1.0, nmse=0.1, explained_variance=0.9, ce_clean=clean.sum() / total,
            ce_spliced=s.sum() / total, ce_zero=zero.sum() / total, dead=0, units=1, tokens=int(total),
        )
        for m, s in spliced.items()
    )  # fmt: skip
    return FrontierTable(rows, {}, {}, SequenceLosses(tokens, clean, {BLOCK: zero}, {BLOCK: spliced}))


def _shared_noise(seed=0, n=400, gain=0.02):
    """Two methods whose per-sequence losses share large noise and differ by a small, steady amount."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(20, 60, n).astype(np.float64)
    clean = tokens * (2.0 + rng.normal(0, 0.3, n))
    zero = clean + tokens * (1.0 + rng.normal(0, 0.3, n))
    hard = tokens * rng.normal(0, 0.4, n)  # what both methods find hard
    better = clean + 0.3 * (zero - clean) + hard
    worse = better + tokens * gain
    return tokens, clean, zero, {"better": better, "worse": worse}


def test_the_point_estimates_are_the_rows_score_and_loss_differences():
    tokens, clean, zero, spliced = _shared_noise()
    table = _table(spliced, clean, zero, tokens)
    a, b = (next(r for r in table.rows if r.method == m) for m in ("better", "worse"))
    found = table.paired("better", "worse")
    expected = ce_loss_score(a.ce_clean, a.ce_spliced, a.ce_zero) - ce_loss_score(b.ce_clean, b.ce_spliced, b.ce_zero)
    assert found.score == pytest.approx(expected, rel=1e-12)
    assert found.ce == pytest.approx(a.ce_spliced - b.ce_spliced, rel=1e-12)
    assert found.score_low <= found.score <= found.score_high and found.ce_low <= found.ce <= found.ce_high


def test_pairing_decides_what_the_separate_intervals_cannot():
    tokens, clean, zero, spliced = _shared_noise()
    table = _table(spliced, clean, zero, tokens)
    separate = {m: bootstrap_ce_score(clean, s, zero, tokens, seed=1) for m, s in spliced.items()}
    assert separate["better"].score_low < separate["worse"].score_high  # the two intervals overlap
    paired = table.paired("better", "worse", seed=1)
    assert paired.decided and paired.ce_high < 0 < paired.score_low
    assert paired.score_high - paired.score_low < 0.5 * (separate["better"].score_high - separate["better"].score_low)


def test_a_difference_of_zero_is_inside_its_interval_most_of_the_time():
    """Coverage: two methods with the same expected loss; the 90 % interval holds 0 in about 90 % of draws."""
    held = 0
    for draw in range(60):
        tokens, clean, zero, spliced = _shared_noise(seed=draw, n=150, gain=0.0)
        rng = np.random.default_rng(1000 + draw)
        spliced["worse"] = spliced["better"] + tokens * rng.normal(0, 0.05, tokens.shape[0])
        found = _table(spliced, clean, zero, tokens).paired("better", "worse", level=0.9, resamples=400, seed=draw)
        held += found.ce_low <= 0 <= found.ce_high
    assert 45 <= held <= 60


def test_several_seeds_average_their_differences_on_the_same_sequences():
    tokens, clean, zero, spliced = _shared_noise()
    shifted = {m: s + tokens * 0.01 * k for k, (m, s) in enumerate(spliced.items())}
    tables = [_table(spliced, clean, zero, tokens), _table(shifted, clean, zero, tokens)]
    found = paired_difference(tables, "better", "worse")
    each = [t.paired("better", "worse") for t in tables]
    assert found.seeds == 2 and found.ce == pytest.approx((each[0].ce + each[1].ce) / 2, rel=1e-12)
    other = _table(spliced, clean + 1.0, zero, tokens)
    with pytest.raises(ValueError, match="same sequences"):
        paired_difference([tables[0], other], "better", "worse")


def test_bad_requests_and_hostile_saved_sequences_get_clear_errors():
    tokens, clean, zero, spliced = _shared_noise(n=5)
    table = _table(spliced, clean, zero, tokens)
    with pytest.raises(ValueError, match=r"method\(s\) \['nope'\]"):
        table.paired("nope", "worse")
    with pytest.raises(ValueError, match="no per-sequence losses"):
        FrontierTable(table.rows).paired("better", "worse")
    again = FrontierTable.from_json(table.to_json())
    assert again.paired("better", "worse") == table.paired("better", "worse")
    good = table.sequences.to_dict()
    for broken, message in [
        ({**good, "clean": good["clean"][:-1]}, "5 numbers"),
        ({**good, "clean": [*good["clean"][:-1], "x"]}, "list of numbers"),
        ({**good, "tokens": [-1.0] * 5}, "whole numbers"),
        ({**good, "zero": {}}, "same blocks"),
        ({**good, "spliced": {BLOCK: {"better": [math.inf] * 5}}}, "finite"),
        ([1, 2], "an object"),
    ]:
        with pytest.raises(ValueError, match=message):
            SequenceLosses.from_dict(broken)


class Scaled(nn.Module):
    def __init__(self, block, factor):
        super().__init__()
        self.block, self.factor = block, factor

    def forward(self, x):
        return self.factor * self.block(x)


def test_evaluate_replacements_keeps_the_losses_of_every_sequence():
    torch.manual_seed(0)
    model = gpt2(layers=2, width=16, heads=2, vocab=50, positions=16, bos_token_id=0, eos_token_id=0).eval()
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 50, (3, 12), generator=generator) for _ in range(2)]
    name = "transformer." + BLOCK
    block = model.get_submodule(name)
    replacements = {name: {"half": Scaled(block, 0.5), "most": Scaled(block, 0.9)}}
    with warnings.catch_warnings():  # the toy block may not move the loss beyond noise: not under test here
        warnings.simplefilter("ignore", UserWarning)
        table = evaluate_replacements(model, batches, replacements)
    rows = {r.method: r for r in table.rows}
    found = table.paired("most", "half", block=name)
    assert found.sequences == 6
    assert found.ce == pytest.approx(rows["most"].ce_spliced - rows["half"].ce_spliced, rel=1e-9)


def test_the_json_names_each_field_s_column_and_pairs_against_the_transcoders():
    tokens, clean, zero, spliced = _shared_noise(n=50)
    spliced = {"cp@8": spliced["better"], "transcoder@8": spliced["worse"], "mxd@16": spliced["worse"]}
    table = _table(spliced, clean, zero, tokens)
    data = json.loads(table.to_json())
    assert data["columns"]["nmse"] == "normalised MSE" and data["columns"]["score"].startswith("CE-loss score")
    assert data["columns"]["dead"] == "dead units"
    assert FrontierTable.from_json(table.to_json()).rows == table.rows
    (found,) = paired_against(table)  # mxd@16 has no transcoder at 16
    assert (found.method, found.baseline) == ("cp@8", "transcoder@8") and found.decided
