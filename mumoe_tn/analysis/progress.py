"""Progress bars of the analysis passes over a dataset (tqdm, on stderr).

``progress=None`` (every analysis function's default) shows a bar where stderr is a terminal
and stays silent in pipes, logs and test runs; ``True`` always shows one, ``False`` never.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

__all__ = ["check_progress", "progress"]

T = TypeVar("T")


def check_progress(value: object) -> bool | None:
    """``value`` as a progress setting: True, False or None (TypeError otherwise)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"progress must be True, False or None (on a terminal only), got {value!r}")
    return value


def progress(
    iterable: Iterable[T], description: str, *, enabled: bool | None = None, total: int | None = None
) -> Iterator[T]:
    """``iterable`` wrapped in a tqdm bar named ``description`` (cleared when done), or as is.

    ``enabled=None`` shows the bar only where stderr is a terminal. ``total`` defaults to
    ``len(iterable)`` where it has one (a DataLoader, a list).
    """
    check_progress(enabled)
    if enabled is False:
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    bar = tqdm(
        iterable, desc=description, total=total, leave=False, mininterval=0.5, dynamic_ncols=True,
        disable=None if enabled is None else False,
    )  # fmt: skip
    with bar:
        yield from bar
