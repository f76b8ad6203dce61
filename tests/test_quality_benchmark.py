"""The quality benchmark: its statistics against hand computations, the examples' seeds, the quick run."""

import json
import math
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import quality  # noqa: E402
from benchmarks.quality_jobs import slug  # noqa: E402
from benchmarks.quality_stats import Interval, mean_std, paired_differences, t_interval  # noqa: E402

# Student-t quantiles t_{0.975, df} from a printed table (df = 1, 2, 4).
T_TABLE = {1: 12.706, 2: 4.303, 4: 2.776}


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))


def test_mean_and_std_by_hand():
    mean, std = mean_std([2.0, 4.0, 9.0])
    assert mean == pytest.approx(5.0)
    # squared deviations 9 + 1 + 16 = 26, over n - 1 = 2
    assert std == pytest.approx(math.sqrt(13.0))
    assert math.isnan(mean_std([1.5])[1])


def test_t_interval_by_hand():
    interval = t_interval([1.0, 2.0, 3.0])  # mean 2, s = 1, n = 3
    assert interval.mean == pytest.approx(2.0)
    assert interval.half_width == pytest.approx(T_TABLE[2] / math.sqrt(3), abs=1e-3)
    assert (interval.low, interval.high) == pytest.approx((2 - 2.4842, 2 + 2.4842), abs=1e-3)
    two = t_interval([2.0, 4.0])  # mean 3, s = √2, n = 2: half width t · √2 / √2
    assert (two.low, two.high) == pytest.approx((3 - T_TABLE[1], 3 + T_TABLE[1]), abs=1e-3)
    five = t_interval([0.1, 0.3, 0.2, 0.5, 0.4])  # mean 0.3, s = √0.025
    assert five.half_width == pytest.approx(T_TABLE[4] * math.sqrt(0.025 / 5), abs=1e-4)
    assert five.excludes_zero() and not interval.excludes_zero()
    single = t_interval([0.7])
    assert single.mean == 0.7 and math.isnan(single.low) and single.n == 1


@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=12), st.floats(-1e3, 1e3))
def test_t_interval_moves_with_a_shift_and_holds_its_mean(values, shift):
    base, moved = t_interval(values), t_interval([v + shift for v in values])
    assert base.low <= base.mean <= base.high
    assert moved.mean == pytest.approx(base.mean + shift, abs=1e-6)
    assert moved.half_width == pytest.approx(base.half_width, rel=1e-6, abs=1e-6)
    assert base.mean == pytest.approx(statistics.fmean(values), abs=1e-9)


def test_paired_differences_by_hand():
    variant, reference = {0: 2.02, 1: 2.04, 7: 3.0}, {0: 2.0, 1: 2.0, 2: 9.0}
    assert paired_differences(variant, reference) == pytest.approx([1.0, 2.0])  # seeds 0 and 1, in %
    assert paired_differences(variant, reference, relative=False) == pytest.approx([0.02, 0.04])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: mean_std([]), "at least one value"),
        (lambda: mean_std([1.0, math.nan]), "finite"),
        (lambda: t_interval([1.0, 2.0], confidence=1.5), "between 0 and 1"),
        (lambda: paired_differences({0: 1.0}, {1: 1.0}), "no seed in common"),
    ],
)
def test_statistics_reject_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _study(example, runs):
    return {"example": example, "length": 100, "factor": "", "name": "x", "runs": runs}


