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
    on one module never see each other's records. While ``torch.compile`` traces the module
    (dynamo cannot trace thread-local storage) they are kept on the module, shared by threads.
    Records are dropped by pickling, ``copy.deepcopy`` and ``torch.save``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._thread_records = _ThreadStore()

    def _remember(self, name: str, value: Any) -> None:
        self._remember_all(**{name: value})

    def _remember_all(self, **values: Any) -> None:
        """`_remember` each of ``values``."""
        compiling = torch.compiler.is_compiling()
        for name, value in values.items():
            if compiling:
                setattr(self, f"_compiled_{name}", value)
            else:
                setattr(self._thread_records, name, value)

    def _recall(self, name: str) -> Any:
        value = getattr(self._thread_records, name, None)
        return self.__dict__.get(f"_compiled_{name}") if value is None else value

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
