"""Checks and resolution of the arguments every μMoE layer shares (network, ranks, matching, factory)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mumoe_tn.costs.matching import match_exact, resolve_target
from mumoe_tn.decompositions.resolve import Decomposition, Rank
from mumoe_tn.decompositions.resolve import resolve_network as resolve_decomposition
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.validation import check_bool, check_size

__all__ = [
    "EXACT",
    "Match",
    "block_networks",
    "check_allocatable",
    "check_factory",
    "check_match_only_options",
    "match_target",
    "resolve_network",
    "split_rank_and_match",
]

#: What ``match=`` accepts: a target name, a number of parameters, or a fraction of the replaced layer's.
Match = str | int | float | None

#: ``rank=EXACT``: the smallest ranks at which every expert can equal any matrix of the layer (see
#: [`mumoe_tn.costs.match_exact`][mumoe_tn.costs.matching.match_exact]), the ranks that make upcycling exact.
EXACT = "exact"


def resolve_network(
    decomposition: Decomposition,
    expert_dims: int | Sequence[int] | None,
    in_features: int,
    out_features: int,
    rank: Rank | None,
    *,
    bias: bool = True,
    options: Mapping[str, Any] | None = None,
    resize: bool = False,
) -> ExpertNetwork:
    """The expert network of a layer ``in_features -> out_features`` (leg ``i`` = in + bias).

    Parameters
    ----------
    decomposition : str or Format or ExpertNetwork or Callable
        A registered name, a [`Format`][mumoe_tn.decompositions.format.Format], a spec string
        (``"n1 a b, a i c, b c o"``), a ready network whose legs must match, or a builder
        ``(expert_dims, i, o, rank, **options)``; see
        [`mumoe_tn.decompositions.resolve_network`][mumoe_tn.decompositions.resolve.resolve_network].
    expert_dims : int or Sequence[int] or None
        Expert mode sizes (optional with a ready network, where they must match).
    in_features, out_features : int
        The layer's sizes.
    rank : int or Sequence[int] or Mapping[str, int] or None
        The decomposition's ranks.
    bias : bool, optional
        Whether leg ``i`` has a folded bias column.
    options : Mapping[str, Any], optional
        Extra format or builder options.
    resize : bool, optional
        Give a ready network this layer's leg sizes instead of requiring them.

    Returns
    -------
    ExpertNetwork
    """
    for what, size in (("in_features", in_features), ("out_features", out_features)):
        check_size(what, size)
        if size >= _MAX_FEATURES:
            raise ValueError(f"{what}={size} is too large for a layer (at most {_MAX_FEATURES - 1:,})")
    check_bool("bias", bias)
    width = in_features + int(bias)
    return resolve_decomposition(decomposition, expert_dims, width, out_features, rank, options=options, resize=resize)


def split_rank_and_match(rank: object, match: object, layer: str) -> tuple[object, object]:
    """Separate ``rank=`` from ``match=``; the old ``rank="linear"/"mlp"`` still works, with a warning.

    Parameters
    ----------
    rank, match : object
        The layer's ``rank=`` and ``match=`` arguments.
    layer : str
        The layer's name, for messages.

    Returns
    -------
    tuple
        ``(rank, match)``.
    """
    if rank == EXACT:
        if match is not None:
            raise ValueError(f"{layer}: rank='exact' chooses the ranks; give it without match={match!r}")
        return None, EXACT
    if isinstance(rank, str):
        if rank not in ("linear", "mlp", "match"):
            raise ValueError(
                f"rank must be ranks (int, sequence or mapping) or 'exact', got the string {rank!r}; "
                "use match= to match parameters"
            )
        warnings.warn(
            f"rank={rank!r} is deprecated: pass match={rank!r} (rank= now only takes ranks)",
            DeprecationWarning,
            stacklevel=3,
        )
        if match is not None:
            raise ValueError(f"{layer}: give match= once (rank={rank!r} is its deprecated spelling)")
        return None, rank
    return rank, match


def match_target(match: object, reference: int, allowed: str, layer: str) -> int:
    """The parameter budget of ``match=`` for a layer whose natural reference is ``allowed``.

    Parameters
    ----------
    match : str or int or float
        ``allowed`` (or ``"match"``): the reference; an int: a budget; a float: a fraction.
    reference : int
        Parameters of what the layer replaces.
    allowed : str
        The target name this layer accepts (``"linear"`` or ``"mlp"``).
    layer : str
        The layer's name, for messages.

    Returns
    -------
    int
    """
    if isinstance(match, str):
        if match in (allowed, "match"):
            return reference
        raise ValueError(
            f"{layer}: match={match!r} is not a target here; use {allowed!r}, a number of parameters (int) or a "
            "fraction of the replaced layer's parameters (float)"
        )
    return resolve_target(match, reference)


def check_factory(device: object, dtype: object) -> dict[str, Any]:
    """Validate ``device=``/``dtype=`` factory arguments before they reach torch.

    Parameters
    ----------
    device : torch.device or str or int or None
        Where the parameters live.
    dtype : torch.dtype or None
        A floating-point dtype.

    Returns
    -------
    dict
        ``{"device": …, "dtype": …}`` for the factory calls.
    """
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype such as torch.float32, got {dtype!r}")
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise TypeError(
                f"device must be a torch.device, a string such as 'cpu' or 'cuda:0', or None, got {device!r}"
            )
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise ValueError(f"unknown device {device!r}; use e.g. 'cpu', 'cuda', 'cuda:1' or 'mps'") from None
        if parsed.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} asks for CUDA, but torch.cuda.is_available() is False here")
        if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: there are only {torch.cuda.device_count()} CUDA device(s)")
    return {"device": device, "dtype": dtype}


def check_allocatable(network: ExpertNetwork) -> None:
    """Raise ``ValueError`` if a core of ``network`` has more elements than a tensor can index."""
    for core, count in network.core_params.items():
        if count >= _MAX_ELEMENTS:
            raise ValueError(
                f"core {core!r} of shape {network.core_shape(core)} has {count:.3g} elements, more than a tensor "
                f"can hold (2**63); lower the sizes or ranks"
            )


_MAX_ELEMENTS = 1 << 63
_MAX_FEATURES = 1 << 40


def check_match_only_options(match_bonds: Sequence[str] | None, rank_multiple: object) -> None:
    """Reject the options that only parameter matching reads when ``match=`` is not given.

    Parameters
    ----------
    match_bonds : Sequence of str or None
        The layer's ``match_bonds=``.
    rank_multiple : object
        The layer's ``rank_multiple=`` (1 is the default).
    """
    if match_bonds is not None:
        raise ValueError("match_bonds= names the bonds match= scales; give match= too")
    if check_size("rank_multiple", rank_multiple) != 1:
        raise ValueError(f"rank_multiple={rank_multiple} rounds the ranks match= chooses; give match= too")


def block_networks(
    decomposition: Decomposition,
    expert_dims: int | Sequence[int] | None,
    sizes: tuple[int, int, int],
    rank: Rank | None,
    match: object,
    match_bonds: Sequence[str] | None,
    rank_multiple: int,
    *,
    bias: bool,
    options: Mapping[str, Any],
    layer: str,
    matcher: Any,
) -> tuple[ExpertNetwork, ExpertNetwork]:
    """The two networks ``I → H`` and ``H → O`` of a block, parameter-matched when asked.

    Parameters
    ----------
    decomposition, expert_dims, rank, match, match_bonds, rank_multiple
        The block's arguments (see [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP]).
    sizes : tuple of int
        ``(in_features, hidden_features, out_features)``.
    bias : bool
        Whether every layer folds a bias into its input leg.
    options : Mapping[str, Any]
        Format or builder options.
    layer : str
        The block's name, for messages.
    matcher : Callable
        ``(first, second, match, match_bonds) -> (first, second)``: the block's own matching,
        called only when ``match`` is given.

    Returns
    -------
    tuple of ExpertNetwork
    """
    in_features, hidden_features, out_features = sizes
    check_size("hidden_features", hidden_features)
    rank, match = split_rank_and_match(rank, match, layer)
    build_rank = 1 if match is not None and rank is None else rank
    shared = {"bias": bias, "options": options, "resize": True}
    first = resolve_network(decomposition, expert_dims, in_features, hidden_features, build_rank, **shared)
    second = resolve_network(decomposition, expert_dims, hidden_features, out_features, build_rank, **shared)
    if match == EXACT:
        first, second = match_exact((first, second), bonds=match_bonds, multiple=rank_multiple)[1]
    elif match is not None:
        first, second = matcher(first, second, match, match_bonds)
    else:
        check_match_only_options(match_bonds, rank_multiple)
    check_allocatable(first)
    check_allocatable(second)
    return first, second
