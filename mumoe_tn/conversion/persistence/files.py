"""The files of a checkpoint, read as data: paths kept inside, regular files only, headers without tensor data.

A checkpoint names its files (a shard index's ``weight_map``); each name must be relative, stay
inside the checkpoint directory once links are resolved, and name a regular file of one hard
link (another link may be a file outside) — a FIFO or a device is never opened. JSON files are
read up to [`MAX_JSON_BYTES`][mumoe_tn.conversion.persistence.bounds.MAX_JSON_BYTES] and tensor headers without their
data (safetensors headers; a pickled ``.bin`` unpickled with ``weights_only=True`` onto the meta
device). Every refusal is a ``ValueError`` naming the file or field and quoting the value.

[`read_once`][mumoe_tn.conversion.persistence.files.read_once] reads a file whole through one descriptor: what
is checked (a regular file, its size) is what is read, and a file that changes while it is read
is refused. [`check_unchanged`][mumoe_tn.conversion.persistence.files.check_unchanged] then asks whether every
file read for one load is still the one read (device, inode, size, modification time): a set of
files replaced during the load is refused, so a load sees one consistent set or fails.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mumoe_tn.conversion.persistence.bounds import (
    JSON_FILES,
    MAX_JSON_BYTES,
    PICKLED_FILES,
    SAFETENSORS_FILES,
    STORED_DTYPES,
)
from mumoe_tn.conversion.persistence.record import parse_json
from mumoe_tn.conversion.persistence.storage import check_file_holds, check_pickled_archive, check_tensor_count

__all__ = [
    "FileBytes",
    "Headers",
    "check_json_files",
    "check_unchanged",
    "file_identity",
    "gather_weights",
    "header_shapes",
    "member_file",
    "read_all_headers",
    "read_headers",
    "read_json",
    "read_once",
    "read_weights",
    "regular_file",
    "weight_files",
]

#: ``(shape, dtype)`` of every tensor of a checkpoint, by state-dict key.
Headers = dict[str, tuple[tuple[int, ...], torch.dtype]]


def regular_file(path: Path, what: str) -> Path:
    """``path`` if it names a regular file (never opened otherwise: a FIFO or device would block or stream)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise ValueError(f"{what} {str(path)!r} cannot be read ({error.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {str(path)!r} is not a regular file")
    return path


