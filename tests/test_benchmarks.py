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
from benchmarks.baselines import (  # noqa: E402
    AuthorsMxD,
    Case,
    HandwrittenLayer,
    build_module,
    count_params,
    make_inputs,
)
from benchmarks.measure import MemoryProbe, Runner, Timing, alternate, live_peak_bytes_here  # noqa: E402
from benchmarks.section_list import SECTIONS, make_sections  # noqa: E402
from benchmarks.sections import FULL  # noqa: E402

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


def test_a_cases_forward_samples_follow_its_training_samples():
    # a forward timed right after each training step would time the rebuilding of inference caches
    calls = []

    class Fake:
        def train_step(self):
            calls.append("train")

        def infer_step(self):
            calls.append("infer")

        def time(self, step, *, train):
            step()
            return 1.0

    alternate({"A": Fake()}, rounds=2, reps=3)
    warm_up, first, second = calls[:2], calls[2:8], calls[8:]
    assert warm_up == ["train", "infer"]
    assert first == second == ["train"] * 3 + ["infer"] * 3


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


def test_dense_moe_weights_every_expert_by_its_gate():
    """Against a loop over the experts, each a narrow MLP, weighted by the softmax gate."""
    module = build_module(Case("m", "dense_moe", {"in_features": 6, "hidden_features": 12, "num_experts": 3}))
    x = torch.randn(4, 6)
    weights = torch.softmax(x @ module.gate.weight.T + module.gate.bias, -1)
    expected = module.down.bias.expand(4, 6).clone()
    for e, rows in enumerate(torch.arange(12).chunk(3)):
        hidden = torch.nn.functional.gelu(x @ module.up.weight[rows].T + module.up.bias[rows])
        expected += weights[:, e : e + 1] * (hidden @ module.down.weight[:, rows].T)
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="num_experts=5"):
        build_module(Case("m", "dense_moe", {"in_features": 6, "hidden_features": 12, "num_experts": 5}))


def test_generation_case_generates_exactly_the_new_tokens_dense_and_converted():
    pytest.importorskip("transformers")
    from mumoe_tn.layers import MuMoEMLP

    model = {"layers": 1, "width": 16, "heads": 2, "vocab_size": 40, "positions": 32, "new_tokens": 5}
    for convert in (None, {"expert_dims": 4, "mlps": r"mlp$"}):
        case = Case("g", "generation", {**model, "convert": convert}, 2, 3, inputs="prompt")
        runner = Runner(case, torch.device("cpu"), train=False)
        (prompt,) = runner.args
        assert prompt.shape == (2, 3) and not prompt.dtype.is_floating_point
        with torch.no_grad():
            out = runner.module(prompt)
        assert out.shape == (2, 8) and torch.equal(out[:, :3], prompt)
        converted = [m for m in runner.module.modules() if isinstance(m, MuMoEMLP)]
        assert len(converted) == (0 if convert is None else 1)
    assert runner.time(runner.infer_step, train=False) > 0


def test_a_case_is_timed_with_its_own_threads(monkeypatch):
    seen = []
    case = Case("l", "linear", {"in_features": 4, "out_features": 3}, 2, 1, threads=1)
    runner = Runner(case, torch.device("cpu"), train=False)
    assert not any(leaf.requires_grad for leaf in runner.leaves)  # forward-only: inputs need no grad
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        runner.time(lambda: seen.append(torch.get_num_threads()), train=False)
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


