"""The specialisation experiment: exact fast ablations, hand-computed polysemanticity, the CLI's JSON."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mumoe_tn import MuMoE
from mumoe_tn.analysis import class_polysemanticity
from mumoe_tn.analysis.specialisation_study import ExperimentConfig, expert_ablation_effects, make_features
from mumoe_tn.cli import main as cli_main

DTYPE = torch.float64


@settings(max_examples=8, deadline=None)
@given(
    st.sampled_from(["entmax15", "softmax", "sparsemax"]),
    st.sampled_from(["batch", "none"]),
    st.integers(1, 12),
    st.integers(0, 2**16),
)
def test_fast_ablation_equals_counterfactual_forward_passes(activation, norm, n_experts, seed):
    """Against the library's N counterfactual forward passes (zeroed coefficients inside the layer)."""
    torch.manual_seed(seed)
    layer = MuMoE(6, 5, n_experts, "cp", 4, activation=activation, gate_norm=norm, dtype=DTYPE)
    layer.train()
    layer(torch.randn(32, 6, dtype=DTYPE))  # BatchNorm running statistics away from their init
    x = torch.randn(40, 6, dtype=DTYPE)
    y = torch.randint(5, (40,))
    fast, coefficients = expert_ablation_effects(layer, x, y, 5)
    slow = class_polysemanticity(layer, layer, x, y, n_classes=5)
    torch.testing.assert_close(fast.accuracy, slow.accuracy)
    torch.testing.assert_close(fast.ablated, slow.ablated)
    torch.testing.assert_close(fast.polysemanticity, slow.polysemanticity)
    assert torch.equal(fast.changed, slow.changed)
    assert coefficients.shape == (40, n_experts)


def test_one_expert_polysemanticity_is_the_hand_computed_value():
    """Ablating the only expert makes every logit 0 (the bias is an expert's): argmax predicts class 0.

    Class 0 then has accuracy 1, every other class 0, so with y_c the intact accuracies
    d_c = 1 for every c ≠ 0 with y_c > 0 and d_0 = 1 − 1/y_0; the one-hot sits at the first class
    with d = 1, so p = sqrt(k − 1 + (1 − 1/y_0)²) with k the classes c ≠ 0 that have y_c > 0.
    """
    torch.manual_seed(3)
    layer = MuMoE(4, 3, 1, "cp", 3, dtype=DTYPE, gate_norm="none")
    with torch.no_grad():
        layer.experts.cores[next(iter(layer.experts.cores))].mul_(5)
    x = torch.randn(60, 4, dtype=DTYPE)
    with torch.no_grad():
        predicted = layer(x).argmax(-1)
    # labels: the prediction for 2/3 of the samples, another class for the rest → 0 < y_c < 1
    y = torch.where(torch.arange(60) % 3 == 0, (predicted + 1) % 3, predicted)
    effects, _ = expert_ablation_effects(layer, x, y, 3)
    accuracy = [float(((predicted == y) & (y == c)).sum() / (y == c).sum()) for c in range(3)]
    k = sum(1 for c in (1, 2) if accuracy[c] > 0)
    expected = math.sqrt(k - 1 + (1 - 1 / accuracy[0]) ** 2)
    assert accuracy[0] > 0 and k == 2
    assert effects.polysemanticity.tolist() == pytest.approx([expected])
    assert effects.ablated[0].tolist() == [1.0, 0.0, 0.0]