def member_file(root: Path, name: object, field: str) -> Path:
    """The file a checkpoint names: relative, inside ``root`` once links are resolved, a regular file of one link."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{field} = {name!r:.120} is invalid: it must name a file of the checkpoint directory")
    relative = Path(name)
    if relative.is_absolute():
        raise ValueError(f"{field} = {name!r:.120} is invalid: a checkpoint names its files by relative paths")
    base = root.resolve()
    resolved = (base / relative).resolve()
    if not resolved.is_relative_to(base):
        raise ValueError(f"{field} = {name!r:.120} is invalid: it leads outside the checkpoint directory {str(root)!r}")
    return _one_link(regular_file(resolved, field), field)


def _one_link(path: Path, what: str, links: int | None = None) -> Path:
    """``path`` if it has one hard link: another link may be a file outside the checkpoint directory."""
    if links is None:
        try:
            links = os.stat(path).st_nlink
        except OSError as error:
            raise ValueError(f"{what} {str(path)!r} cannot be read ({error.strerror})") from None
    if links != 1:
        raise ValueError(
            f"{what} has {links} hard links ({str(path)!r}): a checkpoint's file has one (another may lie outside "
            "its directory; copy the file instead)"
        )
    return path


@dataclass(frozen=True)
class FileBytes:
    """A file's content read through one descriptor, and the identity of the file it was read from.

    ``identity`` is ``(device, inode, size, modification time in ns)``, taken from the open
    descriptor before and after reading (they agreed); ``follow`` says whether ``path`` may be a
    link (a path the caller gave) or names the file itself (a checked member of a directory).
    """

    path: Path
    data: bytes
    identity: tuple[int, int, int, int]
    follow: bool = True


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def read_once(path: Path, what: str, *, limit: int | None = None, follow: bool = True) -> FileBytes:
    """Read ``path`` whole through one open descriptor: a regular file of at most ``limit`` bytes.

    The checks (a regular file, its size) are made on the open descriptor, so they hold for the
    bytes read; a file that grows, shrinks or is rewritten while it is read is refused. With
    ``follow=False`` a link at ``path`` itself is refused (``path`` was resolved and checked).

    Raises
    ------
    ValueError
        If the file cannot be read, is not a regular file, exceeds ``limit`` or changed while read.
    """
    regular_file(path, what)  # a FIFO or device is never opened, not even non-blocking
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as error:
        raise ValueError(f"{what} {str(path)!r} cannot be read ({error.strerror})") from None
    try:
        before = os.fstat(descriptor)
        if not stat.S_ISREG(before.st_mode):
            raise ValueError(f"{what} {str(path)!r} is not a regular file")
        if not follow:  # a checked member of a directory: the file opened must have one link too
            _one_link(Path(path), what, before.st_nlink)
        if limit is not None and before.st_size > limit:
            raise ValueError(f"{what} is {before.st_size:,} bytes, more than the {limit:,} it may have")
        buffer = bytearray(before.st_size + 1)  # one byte more: a file that grew reads past its size
        filled = 0
        with memoryview(buffer) as view, open(descriptor, "rb", buffering=0, closefd=False) as stream:
            while filled < len(buffer):
                count = stream.readinto(view[filled:])
                if not count:
                    break
                filled += count
        after = os.fstat(descriptor)
    except OSError as error:
        raise ValueError(f"{what} {str(path)!r} cannot be read ({error.strerror})") from None
    finally:
        os.close(descriptor)
    if filled != before.st_size or _identity(after) != _identity(before):
        raise ValueError(f"{what} {str(path)!r} changed while it was read: load it once it is written")
    return FileBytes(Path(path), bytes(memoryview(buffer)[:filled]), _identity(before), follow)


def check_unchanged(reads: Sequence[FileBytes], what: str) -> None:
    """Refuse unless every file of ``reads`` is still the one read (same device, inode, size and time).

    Called after the last file of a load was read: every file was then, at one instant, the
    version read, so the load saw one consistent set of files.
    """
    for read in reads:
        try:
            now = _identity(os.stat(read.path, follow_symlinks=read.follow))
        except OSError:
            now = None
        if now != read.identity:
            raise ValueError(
                f"{what}: {str(read.path)!r} was replaced or changed while the checkpoint loaded: load it once it is "
                "written (nothing was changed)"
            )


def file_identity(path: Path) -> FileBytes:
    """The identity of the file at ``path`` now, without reading it (for ``check_unchanged``)."""
    try:
        return FileBytes(Path(path), b"", _identity(os.stat(path, follow_symlinks=False)), follow=False)
    except OSError as error:
        raise ValueError(f"{str(path)!r} cannot be read ({error.strerror})") from None


def check_json_files(root: Path, names: Sequence[str] = JSON_FILES) -> None:
    """Each of ``names`` in ``root``: inside it once links are resolved, a regular file of at most ``MAX_JSON_BYTES``.

    For the files another library reads itself (transformers reads ``config.json``,
    ``generation_config.json`` and a shard index on its own).
    """
    for name in names:
        if os.path.lexists(root / name):
            file = member_file(root, name, name)
            size = os.stat(file).st_size
            if size > MAX_JSON_BYTES:
                raise ValueError(f"{name} is {size:,} bytes, more than the {MAX_JSON_BYTES:,} it may have")


def read_json(file: Path, field: str, reads: list[FileBytes] | None = None, *, limit: int | None = None) -> Any:
    """The JSON content of a checkpoint's ``file`` (at most ``limit`` bytes, default ``MAX_JSON_BYTES``).

    ``field`` names it in errors.

    The file is read once (see [`read_once`][mumoe_tn.conversion.persistence.files.read_once]); ``reads``, if
    given, collects the read for [`check_unchanged`][mumoe_tn.conversion.persistence.files.check_unchanged].
    """
    read = read_once(file, field, limit=MAX_JSON_BYTES if limit is None else min(limit, MAX_JSON_BYTES), follow=False)
    if reads is not None:
        reads.append(read)
    return parse_json(read.data, field)


def weight_files(root: Path, reads: list[FileBytes] | None = None) -> list[Path]:
    """The weight files of a ``save_pretrained`` directory (safetensors or pickled, sharded or not), checked.

    ``reads``, if given, collects the read of a shard index (see
    [`read_json`][mumoe_tn.conversion.persistence.files.read_json]).
    """
    for single, index in (SAFETENSORS_FILES, PICKLED_FILES):
        if os.path.lexists(root / single):
            return [member_file(root, single, single)]
        if os.path.lexists(root / index):
            data = read_json(member_file(root, index, index), index, reads)
            if not isinstance(data, Mapping) or not isinstance(data.get("weight_map"), Mapping):
                raise ValueError(f"{index}: weight_map = {_field(data, 'weight_map')} is invalid: it must be a mapping")
            names = []
            for key, name in data["weight_map"].items():
                field = f"{index}: weight_map[{key!r:.80}]"
                if not isinstance(key, str):
                    raise ValueError(f"{field} is invalid: keys are tensor names")
                if not isinstance(name, str) or not name.endswith(Path(single).suffix):
                    raise ValueError(f"{field} = {name!r:.120} is invalid: it must name a {Path(single).suffix} file")
                names.append(name)
            files = {}
            for name in sorted(set(names)):
                files.setdefault(member_file(root, name, f"{index}: weight_map entry"), name)
            if not files:
                raise ValueError(f"{index}: weight_map is empty")
            return list(files)
    raise ValueError(f"no weights in {str(root)!r}: expected one of {[*SAFETENSORS_FILES, *PICKLED_FILES]}")


def _field(data: object, key: str) -> str:
    value = data.get(key) if isinstance(data, Mapping) else data
    return repr(value)[:120]


def read_headers(file: Path) -> tuple[Headers, dict[str, str]]:
    """Shapes and dtypes of a weight file's tensors, and its metadata, without reading tensor data.

    A ``.safetensors`` file's header is read; a pickled ``.bin`` file is unpickled with
    ``weights_only=True`` onto the meta device.

    Raises
    ------
    ValueError
        If the file is not a valid weight file.
    """
    file = Path(file)
    headers: Headers = {}
    if file.suffix == ".bin":
        check_pickled_archive(file, repr(str(file)))
        try:
            state = torch.load(file, map_location="meta", weights_only=True)
        except Exception as error:  # torch raises many kinds for a malformed pickle
            raise ValueError(f"{str(file)!r} is not a valid weight file ({type(error).__name__})") from None
        if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise ValueError(f"{str(file)!r} is not a state dict of tensors")
        check_file_holds(state, file.stat().st_size, repr(str(file)))
        return {key: (tuple(value.shape), value.dtype) for key, value in state.items()}, {}
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata() or {}
            check_tensor_count(len(handle.keys()), repr(str(file)))
            for key in handle.keys():
                piece = handle.get_slice(key)
                headers[key] = (tuple(piece.get_shape()), _dtype(piece.get_dtype(), file, key))
    except ValueError:
        raise
    except Exception as error:  # safetensors' own error types
        raise ValueError(f"{str(file)!r} is not a valid safetensors file ({error})") from None
    return headers, dict(metadata)


def read_weights(read: FileBytes) -> tuple[dict[str, torch.Tensor], Headers, dict[str, str]]:
    """The tensors of a weight file's bytes (as read once), their headers, and the file's metadata.

    A ``.bin`` file is unpickled with ``weights_only=True``; anything else is parsed as safetensors
    (``safetensors.torch.load``, which checks every tensor's extent against the bytes). Tensors are
    made only from the bytes given, so they are the file's content at one instant.

    Raises
    ------
    ValueError
        If the bytes are not a valid weight file, or hold a dtype a mumoe_tn checkpoint never holds.
    """
    file = read.path
    if file.suffix == ".bin":
        check_pickled_archive(read.data, repr(str(file)))
        for location in ("meta", "cpu"):  # declared sizes checked on the meta device before any is allocated
            try:
                state = torch.load(io.BytesIO(read.data), map_location=location, weights_only=True)
            except Exception as error:  # torch raises many kinds for a malformed pickle
                raise ValueError(f"{str(file)!r} is not a valid weight file ({type(error).__name__})") from None
            if not isinstance(state, Mapping) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
            ):
                raise ValueError(f"{str(file)!r} is not a state dict of tensors")
            check_file_holds(state, len(read.data), repr(str(file)))
        metadata: dict[str, str] = {}
    else:
        from safetensors.torch import load

        try:
            state = load(read.data)
        except Exception as error:  # safetensors' own error types
            raise ValueError(f"{str(file)!r} is not a valid safetensors file ({type(error).__name__})") from None
        check_tensor_count(len(state), repr(str(file)))
        length = int.from_bytes(read.data[:8], "little")  # the format: a little-endian u64, then the JSON header
        metadata = parse_json(read.data[8 : 8 + length], f"header of {str(file)!r}").get("__metadata__") or {}
    allowed = set(_DTYPES.values())
    for key, value in state.items():
        if value.dtype not in allowed:
            raise ValueError(
                f"{str(file)!r}: tensor {key!r:.80} has dtype {value.dtype}, which mumoe_tn checkpoints never hold"
            )
    headers = {key: (tuple(value.shape), value.dtype) for key, value in state.items()}
    return dict(state), headers, dict(metadata)


_DTYPES = {code: getattr(torch, name) for code, name in STORED_DTYPES.items()}


def _dtype(name: str, file: Path, key: str) -> torch.dtype:
    dtype = _DTYPES.get(str(name).upper())
    if dtype is None:
        raise ValueError(
            f"{str(file)!r}: tensor {key!r:.200} has dtype {name!r:.80}, which mumoe_tn checkpoints never hold"
        )
    return dtype


def header_shapes(headers: Headers) -> dict[str, tuple[int, ...]]:
    """The shapes of ``headers``, by key."""
    return {key: shape for key, (shape, _) in headers.items()}


def _add_once(headers: Headers, found: Headers, name: str, owner: str) -> None:
    """Add one weight file's headers to ``headers``, refusing a tensor another file of ``owner`` holds."""
    for key, value in found.items():
        if key in headers:
            raise ValueError(f"{name}: tensor {key!r:.200} is stored in two weight files of {owner}")
        headers[key] = value


def read_all_headers(files: Sequence[Path]) -> Headers:
    """The headers of every weight file together; a tensor stored in two files is refused."""
    headers: Headers = {}
    for file in files:
        found, _ = read_headers(file)
        _add_once(headers, found, repr(str(file)), "the checkpoint")
    return headers


def gather_weights(
    reads: Iterable[tuple[str, FileBytes]], owner: str
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """The tensors of weight files read one after another, each copied into memory of its own, and their shapes.

    Parameters
    ----------
    reads : Iterable of (str, FileBytes)
        Each file's name as an error quotes it, and its bytes as read once; a file's bytes are let
        go before the next file is asked for.
    owner : str
        What the files make up (``"the checkpoint"``, ``"the model"``), for the error.

    Returns
    -------
    state : dict of str to torch.Tensor
        Every tensor, by key.
    shapes : dict of str to tuple of int
        Their shapes, by key.

    Raises
    ------
    ValueError
        If a file is not a valid weight file (see
        [`read_weights`][mumoe_tn.conversion.persistence.files.read_weights]), or a tensor is
        stored in two of them.
    """
    state: dict[str, torch.Tensor] = {}
    headers: Headers = {}
    for name, read in reads:
        found, found_headers, _ = read_weights(read)
        del read
        _add_once(headers, found_headers, name, owner)
        state.update((key, tensor.clone()) for key, tensor in found.items())  # the parsed tensors view the bytes
        del found
    return state, header_shapes(headers)