def test_inference_sections_build_the_requested_comparisons():
    inference, latency, generation = make_sections(["inference", "latency", "generation"], FULL, {}, 4 << 30, 2)
    assert all(not section.train and not section.memory for section in (inference, latency, generation))
    by_label = {case.label: case for case in inference.cases}
    layer = by_label["CP layer, B=1, 1 thread"]
    assert layer.options == {"in_features": 768, "out_features": 3072, "expert_dims": 256, "decomposition": "cp",
                             "match": "linear"}  # fmt: skip
    assert inference.reference_of(layer.label) == "nn.Linear, B=1, 1 thread"
    for fmt in ("CP", "TR", "TT"):
        for tokens in (1, 8, 64):
            for threads in ("1 thread", "2 threads"):
                block = by_label[f"{fmt} block, B={tokens}, {threads}"]
                assert block.options["decomposition"] == fmt.lower() and block.options["match"] == "mlp"
                assert "rank_multiple" not in block.options and block.batch * block.seq == tokens
                assert block.threads == (1 if threads == "1 thread" else 2)
                assert inference.reference_of(block.label) == f"dense MLP, B={tokens}, {threads}"
    hierarchical = by_label["CP block 32×32×32×32 = 1,048,576 experts, B=1, 1 thread"]
    assert hierarchical.options["expert_dims"] == [32, 32, 32, 32]
    # Thread counts are grouped (one switch per round), every target compares cases of one count.
    counts = [case.threads for case in inference.cases]
    assert counts == sorted(counts)
    limits = {target.name: target.limit for target in inference.targets}
    assert (
        limits["CP layer ÷ nn.Linear, B=1, 1 thread"] == 1.3 and limits["CP layer ÷ nn.Linear, B=8, 2 threads"] == 1.15
    )
    assert limits["TR block's ratio ÷ CP block's ratio, B=64, 1 thread (= TR ÷ CP)"] == 1.2
    for target in inference.targets:
        assert by_label[target.numerator].threads == by_label[target.denominator].threads, target.name
    sweep = sorted({case.batch * case.seq for case in latency.cases})
    assert sweep == [2**k for k in range(13)]
    assert {case.label.rsplit(", ", 1)[0] for case in latency.cases} == {
        "nn.Linear", "μMoE CP layer", "dense MLP", "μMoE CP block", "dense MoE, 16 experts"}  # fmt: skip
    moe = next(case for case in latency.cases if case.model == "dense_moe")
    assert count_params(moe) - count_params(next(c for c in latency.cases if c.model == "mlp")) == 768 * 16 + 16
    assert [(t.limit, by_label_of(generation, t.numerator).options.get("convert") is not None) for t in
            generation.targets] == [(1.25, True), (1.25, True)]  # fmt: skip


def by_label_of(section, label):
    return next(case for case in section.cases if case.label == label)


def test_forward_only_sections_run_and_report(tmp_path, monkeypatch):
    """A quick run of the inference, latency and generation sections with a fake clock: structure only."""
    clock = iter(range(1, 100_000))
    monkeypatch.setattr(run.Runner, "time", lambda self, step, *, train: float(next(clock)))
    page = tmp_path / "results.md"
    page.write_text("before\n<!-- inference-cpu:start -->\nOLD-BLOCK\n<!-- inference-cpu:end -->\nafter\n")
    monkeypatch.setattr(report, "DOCS_PAGE", page)
    (tmp_path / "img").mkdir()
    options = ["--quick", "--only", "inference", "latency", "generation", "--no-memory", "--rounds", "2"]
    assert run.main([*options, "--out", str(tmp_path / "out")]) == 0
    store = json.loads((tmp_path / "out" / "results-cpu.json").read_text())
    rows = {
        row["label"]: row for name in ("inference", "latency", "generation") for row in store["sections"][name]["rows"]
    }
    inference = store["sections"]["inference"]
    for row in rows.values():
        assert (row["train_s"] is None and "train_samples" not in row) or row["train_samples"] == []
        assert row["infer_s"] > 0
    samples = inference["samples"]
    assert all(len(row["infer_samples"]) == samples for row in inference["rows"])
    # The TR ÷ CP target equals the TR block's ratio to the MLP divided by the CP block's.
    target = next(
        t for t in inference["targets"] if t["name"].startswith("TR block's ratio ÷ CP block's ratio, B=1, 1")
    )
    tr, cp = rows["TR block, B=1, 1 thread"], rows["CP block, B=1, 1 thread"]
    assert math.isclose(target["value"], tr["ratios"]["infer_s"] / cp["ratios"]["infer_s"])
    assert rows["nn.Linear, 16 tokens"]["tokens"] == 16
    series = report.latency_series(store["sections"]["latency"])
    assert [point[0] for point in series["dense MLP"]] == [1, 2, 4, 8, 16]
    assert (tmp_path / "out" / "inference-latency-cpu.png").stat().st_size > 0
    markdown = (tmp_path / "out" / "results-cpu.md").read_text()
    section = markdown.split("## Inference: eval mode")[1].split("\n## ")[0]
    assert "| case | params | fwd (ms) | × | note |" in section and "fwd+bwd" not in section.split("| case")[1]
    assert (
        page.read_text() == "before\n<!-- inference-cpu:start -->\nOLD-BLOCK\n<!-- inference-cpu:end -->\nafter\n"
    )  # --quick
    assert report.update_inference_docs(store, "cpu", "img/inference-latency-cpu.png", page)
    text = page.read_text()
    assert text.startswith("before\n<!-- inference-cpu:start -->") and text.endswith(
        "<!-- inference-cpu:end -->\nafter\n"
    )
    assert (
        "OLD-BLOCK" not in text
        and "![inference latency against tokens per call](img/inference-latency-cpu.png)" in text
    )
    assert "### Generation: a GPT-2 converted" in text and "≤ 1.25×" in text


