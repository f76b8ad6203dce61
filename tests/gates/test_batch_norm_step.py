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


@pytest.mark.parametrize("momentum", [0.2, None])
@pytest.mark.parametrize("training", [True, False])
def test_substituted_buffers_are_read_and_updated_as_batch_norm_does(momentum, training):
    torch.manual_seed(2)
    quick, reference = (
        LogitBatchNorm(4, affine=False, momentum=momentum),
        nn.BatchNorm1d(4, affine=False, momentum=momentum),
    )
    quick.train(training)
    reference.train(training)
    start = {"running_mean": torch.randn(4), "running_var": torch.rand(4) + 0.5, "num_batches_tracked": torch.tensor(3)}
    mine = {name: value.clone() for name, value in start.items()}
    theirs = {name: value.clone() for name, value in start.items()}
    x = torch.randn(6, 4) * 2 + 1
    got = torch.func.functional_call(quick, mine, (x,))
    expected = torch.func.functional_call(reference, theirs, (x,))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for name in start:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0, msg=name)
    assert int(quick.num_batches_tracked) == 0  # the module's own buffers are untouched


def test_masked_statistics_are_batch_norms_of_the_real_rows():
    torch.manual_seed(3)
    quick, reference = LogitBatchNorm(4, affine=False, momentum=None), nn.BatchNorm1d(4, affine=False, momentum=None)
    for step in range(3):
        x = torch.randn(7, 4) * (step + 1)
        mask = torch.tensor([True, True, False, True, False, True, step % 2 == 0])
        got = quick(x, mask)
        torch.testing.assert_close(got[mask], reference(x[mask]), rtol=0, atol=0)
        assert bool((got[~mask] == 0).all())
    for (name, want), (_, have) in zip(reference.state_dict().items(), quick.state_dict().items(), strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0, msg=name)
