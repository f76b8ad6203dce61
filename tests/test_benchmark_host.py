"""The host section's yardsticks: the fewest-calls floors, the compiled cases and their targets."""

import copy
import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report, run  # noqa: E402
from benchmarks.baselines import Case, build_module  # noqa: E402
from benchmarks.compiled_host import CompiledHostRunner, compiled_case, compiled_graphs  # noqa: E402
from benchmarks.floors import FLOORS, fewest_calls  # noqa: E402
from benchmarks.section_list import make_sections  # noqa: E402
from benchmarks.sections import FULL  # noqa: E402

#: Small layers whose ranks all differ, so that a core read along the wrong axis cannot pass.
FLOOR_LAYERS = {
    "cp": {"rank": 4},
    "tr": {"rank": [2, 3, 5]},
    "mxd": {},
}


def _floor_and_layer(fmt: str):
    torch.manual_seed(3)
    floor = FLOORS[fmt](in_features=12, out_features=7, expert_dims=6, **FLOOR_LAYERS[fmt])
    return floor, copy.deepcopy(floor.layer)


@pytest.mark.parametrize("fmt", sorted(FLOORS))
def test_each_floor_equals_its_layer_in_training_and_eval(fmt):
    """The floor runs the layer's own parameters: same outputs, gradients and running statistics."""
    floor, layer = _floor_and_layer(fmt)
    x = torch.randn(9, 12, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # training moves both norms' running statistics alike
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.testing.assert_close(floor(ours), layer(theirs))
        floor(ours).sum().backward()
        layer(theirs).sum().backward()
        torch.testing.assert_close(ours.grad, theirs.grad)
        for (name, mine), other in zip(floor.layer.named_parameters(), layer.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, other.grad, msg=name)
    torch.testing.assert_close(floor.layer.gate.norms["n1"].running_var, layer.gate.norms["n1"].running_var)
    floor.eval()
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(floor(x[:1]), layer(x[:1]))
        torch.testing.assert_close(floor(x), layer(x))
        torch.testing.assert_close(floor(x.view(3, 3, 12)), layer(x.view(3, 3, 12)))  # (batch, seq, features)


def test_the_softmax_and_entmax_package_floors_run_the_same_gemms_with_their_map():
    torch.manual_seed(0)
    options = {"in_features": 12, "out_features": 7, "expert_dims": 6, "rank": 4, "decomposition": "cp"}
    floors = {}
    for activation in ("entmax15", "softmax", "entmax.entmax15"):
        torch.manual_seed(0)
        floors[activation] = fewest_calls(activation=activation, **options).eval()
    x = torch.randn(5, 12)
    layer = floors["softmax"].layer
    cores, norm = layer.experts, layer.gate.norms["n1"]
    logits = (x @ layer.gate.projections["n1"].weight.T - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps)
    hidden = x @ cores.U_i[:-1] + cores.U_i[-1]
    with torch.no_grad():
        expected = ((torch.softmax(logits, -1) @ cores.U_n1) * hidden) @ cores.U_o.T
        torch.testing.assert_close(floors["softmax"](x), expected)
        torch.testing.assert_close(floors["entmax.entmax15"](x), floors["entmax15"](x))  # both exact 1.5-entmax
        assert not torch.allclose(floors["softmax"](x), floors["entmax15"](x), atol=1e-4)
    with pytest.raises(ValueError, match="activation='sparse'"):
        fewest_calls(activation="sparse", **options)
    with pytest.raises(ValueError, match="decomposition='tt'"):
        fewest_calls(**{**options, "decomposition": "tt"})


def test_a_compiled_case_compiles_once_per_mode_and_counts_later_graphs_as_recompiles():
    linear = Case("l", "linear", {"in_features": 8, "out_features": 5}, 6, 1)
    case = compiled_case(linear, "l, compiled", backend="eager")  # dynamo's graphs, no code generation
    before = compiled_graphs()
    runner = CompiledHostRunner(case, torch.device("cpu"), eval_tokens=1)
    record = runner.compilation()
    # its build warmed it up: train with grad and eval without, one graph each (the shape probe ran eagerly)
    assert compiled_graphs() - before == record["compiled_graphs"] == 2 and record["recompiles"] == 0
    assert runner.launches() == {}
    for step, train in ((runner.train_step, True), (runner.infer_step, False)):
        runner.time(step, train=train)
    record = runner.compilation()
    assert (record["compiled_graphs"], record["recompiles"]) == (2, 0)
    note = record["note"]
    assert note.startswith("2 graphs compiled at warm-up (") and note.endswith(", 0 recompiles while timed")
    runner.eval_args = (torch.randn(3, 8),)  # a new batch size: a recompile
    for _ in range(2):
        runner.time(runner.infer_step, train=False)
    assert (runner.compilation()["compiled_graphs"], runner.compilation()["recompiles"]) == (2, 1)
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(runner.module(x), runner.module.eager(x))
    fresh = build_module(linear)  # seeded as the case alone would be
    assert all(torch.equal(a, b) for a, b in zip(runner.module.parameters(), fresh.parameters(), strict=True))
    with pytest.raises(ValueError, match="compiled already"):
        build_module(compiled_case(case, "twice"))


def test_host_section_targets_follow_the_stated_limits():
    (section,) = make_sections(["host"], FULL, {}, 4 << 30)
    by_label = {case.label: case for case in section.cases}
    for target in section.targets:
        assert target.numerator in by_label and target.denominator in (*by_label, None)
    absolute = {(t.numerator, t.metric): t.limit for t in section.targets if t.denominator is None}
    counts = {key: limit for key, limit in absolute.items() if key[1] != "recompiles"}
    assert counts == {("CP layer, 16 experts", "eval_kernels"): 8, ("CP layer, 16 experts", "train_kernels"): 30}
    versus_cp = [t for t in section.targets if t.denominator == "CP layer, 16 experts"]
    # TR, TT, Tucker, MxD, 4×4 and the three other gates, each for an eval call and a fwd+bwd
    assert len(versus_cp) == 2 * 8 and all(t.limit == 1.5 for t in versus_cp)
    assert {t.numerator for t in versus_cp if "gate" in t.numerator} == {
        "CP layer, 16 experts, sparsemax gate", "CP layer, 16 experts, top-2 softmax gate",
        "MxD layer, 16 experts, ReLU top-2 gate"}  # fmt: skip
    timed = [t for t in section.targets if t.denominator == "nn.Linear"]
    assert {t.limit for t in timed if t.metric == "infer_s"} == {3.0} and len(timed) == 2 * 6
    assert {t.limit for t in timed if t.metric == "train_s"} == {4.0}
    floors = [t for t in section.targets if by_label.get(t.denominator, Case("", "")).model == "fewest_calls"]
    assert len(floors) == 2 * 3 and {t.limit for t in floors} == {1.1}
    for target in floors:  # each layer against the floor of its very own options
        layer, floor = by_label[target.numerator], by_label[target.denominator]
        assert layer.model == "mumoe" and floor.options == layer.options
        assert {t.metric for t in floors if t.numerator == layer.label} == {"infer_s", "train_s"}
    compiled = [t for t in section.targets if t.denominator == "nn.Linear, torch.compile"]
    assert len(compiled) == 2 * 5 and {t.limit for t in compiled} == {2.0}
    for target in compiled:
        inner = by_label[target.numerator].options["case"]
        assert by_label[target.numerator].options["backend"] == "inductor"
        assert inner == by_label[target.numerator.removesuffix(", torch.compile")].to_json()
    recompiles = [t for t in section.targets if t.metric == "recompiles"]
    assert len(recompiles) == 6 and {t.limit for t in recompiles} == {0}
    assert section.eval_tokens == 1 and all(case.batch * case.seq == 64 for case in section.cases)
    (plain,) = make_sections(["host"], FULL, {}, 4 << 30, compile_rows=False)
    assert not any(case.model == "compiled" for case in plain.cases)
    assert len(plain.targets) == len(section.targets) - len(compiled) - len(recompiles)


def test_inference_section_decomposes_the_cp_layer_at_one_token():
    (section,) = make_sections(["inference"], FULL, {}, 4 << 30, 2)
    by_label = {case.label: case for case in section.cases}
    for threads in ("1 thread", "2 threads"):
        layer = by_label[f"CP layer, B=1, {threads}"]
        rows = [case for case in section.cases if case.model == "fewest_calls" and case.label.endswith(threads)]
        assert sorted(case.options["activation"] for case in rows) == ["entmax.entmax15", "entmax15", "softmax"]
        for case in rows:
            assert {**case.options, "activation": None} == {**layer.options, "activation": None}
            assert (case.batch * case.seq, case.threads) == (1, layer.threads)
            assert section.reference_of(case.label) == f"nn.Linear, B=1, {threads}"
    assert "the same GEMMs with a softmax map, B=1, 1 thread" in by_label
    assert "the same GEMMs with entmax15 from the `entmax` package, B=1, 2 threads" in by_label


def test_host_run_reports_floors_and_compiled_rows(tmp_path, monkeypatch):
    """A host run of a few cases with a fake clock: the floor's ratio target and a compiled row's record."""
    import dataclasses

    (full,) = make_sections(["host"], FULL, {}, 4 << 30)
    keep = {"nn.Linear", "CP layer, 16 experts", "CP layer, 16 experts, fewest eager calls"}
    by_label = {case.label: case for case in full.cases}
    compiled = [compiled_case(by_label["nn.Linear"], "nn.Linear, torch.compile", backend="eager")]
    labels = keep | {case.label for case in compiled}
    small = dataclasses.replace(
        full,
        reps=2,  # calls of the real modules (they must run and compile); the clock is the test's
        cases=(*(case for case in full.cases if case.label in keep), *compiled),
        targets=tuple(t for t in full.targets if t.numerator in labels and t.denominator in (*labels, None)),
        pairs=tuple(pair for pair in full.pairs if pair[0] in labels),
    )
    monkeypatch.setattr(run, "make_sections", lambda *args, **kwargs: [small])
    clock = iter(range(1, 100_000))
    real_time = run.HostRunner.time

    def fake_time(self, step, *, train):
        real_time(self, step, train=train)  # the call runs (and compiles), the clock is the test's
        return float(next(clock))

    monkeypatch.setattr(run.HostRunner, "time", fake_time)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run.main(["--quick", "--only", "host", "--rounds", "2", "--out", str(tmp_path)]) == 0
    section = json.loads((tmp_path / "results-cpu.json").read_text())["sections"]["host"]
    rows = {row["label"]: row for row in section["rows"]}
    targets = {target["name"]: target for target in section["targets"]}
    layer, floor = rows["CP layer, 16 experts"], rows["CP layer, 16 experts, fewest eager calls"]
    target = targets["CP layer, 16 experts ÷ its fewest eager calls: host time, eval B = 1"]
    assert math.isclose(target["value"], layer["infer_s"] / floor["infer_s"]) and target["limit"] == 1.1
    assert floor["params"] == layer["params"] and floor["eval_kernels"] >= 1
    compiled_row = rows["nn.Linear, torch.compile"]
    assert (compiled_row["compiled_graphs"], compiled_row["recompiles"]) == (2, 0)
    assert "eval_kernels" not in compiled_row and compiled_row["reference"] == "nn.Linear, torch.compile"
    assert compiled_row["params"] == rows["nn.Linear"]["params"]
    recompiles = targets["nn.Linear, torch.compile: recompiles while timed"]
    assert recompiles["value"] == 0 and report.is_met(recompiles)
    assert report.target_line(recompiles).endswith("| 0 |  | ≤ 0 | met |")
    markdown = (tmp_path / "results-cpu.md").read_text()
    assert "2 graphs compiled at warm-up (" in markdown and "0 recompiles while timed" in markdown