def test_the_anatomy_of_an_inference_call_times_every_part():
    from benchmarks.anatomy import anatomy

    timings = anatomy(2, in_features=8, out_features=12, experts=4)
    assert set(timings) == {
        "nn.Linear", "μMoE layer", "its gate", "its experts", "floor: products", "floor: gate product", "entmax15",
    }  # fmt: skip
    assert all(value > 0 for value in timings.values())


def test_the_gate_maps_benchmark_times_every_map_and_form_against_softmax(capsys):
    from benchmarks.gate_maps import main, timings

    figures = timings(torch.randn(2, 16), 2, calls=1, rounds=1)
    assert next(iter(figures)) == "softmax (torch)" and len(figures) == 15
    assert all(value > 0 for value in figures.values())
    for name in ("entmax15", "sparsemax"):
        forms = {f"{name} {form} form" for form in ("numpy", "search", "sort")}
        assert {*forms, f"{name} inference_map"} <= set(figures)
    main(["--rows", "1", "--width", "8", "--calls", "1", "--rounds", "1"])
    printed = capsys.readouterr().out
    assert "(1, 8) float32 logits of scale 1" in printed and printed.count("× softmax") == 15


def test_the_scale_grid_splits_expert_counts_into_equal_powers_of_two():
    from benchmarks.scale import expert_dims

    assert expert_dims(8, 1) == (256,)
    assert expert_dims(8, 3) == (8, 8, 4)
    assert expert_dims(24, 5) == (32, 32, 32, 32, 16)
    assert all(math.prod(expert_dims(k, e)) == 2**k for k in (8, 12, 24) for e in range(1, 7))
    with pytest.raises(ValueError, match="cannot be split"):
        expert_dims(4, 5)


# A small grid of the scale section: matched to nn.Linear(768, 3072), 1,024 tokens. Planning only.
SCALE_GRID = [
    (fmt, exponent, modes)
    for fmt in ("cp", "tr", "tt", "tucker", "tree")
    for exponent, modes in ((8, 2), (16, 4), (24, 3), (16, 6))
]


@pytest.mark.parametrize(("fmt", "exponent", "modes"), SCALE_GRID)
def test_scale_grid_plans_stay_within_the_peak_bound_and_the_closed_form(fmt, exponent, modes):
    from benchmarks.scale import expert_dims, plan_row

    row = plan_row(fmt, expert_dims(exponent, modes), 768, 3072, 1024)
    assert row.planned_fma is not None, row.note
    assert abs(row.params - 769 * 3072) <= 0.05 * 769 * 3072  # matched to nn.Linear within 5 %
    assert row.peak <= 4 * 1024 * 3072  # 4× the larger activation (the output's)
    assert row.smallest is None and row.note == ""
    if fmt == "tree":  # a user's network: no closed form to hold the plan to
        assert row.closed_fma is None
        return
    # Never worse than the format's stated order (CP's plans sit 0.1-0.2 % above its closed form,
    # Tucker's below it: the planner finds a cheaper order than the one the formula counts; TT
    # over uneven modes within 4 %).
    assert row.planned_fma <= 1.04 * row.closed_fma
    if fmt == "tr" or (fmt == "tt" and modes != 6):
        assert row.planned_fma == row.closed_fma


