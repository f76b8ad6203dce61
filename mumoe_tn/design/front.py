"""Pareto fronts of points with objectives to minimise (torch-free)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["dominates", "pareto_front"]

T = TypeVar("T")


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether ``a`` is at least as good as ``b`` in every objective and better in one (all minimised).

    Examples
    --------
    >>> dominates((1, 2), (1, 3)), dominates((1, 3), (1, 3)), dominates((0, 4), (1, 3))
    (True, False, False)
    """
    return all(x <= y for x, y in zip(a, b, strict=True)) and any(x < y for x, y in zip(a, b, strict=True))


def pareto_front(items: Sequence[T], objectives: Callable[[T], Sequence[float]]) -> list[T]:
    """The items no other item dominates, in their given order.

    Items with equal objectives are all kept (neither dominates the other).

    Parameters
    ----------
    items : Sequence
        Candidates.
    objectives : Callable
        ``item -> (f_1, …, f_k)``, every one minimised (negate what should be maximised).

    Returns
    -------
    list
    """
    values = [tuple(objectives(item)) for item in items]
    order = sorted(range(len(items)), key=lambda k: values[k])
    front: list[int] = []
    for k in order:  # lexicographic order: no later item dominates an earlier one
        if not any(dominates(values[j], values[k]) for j in front):
            front.append(k)
    return [items[k] for k in sorted(front)]
