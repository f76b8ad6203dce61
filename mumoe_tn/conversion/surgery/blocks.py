"""Recognise MLP blocks in existing models: plain, gated (SwiGLU/GeGLU), packed-gated, split.

Four shapes are recognised, each read through
[`mumoe_tn.conversion.surgery.adapters`][mumoe_tn.conversion.surgery.adapters] (so
``nn.Linear``,
Hugging Face ``Conv1D`` and any registered layer type count as linear layers):

- **gated**: children named as in a registered [`GatedNames`][mumoe_tn.conversion.surgery.blocks.GatedNames] —
Llama/Mistral/Qwen/Gemma
  ``gate_proj, up_proj, down_proj, act_fn`` and timm ``SwiGLU`` ``fc1_g, fc1_x, fc2, act``;
  computes ``down(act(gate(z)) ⊙ up(z))``.
- **packed gated**: one projection holding both halves — timm ``GluMlp``/``SwiGLUPacked``
  (``fc1`` chunked, ``gate_last`` says which half is gated) and Phi-3 ``gate_up_proj``.
- **split**: Hugging Face BERT-style layers, whose MLP lives in two sibling modules
  ``intermediate`` (``dense`` + activation) and ``output`` (``dense``, then dropout, residual and
  LayerNorm). The μMoE block replaces ``intermediate`` and ``output.dense`` becomes an
  ``nn.Identity``, so ``output`` keeps its residual and LayerNorm.
- **plain**: exactly two linear children chaining ``I → H → O`` and no other child with
  parameters (GPT-2's ``c_fc, act, c_proj``, timm ``Mlp``, ``nn.Sequential`` MLPs). An attention
  block with parameters besides two projections is not one.

A block whose other children hold parameters (e.g. a timm ``Mlp`` with a hidden LayerNorm) is not
recognised: replacing it would drop them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mumoe_tn.conversion.surgery.adapters import LinearView, linear_view
from mumoe_tn.conversion.surgery.block_kinds import GATED, MLP, SPLIT, BlockKind, block_kind
from mumoe_tn.registry import Registry

__all__ = ["GATED_LAYOUTS", "PACKED_GATED_CLASSES", "GatedNames", "MLPParts", "mlp_parts", "register_gated_names"]


@dataclass(frozen=True)
class GatedNames:
    """Child names of a gated MLP block ``down(act(gate(z)) ⊙ up(z))``.

    Parameters
    ----------
    gate, up, down : str
        The three projections (``up`` is None when ``gate`` is packed: its output holds both
        halves).
    activation : str
        The activation applied to the gate projection.
    gate_first : bool, optional
        For a packed projection: the gate is the first half of its outputs (default True).
    """

    gate: str
    up: str | None
    down: str
    activation: str
    gate_first: bool = True


def _check_layout(key: object, names: object) -> None:
    if not isinstance(names, GatedNames):
        raise TypeError(f"names must be a GatedNames, got {type(names).__name__}")


#: Gated MLP layouts recognised by their child names, tried newest first (a
#: [`Registry`][mumoe_tn.registry.Registry] keyed by the layout itself).
GATED_LAYOUTS: Registry[GatedNames, GatedNames] = Registry(
    "gated MLP layout",
    check=_check_layout,
    entries={
        names: names
        for names in (
            GatedNames("gate_up_proj", None, "down_proj", "activation_fn"),  # Phi-3 (packed, gate first)
            GatedNames("fc1_g", "fc1_x", "fc2", "act"),  # timm SwiGLU
            GatedNames("gate_proj", "up_proj", "down_proj", "act_fn"),  # Llama, Mistral, Qwen, Gemma
        )
    },
)
#: Gated layouts of classes of optional libraries, by ``module.qualname``: timm's GluMlp computes
#: ``x1 * act(x2)`` when ``gate_last`` (the default), from chunks of ``fc1``.
PACKED_GATED_CLASSES: Registry[str, GatedNames] = Registry(
    "packed gated MLP class",
    check=_check_layout,
    entries={"timm.layers.mlp.GluMlp": GatedNames("fc1", None, "fc2", "act", gate_first=False)},
)


def register_gated_names(names: GatedNames, *, replace: bool = False) -> None:
    """Recognise a further gated MLP layout by its child names; the layout registered last is tried first.

    Parameters
    ----------
    names : GatedNames
        The child names of the layout (see [`GatedNames`][mumoe_tn.conversion.surgery.blocks.GatedNames]).
    replace : bool, optional
        Register a layout that is already registered again, so that it is tried first (default: raise).

    Raises
    ------
    TypeError
        If ``names`` is not a ``GatedNames``.
    ValueError
        If the layout is already registered and ``replace`` is False.
    """
    if not isinstance(names, GatedNames):
        raise TypeError(f"names must be a GatedNames, got {type(names).__name__}")
    if names in GATED_LAYOUTS and not replace:
        raise ValueError(f"the gated MLP layout {names!r} is already registered; pass replace=True")
    GATED_LAYOUTS.unregister(names)  # registered again, it is tried first
    GATED_LAYOUTS.register(names, names)


@dataclass(frozen=True)
class MLPParts:
    """A recognised MLP block.

    Attributes
    ----------
    kind : BlockKind
        Plain two-layer, gated (three projections) or split across two sibling modules (a name is
        looked up in [`BLOCK_KINDS`][mumoe_tn.conversion.surgery.block_kinds.BLOCK_KINDS]).
    up : LinearView
        The first layer ``I → H`` (the ungated "up" projection of a gated block).
    down : LinearView
        ``H → O``.
    activation : nn.Module or None
        The non-linearity (applied to the gate projection in a gated block).
    gate : LinearView or None
        The gate projection of a gated block.
    target : str
        Child path (relative to the block) the μMoE block replaces; ``""`` is the block itself.
    bypass : tuple of str
        Child paths (relative to the block) that become ``nn.Identity``.
    """

    kind: BlockKind
    up: LinearView
    down: LinearView
    activation: nn.Module | None
    gate: LinearView | None = None
    target: str = ""
    bypass: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", block_kind(self.kind))

    @property
    def layers(self) -> dict[str, LinearView]:
        """The linear layers by role (``gate``, ``up``, ``down``)."""
        roles = {"gate": self.gate, "up": self.up, "down": self.down}
        return {role: view for role, view in roles.items() if view is not None}

    @property
    def replaced(self) -> tuple[str, ...]:
        """Child paths (relative to the block) that conversion replaces."""
        return (self.target, *self.bypass)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_activation(module: nn.Module | None) -> bool:
    return module is not None and not isinstance(module, nn.Dropout) and not _has_parameters(module)


def _gated(module: nn.Module) -> MLPParts | None:
    names = PACKED_GATED_CLASSES.get(f"{type(module).__module__}.{type(module).__qualname__}")
    candidates = [names] if names is not None else list(GATED_LAYOUTS.values())[::-1]
    children = dict(module.named_children())
    for names in candidates:
        used = {names.gate, names.up, names.down, names.activation} - {None}
        if not used <= children.keys() or not _is_activation(children[names.activation]):
            continue
        if any(_has_parameters(child) for key, child in children.items() if key not in used):
            continue
        gate, down = linear_view(children[names.gate]), linear_view(children[names.down])
        up = None if names.up is None else linear_view(children[names.up])
        if gate is None or down is None or (names.up is not None and up is None):
            continue
        if names.up is None:  # packed: split the projection's outputs into halves
            gate_first = not module.gate_last if hasattr(module, "gate_last") else names.gate_first
            if gate.out_features % 2:
                continue
            half = gate.out_features // 2
            first, second = gate.rows(0, half), gate.rows(half, 2 * half)
            gate, up = (first, second) if gate_first else (second, first)
        if gate.in_features != up.in_features or gate.out_features != up.out_features:
            continue
        if up.out_features != down.in_features:
            continue
        return MLPParts(GATED, up, down, children[names.activation], gate=gate)
    return None


def _split(module: nn.Module) -> MLPParts | None:
    children = dict(module.named_children())
    intermediate, output = children.get("intermediate"), children.get("output")
    if intermediate is None or output is None:
        return None
    inner = dict(intermediate.named_children())
    up = linear_view(inner["dense"]) if "dense" in inner else None
    down = linear_view(output.dense) if isinstance(getattr(output, "dense", None), nn.Module) else None
    if up is None or down is None or up.out_features != down.in_features:
        return None
    others = [child for key, child in inner.items() if key != "dense"]
    if any(_has_parameters(child) for child in others):
        return None
    activations = [child for child in others if _is_activation(child)]
    return MLPParts(
        SPLIT, up, down, activations[0] if activations else None, target="intermediate", bypass=("output.dense",)
    )


def _plain(module: nn.Module) -> MLPParts | None:
    children = list(module.children())
    views = [linear_view(child) for child in children]
    positions = [k for k, view in enumerate(views) if view is not None]
    if len(positions) != 2:
        return None
    if any(_has_parameters(child) for k, child in enumerate(children) if k not in positions):
        return None
    up, down = views[positions[0]], views[positions[1]]
    if up.out_features != down.in_features:
        return None
    between = [c for c in children[positions[0] + 1 : positions[1]] if _is_activation(c) and linear_view(c) is None]
    if not between:  # e.g. GPT-2 registers c_fc, c_proj, then act
        between = [c for c in children if _is_activation(c) and linear_view(c) is None]
    return MLPParts(MLP, up, down, between[0] if between else None)


def mlp_parts(module: nn.Module) -> MLPParts | None:
    """How ``module`` is an MLP block (gated, split or plain, in that order), or None."""
    for recognise in (_gated, _split, _plain):
        parts = recognise(module)
        if parts is not None:
            return parts
    return None
