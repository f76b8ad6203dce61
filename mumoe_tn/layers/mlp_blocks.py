"""Which block class builds an MLP block of a format: the registry of MLP block kinds.

A format names the kind of block an MLP becomes with its
[`mlp_block`][mumoe_tn.decompositions.format.Format] key; this registry maps the key to the block's
builder, so every tool that builds a block (conversion, replay of a checkpoint, distillation)
asks [`mlp_block_for`][mumoe_tn.layers.mlp_blocks.mlp_block_for] and never tests a format's name.
The key is resolved here, above the torch-free formats, so ``decompositions`` never names a
torch class. Two kinds are registered:

- ``"mumoe"``: [`mumoe_mlp`][mumoe_tn.layers.mlp_blocks.mumoe_mlp], every layer factorized
  ([`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP], or [`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP] for a
  gated block);
- ``"decoders"``: [`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders], a dense encoder and a
  factorized decoder.

A format with a block of its own registers a builder under its key with
[`register_mlp_block`][mumoe_tn.layers.mlp_blocks.register_mlp_block].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from mumoe_tn.decompositions.resolve import Decomposition, format_of
from mumoe_tn.layers.decoders import MixtureOfDecoders
from mumoe_tn.layers.mlp import MuMoEGatedMLP, MuMoEMLP
from mumoe_tn.registry import Registry

__all__ = [
    "MLP_BLOCKS",
    "MLPBlockKind",
    "mlp_block_for",
    "mumoe_mlp",
    "register_mlp_block",
    "registered_mlp_blocks",
    "unregister_mlp_block",
]

#: The kind of block a network without a format (a custom network or builder) becomes.
DEFAULT_KIND = "mumoe"


@dataclass(frozen=True)
class MLPBlockKind:
    """How an MLP block of a format is built.

    Attributes
    ----------
    key : str
        The registered key (a format's ``mlp_block``).
    build : Callable
        ``build(in_features, hidden_features, out_features, expert_dims, decomposition, *, gated, **options)``
        returns the block (``rank=``/``match=`` and the layer options pass through ``options``).
    dense_encoder : bool
        The block keeps its encoder dense and upcycling copies it, so an upcycled block keeps the
        MLP's hidden width.
    """

    key: str
    build: Callable[..., nn.Module]
    dense_encoder: bool = False


#: The registered MLP block kinds, by key.
MLP_BLOCKS: Registry[str, MLPBlockKind] = Registry("MLP block kind")


def register_mlp_block(
    key: str, build: Callable[..., nn.Module], *, dense_encoder: bool = False, replace: bool = False
) -> MLPBlockKind:
    """Register the builder of an MLP block kind under ``key`` (what a format's ``mlp_block`` names).

    Parameters
    ----------
    key : str
        The key.
    build : Callable
        See [`MLPBlockKind`][mumoe_tn.layers.mlp_blocks.MLPBlockKind].
    dense_encoder : bool, optional
        Whether the block's encoder stays dense (upcycling copies it).
    replace : bool, optional
        Replace the block kind already registered under ``key`` (default: raise).

    Returns
    -------
    MLPBlockKind

    Raises
    ------
    ValueError
        If ``key`` is not a non-empty string, or is taken and ``replace`` is False.
    TypeError
        If ``build`` is not callable.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"an MLP block kind needs a non-empty string key, got {key!r}")
    if not callable(build):
        raise TypeError(f"build must be callable, got {build!r}")
    return MLP_BLOCKS.register(key, MLPBlockKind(key, build, dense_encoder=bool(dense_encoder)), replace=replace)


def unregister_mlp_block(key: str) -> None:
    """Remove the MLP block kind registered under ``key`` (e.g. at the end of a test)."""
    MLP_BLOCKS.unregister(key)


def registered_mlp_blocks() -> list[str]:
    """Sorted keys of the registered MLP block kinds."""
    return MLP_BLOCKS.names()


def mlp_block_for(decomposition: Decomposition) -> MLPBlockKind:
    """The kind of block an MLP becomes with ``decomposition`` (its format's ``mlp_block``; the default without one).

    Raises
    ------
    ValueError
        If the format names a kind that is not registered.
    """
    fmt = format_of(decomposition)
    key = DEFAULT_KIND if fmt is None else fmt.mlp_block
    kind = MLP_BLOCKS.get(key)
    if kind is None:
        raise ValueError(
            f"the format {fmt.name!r} builds MLP blocks of the kind {key!r}, which is not registered: register its "
            f"builder with mumoe_tn.layers.mlp_blocks.register_mlp_block (registered: {registered_mlp_blocks()})"
        )
    return kind


def mumoe_mlp(
    in_features: int,
    hidden_features: int,
    out_features: int,
    expert_dims: int | Sequence[int],
    decomposition: Decomposition,
    *,
    gated: bool = False,
    **options: Any,
) -> nn.Module:
    """A block with every layer factorized.

    [`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP] when ``gated``, [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP]
    otherwise; the other arguments are theirs.
    """
    cls = MuMoEGatedMLP if gated else MuMoEMLP
    return cls(in_features, hidden_features, out_features, expert_dims, decomposition, **options)


register_mlp_block("mumoe", mumoe_mlp)
register_mlp_block("decoders", MixtureOfDecoders, dense_encoder=True)
