"""Progress bars of the analysis passes over a dataset (tqdm, on stderr)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

__all__ = ["progress"]

T = TypeVar("T")


def progress(iterable: Iterable[T], description: str, *, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """``iterable`` wrapped in a tqdm bar named ``description`` (cleared when done), or as is.

    ``total`` defaults to ``len(iterable)`` where it has one (a DataLoader, a list).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"progress must be a bool, got {enabled!r}")
    if not enabled:
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with tqdm(iterable, desc=description, total=total, leave=False, mininterval=0.5, dynamic_ncols=True) as bar:
        yield from bar
