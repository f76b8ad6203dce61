"""The benchmark machinery: the paper's einsums, alternation, peak memory, the smoke run."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report, run  # noqa: E402
from benchmarks.baselines import Case, HandwrittenLayer, build_module, count_params, make_inputs  # noqa: E402
from benchmarks.measure import MemoryProbe, Timing, alternate, live_peak_bytes_here  # noqa: E402
from benchmarks.sections import FULL, SECTIONS, make_sections  # noqa: E402

LAYER = {"in_features": 6, "out_features": 5, "rank": 3}


@pytest.mark.parametrize("formula", ["cp", "tr"])
@pytest.mark.parametrize("dims", [[4], [3, 2]])
def test_paper_einsums_equal_the_dense_expert_tensor(formula, dims):
    """The transcribed appendix einsums against y = W ×_1 a_1 … ×_E a_E ×_{E+1} z with W materialised."""
    options = {**LAYER, "expert_dims": dims, "decomposition": formula}
    if formula == "tr":
        options["rank"] = [2] * (len(dims) + 2)
    case = Case("h", "handwritten", {"formula": formula, **options}, 2, 3, inputs="contraction")
    module = build_module(case)
    _, (z, coefficients) = make_inputs(case, module)
    dense = module.experts.to_dense()  # (N_1, …, N_E, I, O)
    letters = "nm"[: len(dims)]
    equation = f"{letters}io," + ",".join(f"bt{c}" for c in letters) + ",bti->bto"
    expected = torch.einsum(equation, dense, *coefficients, z)
    torch.testing.assert_close(module(z, coefficients), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("formula", ["cp", "tr"])
def test_handwritten_layer_equals_the_planned_layer(formula):
    options = {**LAYER, "expert_dims": [4], "decomposition": formula}
    if formula == "tr":
        options["rank"] = [2, 2, 3]
    hand = build_module(Case("h", "handwritten_layer", {"formula": formula, **options}))
    assert isinstance(hand, HandwrittenLayer)
    x = torch.randn(2, 3, 6)
    hand.eval()
    torch.testing.assert_close(hand(x), hand.layer(x), rtol=1e-4, atol=1e-5)


def test_alternate_interleaves_the_cases_and_takes_medians():
    calls = []

    class Fake:
        def __init__(self, name, seconds):
            self.name, self.seconds = name, iter(seconds)

        def train_step(self):
            calls.append(self.name)

        def infer_step(self):
            pass

        def time(self, step, *, train):
            step()
            return next(self.seconds) if train else 0.0

    runners = {"A": Fake("A", [9, 1, 5, 3]), "B": Fake("B", [9, 2, 4, 6])}
    finished = []
    timings = alternate(runners, rounds=3, reps=1, done=lambda label, t: finished.append(label))
    assert calls == ["A", "A", "B", "B", "A", "B", "A", "B"]  # warm-up, then A B A B A B
    assert timings["A"].train == [1, 5, 3] and timings["A"].train_s == 3  # warm-up (9) dropped
    assert timings["B"].train_s == 4 and finished == ["A", "B"]
    assert Timing([1.0, 3.0], [2.0]).infer_s == 2.0


def test_peak_memory_is_measured_in_fresh_processes():
    small = Case("linear", "linear", {"in_features": 8, "out_features": 4096}, 2, 1024)
    large = Case("linear", "linear", {"in_features": 8, "out_features": 4096}, 8, 1024)
    output = 2 * 1024 * 4096 * 4  # float32 output of the small case; its gradient is as large again
    cpu = torch.device("cpu")
    with MemoryProbe(cpu, 1) as probe:  # forked children of one pristine server
        answers = [probe.peak(small), probe.peak(large), probe.peak(small)]
    forked = [answer["rss_bytes"] for answer in answers]
    assert 1.5 * output <= forked[0] <= 20 * output
    assert 2.5 * forked[0] <= forked[1]  # four times the tokens
    assert abs(forked[2] - forked[0]) <= 0.2 * forked[0]  # a large case before leaves no trace
    # live tensors: the output and its gradient, then the input, weight and bias gradients
    per_token, fixed = 2 * output + 4 * 2 * 1024 * 8, 4 * (8 * 4096 + 4096)
    assert [answer["peak_bytes"] for answer in answers] == [per_token + fixed, 4 * per_token + fixed, per_token + fixed]


def test_live_tensor_peak_counts_storages_not_views():
    def step() -> None:
        first = torch.empty(1000)  # 4,000 bytes
        second = torch.empty(2000)  # 8,000 bytes: 12,000 alive
        second.view(2, 1000).t()  # views add nothing
        second.add_(1)  # nor do in-place results
        del first
        torch.empty(500)  # 2,000 bytes: 10,000 alive

    assert live_peak_bytes_here(step, torch.device("cpu")) == 12_000


def test_peers_at_matched_parameters_hold_about_the_mlp_parameters():
    for module in ("PEER_pytorch", "soft_moe_pytorch", "st_moe_pytorch"):
        pytest.importorskip(module)
    (section,) = make_sections(["params"], FULL, {}, 4 << 30)
    mlp = 2 * 768 * 3072 + 3072 + 768
    peers = [case for case in section.cases if case.model in ("peer", "soft_moe", "st_moe")]
    assert len(peers) == 3
    for case in peers:
        assert abs(count_params(case) - mlp) <= 0.12 * mlp, case.label


def test_quick_run_prints_rows_and_writes_targets(tmp_path, capsys):
    options = ["--quick", "--only", "layer", "--no-memory", "--threads", "1", "--rounds", "2"]
    assert run.main([*options, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.index("nn.Linear ") < out.index("Targets")  # rows print before the summary
    store = json.loads((tmp_path / "results-cpu.json").read_text())
    rows = store["sections"]["layer"]["rows"]
    assert [r["label"] for r in rows] == ["nn.Linear", "CP μMoE, 16 experts", "TR μMoE, 16 experts"]
    for row in rows:
        assert row["train_s"] > 0 and row["infer_s"] > 0
        linear = rows[0]
        assert math.isclose(row["ratios"]["train_s"], row["train_s"] / linear["train_s"])
    report = (tmp_path / "results-cpu.md").read_text()
    assert "| target | measured | paired ratios (quartiles) | limit | met |" in report and "≤ 1.15×" in report
    # Two rounds: two side-by-side pairs, whose ratios' quartiles lie a quarter in from each end.
    target = store["sections"]["layer"]["targets"][0]
    cp = next(r for r in rows if r["label"] == target_numerator(target["name"], rows))
    pairs = sorted(a / b for a, b in zip(cp["train_samples"], rows[0]["train_samples"], strict=True))
    assert len(pairs) == 2
    low, high = target["spread"]
    assert math.isclose(low, pairs[0] + 0.25 * (pairs[1] - pairs[0]))
    assert math.isclose(high, pairs[0] + 0.75 * (pairs[1] - pairs[0]))


def target_numerator(name, rows):
    """The row a target of the layer section divides by nn.Linear: the one its name starts with."""
    return next(r["label"] for r in rows[1:] if name.startswith(r["label"]))


def test_paired_spread_by_hand():
    # ratios 2, 2, 2, 4: inclusive quartiles at positions 0.75 and 2.25 of the sorted ratios
    assert report.paired_spread([2, 4, 6, 8], [1, 2, 3, 2]) == (2.0, 2.5)
    assert report.paired_spread([1.0], [2.0]) is None and report.paired_spread(None, [1.0, 2.0]) is None
    assert report.paired_spread([1.0, 2.0], [0.0, 1.0]) is None  # a zero reference, as ratio() says
    assert report.paired_spread([1.0, 2.0, 3.0], [1.0, 2.0]) is None  # unpaired samples


def test_targets_within_the_paired_spread_say_so():
    line = report.target_line({"name": "x", "value": 0.96, "limit": 0.95, "spread": (0.90, 1.00)})
    assert line == "| x | 0.96× | 0.90–1.00× | ≤ 0.95× | **missed** (within noise) |"
    line = report.target_line({"name": "x", "value": 0.90, "limit": 0.95, "spread": (0.85, 0.93)})
    assert line.endswith("| ≤ 0.95× | met |")
    # The ratio of medians above the limit, every quartile of the paired ratios below it.
    line = report.target_line({"name": "x", "value": 1.06, "limit": 1.05, "spread": (0.98, 1.04)})
    assert line.endswith("| ≤ 1.05× | **missed** (within noise) |")
    line = report.target_line({"name": "x", "value": 2.01, "limit": 1.3, "spread": (1.87, 2.17)})
    assert line.endswith("| **missed** |")
    assert report.target_line({"name": "x", "value": None, "limit": 1.3}) == "| x | not measured |  | ≤ 1.3× | — |"


def test_sections_have_unique_rows_and_known_names():
    for section in make_sections(list(SECTIONS), FULL, {"optimize": "greedy"}, 4 << 30):
        labels = section.labels()
        assert len(labels) == len(set(labels))
        for case in section.cases:
            if case.model.startswith("mumoe") or case.model in ("planned",):
                tuned = section.name == "autotune" and case.label.endswith(", autotuned")
                expected = "autotune" if tuned else "greedy"  # --optimize reaches every other μMoE
                assert case.options.get("optimize") == expected, case.label


def test_autotune_section_pairs_each_autotuned_case_with_its_default_twin():
    (section,) = make_sections(["autotune"], FULL, {}, 4 << 30)
    by_label = {case.label: case for case in section.cases}
    tuned = [case for case in section.cases if case.label.endswith(", autotuned")]
    assert len(tuned) == len(section.cases) // 2 == 6
    for case in tuned:
        twin = by_label[section.reference_of(case.label)]
        assert twin.label == case.label.replace(", autotuned", ", default plan")
        assert case.options == {**twin.options, "optimize": "autotune"} and "optimize" not in twin.options
        assert (case.model, case.batch, case.seq, case.inputs) == (twin.model, twin.batch, twin.seq, twin.inputs)
        assert section.reference_of(twin.label) == twin.label


def test_inference_section_switches_only_the_pre_contraction():
    (section,) = make_sections(["inference"], FULL, {}, 4 << 30)
    cached = [case for case in section.cases if case.label.endswith("pre-contracted")]
    assert [(case.batch * case.seq) for case in cached] == [8, 512]
    for case in cached:
        plain = next(c for c in section.cases if section.reference_of(case.label) == c.label)
        assert plain.options == {**case.options, "precontract": False}
        assert section.reference_of(plain.label).startswith("nn.Linear")
    small = Case("t", "mumoe", {**LAYER, "expert_dims": [3, 2], "decomposition": "tucker"}, 2, 3)
    on = build_module(small).eval()
    off = build_module(Case("t", "mumoe", {**small.options, "precontract": False}, 2, 3)).eval()
    assert on.experts.precontract is True and off.experts.precontract is False
    x = torch.randn(2, 3, 6)
    with torch.no_grad():
        torch.testing.assert_close(on(x), off(x))  # same seed, same weights, the same map


def test_samples_are_stored_in_the_order_taken(tmp_path, monkeypatch):
    """Pairs are formed by position: each row's samples must keep the order of the rounds."""
    clock = iter(range(1, 10_000))

    def fake_time(self, step, *, train):
        step()
        return float(next(clock))

    monkeypatch.setattr(run.Runner, "time", fake_time)
    options = ["--quick", "--only", "layer", "--no-memory", "--threads", "1", "--rounds", "3", "--no-docs"]
    assert run.main([*options, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results-cpu.json").read_text())["sections"]["layer"]["rows"]
    for row in rows:
        assert row["train_samples"] == sorted(row["train_samples"]) and len(row["train_samples"]) == 3
    # Later cases of a round take later ticks: every CP sample follows nn.Linear's of the same round.
    linear, cp = rows[0]["train_samples"], rows[1]["train_samples"]
    assert all(a < b for a, b in zip(linear, cp, strict=True))
