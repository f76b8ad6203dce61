"""Trained replacements in one safetensors file, loaded all or nothing.

[`save_replacements`][mumoe_tn.distillation.replacement_files.save_replacements] writes every
replacement's state under the key ``"<block>/<method>/<tensor>"``;
[`load_replacements`][mumoe_tn.distillation.replacement_files.load_replacements] reads the file
once, whole, through one descriptor (see [`read_once`][mumoe_tn.conversion.persistence.files.read_once]),
parses every tensor from those bytes, checks every key, shape and dtype kind against the built
modules, and only then copies the weights in: a file that is not saved replacements, that does
not fit, or that changes while it is read leaves every module as it was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from mumoe_tn.conversion.persistence.files import FileBytes, Headers, read_once, read_weights, regular_file

__all__ = ["REPLACEMENTS_FORMAT", "fill_replacements", "load_replacements", "read_replacements", "save_replacements"]

#: The ``format`` entry of a replacements file's metadata.
REPLACEMENTS_FORMAT = "mumoe_tn.replacements/1"


def save_replacements(
    replacements: Mapping[str, Mapping[str, nn.Module]],
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write trained replacements to one ``.safetensors`` file: key ``"<block>/<method>/<tensor>"``.

    Parameters
    ----------
    replacements : Mapping
        ``block name -> method -> module`` (``Distillation.replacements``).
    path : str or PathLike
        The file.
    metadata : Mapping[str, str], optional
        Strings stored in the file's header (e.g. the run's configuration as JSON).

    Returns
    -------
    Path
    """
    from safetensors.torch import save_file

    tensors = {
        f"{block}/{method}/{key}": tensor.detach().cpu().contiguous().clone()
        for block, methods in replacements.items()
        for method, module in methods.items()
        for key, tensor in module.state_dict().items()
    }
    path = Path(path)
    save_file(tensors, str(path), metadata={"format": REPLACEMENTS_FORMAT, **dict(metadata or {})})
    return path


def read_replacements(read: FileBytes) -> tuple[dict[str, torch.Tensor], Headers, dict[str, str]]:
    """The tensors, headers and metadata of a replacements file's bytes (as read once).

    Raises
    ------
    ValueError
        Bytes that are not a safetensors file of saved replacements.
    """
    if read.path.suffix == ".bin":
        raise ValueError(f"{str(read.path)!r} is not a replacements file: they are saved as .safetensors")
    tensors, headers, metadata = read_weights(read)
    if metadata.get("format") != REPLACEMENTS_FORMAT:
        raise ValueError(
            f"{str(read.path)!r} holds no saved replacements (format {str(metadata.get('format'))[:80]!r}, "
            f"expected {REPLACEMENTS_FORMAT!r})"
        )
    return tensors, headers, metadata


def _expected(replacements: Mapping[str, Mapping[str, nn.Module]]) -> dict[str, torch.Tensor]:
    if not isinstance(replacements, Mapping):
        raise TypeError(f"replacements must be a mapping block -> method -> module, got {type(replacements).__name__}")
    expected = {}
    for block, methods in replacements.items():
        if not isinstance(methods, Mapping):
            raise TypeError(f"replacements[{block!r:.80}] must be a mapping method -> module")
        for method, module in methods.items():
            if not isinstance(module, nn.Module):
                raise TypeError(f"replacements[{block!r:.80}][{method!r:.80}] must be an nn.Module")
            for key, tensor in module.state_dict().items():
                expected[f"{block}/{method}/{key}"] = tensor
    return expected


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "float" if dtype.is_floating_point else "int"


def fill_replacements(
    replacements: Mapping[str, Mapping[str, nn.Module]], tensors: Mapping[str, torch.Tensor], source: str
) -> dict[str, dict[str, nn.Module]]:
    """Copy ``tensors`` (keyed ``"<block>/<method>/<tensor>"``) into built modules, all or nothing.

    Every key, shape and dtype kind is checked before the first copy; on any refusal no module
    has changed.

    Parameters
    ----------
    replacements : Mapping
        ``block name -> method -> module``.
    tensors : Mapping[str, torch.Tensor]
        The saved tensors.
    source : str
        Where they come from (quoted in errors).

    Returns
    -------
    dict
        The same modules, holding the tensors, in eval mode.

    Raises
    ------
    ValueError
        A key missing or extra, or a shape or dtype kind that differs (named).
    """
    expected = _expected(replacements)
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise ValueError(f"{source!r} does not hold these replacements: missing {missing[:5]}, extra {extra[:5]}")
    for what, read in (("shapes", lambda t: tuple(t.shape)), ("dtypes", lambda t: t.dtype)):
        same = (lambda a, b: a == b) if what == "shapes" else (lambda a, b: _kind(a) == _kind(b))
        wrong = [
            f"{key}: {read(tensors[key])} saved, {read(own)} built"
            for key, own in expected.items()
            if not same(read(tensors[key]), read(own))
        ]
        if wrong:
            raise ValueError(f"{source!r} holds replacements of other {what}: {'; '.join(wrong[:5])}")
    out: dict[str, dict[str, nn.Module]] = {}
    with torch.no_grad():
        for key, own in expected.items():
            own.copy_(tensors[key])
    for block, methods in replacements.items():
        out[block] = {method: module.eval() for method, module in methods.items()}
    return out


def load_replacements(
    replacements: Mapping[str, Mapping[str, nn.Module]], path: str | os.PathLike
) -> dict[str, dict[str, nn.Module]]:
    """Load what [`save_replacements`][mumoe_tn.distillation.replacement_files.save_replacements] wrote, all or nothing.

    The file is read once, whole, and every tensor parsed from those bytes; every key, shape and
    dtype kind is checked against the modules before any weight is copied, so a file that does
    not fit, is truncated, or changes while it is read leaves every module unchanged.

    Parameters
    ----------
    replacements : Mapping
        ``block name -> method -> module`` built as the saved ones were (the same factories).
    path : str or PathLike

    Returns
    -------
    dict
        The same modules, holding the saved weights, in eval mode.

    Raises
    ------
    ValueError
        A file that is not saved replacements, or a key or shape that differs (named).
    """
    _expected(replacements)  # the argument's types, before the file is read
    path = regular_file(Path(path), "replacements file")
    tensors, _, _ = read_replacements(read_once(path, "replacements file"))
    return fill_replacements(replacements, tensors, str(path))
