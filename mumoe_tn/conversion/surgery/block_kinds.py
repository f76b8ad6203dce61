"""The kinds of module conversion replaces — a linear layer, a plain, gated or split MLP block — as registered objects.

A [`BlockKind`][mumoe_tn.conversion.surgery.block_kinds.BlockKind] says what the tools that build, record,
replay and distil a replacement need to know of it: whether it is an MLP block, whether it is gated,
whether it spans two sibling modules, and the roles of its layers. The tools ask these attributes
and never compare a kind with a string. A kind is its name as well (a ``str``): the name is its key
in [`BLOCK_KINDS`][mumoe_tn.conversion.surgery.block_kinds.BLOCK_KINDS], what a conversion record saves
and what reports print, and a kind equals its name (``parts.kind == "gated"``).

Not to be confused with the MLP block kinds of formats
([`mumoe_tn.layers.mlp_blocks`][mumoe_tn.layers.mlp_blocks]: which μMoE block an MLP becomes);
a kind here is what the replaced module was.
"""

from __future__ import annotations

from typing import Any

from mumoe_tn.registry import Registry

__all__ = ["BLOCK_KINDS", "GATED", "LINEAR", "MLP", "SPLIT", "BlockKind", "block_kind"]


class BlockKind(str):
    """A kind of replaced module: its name, and what a tool needs to know of it.

    Attributes
    ----------
    name : str
        The name (the registry key, what records save).
    roles : tuple of str
        The roles of its linear layers, in the block's order (``"layer"``; ``"up"``, ``"down"``;
        ``"gate"``, ``"up"``, ``"down"``).
    mlp : bool
        An MLP block (the default when made); False: a single linear layer.
    gated : bool
        A gated block ``down(act(gate(z)) ⊙ up(z))``.
    split : bool
        A block split across two sibling modules (BERT's ``intermediate`` and ``output``).
    """

    roles: tuple[str, ...]
    mlp: bool
    gated: bool
    split: bool

    def __new__(
        cls, name: str, roles: tuple[str, ...], *, mlp: bool = True, gated: bool = False, split: bool = False
    ) -> BlockKind:
        kind = super().__new__(cls, name)
        kind.roles, kind.mlp, kind.gated, kind.split = tuple(roles), mlp, gated, split
        return kind

    @property
    def name(self) -> str:
        """The kind's name, as a plain string."""
        return str.__str__(self)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return block_kind, (self.name,)


#: A single linear layer.
LINEAR = BlockKind("linear", ("layer",), mlp=False)
#: A plain two-layer MLP block ``down(act(up(z)))``.
MLP = BlockKind("mlp", ("up", "down"))
#: A gated (SwiGLU/GeGLU) MLP block ``down(act(gate(z)) ⊙ up(z))``.
GATED = BlockKind("gated", ("gate", "up", "down"), gated=True)
#: A BERT-style MLP block split across two sibling modules.
SPLIT = BlockKind("split", ("up", "down"), split=True)

BLOCK_KINDS: Registry[str, BlockKind] = Registry(
    "replaced block kind", entries={**{kind.name: kind for kind in (LINEAR, MLP, GATED, SPLIT)}, "plain": MLP}
)
"""The registered kinds by name (``"plain"`` names the plain MLP block too)."""


def block_kind(kind: str) -> BlockKind:
    """The registered kind named ``kind`` (a kind is returned as it is).

    Raises
    ------
    ValueError
        If no kind is registered under that name.
    """
    if isinstance(kind, BlockKind):
        return kind
    if not isinstance(kind, str):
        raise TypeError(f"a block kind is one of {BLOCK_KINDS.names()}, got {kind!r}")
    return BLOCK_KINDS.lookup(kind)
