"""Per-forward records of a module (coefficients, losses, token masks), kept separately for every thread."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

__all__ = ["PerThreadRecords", "gate_losses"]


class _ThreadStore(threading.local):
    """Thread-local attributes that pickle and deep-copy as empty."""

    def __reduce__(self) -> tuple[type, tuple]:
        return (type(self), ())


class PerThreadRecords(nn.Module):
    """An ``nn.Module`` that records per-forward values separately for every thread.

    Values recorded in eager mode live in thread-local storage, so concurrent forward passes
    on one module never see each other's records. A call compiled by ``torch.compile`` changes
    nothing Python-side but what a backward pass reads: only the names in
    `RECORDED_UNDER_COMPILE` (the gate's auxiliary losses), and only in training mode with
    gradients on. Those are kept on the module, shared by threads (dynamo cannot trace
    thread-local storage) and written by dynamo after the graph; an eager call drops them
    again, so the last call's record is the one read. A compiled call in eval mode or without
    gradients, the one a CUDA graph captures for decoding, records nothing. Records are dropped
    by pickling, ``copy.deepcopy`` and ``torch.save``.
    """

    #: The records a compiled call keeps (in training mode, with gradients on): those a loss reads.
    RECORDED_UNDER_COMPILE = frozenset({"losses"})

    def __init__(self) -> None:
        super().__init__()
        self._thread_records = _ThreadStore()

    def _remember(self, name: str, value: Any) -> None:
        self._remember_all(**{name: value})

    def _remember_all(self, **values: Any) -> None:
        """`_remember` each of ``values``."""
        if torch.compiler.is_compiling():
            if self.training and torch.is_grad_enabled():
                for name in self.RECORDED_UNDER_COMPILE.intersection(values):
                    setattr(self, f"_compiled_{name}", values[name])
            return
        self._remember_eager(tuple(values), tuple(values.values()))

    def _remember_eager(self, names: tuple[str, ...], values: tuple[Any, ...]) -> None:
        """`_remember_all` of a call ``torch.compile`` does not trace: ``names[k]`` records ``values[k]``."""
        records = self._thread_records
        for name, value in zip(names, values, strict=True):
            setattr(records, name, value)
        if not self.RECORDED_UNDER_COMPILE.isdisjoint(names):
            state = self.__dict__
            for name in self.RECORDED_UNDER_COMPILE.intersection(names):
                state.pop(f"_compiled_{name}", None)  # (an eager call's record is now the last one)

    def _recall(self, name: str) -> Any:
        compiled = self.__dict__.get(f"_compiled_{name}")
        return getattr(self._thread_records, name, None) if compiled is None else compiled

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if not key.startswith("_compiled_")}


def gate_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """Sum every gate's auxiliary losses over the μMoE layers of ``model`` (this thread's last pass).

    Parameters
    ----------
    model : nn.Module
        Any module; every submodule with a ``gate_losses()`` method (MuMoE, MuMoEMLP)
        contributes.

    Returns
    -------
    dict of str to torch.Tensor
        ``"balance"`` and/or ``"z"`` summed over layers (empty if no layer records any).

    Examples
    --------
    >>> loss = task_loss + 0.01 * gate_losses(model)["balance"]  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    totals: dict[str, torch.Tensor] = {}
    for module in model.modules():
        method = getattr(module, "gate_losses", None)
        if callable(method):
            for name, value in method().items():
                totals[name] = totals[name] + value if name in totals else value
    return totals
