"""Distilled blocks report, in the process that trained them, the metrics their reloaded weights give.

Flat μMoE blocks train with the auxiliary-k term, whose no-grad forward between fused optimiser
steps once left their inference caches holding the weights of that step: the same process then
evaluated stale weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_corpus import _after
from test_training import ToyLM, _batches

from mumoe_tn.distillation.faithfulness import evaluate_replacements
from mumoe_tn.distillation.interruption import DistillationStopped
from mumoe_tn.distillation.losses import AuxK
from mumoe_tn.distillation.replacements import mumoe_factory
from mumoe_tn.distillation.streaming import select_blocks
from mumoe_tn.distillation.training import distill


def _metrics(model, replacements):
    table = evaluate_replacements(model, _batches(3, seed=9), replacements)
    return {row.method: (row.nmse, row.l0) for row in table.rows}


def test_distilled_flat_blocks_evaluate_their_trained_weights():
    torch.manual_seed(0)
    model = ToyLM(width=16, hidden=64)
    block = select_blocks(model)[0]
    budget = 4 * block.parameters
    factories = {
        fmt: mumoe_factory(fmt, 64, 4, budget, aux_k=AuxK(dead_after=64)) for fmt in ("cp", "tr")
    }  # a short dead_after: the auxiliary term (and its no-grad forward) runs from the first steps
    run = distill(model, _batches(24), factories, tokens=24 * 64, batch_size=64, buffer_tokens=256, progress=False)
    reported = _metrics(model, run.replacements)
    reloaded = {}
    for mlp, methods in run.replacements.items():
        reloaded[mlp] = {}
        for method, module in methods.items():
            fresh = copy.deepcopy(module)  # a deep copy keeps no inference cache
            fresh.load_state_dict(module.state_dict())
            reloaded[mlp][method] = fresh
    expected = _metrics(model, reloaded)
    assert reported.keys() == expected.keys() == {"cp", "tr"}
    for method, (nmse, l0) in expected.items():
        assert abs(reported[method][0] - nmse) <= 1e-5 * max(1.0, nmse), (method, reported[method], nmse)
        assert reported[method][1] == l0


def test_an_interrupted_and_resumed_run_reports_the_table_of_an_uninterrupted_one(tmp_path):
    """Once, an uninterrupted run evaluated stale weights and a resumed one fresh weights: two tables, equal weights."""
    torch.manual_seed(0)
    model = ToyLM(width=16, hidden=64)
    block = select_blocks(model)[0]
    factories = {
        fmt: mumoe_factory(fmt, 64, 4, 4 * block.parameters, aux_k=AuxK(dead_after=64)) for fmt in ("cp", "tr")
    }
    options = {"tokens": 16 * 64, "batch_size": 64, "buffer_tokens": 256, "progress": False}
    whole = distill(model, _batches(16), factories, **options)
    path = tmp_path / "run.pt"
    with pytest.raises(DistillationStopped):
        distill(model, _batches(16), factories, checkpoint=path, stop=_after(9), **options)
    resumed = distill(model, _batches(16), factories, checkpoint=path, resume=True, **options)
    for method in ("cp", "tr"):
        for (name, a), b in zip(
            whole.replacements["mlp"][method].state_dict().items(),
            resumed.replacements["mlp"][method].state_dict().values(),
            strict=True,
        ):
            assert torch.equal(a, b), (method, name)
    assert _metrics(model, whole.replacements) == _metrics(model, resumed.replacements)
