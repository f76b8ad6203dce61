"""Turn whatever a user passes as a decomposition into an `ExpertNetwork` (torch-free).

Accepted everywhere a decomposition is asked for (layers, cost tables, conversion, the CLI):
a registered name (``"cp"``), a [`Format`][mumoe_tn.decompositions.format.Format], a spec string
(``"A: n1 a b, B: a i c, C: b c o"``, optionally named: ``"mine=A: n1 a b, B: a i c, C: b c o"``),
a ready [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork], or a builder
``(expert_dims, in_features, out_features, rank, **options) -> ExpertNetwork``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mumoe_tn.decompositions.format import Format
from mumoe_tn.decompositions.registry import available, get_format
from mumoe_tn.network import ExpertNetwork, expert_leg, normalise_expert_dims
from mumoe_tn.validation import check_size

__all__ = ["Decomposition", "Rank", "format_of", "is_spec", "resolve_network", "spec_ranks", "split_spec_name"]

#: Anything that names or describes an expert network.
Decomposition = str | Format | ExpertNetwork | Callable[..., ExpertNetwork]
#: Ranks: one int, one per bond, or bond -> size (spec strings).
Rank = int | Sequence[int] | Mapping[str, int]


#: ``NAME=`` in front of a spec string: the network's (and a cost table row's) name.
_SPEC_NAME = re.compile(r"\s*([A-Za-z0-9_][A-Za-z0-9_.+\-]*)\s*=(.*)\Z", re.DOTALL)


def is_spec(text: str) -> bool:
    """Whether ``text`` is a spec string rather than a format name (it has cores or labels to split)."""
    return isinstance(text, str) and text.lower() not in available() and any(c in text for c in ", :=")


def split_spec_name(spec: str) -> tuple[str | None, str]:
    """Split ``"NAME=SPEC"`` into ``(NAME, SPEC)``; a spec without a name gives ``(None, spec)``.

    Examples
    --------
    >>> split_spec_name("mine=A: n1 a b, B: a i c, C: b c o")
    ('mine', 'A: n1 a b, B: a i c, C: b c o')
    >>> split_spec_name("n1 r, i r, r o")
    (None, 'n1 r, i r, r o')
    """
    if "=" not in spec:
        return None, spec
    found = _SPEC_NAME.match(spec)
    if found is None:
        raise ValueError(
            f"a named spec is NAME=SPEC with a NAME of letters, digits and _ . + - (such as "
            f"'mine=n1 a b, a i c, b c o'), got {spec!r}"
        )
    return found.group(1), found.group(2).strip()


def spec_ranks(bonds: Sequence[str], rank: Rank, name: str, *, every: bool = True) -> dict[str, int]:
    """Bond sizes from one rank, one rank per bond (in the order of ``bonds``), or ``{bond: size}``.

    Parameters
    ----------
    bonds : Sequence[str]
        The network's bonds, in order of first appearance in its spec.
    rank : int or Sequence[int] or Mapping[str, int]
        One size for every bond, a size per bond in order, or every bond by name.
    name : str
        The network's name, for error messages.
    every : bool, optional
        Whether ``{bond: size}`` must name every bond (False: a network that already has sizes
        changes only the named ones).

    Returns
    -------
    dict of str to int
    """
    if isinstance(rank, Mapping):
        unknown = [bond for bond in rank if bond not in bonds]
        missing = [bond for bond in bonds if bond not in rank] if every else []
        if unknown or missing:
            problem = f"names no bond {unknown}" if unknown else f"leaves out {missing}"
            raise ValueError(
                f"ranks for {name!r} by bond {dict(rank)} {problem}; name every bond of {list(bonds)}, give one "
                f"rank for all, or {len(bonds)} in that order"
            )
        return {bond: check_size(f"{name} rank of bond {bond!r}", rank[bond]) for bond in bonds if bond in rank}
    if isinstance(rank, int) and not isinstance(rank, bool):
        return {bond: check_size(f"{name} rank", rank) for bond in bonds}
    if isinstance(rank, str) or not isinstance(rank, Sequence):
        raise TypeError(
            f"ranks for {name!r} must be one int, {len(bonds)} ints (bonds {list(bonds)} in order) or "
            f"{{bond: size}}, got {rank!r}"
        )
    if len(rank) != len(bonds):
        raise ValueError(
            f"{name!r} has {len(bonds)} bonds {list(bonds)}, so it takes one rank or {len(bonds)} in that order "
            f"(or bond=size pairs), got {len(rank)}: {tuple(rank)}"
        )
    return {bond: check_size(f"{name} rank of bond {bond!r}", size) for bond, size in zip(bonds, rank, strict=True)}


def resolve_network(
    decomposition: Decomposition,
    expert_dims: int | Sequence[int] | None,
    in_features: int,
    out_features: int,
    rank: Rank | None,
    *,
    options: Mapping[str, Any] | None = None,
    resize: bool = False,
) -> ExpertNetwork:
    """The network of ``decomposition`` with legs ``i = in_features`` and ``o = out_features``.

    Parameters
    ----------
    decomposition : str or Format or ExpertNetwork or Callable
        See the module docstring.
    expert_dims : int or Sequence[int] or None
        ``N_1 … N_E`` (optional with a ready network, whose dims must then match unless
        ``resize``).
    in_features, out_features : int
        Sizes of the legs ``i`` (bias column included, if any) and ``o``.
    rank : int or Sequence[int] or Mapping[str, int] or None
        Ranks for names, formats, spec strings and builders; ignored for a ready network.
    options : Mapping[str, Any], optional
        Format or builder options (e.g. ``expert_rank`` for TR).
    resize : bool, optional
        Give a ready network the requested leg sizes (its structure and bonds kept) instead of
        requiring them to match.

    Returns
    -------
    ExpertNetwork
    """
    options = dict(options or {})
    check_size("in_features (leg i)", in_features)
    check_size("out_features (leg o)", out_features)
    if isinstance(decomposition, ExpertNetwork):
        return _fit_network(decomposition, expert_dims, in_features, out_features, resize)
    if expert_dims is None:
        raise TypeError("expert_dims is required unless the decomposition is an ExpertNetwork")
    dims = normalise_expert_dims(expert_dims)
    if rank is None:
        if not _has_no_bond(decomposition, dims, in_features, out_features):
            raise TypeError(f"rank is required for decomposition {_describe(decomposition)} (or give match=)")
        rank = ()
    if isinstance(decomposition, Format):
        return decomposition.build(dims, in_features, out_features, rank, **options)
    if isinstance(decomposition, str):
        if is_spec(decomposition):
            if options:
                raise TypeError(f"a spec string takes no builder options, got {sorted(options)}")
            name, spec = split_spec_name(decomposition)
            shape = ExpertNetwork.from_spec(
                spec, expert_dims=dims, in_features=in_features, out_features=out_features, ranks=1, name=name
            )
            return shape.with_sizes(**spec_ranks(shape.bonds, rank, shape.name))
        return get_format(decomposition).build(dims, in_features, out_features, rank, **options)
    if callable(decomposition):
        network = decomposition(dims, in_features, out_features, rank, **options)
        if not isinstance(network, ExpertNetwork):
            raise TypeError(f"the decomposition builder returned {type(network).__name__}, not an ExpertNetwork")
        return _fit_network(network, dims, in_features, out_features, resize=False)
    raise TypeError(
        "decomposition must be a format name, a Format, a spec string, an ExpertNetwork or a builder, got "
        f"{decomposition!r} ({type(decomposition).__name__})"
    )


def format_of(decomposition: Decomposition) -> Format | None:
    """The registered format a decomposition argument names or carries (None: a custom network or builder).

    Parameters
    ----------
    decomposition : str or Format or ExpertNetwork or Callable
        A format name, a Format, a spec string, a ready network or a builder.

    Returns
    -------
    Format or None
    """
    if isinstance(decomposition, Format):
        return decomposition
    if isinstance(decomposition, ExpertNetwork):
        return decomposition.format
    if isinstance(decomposition, str) and not is_spec(decomposition):
        return get_format(decomposition)
    return None


def _has_no_bond(decomposition: Decomposition, dims: tuple[int, ...], in_features: int, out_features: int) -> bool:
    """Whether a format or spec string builds a network without bonds (one that needs no rank)."""
    if isinstance(decomposition, str) and is_spec(decomposition):
        _, spec = split_spec_name(decomposition)
        try:
            shape = ExpertNetwork.from_spec(
                spec, expert_dims=dims, in_features=in_features, out_features=out_features, ranks=1
            )
        except ValueError:
            return False  # the build proper reports what is wrong with the spec
        return not shape.bonds
    fmt = None if isinstance(decomposition, ExpertNetwork) else format_of(decomposition)
    if fmt is None:
        return False
    try:
        return not fmt.network(dims, in_features, out_features, ()).bonds
    except (TypeError, ValueError):
        return False  # the format wants ranks


def _describe(decomposition: object) -> str:
    return repr(decomposition) if isinstance(decomposition, str) else type(decomposition).__name__


def _fit_network(
    network: ExpertNetwork,
    expert_dims: int | Sequence[int] | None,
    in_features: int,
    out_features: int,
    resize: bool,
) -> ExpertNetwork:
    dims = network.expert_dims if expert_dims is None else normalise_expert_dims(expert_dims)
    if len(dims) != network.n_expert_modes:
        raise ValueError(
            f"expert_dims={dims} has {len(dims)} mode(s) but the network has {network.n_expert_modes} "
            f"({network.expert_legs})"
        )
    wanted = {expert_leg(m): size for m, size in enumerate(dims, start=1)} | {"i": in_features, "o": out_features}
    if all(network.sizes[leg] == size for leg, size in wanted.items()):
        return network
    if resize:
        return network.with_sizes(**wanted)
    have = {leg: network.sizes[leg] for leg in wanted}
    raise ValueError(
        f"the network's legs {have} do not match the requested {wanted} (leg i includes a folded bias column)"
    )
