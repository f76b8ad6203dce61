"""Stopping a distillation cleanly: a stop request set by SIGINT / SIGTERM, and the error a stopped run raises.

[`distill`][mumoe_tn.distillation.training.distill] takes a ``stop`` callable and asks it after
every optimiser step and before every batch it reads: once it returns True, the run writes its
checkpoint and raises [`DistillationStopped`][mumoe_tn.distillation.interruption.DistillationStopped].
[`StopOnSignals`][mumoe_tn.distillation.interruption.StopOnSignals] is such a callable that turns
SIGINT and SIGTERM into a stop request for the duration of a ``with`` block, then puts the
previous handlers back; a second signal interrupts at once (``KeyboardInterrupt``).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType

__all__ = ["DistillationStopped", "StopOnSignals"]


class DistillationStopped(Exception):
    """A distillation stopped on request, after its last whole step.

    Attributes
    ----------
    checkpoint : Path or None
        The checkpoint written at the stop (resume from it), or None when the run kept none.
    trained : int
        Tokens trained on so far.
    tokens : int
        Tokens the run asked for.
    """

    def __init__(self, checkpoint: Path | None, trained: int, tokens: int) -> None:
        kept = f"its state is in {checkpoint}" if checkpoint is not None else "no checkpoint was kept"
        super().__init__(f"the distillation stopped after {trained:,} of {tokens:,} tokens; {kept}")
        self.checkpoint, self.trained, self.tokens = checkpoint, trained, tokens


class StopOnSignals:
    """A stop request raised by SIGINT or SIGTERM while the ``with`` block runs: call it to ask.

    Inside the block the first of these signals sets the request (and prints ``notice`` on
    stderr, if given); a second one raises ``KeyboardInterrupt`` at once. On exit the previous
    handlers are restored. Outside the main thread, where Python cannot install handlers, the
    block changes nothing and the request is never set.

    Attributes
    ----------
    signal : int or None
        The signal that set the request (``signal.SIGINT``, ``signal.SIGTERM``), or None.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, notice: str | None = None) -> None:
        self.notice = notice
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def __call__(self) -> bool:
        """Whether a stop was requested."""
        return self.signal is not None

    @property
    def exit_status(self) -> int:
        """The shell's status for death by the signal received: ``128 + signal`` (130 SIGINT, 143 SIGTERM)."""
        return 128 + (self.signal or 0)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = number
        if self.notice:
            print(self.notice, file=sys.stderr, flush=True)

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous = {}
