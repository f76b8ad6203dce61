"""Peak bytes of live tensors on CPU, for tests (and benchmarks) that bound what a computation holds at once."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorPeak", "live_peak_bytes"]


class LiveTensorPeak(TorchDispatchMode):
    """The high-water mark of tensor storages that ops create while the mode is active.

    The CPU counterpart of ``torch.cuda.max_memory_allocated``: every storage an op returns
    that none of its inputs held is counted from its creation until it is freed (a weak
    finalizer on the storage), so views and in-place results are not double-counted and
    memory the C allocator keeps after a free (which the resident set still shows) is not
    counted. Storages created inside a kernel and never returned (e.g. BLAS packing buffers)
    are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        held = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in held or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def live_peak_bytes(run: Callable[[], object]) -> int:
    """Peak bytes of the tensors that one call of ``run`` creates and holds at once (see `LiveTensorPeak`)."""
    with LiveTensorPeak() as tracker:
        run()
    return tracker.peak