def test_a_grid_row_over_the_bound_names_the_smallest_peak_of_any_path():
    from benchmarks.scale import plan_row

    row = plan_row("tucker", (256,), 768, 3072, 1024)  # its 1,024 × 256 × s_o intermediate is unavoidable
    assert row.peak > row.bound and row.smallest == row.peak
    assert "smallest peak of any path is 1.152× it" in row.note


@pytest.mark.parametrize("modes", range(1, 8))
def test_the_tree_network_has_one_factor_per_mode_and_a_binary_tree_of_bonds(modes):
    from benchmarks.scale import tree_spec
    from mumoe_tn import ExpertNetwork

    network = ExpertNetwork.from_spec(
        tree_spec(modes), expert_dims=(16,) * modes, in_features=9, out_features=7, ranks=3
    )
    assert network.expert_legs == tuple(f"n{e}" for e in range(1, modes + 1))
    assert len(network.cores) == 2 * modes - 1 + 3  # leaves, internal nodes, root, input and output factors
    assert all(len(labels) == 2 for name, labels in network.cores.items() if name.startswith("U"))
    assert all(len(labels) == 3 for name, labels in network.cores.items() if name[0] in "TC")
    holders = [sum(bond in labels for labels in network.cores.values()) for bond in network.bonds]
    assert holders == [2] * len(network.bonds)  # a tree: every bond joins two cores
    assert len(network.bonds) == len(network.cores) - 1


def test_the_papers_mxd_equations_equal_the_mxd_block_on_the_same_weights():
    options = {"in_features": 12, "hidden_features": 40, "match": "mlp", "expert_dims": 6, "gate_k": 3}
    block = build_module(Case("block", "mxd_block", options))
    authors = AuthorsMxD(**options)
    with torch.no_grad():
        authors.encoder.load_state_dict(block.up_proj.state_dict())
        authors.gate.weight.copy_(block.gate.projections["n1"].weight)
        authors.gate.bias.copy_(block.gate.projections["n1"].bias)
        authors.decoder.copy_(block.decoder.D)
        authors.experts.copy_(block.decoder.C_n1)
        block.output_bias.normal_()
        authors.output_bias.copy_(block.output_bias)
    x = torch.randn(5, 7, 12)
    torch.testing.assert_close(authors(x), block(x))
    assert (block.last_coefficients[0] > 0).sum(-1).max() <= 3


def test_report_notes_the_device_it_was_measured_on():
    gpu = report.markdown(report.load(ROOT / "benchmarks" / "results-gpu.json"), SECTIONS, run.COMMAND)
    cpu = report.markdown(report.load(ROOT / "benchmarks" / "results-cpu.json"), SECTIONS, run.COMMAND)
    assert report.GPU_NOTE in gpu and report.CPU_NOTE not in gpu
    assert report.CPU_NOTE in cpu and report.GPU_NOTE not in cpu


def test_compiled_decoding_benchmark_checks_its_options_and_needs_cuda(capsys):
    from benchmarks import compiled

    with pytest.raises(SystemExit):
        compiled.main(["--batch", "0"])
    assert "every --batch must be at least 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert compiled.main([]) == 2
        assert "this benchmark needs CUDA" in capsys.readouterr().err


