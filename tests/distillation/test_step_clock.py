"""Each replacement's training throughput: its own steps' time, summed per key, read without a device wait."""

import math

import pytest
import torch
from test_training import ToyLM, _batches, _tc

from mumoe_tn.distillation import step_clock
from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.study import THROUGHPUT_COLUMN, with_throughput
from mumoe_tn.distillation.training import distill


def test_the_clock_sums_each_key_s_own_time_and_tokens(monkeypatch):
    ticks = iter([10.0, 10.5, 20.0, 20.25, 30.0, 31.0])
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: next(ticks))
    clock = step_clock.StepClock()
    cpu = torch.device("cpu")
    for key, tokens in (("a", 100), ("b", 50), ("a", 100)):
        with clock.timing(key, cpu, tokens):
            pass
    assert clock.seconds == {"a": 1.5, "b": 0.25}
    assert clock.tokens_per_second("a") == pytest.approx(200 / 1.5)
    assert clock.tokens_per_second("b") == pytest.approx(200.0)
    assert math.isnan(clock.tokens_per_second("never"))


def test_a_run_reports_each_replacement_s_throughput_and_the_table_carries_it():
    torch.manual_seed(0)
    model = ToyLM(width=8, hidden=16)
    methods = {**_tc(k=2, latents=16), "tc-wide": _tc(k=2, latents=64)["tc"]}
    run = distill(model, _batches(6), methods, tokens=256, batch_size=32, buffer_tokens=64, progress=False)
    speeds = run.throughput["mlp"]
    assert set(speeds) == {"tc", "tc-wide"} and all(0 < value < math.inf for value in speeds.values())
    table = with_throughput(evaluate_replacements(model, _batches(2, seed=3), run.replacements), run)
    assert {row.method: row.extra[THROUGHPUT_COLUMN] for row in table.rows} == speeds
    assert "train tokens/s" in table.to_markdown().splitlines()[0]
