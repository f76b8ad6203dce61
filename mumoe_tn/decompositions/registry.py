"""The registry of named decomposition formats (see [`Format`][mumoe_tn.decompositions.format.Format]).

A format registers itself when its class is defined with a ``name=`` keyword;
[`register`][mumoe_tn.decompositions.registry.register] does the same for an instance. Names are case-insensitive and
unique. This is the only place that maps a name to a format: every tool asks a network's `format` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mumoe_tn.network import ExpertNetwork
from mumoe_tn.registry import Registry
from mumoe_tn.validation import check_size

if TYPE_CHECKING:
    from mumoe_tn.decompositions.format import Format

__all__ = ["FORMATS", "available", "build", "get_format", "normalise_ranks", "register", "unregister"]


def _is_format(value: object) -> bool:
    """Whether ``value`` is a format: what [`Format`][mumoe_tn.decompositions.format.Format] instances provide.

    Checked by its interface, so the registry never imports the format module (formats use the
    registry, not the reverse).
    """
    return (
        not isinstance(value, type)
        and isinstance(getattr(value, "name", None), str)
        and all(callable(getattr(value, method, None)) for method in ("build", "check", "matched_bonds"))
    )


def _check_entry(name: str, format: object) -> None:
    if not _is_format(format):
        raise TypeError(f"register() takes a Format instance, got {type(format).__name__}")
    if not name or name != getattr(format, "name", "").lower():
        raise ValueError(f"a format is registered under its own non-empty name, got {name!r} for {format!r}")


#: The registered formats by lower-cased name (a [`Registry`][mumoe_tn.registry.Registry]).
FORMATS: Registry[str, Format] = Registry("format", normalise=lambda name: name.lower(), check=_check_entry)


def register(format: Format, *, replace: bool = False) -> Format:
    """Register a format instance under its ``name`` (lower-cased).

    Subclassing ``Format`` with ``name=`` calls this for you.

    Parameters
    ----------
    format : Format
        The format.
    replace : bool, optional
        Replace a format already registered under that name (default: raise).

    Returns
    -------
    Format
        ``format``, for chaining.

    Raises
    ------
    ValueError
        If the name is taken and ``replace`` is False.
    """
    if not _is_format(format):
        raise TypeError(f"register() takes a Format instance, got {type(format).__name__}")
    if not format.name:
        raise ValueError("a format needs a non-empty name")
    known = FORMATS.get(format.name)
    if known is not None and known is not format and not replace:
        raise ValueError(f"a format named {format.name.lower()!r} is already registered ({known!r}); pass replace=True")
    return FORMATS.register(format.name, format, replace=True)


def unregister(name: str) -> None:
    """Remove the format registered under ``name`` (e.g. at the end of a test)."""
    FORMATS.unregister(get_format(name).name)


def available() -> list[str]:
    """Sorted names of the registered formats."""
    return FORMATS.names()


def get_format(name: str) -> Format:
    """The format registered under ``name`` (case-insensitive).

    Raises
    ------
    TypeError
        If ``name`` is not a string.
    ValueError
        If no format has that name; the message lists the registered ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"a decomposition name must be a string, got {name!r} ({type(name).__name__})")
    found = FORMATS.get(name)
    if found is None:
        raise ValueError(f"unknown decomposition {name!r}; registered: {available()}")
    return found


def build(
    name: str | Format,
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
    **options: Any,
) -> ExpertNetwork:
    """Build a registered format's [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork].

    Parameters
    ----------
    name : str or Format
        A registered name (``"cp"``, ``"tr"``, ``"tt"``, ``"tucker"``, …) or a format.
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        One int, or one rank per bond (see each format).
    **options
        Format-specific options (e.g. ``expert_rank`` for TR).

    Returns
    -------
    ExpertNetwork
    """
    format = name if _is_format(name) else get_format(name)
    return format.build(expert_dims, in_features, out_features, rank, **options)


def normalise_ranks(decomposition: str, rank: int | Sequence[int], count: int) -> tuple[int, ...]:
    """Return ``count`` ranks from one int or a sequence of exactly ``count`` ints.

    Parameters
    ----------
    decomposition : str
        Name used in error messages.
    rank : int or Sequence[int]
        One rank for all bonds, or one per bond.
    count : int
        Number of bonds.

    Returns
    -------
    tuple of int
    """
    if isinstance(rank, int) and not isinstance(rank, bool):
        rank = (rank,) * count
    elif isinstance(rank, str) or not isinstance(rank, Sequence):
        raise TypeError(f"{decomposition} rank must be an int or a sequence of {count} ints, got {rank!r}")
    if len(rank) != count:
        raise ValueError(f"{decomposition} needs {count} ranks (one per bond), got {len(rank)}: {tuple(rank)}")
    return tuple(check_size(f"{decomposition} rank[{k}]", r) for k, r in enumerate(rank))
