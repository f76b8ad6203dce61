"""Registry of named decompositions.

Each name maps to a builder that returns an [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork], and to the closed-form
costs the paper gives (or that are derived here) for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mumoe_tn.network import ExpertNetwork, _check_size

__all__ = [
    "Builder",
    "ClosedForms",
    "available",
    "build",
    "closed_forms",
    "get_builder",
    "normalize_ranks",
    "register",
]


class Builder(Protocol):
    """Signature shared by every decomposition builder."""

    def __call__(
        self,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        rank: int | Sequence[int],
    ) -> ExpertNetwork:
        """Build the network for the given expert dims, leg sizes and ranks."""
        ...


@dataclass(frozen=True)
class ClosedForms:
    """Closed-form costs of a named decomposition, as functions of one of its networks.

    Every count is per input vector (one token) and in fused multiply-adds (1 FMA = 1 FLOP,
    the paper's convention); gating is not included.

    Attributes
    ----------
    fma : Callable[[ExpertNetwork], int]
        The formula as the paper states it (Table decomp-tradeoff and the hierarchical
        derivations), or as derived here where the paper gives none.
    hand_fma : Callable[[ExpertNetwork], int]
        The exact FMAs of the hand-derived contraction order, lower-order terms included;
        ``hand_fma - fma`` is what the stated formula omits.
    rank_bound : Callable[[ExpertNetwork], int]
        Upper bound on the rank of every expert matrix.
    matched_bonds : Callable[[ExpertNetwork], tuple[str, ...]] or None
        Bonds that parameter matching scales by default, or None when the caller must name
        them.
    """

    fma: Callable[[ExpertNetwork], int]
    hand_fma: Callable[[ExpertNetwork], int]
    rank_bound: Callable[[ExpertNetwork], int]
    matched_bonds: Callable[[ExpertNetwork], tuple[str, ...]] | None = None


_BUILDERS: dict[str, Builder] = {}
_CLOSED_FORMS: dict[str, ClosedForms] = {}


def register(name: str, closed: ClosedForms | None = None) -> Callable[[Builder], Builder]:
    """Register a decomposition builder under ``name`` (case-insensitive).

    Parameters
    ----------
    name : str
        The name users pass as ``decomposition=`` (stored lower-case).
    closed : ClosedForms, optional
        Its closed-form costs, if known.

    Returns
    -------
    Callable
        A decorator that registers and returns the builder unchanged.

    Raises
    ------
    ValueError
        If the name is already registered.
    """
    key = name.lower()

    def decorator(builder: Builder) -> Builder:
        if key in _BUILDERS:
            raise ValueError(f"a decomposition named {key!r} is already registered")
        _BUILDERS[key] = builder
        if closed is not None:
            _CLOSED_FORMS[key] = closed
        return builder

    return decorator


def closed_forms(network: ExpertNetwork) -> ClosedForms | None:
    """The closed forms registered for ``network.name``, or None (custom networks)."""
    return _CLOSED_FORMS.get(network.name.lower())


def available() -> list[str]:
    """Sorted names of the registered decompositions."""
    return sorted(_BUILDERS)


def get_builder(name: str) -> Builder:
    """Return the builder registered under ``name``.

    Raises
    ------
    ValueError
        If no decomposition has that name; the message lists the registered ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"decomposition name must be a string, got {type(name).__name__}")
    try:
        return _BUILDERS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown decomposition {name!r}; registered: {available()}") from None


def build(
    name: str,
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
    **options: object,
) -> ExpertNetwork:
    """Build the named decomposition's [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork].

    Parameters
    ----------
    name : str
        A registered name (``"cp"``, ``"tr"``, ``"tt"``, ``"tucker"``, …).
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        One int, or one rank per bond (see each builder).
    **options
        Builder-specific options (e.g. ``expert_rank`` for TR).

    Returns
    -------
    ExpertNetwork
    """
    return get_builder(name)(expert_dims, in_features, out_features, rank, **options)


def normalize_ranks(decomposition: str, rank: int | Sequence[int], count: int) -> tuple[int, ...]:
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
    return tuple(_check_size(f"{decomposition} rank[{k}]", r) for k, r in enumerate(rank))
