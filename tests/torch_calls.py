"""A recorder of the torch functions a block of code calls (to check which kernels a path uses)."""

import torch


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Records the names of the torch functions and tensor methods called inside the block."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))