def test_hand_computed_polysemanticity_on_a_constructed_head():
    """Two classes, two experts, every weight set by hand; the expected d and p worked out below.

    The gate (no normalisation, sparsemax, logits ±10·x₀) selects expert 0 alone for x₀ > 0 and
    expert 1 alone for x₀ < 0. Expert 0 gives class 1 the logit x₀, expert 1 gives class 0 the
    logit −x₀, so every sample is classified correctly. Ablating an expert zeroes its samples'
    logits, and argmax of a zero row is class 0.
    """
    layer = MuMoE(2, 2, 2, "cp", 2, activation="sparsemax", gate_norm="none", bias=False, dtype=DTYPE)
    gate = next(iter(layer.gate.projections.values()))
    with torch.no_grad():
        gate.weight.copy_(torch.tensor([[10.0, 0.0], [-10.0, 0.0]], dtype=DTYPE))
    # experts: W_0 = [[0, 1], [0, 0]] (class 1 from x₀), W_1 = [[-1, 0], [0, 0]] (class 0 from −x₀)
    expert_factor, in_factor, out_factor = (layer.experts.cores[k] for k in layer.experts.cores)
    with torch.no_grad():
        for core, value in zip(
            (expert_factor, in_factor, out_factor),
            ([[1.0, 0.0], [0.0, 1.0]], [[1.0, -1.0], [0.0, 0.0]], [[0.0, 1.0], [1.0, 0.0]]),
            strict=True,
        ):
            core.copy_(torch.tensor(value, dtype=DTYPE).reshape(core.shape))
    x = torch.tensor([[1.0, 0.3], [2.0, -0.2], [-1.0, 0.5], [-3.0, 0.1]], dtype=DTYPE)
    y = torch.tensor([1, 1, 0, 0])
    with torch.no_grad():
        assert torch.equal(layer(x).argmax(-1), y), "the constructed head must classify every sample"
    effects, coefficients = expert_ablation_effects(layer, x, y, 2)
    assert coefficients.tolist() == [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    # expert 0 off: class-1 samples get logits 0 → class 0 → class 1 accuracy 0: d = (0, 1), p = 0
    # expert 1 off: class-0 samples get logits 0 → class 0 (argmax tie) → still right: d = (0, 0), p = 1
    assert effects.differences.tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert effects.polysemanticity.tolist() == pytest.approx([0.0, 1.0])
    assert effects.changed.tolist() == [True, False]


def test_an_expert_the_gate_never_selects_changes_nothing():
    torch.manual_seed(0)
    layer = MuMoE(5, 4, 6, "cp", 3, activation="entmax15", gate_norm="none", dtype=DTYPE)
    gate = next(iter(layer.gate.projections.values()))
    x = torch.randn(50, 5, dtype=DTYPE)
    x[:, 0] = 1.0  # a constant feature: expert 2's logit is 40 below the others' on every sample
    with torch.no_grad():
        gate.weight[:, 0] += 20.0
        gate.weight[2, 0] -= 40.0
    y = torch.randint(4, (50,))
    effects, coefficients = expert_ablation_effects(layer, x, y, 4)
    assert bool((coefficients[:, 2] == 0).all())
    assert effects.ablated[2].tolist() == effects.accuracy.tolist()
    assert not bool(effects.changed[2])
    assert effects.polysemanticity[2].item() == pytest.approx(1.0)  # ‖0 − one-hot‖


def test_generator_is_deterministic_and_shaped():
    config = ExperimentConfig.quick()
    a, b = make_features(config), make_features(config)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert a.train_x.shape == (config.classes * config.train_per_class, config.features)
    assert torch.bincount(a.test_y).tolist() == [config.test_per_class] * config.classes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quick", "--epochs", "-1"], "epochs must be a positive integer, got -1"),
        (["--quick", "--experts", "0"], "expert_counts must be positive integers"),
        (["--quick", "--plot", "/nonexistent-folder/x.png"], "does not exist"),
    ],
)
def test_bad_arguments_get_one_line_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["specialisation", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_quick_run_json_through_the_cli(capsys, tmp_path):
    plot = tmp_path / "s.png"
    assert cli_main(["specialisation", "--quick", "--json", "--no-progress", "--plot", str(plot)]) == 0
    result = json.loads(capsys.readouterr().out)
    config = ExperimentConfig.quick()
    assert plot.stat().st_size > 0
    assert set(result) >= {"config", "table", "runs", "linear_probe_accuracy", "seconds", "machine"}
    assert len(result["runs"]) == len(config.gates) * len(config.expert_counts) * len(config.seeds)
    assert {(r["gate"], r["experts"]) for r in result["table"]} == {
        (g, n) for g in config.gates for n in config.expert_counts
    }
    for run in result["runs"]:
        n = run["experts"]
        assert 0 <= run["experts_changing_a_class"] <= run["experts_used"] <= n
        assert 1 <= run["experts_per_sample"] <= run["experts_used"]
        assert 1 / n - 1e-9 <= run["top_coefficient"] <= 1 + 1e-9
        assert len(run["max_drops"]) == run["experts_changing_a_class"]
        # experts that change nothing have p = 1: the unfiltered mean mixes them in
        changing = run["experts_changing_a_class"]
        if changing:
            mixed = (changing * run["mean_polysemanticity"] + (n - changing)) / n
            assert run["mean_polysemanticity_all"] == pytest.approx(mixed)
        if n == 1:  # ablating the only expert: every class but class 0 loses all its accuracy
            assert run["experts_changing_a_class"] == 1 and run["mean_max_drop"] == 1.0
    for row in result["table"]:
        assert row["seeds"] == len(config.seeds)
        assert row["test_accuracy_min"] <= row["test_accuracy"] <= row["test_accuracy_max"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--epochs", "-1"], "--epochs: expected a positive integer, got '-1'"),
        (["demo", "--epochs", "0"], "--epochs: expected a positive integer, got '0'"),
        (["demo", "--experts", "8", "0"], "--experts: expected a positive integer, got '0'"),
        (["demo", "--plot", "/nonexistent-folder/p.png"], "does not exist"),
    ],
)
def test_demo_rejects_arguments_that_would_report_an_untrained_model(argv, message, capsys):
    """``demo --epochs -1`` once printed an untrained model's figures as results."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, message",
    [
        ({"epochs": -1}, "epochs must be a positive integer, got -1"),
        ({"epochs": 0}, "epochs must be a positive integer, got 0"),
        ({"expert_counts": (8, 0)}, "expert_counts must be positive integers"),
    ],
)
def test_demo_function_rejects_an_untrained_model(options, message):
    """The same checks in the library function, for callers that bypass the CLI."""
    from mumoe_tn.cli.demo_command import run_demo

    with pytest.raises(ValueError, match=message):
        run_demo(**options)
