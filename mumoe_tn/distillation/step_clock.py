"""Each replacement's own training time, measured without waiting for the device.

A distillation step trains every replacement in turn on the same rows; how fast each method
trains is what a user compares. On the CPU a step's host time is its time. On an accelerator the
host only queues kernels, so each step is bracketed by two timing events on the device's stream,
read when the run next reads its losses (a point where it waits for the device anyway): the
clock adds no synchronisation to the training loop.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["StepClock"]


class StepClock:
    """Seconds each key (a replacement) spent in its training steps, and the tokens it trained on."""

    def __init__(self) -> None:
        self.seconds: dict[Hashable, float] = {}
        self.tokens: dict[Hashable, int] = {}
        self._pending: list[tuple[Hashable, Any, Any]] = []  # device events not yet read

    @contextmanager
    def timing(self, key: Hashable, device: torch.device, tokens: int) -> Any:
        """Time the block's work for ``key`` (``tokens`` rows of training)."""
        self.tokens[key] = self.tokens.get(key, 0) + tokens
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((key, start, end))
            return
        began = time.perf_counter()
        yield
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - began

    def settle(self) -> None:
        """Read the device events recorded so far (the caller has just waited for the device)."""
        for key, start, end in self._pending:
            end.synchronize()
            self.seconds[key] = self.seconds.get(key, 0.0) + start.elapsed_time(end) / 1000
        self._pending = []

    def tokens_per_second(self, key: Hashable) -> float:
        """Tokens trained per second of ``key``'s own steps (NaN before any step)."""
        self.settle()
        seconds = self.seconds.get(key, 0.0)
        return self.tokens.get(key, 0) / seconds if seconds > 0 else float("nan")