def test_summary_gap_is_the_paired_t_interval_by_hand():
    def run(loss, seed):
        return {"val_loss": loss, "seed": seed, "params": 10, "mlp_params": 5, "steps_per_s": 4.0}

    mlp = {0: run(2.0, 0), 1: run(1.0, 1), 2: run(4.0, 2)}
    # per-seed gaps: +1 %, +3 %, +2 % (the MLP's seed-to-seed spread cancels in the pairs)
    cp = {0: run(2.02, 0), 1: run(1.03, 1), 2: run(4.08, 2)}
    rows = {row["variant"]: row for row in quality.summarise(_study("char_gpt", {"MLP": mlp, "CP": cp}))}
    gap = rows["CP"]["gap"]
    assert gap.mean == pytest.approx(2.0)
    assert gap.half_width == pytest.approx(T_TABLE[2] * 1.0 / math.sqrt(3), abs=1e-3)
    assert rows["CP"]["mean"] == pytest.approx((2.02 + 1.03 + 4.08) / 3)
    assert "gap" not in rows["MLP"]
    assert quality.fmt_interval(gap) == "+2.00 % [-0.48, +4.48]"


def test_summary_of_accuracy_is_in_points_and_higher_is_better():
    def run(accuracy, seed):
        return {"accuracy": accuracy, "seed": seed, "params": 10, "steps_per_s": 4.0}

    mlp = {0: run(0.90, 0), 1: run(0.95, 1)}
    cp = {0: run(0.92, 0), 1: run(0.96, 1)}
    rows = {row["variant"]: row for row in quality.summarise(_study("mixer_digits", {"MLP": mlp, "CP": cp}))}
    assert rows["CP"]["gap"].mean == pytest.approx(0.015)  # accuracy differences, not % of a loss


def test_factor_change_is_paired_against_the_defaults():
    def run(loss, seed):
        return {"val_loss": loss, "seed": seed, "params": 10, "mlp_params": 5, "steps_per_s": 4.0}

    baseline = _study("char_gpt", {"MLP": {0: run(2.0, 0), 1: run(2.0, 1)}, "CP": {0: run(2.1, 0), 1: run(2.2, 1)}})
    factor = {**_study("char_gpt", {"CP": {0: run(2.1 * 0.99, 0), 1: run(2.2 * 0.97, 1)}}), "factor": "--x"}
    assert quality.baseline_of(factor, [factor, baseline]) is baseline
    (row,) = quality.summarise(factor, baseline)
    assert row["change"].mean == pytest.approx(-2.0)  # −1 % and −3 %
    assert row["gap"].mean == pytest.approx((100 * (2.079 - 2) / 2 + 100 * (2.134 - 2) / 2) / 2)


def test_slug_names_a_file():
    assert slug("CP μMoE (32×32×32×32 experts)") == "cp-mumoe-32x32x32x32-experts"


def test_char_gpt_seed_fixes_the_run_and_the_shared_parts(examples):
    import char_gpt

    args = ["--quick", "--threads", "1", "--variants", "MLP"]
    first = char_gpt.main([*args, "--seeds", "3", "5"])
    again = char_gpt.main([*args, "--seeds", "3"])
    assert [row["seed"] for row in first] == [3, 5]
    assert again[0]["val_loss"] == first[0]["val_loss"]  # a seed reproduces its run
    assert first[0]["val_loss"] != first[1]["val_loss"]  # another seed is another run
    # one seed, two MLP blocks: everything else starts alike
    mlp = char_gpt.CharGPT(20, 8, 16, 2, 2, lambda: char_gpt.mlp_block(16), seed=4)
    mumoe = char_gpt.CharGPT(20, 8, 16, 2, 2, lambda: char_gpt.VARIANTS["CP μMoE (64 experts)"](16), seed=4)
    other = char_gpt.CharGPT(20, 8, 16, 2, 2, lambda: char_gpt.mlp_block(16), seed=5)
    shared = {name: p for name, p in mlp.named_parameters() if ".mlp." not in name}
    for name, p in mumoe.named_parameters():
        if ".mlp." not in name:
            torch.testing.assert_close(p, shared[name], rtol=0, atol=0)
    assert not torch.equal(other.tokens.weight, mlp.tokens.weight)


