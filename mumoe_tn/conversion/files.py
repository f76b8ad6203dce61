"""The files of a checkpoint, read as data: paths kept inside, regular files only, headers without tensor data.

A checkpoint names its files (a shard index's ``weight_map``); each name must be relative, stay
inside the checkpoint directory once links are resolved, and name a regular file — a FIFO or a
device is never opened. JSON files are read up to [`MAX_JSON_BYTES`][mumoe_tn.conversion.files]
and tensor headers without their data (safetensors headers; a pickled ``.bin`` unpickled with
``weights_only=True`` onto the meta device). Every refusal is a ``ValueError`` naming the file or
field and quoting the value.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mumoe_tn.conversion.record import parse_json
from mumoe_tn.conversion.storage import check_file_holds

__all__ = [
    "MAX_JSON_BYTES",
    "Headers",
    "header_shapes",
    "member_file",
    "read_all_headers",
    "read_headers",
    "read_json",
    "regular_file",
    "weight_files",
]

_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")

#: Largest ``config.json`` or shard index read (a record of thousands of modules is a few MB).
MAX_JSON_BYTES = 64 << 20

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
    """The file a checkpoint names: relative, inside ``root`` once links are resolved, and a regular file."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{field} = {name!r:.120} is invalid: it must name a file of the checkpoint directory")
    relative = Path(name)
    if relative.is_absolute():
        raise ValueError(f"{field} = {name!r:.120} is invalid: a checkpoint names its files by relative paths")
    base = root.resolve()
    resolved = (base / relative).resolve()
    if not resolved.is_relative_to(base):
        raise ValueError(f"{field} = {name!r:.120} is invalid: it leads outside the checkpoint directory {str(root)!r}")
    return regular_file(resolved, field)


def read_json(file: Path, field: str) -> Any:
    """The JSON content of a checkpoint's ``file`` (at most ``MAX_JSON_BYTES``); ``field`` names it in errors."""
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{field} is {size:,} bytes; a checkpoint's JSON files are read up to {MAX_JSON_BYTES:,}")
    try:
        text = file.read_bytes()
    except OSError as error:
        raise ValueError(f"{field} cannot be read ({error.strerror})") from None
    return parse_json(text, field)


def weight_files(root: Path) -> list[Path]:
    """The weight files of a ``save_pretrained`` directory (safetensors or pickled, sharded or not), checked."""
    for single, index in (_SAFETENSORS, _PICKLED):
        if (root / single).exists():
            return [member_file(root, single, single)]
        if (root / index).exists():
            data = read_json(member_file(root, index, index), index)
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
    raise ValueError(f"no weights in {str(root)!r}: expected one of {[*_SAFETENSORS, *_PICKLED]}")


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
            for key in handle.keys():
                piece = handle.get_slice(key)
                headers[key] = (tuple(piece.get_shape()), _dtype(piece.get_dtype(), file, key))
    except ValueError:
        raise
    except Exception as error:  # safetensors' own error types
        raise ValueError(f"{str(file)!r} is not a valid safetensors file ({error})") from None
    return headers, dict(metadata)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def _dtype(name: str, file: Path, key: str) -> torch.dtype:
    dtype = _DTYPES.get(str(name).upper())
    if dtype is None:
        raise ValueError(f"{str(file)!r}: tensor {key!r} has dtype {name!r}, which mumoe_tn checkpoints never hold")
    return dtype


def header_shapes(headers: Headers) -> dict[str, tuple[int, ...]]:
    """The shapes of ``headers``, by key."""
    return {key: shape for key, (shape, _) in headers.items()}


def read_all_headers(files: Sequence[Path]) -> Headers:
    """The headers of every weight file together; a tensor stored in two files is refused."""
    headers: Headers = {}
    for file in files:
        found, _ = read_headers(file)
        for key, value in found.items():
            if key in headers:
                raise ValueError(f"{str(file)!r}: tensor {key!r} is stored in two weight files of the checkpoint")
            headers[key] = value
    return headers
