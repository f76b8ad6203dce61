"""The gate's quicker batch norm computes and updates exactly what ``nn.BatchNorm1d`` does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mumoe_tn.gates.batch_norm_step import batch_norm_matrix
from mumoe_tn.gates.modules import LogitBatchNorm

SETTINGS = [
    {},
    {"momentum": None},
    {"momentum": 0.3, "eps": 1e-3},
    {"affine": True},
    {"track_running_stats": False},
]


@pytest.mark.parametrize("options", SETTINGS)
def test_matches_batch_norm_over_training_and_eval_steps(options: dict) -> None:
    torch.manual_seed(0)
    reference = nn.BatchNorm1d(5, **options)
    quick = nn.BatchNorm1d(5, **options)
    if reference.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.uniform_(-1, 1)
        quick.load_state_dict(reference.state_dict())
    for step in range(4):
        x = torch.randn(7, 5) * (step + 1) + step
        for module in (reference, quick):
            module.train(step != 3)
        expected = reference(x)
        got = batch_norm_matrix(quick, x)
        assert got is not None
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for (name, want), (_, have) in zip(reference.state_dict().items(), quick.state_dict().items(), strict=True):
            torch.testing.assert_close(have, want, rtol=0, atol=0, msg=f"{name} after step {step}")


def test_gradients_match_batch_norm() -> None:
    torch.manual_seed(1)
    reference, quick = nn.BatchNorm1d(4, affine=True), nn.BatchNorm1d(4, affine=True)
    x = torch.randn(6, 4, requires_grad=True)
    grad = torch.randn(6, 4)
    (want,) = torch.autograd.grad(reference(x), x, grad)
    (have,) = torch.autograd.grad(batch_norm_matrix(quick, x), x, grad)
    torch.testing.assert_close(have, want, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 3), (4, 3, 2)])
def test_hands_unusual_input_back_untouched(shape: tuple[int, ...]) -> None:
    norm = nn.BatchNorm1d(3)
    assert batch_norm_matrix(norm, torch.randn(*shape)) is None
    assert int(norm.num_batches_tracked) == 0


def test_logit_batch_norm_counts_batches_and_keeps_its_errors() -> None:
    norm = LogitBatchNorm(3, affine=False)
    reference = nn.BatchNorm1d(3, affine=False)
    x = torch.randn(8, 3)
    torch.testing.assert_close(norm(x), reference(x), rtol=0, atol=0)
    norm(x)
    assert int(norm.num_batches_tracked) == 2
    with pytest.raises(ValueError, match="at least 2 tokens"):
        norm(torch.randn(1, 3))


def test_subclass_runs_the_inherited_forward() -> None:
    calls = []

    class Counting(LogitBatchNorm):
        def _check_input_dim(self, input: torch.Tensor) -> None:
            calls.append(input.shape)
            super()._check_input_dim(input)

    Counting(3, affine=False)(torch.randn(4, 3))
    assert calls == [torch.Size([4, 3])]