def test_char_gpt_writes_curves_and_takes_block_options(examples, tmp_path):
    import char_gpt

    path = tmp_path / "runs.json"
    argv = [
        "--quick",
        "--threads",
        "1",
        "--variants",
        "CP μMoE (64 experts)",
        "--eval-every",
        "10",
        "--json",
        str(path),
    ]
    rows = char_gpt.main([*argv, "--block-option", "gate_init=zeros", "--gate-lr", "0.5"])
    stored = json.loads(path.read_text())
    assert [step for step, _ in stored["runs"][0]["curve"]] == [10, 20, 30, 40]
    assert stored["runs"][0]["curve"][-1][1] == rows[0]["val_loss"]
    assert stored["config"]["block_options"] == {"gate_init": "zeros"} and stored["config"]["gate_lr"] == 0.5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "1", "1"], "distinct"),
        (["--seeds", "-1"], "non-negative"),
        (["--block-option", "gate_init"], "KEY=VALUE"),
    ],
)
def test_char_gpt_rejects_bad_options(examples, argv, message, capsys):
    import char_gpt

    with pytest.raises(SystemExit):
        char_gpt.main(["--quick", "--variants", "MLP", *argv])
    assert message in capsys.readouterr().err


def test_mixer_seed_fixes_the_run(examples):
    pytest.importorskip("sklearn")
    import mixer_digits

    args = ["--quick", "--threads", "1", "--variants", "MLP", "--epochs", "1"]
    first = mixer_digits.main([*args, "--seeds", "0", "1"])
    again = mixer_digits.main([*args, "--seeds", "1"])
    assert [row["seed"] for row in first] == [0, 1]
    assert again[0]["epoch_losses"] == first[1]["epoch_losses"]
    assert first[0]["epoch_losses"] != first[1]["epoch_losses"]


def test_quick_benchmark_runs_in_parallel_and_reports_the_paired_gap(tmp_path, capsys):
    variants = ["MLP", "CP μMoE (64 experts)"]
    argv = ["--quick", "--only", "char_gpt", "--variants", *variants, "--seeds", "0", "1", "--out", str(tmp_path)]
    assert quality.main(argv) == 0
    (study,) = quality.load(tmp_path)
    assert list(study["runs"]) == variants and all(sorted(r) == [0, 1] for r in study["runs"].values())
    losses = {v: [study["runs"][v][s]["val_loss"] for s in (0, 1)] for v in variants}
    gaps = [100 * (c - m) / m for c, m in zip(losses[variants[1]], losses["MLP"], strict=True)]
    mean, half = statistics.fmean(gaps), T_TABLE[1] * statistics.stdev(gaps) / math.sqrt(2)
    report = (tmp_path / "quality-cpu.md").read_text()
    (line,) = [line for line in report.splitlines() if line.startswith(f"| {variants[1]} |") and " ± " in line]
    shown = re.search(r"([-+][\d.]+) % \[([-+][\d.]+), ([-+][\d.]+)\]", line).groups()
    assert [float(x) for x in shown] == pytest.approx([mean, mean - half, mean + half], abs=0.011)
    assert (tmp_path / "quality-cpu.png").exists()
    capsys.readouterr()
    assert quality.main(argv) == 0  # a second run finds every run stored and trains nothing
    assert "2 runs, 2 already stored" in capsys.readouterr().out


def test_verdict_against_the_papers_gaps():
    assert quality.paper_gap("CP μMoE (32×32×32×32 experts)") == 0.6
    assert quality.paper_gap("TR μMoE (64 experts)") == 0.35
    assert quality.paper_gap("TT μMoE (64 experts)") is None and quality.paper_gap("MLP") is None
    assert quality.verdict(Interval(0.5, -0.1, 1.1, 3), 0.6) == "within the paper's gap"
    assert quality.verdict(Interval(1.0, 0.2, 1.8, 3), 0.6) == "mean above the paper's gap; the interval reaches it"
    assert quality.verdict(Interval(2.0, 1.0, 3.0, 3), 0.6) == "above the paper's gap"


