"""Reading a model's logits out of whatever its forward returns, and decoding token ids to text."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["decoder", "logits_of"]


def logits_of(output: object) -> torch.Tensor:
    """The logits of a model's output: a tensor, an object with ``.logits`` (Hugging Face) or ``{"logits": …}``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"the model returned {type(output).__name__}, not logits: pass forward=lambda model, x: ... returning them"
    )


def decoder(vocabulary: Sequence[str] | Callable[[int], str] | None) -> Callable[[int], str]:
    """``id -> text`` from a vocabulary list, a callable (e.g. a tokenizer's ``decode``) or None (``"⟨id⟩"``)."""
    if vocabulary is None:
        return lambda token: f"⟨{token}⟩"
    if callable(vocabulary):
        return lambda token: str(vocabulary(token))
    if isinstance(vocabulary, (str, bytes)) or not isinstance(vocabulary, Sequence):
        raise TypeError(f"vocabulary must be a sequence of strings or a callable, got {type(vocabulary).__name__}")
    entries = list(vocabulary)

    def look_up(token: int) -> str:
        return str(entries[token]) if 0 <= token < len(entries) else f"⟨{token}⟩"

    return look_up
