"""Compiled layers: one graph per mode and grad mode, none recompiled after warm-up.

``torch.compile(layer, fullgraph=True)`` traces the whole call (nothing Python-side is mutated in
the compiled region, so ``mode="reduce-overhead"`` can capture it). After one warm-up pass over
train/eval, grad/no-grad and two batch sizes of one bucket, the same calls — with eager calls of
the same layer in between — compile nothing new. Frames are counted by a backend that compiles
nothing (the graph runs eagerly), so the test is about guards, not about inductor.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from strategies import rank_of, shipped_formats

from mumoe_tn import Gate, MixtureOfDecoders, MuMoE, ReLUTopKGate, TopKGate

GATES = {
    "entmax15": lambda: Gate(),
    "sparsemax": lambda: Gate(activation="sparsemax", norm="layer"),
    "softmax": lambda: Gate(activation="softmax", norm="none"),
    "top-k": lambda: TopKGate(k=2),
    "relu top-k": lambda: ReLUTopKGate(k=2),
}
CALLS = [(training, grad, rows) for training, grad in itertools.product((False, True), repeat=2) for rows in (3, 4)]


def _layer(fmt: str, gate: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if fmt == "mxd":
        return MixtureOfDecoders(6, 8, 5, 4, gate=GATES[gate]())
    return MuMoE(6, 5, 4, fmt, rank_of(fmt, 2), gate=GATES[gate]())


@pytest.mark.parametrize(("fmt", "gate"), list(itertools.product(shipped_formats(), GATES)))
def test_a_compiled_layer_compiles_nothing_after_warm_up(fmt, gate):
    torch._dynamo.reset()
    frames = []

    def counting(graph, example_inputs):
        frames.append(graph)
        return graph.forward

    layer = _layer(fmt, gate)
    compiled = torch.compile(layer, backend=counting, fullgraph=True, dynamic=True)

    def run(with_eager: bool) -> None:
        for training, grad, rows in CALLS:
            layer.train(training)
            x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows))
            with torch.set_grad_enabled(grad):
                got = compiled(x)
                if with_eager:
                    torch.testing.assert_close(got, layer(x), rtol=1e-4, atol=1e-5)

    run(with_eager=False)
    warm = len(frames)
    assert 1 <= warm <= 4, f"{warm} graphs for two modes × two grad modes"
    run(with_eager=True)
    run(with_eager=False)
    assert len(frames) == warm, f"recompiled after warm-up: {warm} graphs, then {len(frames)}"
