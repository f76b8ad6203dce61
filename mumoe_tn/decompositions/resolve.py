"""Turn whatever a user passes as a decomposition into an `ExpertNetwork` (torch-free).

Accepted everywhere a decomposition is asked for (layers, cost tables, conversion, the CLI):
a registered name (``"cp"``), a [`Format`][mumoe_tn.decompositions.format.Format], a spec string
(``"A: n1 a b, B: a i c, C: b c o"``), a ready [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork], or a builder
``(expert_dims, in_features, out_features, rank, **options) -> ExpertNetwork``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mumoe_tn.decompositions.format import Format
from mumoe_tn.decompositions.registry import available, get_format
from mumoe_tn.network import ExpertNetwork, expert_leg, normalize_expert_dims
from mumoe_tn.validation import check_size

__all__ = ["Decomposition", "Rank", "is_spec", "resolve_network"]

#: Anything that names or describes an expert network.
Decomposition = str | Format | ExpertNetwork | Callable[..., ExpertNetwork]
#: Ranks: one int, one per bond, or bond -> size (spec strings).
Rank = int | Sequence[int] | Mapping[str, int]


def is_spec(text: str) -> bool:
    """Whether ``text`` is a spec string rather than a format name (it has cores or labels to split)."""
    return isinstance(text, str) and text.lower() not in available() and any(c in text for c in ", :")


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
    dims = normalize_expert_dims(expert_dims)
    if rank is None:
        raise TypeError(f"rank is required for decomposition {_describe(decomposition)} (or give match=)")
    if isinstance(decomposition, Format):
        return decomposition.build(dims, in_features, out_features, rank, **options)
    if isinstance(decomposition, str):
        if is_spec(decomposition):
            if options:
                raise TypeError(f"a spec string takes no builder options, got {sorted(options)}")
            return ExpertNetwork.from_spec(
                decomposition, expert_dims=dims, in_features=in_features, out_features=out_features, ranks=rank
            )
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


def _describe(decomposition: object) -> str:
    return repr(decomposition) if isinstance(decomposition, str) else type(decomposition).__name__


def _fit_network(
    network: ExpertNetwork,
    expert_dims: int | Sequence[int] | None,
    in_features: int,
    out_features: int,
    resize: bool,
) -> ExpertNetwork:
    dims = network.expert_dims if expert_dims is None else normalize_expert_dims(expert_dims)
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
