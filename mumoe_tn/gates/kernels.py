"""When the gate activations run as Triton kernels, and the switch that forces or disables them.

On CUDA tensors, when Triton is importable, entmax15, sparsemax and the top-k gates run as one
kernel per direction ([`mumoe_tn.gates.triton_kernels`][mumoe_tn.gates.triton_kernels]); everywhere
else, and for float64, they take their torch paths. The choice is one of three modes:

- ``"auto"`` (default): the kernels on CUDA tensors of float32, bfloat16 or float16 when Triton
  imports;
- ``"never"``: always the torch paths;
- ``"always"``: the kernels on any device (a CPU tensor needs Triton's interpreter,
  ``TRITON_INTERPRET=1``; this is how the test suite checks them without a GPU).

The mode starts from the environment variable ``MUMOE_TN_GATE_KERNELS`` (read when this module is
first imported; ``auto``, ``never`` or ``always``) and [`use_gate_kernels`][mumoe_tn.gates.kernels.use_gate_kernels]
changes it. Under ``torch.func`` transforms the torch paths are taken (the kernels' operators
define no batching rule).

``kernels.sparse_map``, ``kernels.top_k_softmax`` and ``kernels.relu_top_k`` are the kernel
module's own functions ([`sparse_map`][mumoe_tn.gates.triton_kernels.sparse_map],
[`top_k_softmax`][mumoe_tn.gates.triton_kernels.top_k_softmax],
[`relu_top_k`][mumoe_tn.gates.triton_kernels.relu_top_k]), served from it on first access, so that
Triton is imported only when a gate map runs as a kernel.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from mumoe_tn.lazy_names import lazy_getattr

#: The kernel maps: the Triton module's own functions, served from it on first access.
_LAZY = dict.fromkeys(("relu_top_k", "sparse_map", "top_k_softmax"), "mumoe_tn.gates.triton_kernels")

__all__ = [
    "GATE_KERNELS_ENV",
    "GATE_KERNEL_MODES",
    "gate_kernels",
    "gate_kernels_apply",
    "mode_from_environment",
    "use_gate_kernels",
    *sorted(_LAZY),
]

#: Environment variable that sets the starting mode.
GATE_KERNELS_ENV = "MUMOE_TN_GATE_KERNELS"

#: The modes [`use_gate_kernels`][mumoe_tn.gates.kernels.use_gate_kernels] accepts.
GATE_KERNEL_MODES = ("auto", "never", "always")

#: Input dtypes the kernels take (they compute in float32; float64 keeps its torch path).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_mode(mode: object, source: str) -> str:
    if mode not in GATE_KERNEL_MODES:
        raise ValueError(f"{source} must be one of {list(GATE_KERNEL_MODES)}, got {mode!r}")
    return mode


def mode_from_environment() -> str:
    """The mode ``MUMOE_TN_GATE_KERNELS`` names (``"auto"`` when it is unset).

    Returns
    -------
    str
        One of [`GATE_KERNEL_MODES`][mumoe_tn.gates.kernels].

    Raises
    ------
    ValueError
        If the variable names no mode.
    """
    return _check_mode(os.environ.get(GATE_KERNELS_ENV, "auto"), GATE_KERNELS_ENV)


_state = {"mode": mode_from_environment(), "module": None}


def use_gate_kernels(mode: str) -> str:
    """Set when the gate activations run as Triton kernels; returns the previous mode.

    Parameters
    ----------
    mode : {"auto", "never", "always"}
        See the module notes.

    Returns
    -------
    str
        The mode before the call.
    """
    previous = _state["mode"]
    _state["mode"] = _check_mode(mode, "mode")
    return previous


@contextlib.contextmanager
def gate_kernels(mode: str) -> Iterator[None]:
    """[`use_gate_kernels`][mumoe_tn.gates.kernels.use_gate_kernels] for the duration of a ``with`` block.

    Parameters
    ----------
    mode : {"auto", "never", "always"}
        See the module notes.
    """
    previous = use_gate_kernels(mode)
    try:
        yield
    finally:
        use_gate_kernels(previous)


def _kernels() -> ModuleType | None:
    """The kernel module, imported on first use (None without Triton)."""
    module = _state["module"]
    if module is None:
        module = False
        if importlib.util.find_spec("triton") is not None:
            from mumoe_tn.gates import triton_kernels

            module = triton_kernels if triton_kernels.AVAILABLE else False
        _state["module"] = module
    return module or None


def gate_kernels_apply(x: torch.Tensor) -> bool:
    """Whether the activation of the logits ``x`` runs as a Triton kernel (see the module notes).

    Parameters
    ----------
    x : torch.Tensor
        The logits.

    Returns
    -------
    bool
    """
    mode = _state["mode"]
    if mode == "never" or x.dtype not in KERNEL_DTYPES or x.ndim == 0:
        return False
    if mode == "auto" and not x.is_cuda:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return _kernels() is not None


__getattr__ = lazy_getattr(__name__, _LAZY)
