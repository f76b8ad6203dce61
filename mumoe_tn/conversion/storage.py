"""Declared sizes held against stored bytes: a tensor read from a checkpoint must hold its own elements.

A pickled tensor declares its shape, strides and storage separately, so a few stored bytes can
declare a tensor of any size (a stride-0 ``expand``ed view, or views overlapping one storage);
loading it into a parameter of that size, casting it or running it allocates the declared size.
[`check_stored`][mumoe_tn.conversion.storage.check_stored] refuses a tensor whose elements do not
each own their bytes, and [`check_file_holds`][mumoe_tn.conversion.storage.check_file_holds] a
file whose tensors declare more bytes than the file could store, before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["SHARED_ALLOWANCE", "check_file_holds", "check_stored"]

#: How many times its own size a weight file's tensors may declare together: tied weights (one
#: storage at two keys, as an embedding shared with the output layer) count twice.
SHARED_ALLOWANCE = 2


def _dims(tensor: torch.Tensor) -> list[tuple[int, int]]:
    return [(stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1]


def check_stored(key: str, tensor: torch.Tensor, source: str) -> None:
    """Refuse a tensor whose elements share bytes (stride 0, overlapping strides) or lie outside its storage.

    Parameters
    ----------
    key : str
        Its state-dict key (quoted in the error).
    tensor : torch.Tensor
        The tensor as loaded (on any device, meta included: only sizes are read).
    source : str
        The file or argument it comes from (quoted in the error).

    Raises
    ------
    ValueError
        If two of its elements share bytes, or its view reaches past its storage.
    """
    if tensor.numel() == 0:
        return
    reach = 1  # elements spanned by the dimensions seen so far, smallest stride first
    for stride, size in sorted(_dims(tensor)):
        if stride < reach:
            raise ValueError(
                f"{source}: tensor {key[:200]!r} of shape {tuple(tensor.shape)} has strides {tensor.stride()}, so its "
                "elements share stored bytes (an expanded or overlapping view): a checkpoint's tensor must store "
                "every element it declares"
            )
        reach += stride * (size - 1)
    extent = (tensor.storage_offset() + reach) * tensor.element_size()
    stored = tensor.untyped_storage().nbytes()
    if extent > stored:
        raise ValueError(
            f"{source}: tensor {key[:200]!r} of shape {tuple(tensor.shape)} reaches byte {extent:,} of a storage of "
            f"{stored:,} bytes: a checkpoint's tensor must lie inside its storage"
        )


def check_file_holds(tensors: Mapping[str, torch.Tensor], file_bytes: int, source: str) -> None:
    """Refuse a weight file whose tensors declare more bytes than it stores.

    Every tensor is checked by [`check_stored`][mumoe_tn.conversion.storage.check_stored], and together they may
    declare at most ``SHARED_ALLOWANCE`` times the file's size (declared storage sizes are not trusted: the
    file's size is).

    Raises
    ------
    ValueError
        If a tensor does not store its elements, or the tensors declare more than the file can hold.
    """
    declared = 0
    for key, tensor in tensors.items():
        check_stored(key, tensor, source)
        declared += tensor.numel() * tensor.element_size()
    if declared > SHARED_ALLOWANCE * file_bytes + 4096:
        raise ValueError(
            f"{source}: its tensors declare {declared:,} bytes, more than a file of {file_bytes:,} bytes holds "
            f"(tied weights counted {SHARED_ALLOWANCE} times at most): their declared storage sizes are not the file's"
        )
