"""A user's text for distillation: plain UTF-8 files read in a fixed order, and their token ids.

[`text_files`][mumoe_tn.distillation.corpus.text_files] lists the files a path names: a file is
itself; a directory gives its regular files ending ``.txt`` or ``.md`` (any case), in its
subdirectories too, sorted by their path relative to it. Symbolic links to directories are not
followed, and a linked file must lie inside the directory. At most ``max_bytes`` are read in all
(64 MiB by default). [`read_text`][mumoe_tn.distillation.corpus.read_text] joins the files' text
with a blank line; [`encode_text`][mumoe_tn.distillation.corpus.encode_text] turns text into a
1-D tensor of token ids with a tokenizer, or with one token per UTF-8 byte (ids 0–255).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["MAX_TEXT_BYTES", "TEXT_SUFFIXES", "encode_text", "read_text", "text_files"]

MAX_TEXT_BYTES = 64 * 2**20
"""The most bytes of text read by default (64 MiB)."""

TEXT_SUFFIXES = (".txt", ".md")
"""The file name endings (any case) of the text files a directory gives."""


def _paths(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    if isinstance(paths, bytes) or not isinstance(paths, Iterable):
        raise TypeError(f"text paths must be a path or a sequence of paths, got {paths!r:.80}")
    listed = list(paths)
    for path in listed:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"text paths must be str or PathLike, got {path!r:.80}")
    if not listed:
        raise ValueError("no text path given")
    return [Path(path) for path in listed]


def _directory_files(directory: Path) -> list[Path]:
    root = directory.resolve()
    found = []
    for folder, subfolders, names in os.walk(directory):  # does not descend into linked directories
        subfolders.sort()
        for name in names:
            path = Path(folder) / name
            if not name.lower().endswith(TEXT_SUFFIXES):
                continue
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                raise ValueError(f"the text file {str(path)!r} links outside the directory {str(directory)!r}")
            if path.is_file():  # a regular file (or a link to one inside the directory)
                found.append(path)
    return sorted(found, key=lambda path: path.relative_to(directory).parts)


def text_files(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """The text files that ``paths`` name, in reading order (see the module's notes).

    Parameters
    ----------
    paths : path or sequence of paths
        Files and directories, read in the order given.

    Returns
    -------
    list of Path

    Raises
    ------
    ValueError
        A path that does not exist or is neither a regular file nor a directory, a directory
        without text files, or a link out of a directory.
    """
    files = []
    for path in _paths(paths):
        if path.is_dir():
            inside = _directory_files(path)
            if not inside:
                raise ValueError(f"the directory {str(path)!r} holds no text file (names ending {TEXT_SUFFIXES})")
            files.extend(inside)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise ValueError(f"the text path {str(path)!r} is neither a regular file nor a directory")
        else:
            raise ValueError(f"the text path {str(path)!r} does not exist")
    return files


def read_text(paths: str | os.PathLike | Iterable[str | os.PathLike], *, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The text of the files ``paths`` name, joined by blank lines.

    Parameters
    ----------
    paths : path or sequence of paths
        Files and directories (see [`text_files`][mumoe_tn.distillation.corpus.text_files]).
    max_bytes : int, optional
        The most bytes read in all (default ``MAX_TEXT_BYTES``, 64 MiB), checked before reading.

    Returns
    -------
    str

    Raises
    ------
    ValueError
        A path [`text_files`][mumoe_tn.distillation.corpus.text_files] refuses, more than
        ``max_bytes`` bytes, a file that is not UTF-8 (named, with the byte offset), or no text.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    files = text_files(paths)
    total = sum(path.stat().st_size for path in files)
    if total > max_bytes:
        raise ValueError(f"the text files hold {total:,} bytes, more than max_bytes={max_bytes:,}")
    parts = []
    for path in files:
        data = path.read_bytes()
        try:
            parts.append(data.decode("utf-8"))
        except UnicodeDecodeError as error:
            reason = f"{error.reason} at byte {error.start}"
            raise ValueError(f"the text file {str(path)!r} is not UTF-8: {reason}") from None
    text = "\n\n".join(parts)
    if not text.strip():
        raise ValueError(f"the text files {[str(path) for path in files][:5]} hold no text")
    return text


def encode_text(text: str, tokenizer: Any = None, *, vocab_size: int | None = None) -> torch.Tensor:
    """``text`` as a 1-D int64 tensor of token ids.

    Parameters
    ----------
    text : str
    tokenizer : object, optional
        Anything with ``encode(text) -> Sequence[int]`` (a Hugging Face tokenizer); None (default)
        for one token per UTF-8 byte, ids 0–255.
    vocab_size : int, optional
        The model's vocabulary: every id must be below it (bytes need at least 256).

    Returns
    -------
    torch.Tensor

    Raises
    ------
    ValueError
        Byte tokens for a vocabulary under 256, or a token id the vocabulary does not hold.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if tokenizer is None:
        if vocab_size is not None and vocab_size < 256:
            raise ValueError(
                f"byte tokens need a vocabulary of at least 256, the model has {vocab_size}: save the model's "
                "tokenizer beside it"
            )
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must have an encode(text) method, got {type(tokenizer).__name__}")
    ids: Sequence[int] = tokenizer.encode(text)
    tokens = torch.as_tensor(list(ids), dtype=torch.long)
    if tokens.ndim != 1:
        raise ValueError(f"the tokenizer's encode returned ids of shape {tuple(tokens.shape)}, not a flat list")
    if vocab_size is not None and tokens.numel() and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
        raise ValueError(
            f"the tokenizer gives ids from {int(tokens.min())} to {int(tokens.max())}, outside the model's "
            f"vocabulary of {vocab_size}"
        )
    return tokens