def test_the_gap_along_the_run_is_paired_at_every_evaluation():
    def run(seed, losses):
        curve = [[100 * (k + 1), loss] for k, loss in enumerate(losses)]
        return {"val_loss": losses[-1], "seed": seed, "params": 1, "steps_per_s": 1.0, "curve": curve}

    mlp = {0: run(0, [4.0, 2.0]), 1: run(1, [2.0, 1.0])}
    cp = {0: run(0, [4.4, 2.02]), 1: run(1, [2.0, 1.03])}  # +10 %, 0 %; then +1 %, +3 %
    study = _study("char_gpt", {"MLP": mlp, "CP": cp})
    steps, intervals = quality.curve_gaps(study)["CP"]
    assert steps == [100, 200] and [i.mean for i in intervals] == pytest.approx([5.0, 2.0])
    table = "\n".join(quality.curve_markdown(study, columns=2))
    assert "| step 100 | step 200 |" in table and "| CP | +5.00 % | +2.00 % |" in table


def test_factor_table_gives_each_factors_paired_change_by_hand():
    def run(loss, seed):
        return {"val_loss": loss, "seed": seed, "params": 10, "mlp_params": 5, "steps_per_s": 4.0}

    defaults = {0: run(2.0, 0), 1: run(1.0, 1), 2: run(4.0, 2)}
    baseline = _study("char_gpt", {"MLP": defaults, "CP": defaults, "TR": defaults})
    # CP: −1 %, −2 %, −3 % (mean −2, std 1); TR: +1 % on one seed
    lowered = {0: run(1.98, 0), 1: run(0.98, 1), 2: run(3.88, 2)}
    factor = {**_study("char_gpt", {"CP": lowered, "TR": {0: run(2.02, 0)}}), "factor": "--gate-lr 3"}
    other = {**_study("char_gpt", {"CP": defaults}), "factor": "--warmup 9", "length": 50}
    table = "\n".join(quality.factor_markdown([baseline, factor, other], "char_gpt"))
    half = T_TABLE[2] * 1.0 / math.sqrt(3)
    assert f"| `--gate-lr 3` | -2.00 % [{-2 - half:+.2f}, {-2 + half:+.2f}] (3 seeds) | +1.00 % (one seed) |" in table
    assert "| factor | CP | TR |" in table and "100 steps: one factor at a time" in table
    assert "--warmup 9" not in table  # a length without its defaults' study has no row
    heading = "**`char_gpt`, 100 steps, `--gate-lr 3`**"
    assert heading in quality.markdown([baseline, factor], "M")
    summary_only = quality.markdown([baseline, factor], "M", factor_tables=False)
    assert heading not in summary_only and "| `--gate-lr 3` |" in summary_only


def test_the_ranking_settles_where_the_order_stops_changing():
    def run(seed, losses):
        curve = [[100 * (k + 1), loss] for k, loss in enumerate(losses)]
        return {"val_loss": losses[-1], "seed": seed, "params": 1, "steps_per_s": 1.0, "curve": curve}

    # means per step: 100: CP < MLP < TR; 200: TR < MLP < CP; 300 and 400: MLP < CP < TR
    runs = {
        "MLP": {0: run(0, [3.0, 2.0, 1.5, 1.4]), 1: run(1, [3.0, 2.0, 1.5, 1.4])},
        "CP": {0: run(0, [2.9, 2.1, 1.50, 1.40]), 1: run(1, [2.9, 2.1, 1.54, 1.50])},
        "TR": {0: run(0, [3.1, 1.9, 1.55, 1.5]), 1: run(1, [3.1, 1.9, 1.55, 1.5])},
    }
    study = {**_study("char_gpt", runs), "length": 400}
    assert quality.settled_ranking(study) == (300, ["MLP", "CP", "TR"])
    assert "(MLP < CP < TR) at every evaluation from step 300 of 400 on" in "\n".join(quality.settled_markdown(study))
    runs["TR"][1] = run(1, [3.1, 1.9, 1.55, 1.2])  # TR first at the end only
    assert quality.settled_ranking(study) == (400, ["TR", "MLP", "CP"])
