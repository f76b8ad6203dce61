"""The sparse maps compiled with dynamic shapes and gradients: values and gradients as the ``entmax`` package's.

A gate with two expert modes applies its map once per mode inside one graph; each call is traced
through the map's autograd ``Function``, whose closed-form backward the compiled graph keeps.
"""

from __future__ import annotations

import entmax
import pytest
import torch
from torch._dynamo.utils import counters

from mumoe_tn.gates.activation_maps import entmax15, sparsemax

OURS = {"entmax15": entmax15, "sparsemax": sparsemax}
REFERENCES = {"entmax15": entmax.entmax15, "sparsemax": entmax.sparsemax}
#: Per map, a row whose second and third entries lie exactly on the threshold (zero, at the support's edge).
ON_THE_EDGE = {"entmax15": [2.0, 0.0, 0.0], "sparsemax": [1.0, 0.0, 0.0]}
#: The expert sizes of the modes.
MODES = {1: (7,), 2: (3, 4)}


def _logits(name: str, rows: int, width: int, seed: int) -> torch.Tensor:
    """Half-integer logits (ties in and out of the support): row 0 on the support's edge, row 1 tied at the peak."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, width), generator=generator, dtype=torch.float64) / 2
    x[0, :3] = torch.tensor(ON_THE_EDGE[name], dtype=x.dtype)
    x[0, 3:] = -2.0
    x[1] = torch.tensor([1.5, 1.5, 1.0, 1.0, 1.0, 0.5, 0.5], dtype=x.dtype)[:width]
    return x


def _map_per_mode(name: str, sizes: tuple[int, ...]):
    return lambda x: [OURS[name](part, dim=-1) for part in x.split(sizes, dim=-1)]


def _reference(name: str, x: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    return [REFERENCES[name](part, dim=-1) for part in x.split(sizes, dim=-1)]


def _values_and_gradient(per_mode, x: torch.Tensor, weights: torch.Tensor):
    x = x.clone().requires_grad_()
    outputs = per_mode(x)
    loss = sum((y * w).sum() for y, w in zip(outputs, weights.split([y.shape[-1] for y in outputs], -1), strict=True))
    (gradient,) = torch.autograd.grad(loss, x)
    return torch.cat(outputs, -1).detach(), gradient


@pytest.mark.parametrize("modes", sorted(MODES))
@pytest.mark.parametrize("name", sorted(OURS))
def test_a_compiled_map_per_mode_equals_the_entmax_package(name, modes):
    sizes = MODES[modes]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_map_per_mode(name, sizes), backend="eager", fullgraph=True, dynamic=True)
    for rows, seed in ((5, 0), (6, 1)):  # two batch sizes: one graph with a symbolic row count
        x = _logits(name, rows, sum(sizes), seed)
        weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 10), dtype=x.dtype)
        values, gradient = _values_and_gradient(compiled, x, weights)
        expected_values, expected_gradient = _values_and_gradient(lambda t: _reference(name, t, sizes), x, weights)
        torch.testing.assert_close(values, expected_values, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gradient, expected_gradient, rtol=1e-12, atol=1e-12)
        assert gradient.isfinite().all(), gradient
    assert counters["stats"]["unique_graphs"] == 1, f"{counters['stats']['unique_graphs']} graphs for two row counts"
    torch._dynamo.reset()
