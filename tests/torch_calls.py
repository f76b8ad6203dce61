"""Recorders of what a block of code calls, shared with the benchmarks (see ``benchmarks.launches``).

``TorchCalls`` records the names of the torch functions and tensor methods called (which path
ran); ``AtenCalls`` counts the kernels and host reads of the ATen operators run.
"""

from benchmarks.launches import AtenCalls, TorchCalls, count_call

__all__ = ["AtenCalls", "TorchCalls", "count_call"]
