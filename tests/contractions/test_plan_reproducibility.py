"""Reproducible plans: the same network, shapes and optimizer give the same plan in every process,
and a plan survives a trip through JSON."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import any_network

from mumoe_tn import ExpertNetwork
from mumoe_tn.contractions import ContractionPlan, plan_contraction, plan_forward

ROOT = Path(__file__).resolve().parents[2]


def grid_network(side=5, dim=2, rank=3, width=16):
    """A side × side grid of cores, one expert mode of ``dim`` each, bonds of ``rank`` to the neighbours."""
    cores, sizes = {}, {"i": width, "o": width}
    for row in range(side):
        for column in range(side):
            mode = f"n{row * side + column + 1}"
            labels = [mode]
            sizes[mode] = dim
            if row + 1 < side:
                labels.append(f"v{row}_{column}")
            if row:
                labels.append(f"v{row - 1}_{column}")
            if column + 1 < side:
                labels.append(f"h{row}_{column}")
            if column:
                labels.append(f"h{row}_{column - 1}")
            cores[f"c{row}_{column}"] = tuple(labels)
    cores["c0_0"] += ("i",)
    cores[f"c{side - 1}_{side - 1}"] += ("o",)
    sizes.update({label: rank for labels in cores.values() for label in labels if label[0] in "vh"})
    return ExpertNetwork(cores, sizes, name="grid")


PLAN_IN_A_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from contractions.test_plan_reproducibility import grid_network
from mumoe_tn.contractions import plan_forward
plan = plan_forward(grid_network(), 64)
print(json.dumps(plan.to_dict()))
"""


def test_a_large_network_gets_the_same_plan_in_separate_processes():
    network = grid_network()
    assert len(network.forward_equation()[0]) == 51  # far beyond dynamic programming
    code = PLAN_IN_A_PROCESS.format(tests=str(ROOT / "tests"))
    plans = []
    for seed in ("1", "2"):  # string hashing (and so the order of sets of labels) differs per process
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        plans.append(json.loads(done.stdout))
    assert plans[0] == plans[1]
    assert ContractionPlan.from_dict(plans[0]) == plan_forward(network, 64)


def test_planning_leaves_the_callers_random_state_alone():
    random.seed(7)
    expected = random.random()
    random.seed(7)
    plan_forward(grid_network(), 64)  # runs seeded randomised searches
    assert random.random() == expected


@settings(max_examples=25, deadline=None)
@given(any_network(), st.integers(1, 64))
def test_plans_round_trip_through_json(network, batch):
    plan = plan_forward(network, batch)
    restored = ContractionPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert restored == plan
    assert restored.fma == plan.fma and restored.largest_intermediate == plan.largest_intermediate


def _saved():
    sizes = {"a": 2, "b": 3, "c": 4}
    return plan_contraction([("a", "b"), ("b", "c")], ("a", "c"), sizes).to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("path"), r"needs the keys \['path'\]"),
        (lambda d: d.update(format=9), "saved plan format 9 is not the supported 1"),
        (lambda d: d.update(path=[[0, 5]]), "refers to a position outside"),
        (lambda d: d["steps"][0].update(output=["a", "z"]), "returns labels .* its operands do not carry"),
        (lambda d: d["steps"][0].update(output=["c", "a"]), r"ends in \('c', 'a'\), not the output \('a', 'c'\)"),
        (lambda d: d["sizes"].pop("b"), "label 'b' has no size"),
        (lambda d: d.update(sizes={"a": "x", "b": 3, "c": 4}), "malformed entries"),
    ],
)
def test_a_damaged_saved_plan_is_refused(change, message):
    saved = _saved()
    change(saved)
    with pytest.raises(ValueError, match=message):
        ContractionPlan.from_dict(saved)


def test_a_saved_plan_must_be_a_dict():
    with pytest.raises(TypeError, match=r"a saved plan is a dict from ContractionPlan\.to_dict"):
        ContractionPlan.from_dict([1, 2])
