"""What one call costs the host: the kernels it launches and the values it reads back.

``AtenCalls`` records, while it is active, every ATen operator
the dispatcher runs — forward and backward, on the device of the tensors — and sorts them:

- *kernels*: operators that compute (on an accelerator each is at least one kernel launch);
  views, allocations without a fill and metadata queries are left out, as are operators that
  return no tensor (``promote_types``, ``sym_size``);
- *host reads*: operators and tensor methods that bring a tensor's values to the host
  (``item``, ``bool(t)``, ``int(t)``, ``nonzero`` and other data-dependent shapes, ``tolist``,
  ``numpy``, a copy from an accelerator to the CPU). On an accelerator each one waits for every
  kernel queued before it; on the CPU they cost nothing special, but a code path that reads one
  there reads it wherever it runs the same steps.

Work a CPU path hands to NumPy (``Tensor.numpy()`` then array calls) runs no ATen operator after
the read: it shows as one host read and no kernels. The benchmarks' ``host`` section and the
kernel-count tests use this one recorder, so a budget in a test and a figure in a report mean
the same thing; it lives with the tests' helpers (``benchmarks.launches`` re-exports it), so
the library's tests import no benchmark. ``TorchCalls`` records the names of the torch
functions called instead (which Python-level path ran).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AtenCalls", "Launches", "TorchCalls", "count_call"]

#: Operators that allocate, alias or change metadata only (views are told by their schema).
NOT_KERNELS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "_reshape_alias",
    "detach", "alias", "lift_fresh", "set_", "resize_", "resize_as_", "unsqueeze_", "squeeze_", "t_", "transpose_",
    "as_strided_", "_local_scalar_dense",
})  # fmt: skip

#: Operators whose result the host must read: a scalar value or a data-dependent shape.
HOST_READ_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static_", "masked_select", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "is_nonzero", "equal",
})  # fmt: skip

#: Tensor methods that hand values to Python or NumPy without an operator of their own on the CPU.
HOST_READ_METHODS = frozenset({"tolist", "numpy", "__array__"})


class TorchCalls(TorchFunctionMode):
    """Records the names of the torch functions and tensor methods called inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


class _HostReadMethods(TorchFunctionMode):
    """Counts ``tolist``/``numpy`` calls and tells the dispatch side not to count their copy again."""

    def __init__(self, owner: AtenCalls) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in HOST_READ_METHODS:
            return func(*args, **(kwargs or {}))
        self.owner.host_reads[name] += 1
        self.owner.inside_read += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.owner.inside_read -= 1


class AtenCalls(TorchDispatchMode):
    """Counts the kernels and host reads of the code run inside the block (see the module docstring).

    Attributes
    ----------
    kernels : collections.Counter
        Computing ATen operators by name (``"mm"``, ``"add_"``, …).
    host_reads : collections.Counter
        Host reads by operator or method name.
    others : collections.Counter
        Every other ATen call (views, allocations, metadata).
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: collections.Counter[str] = collections.Counter()
        self.host_reads: collections.Counter[str] = collections.Counter()
        self.others: collections.Counter[str] = collections.Counter()
        self.inside_read = 0
        self._methods = _HostReadMethods(self)

    def __enter__(self) -> AtenCalls:
        self._methods.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._methods.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._methods.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.inside_read and (name in HOST_READ_OPS or _copies_to_host(name, args, kwargs, out)):
            self.host_reads[name] += 1
        returns_tensor = any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(out))
        if func.is_view or name in NOT_KERNELS or not returns_tensor:
            self.others[name] += 1
        else:
            self.kernels[name] += 1
        return out


def _copies_to_host(name: str, args: tuple, kwargs: dict | None, out: object) -> bool:
    """Whether an operator copies an accelerator tensor to the CPU."""
    if name not in ("_to_copy", "copy_"):
        return False
    sources = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    targets = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
    source = sources[1] if name == "copy_" and len(sources) > 1 else sources[0] if sources else None
    return source is not None and source.device.type != "cpu" and any(t.device.type == "cpu" for t in targets)


@dataclass(frozen=True)
class Launches:
    """Kernels and host reads of one call, with their names."""

    kernels: int
    host_reads: int
    by_name: dict[str, int] = field(default_factory=dict)
    reads_by_name: dict[str, int] = field(default_factory=dict)


def count_call(call: Callable[[], object]) -> Launches:
    """Kernels and host reads of one ``call()``, counted by [`AtenCalls`][benchmarks.launches.AtenCalls]."""
    with AtenCalls() as calls:
        call()
    return Launches(
        sum(calls.kernels.values()), sum(calls.host_reads.values()), dict(calls.kernels), dict(calls.host_reads)
    )
