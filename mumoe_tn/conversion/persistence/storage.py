"""Declared sizes held against stored bytes: a tensor read from a checkpoint must hold its own elements.

A pickled tensor declares its shape, strides and storage separately, so a few stored bytes can
declare a tensor of any size (a stride-0 ``expand``ed view, or views overlapping one storage);
loading it into a parameter of that size, casting it or running it allocates the declared size.
[`check_stored`][mumoe_tn.conversion.persistence.storage.check_stored] refuses a tensor whose elements do not
each own their bytes, and [`check_file_holds`][mumoe_tn.conversion.persistence.storage.check_file_holds] a
file whose tensors declare more bytes than the file could store, before anything is allocated.

A pickled weight file is read only in torch's zip format with every entry stored uncompressed
([`check_pickled_archive`][mumoe_tn.conversion.persistence.storage.check_pickled_archive]): torch then holds a
storage's declared size against its entry before allocating it, so a file's storages together
hold at most its own bytes. A compressed entry would expand to its declared size (a 1 MB entry to
1 GiB), and the legacy format allocates each declared storage before reading it (a truncated file
declaring 256 MiB costs 256 MiB): both are refused before torch reads them.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Mapping

import torch

from mumoe_tn.conversion.persistence.bounds import (
    MAX_CHECKPOINT_TENSORS,
    MAX_PICKLE_BYTES,
    SHARED_ALLOWANCE,
    SHARED_SLACK_BYTES,
)

__all__ = [
    "check_file_holds",
    "check_pickled_archive",
    "check_stored",
    "check_tensor_count",
]


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
        If it is not dense (sparse, nested), two of its elements share bytes, or its view reaches
        past its storage.
    TypeError
        If it is not a tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{source}: {key[:200]!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.is_nested or tensor.layout != torch.strided:
        layout = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
        raise ValueError(
            f"{source}: tensor {key[:200]!r} is {layout}: a checkpoint's tensor is dense (strided), as saving a "
            "model writes it"
        )
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

    Every tensor is checked by [`check_stored`][mumoe_tn.conversion.persistence.storage.check_stored], and together they
    may declare at most ``SHARED_ALLOWANCE`` times the file's size (declared storage sizes are not trusted: the
    file's size is).

    Raises
    ------
    ValueError
        If the file holds more than ``MAX_CHECKPOINT_TENSORS`` tensors, a tensor does not store its
        elements, or the tensors declare more than the file can hold.
    """
    check_tensor_count(len(tensors), source)
    declared = 0
    for key, tensor in tensors.items():
        check_stored(key, tensor, source)
        declared += tensor.numel() * tensor.element_size()
    if declared > SHARED_ALLOWANCE * file_bytes + SHARED_SLACK_BYTES:
        raise ValueError(
            f"{source}: its tensors declare {declared:,} bytes, more than a file of {file_bytes:,} bytes holds "
            f"(tied weights counted {SHARED_ALLOWANCE} times at most): their declared storage sizes are not the file's"
        )


def check_tensor_count(count: int, source: str) -> None:
    """Refuse ``count`` tensors from ``source`` if they are more than ``MAX_CHECKPOINT_TENSORS``."""
    if count > MAX_CHECKPOINT_TENSORS:
        raise ValueError(
            f"{source} holds {count:,} tensors, more than the {MAX_CHECKPOINT_TENSORS:,} a checkpoint may hold"
        )


def check_pickled_archive(archive: bytes | os.PathLike, source: str) -> None:
    """Refuse a pickled weight file that is not a zip archive of uncompressed entries, before torch reads it.

    Parameters
    ----------
    archive : bytes or path-like
        The file's bytes, or its path (only its first bytes and its zip directory are read).
    source : str
        The file (quoted in the error).

    Raises
    ------
    ValueError
        If the file is not in torch's zip format (the legacy format, or not a pickle archive at
        all), an entry is compressed, or its pickle is longer than ``MAX_PICKLE_BYTES``.
    """
    try:
        if isinstance(archive, bytes):
            start, handle = archive[:4], io.BytesIO(archive)
        else:
            with open(archive, "rb") as stream:
                start = stream.read(4)
            handle = archive
        if start != b"PK\x03\x04":
            raise ValueError(
                f"{source} is not in torch's zip format (what torch.save writes since torch 1.6): a pickled weight "
                "file in the legacy format allocates what it declares before it is read, so it is not loaded "
                "(re-save it with torch.save)"
            )
        with zipfile.ZipFile(handle) as zipped:
            entries = zipped.infolist()
    except (OSError, zipfile.BadZipFile, EOFError) as error:
        raise ValueError(f"{source} is not a valid weight file ({type(error).__name__})") from None
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
            raise ValueError(
                f"{source}: entry {entry.filename[:200]!r} is compressed ({entry.compress_size:,} bytes holding "
                f"{entry.file_size:,}): torch.save stores entries uncompressed, and a compressed storage expands to "
                "whatever it declares"
            )
        if entry.filename.endswith(".pkl") and entry.file_size > MAX_PICKLE_BYTES:
            raise ValueError(
                f"{source}: its pickle {entry.filename[:200]!r} is {entry.file_size:,} bytes, more than the "
                f"{MAX_PICKLE_BYTES:,} a checkpoint's may have"
            )
