"""The call recorders the ``host`` section counts with: the tests' own (``tests/torch_calls.py``).

A budget in ``tests/layers/test_kernel_counts.py`` and a figure in a report are counted by the
same ``AtenCalls``, so they mean the same thing.
"""

from tests.torch_calls import AtenCalls, Launches, TorchCalls, count_call

__all__ = ["AtenCalls", "Launches", "TorchCalls", "count_call"]