def test_aten_calls_count_kernels_and_host_reads_by_hand():
    from benchmarks.launches import count_call

    x = torch.randn(4, 3)
    assert count_call(lambda: x.t().reshape(12).view(3, 4).unsqueeze(0)).by_name == {"clone": 1}  # reshape copies
    found = count_call(lambda: x.sum().item())
    assert (found.kernels, found.host_reads, found.reads_by_name) == (1, 1, {"_local_scalar_dense": 1})
    found = count_call(lambda: (x > 0).nonzero())  # a kernel whose shape the host must read
    assert (found.kernels, found.reads_by_name) == (2, {"nonzero": 1})
    assert count_call(lambda: x.tolist()).reads_by_name == {"tolist": 1}
    assert count_call(lambda: x.numpy()).reads_by_name == {"numpy": 1}
    assert count_call(lambda: bool(x[0, 0] > 0)).host_reads == 1
    linear = torch.nn.Linear(3, 5)
    leaf = torch.randn(2, 3, requires_grad=True)
    grad = torch.randn(2, 5)
    with torch.no_grad():
        assert count_call(lambda: linear(leaf)).by_name == {"addmm": 1}
    # backward: grad of the input and of the weight (two mm), of the bias (one sum)
    found = count_call(lambda: linear(leaf).backward(grad))
    assert (found.kernels, found.host_reads) == (4, 0) and found.by_name == {"addmm": 1, "mm": 2, "sum": 1}


def test_host_section_counts_every_case_and_reports_counts_against_their_limits(tmp_path, monkeypatch):
    """A quick host run of a few cases with a fake clock: counts per row, count and ratio targets."""
    import dataclasses

    from benchmarks import host_section

    (full,) = make_sections(["host"], FULL, {}, 4 << 30)
    keep = {"nn.Linear", "CP layer, 16 experts", "CP layer, 16 experts, top-2 softmax gate", "dense MLP"}
    keep.add("CP block, 16 experts")
    assert keep <= set(full.labels())
    small = dataclasses.replace(
        full,
        reps=2,  # the modules run for real; the clock is the test's
        cases=tuple(case for case in full.cases if case.label in keep),
        targets=tuple(t for t in full.targets if t.numerator in keep and t.denominator in (*keep, None)),
        pairs=tuple(pair for pair in full.pairs if pair[0] in keep),
    )
    monkeypatch.setattr(run, "make_sections", lambda *args, **kwargs: [small])
    clock = iter(range(1, 100_000))
    monkeypatch.setattr(run.HostRunner, "time", lambda self, step, *, train: float(next(clock)))
    assert run.main(["--quick", "--only", "host", "--rounds", "2", "--out", str(tmp_path)]) == 0
    section = json.loads((tmp_path / "results-cpu.json").read_text())["sections"]["host"]
    rows = {row["label"]: row for row in section["rows"]}
    linear = rows["nn.Linear"]
    assert (linear["eval_kernels"], linear["train_kernels"], linear["eval_host_reads"]) == (1, 4, 0)
    assert rows["dense MLP"]["eval_kernels"] == 3  # addmm, gelu, addmm
    assert rows["CP block, 16 experts"]["reference"] == "dense MLP" and rows["CP layer, 16 experts"]["train_s"] > 0
    targets = {target["name"]: target for target in section["targets"]}
    count = targets["CP layer, 16 experts: kernels per eval call (B = 1)"]
    assert count["value"] == rows["CP layer, 16 experts"]["eval_kernels"] and count["limit"] == 8
    assert count["unit"] == "" and count["spread"] is None
    timed = targets["CP layer, 16 experts ÷ nn.Linear: host time, fwd+bwd B = 64"]
    assert math.isclose(timed["value"], rows["CP layer, 16 experts"]["train_s"] / linear["train_s"])
    assert timed["limit"] == host_section.HOST_TIME["train_s"] and "unit" not in timed
    markdown = (tmp_path / "results-cpu.md").read_text()
    assert "| case | params | kernels, fwd | kernels, fwd+bwd | host reads, fwd | host reads, fwd+bwd | " in markdown
    line = report.target_line(count)
    assert line.startswith(f"| {count['name']} | {count['value']} |  | ≤ 8 | ") and "×" not in line


def test_gpu_check_fits_in_eight_minutes_and_stops_clearly_without_a_gpu():
    import os
    import re
    import subprocess

    script = ROOT / "benchmarks" / "gpu-check.sh"
    limits = [int(limit) for limit in re.findall(r"^step \w+ (\d+) ", script.read_text(), flags=re.MULTILINE)]
    assert len(limits) == 3 and sum(limits) < 8 * 60
    if torch.cuda.is_available():
        return
    environment = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(script)], env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "has no CUDA build of torch that sees a GPU" in result.stderr
