"""Choosing and building blocks: the modules of a model a conversion replaces, their μMoE blocks, and installing them.

[`convert`][mumoe_tn.conversion.convert.convert] chooses modules with
[`choose`][mumoe_tn.conversion.surgery.building.choose] and builds their replacements with
[`build_block`][mumoe_tn.conversion.surgery.building.build_block]; replaying a record
([`mumoe_tn.conversion.persistence.record`][mumoe_tn.conversion.persistence.record]) builds the same blocks from the
record's networks. The block an MLP becomes is the one its format names (see
[`mumoe_tn.layers.mlp_blocks`][mumoe_tn.layers.mlp_blocks]): nothing here tests a format's name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.surgery.adapters import LinearView, linear_view
from mumoe_tn.conversion.surgery.block_kinds import LINEAR, BlockKind, block_kind
from mumoe_tn.conversion.surgery.blocks import MLPParts, mlp_parts
from mumoe_tn.decompositions.resolve import Decomposition
from mumoe_tn.layers import FactorizedExperts, MuMoE
from mumoe_tn.layers.mlp_blocks import mlp_block_for
from mumoe_tn.network import ExpertNetwork

__all__ = ["Choice", "build_block", "choose", "install", "join_path", "set_module", "uninstall"]


def join_path(prefix: str, child: str) -> str:
    """``prefix.child``, or ``prefix`` for an empty child."""
    return f"{prefix}.{child}" if child else prefix


@dataclass
class Choice:
    """A module chosen for replacement, with every path it sits at."""

    kind: BlockKind
    module: nn.Module
    layers: dict[str, LinearView]
    parts: MLPParts | None
    paths: list[str]

    def __post_init__(self) -> None:
        self.kind = block_kind(self.kind)


def choose(model: nn.Module, select_linear: Callable, select_mlp: Callable) -> list[Choice]:
    """The modules of ``model`` the selectors choose (MLP blocks first), each once with all its paths."""
    choices: dict[int, Choice] = {}
    taken: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or any(name == t or name.startswith(t + ".") for t in taken):
            continue
        known = choices.get(id(module))
        if known is not None:  # the same module at a second path
            known.paths.append(name)
            if known.parts is not None:
                taken.extend(join_path(name, child) for child in known.parts.replaced)
            continue
        parts = mlp_parts(module)
        if parts is not None and select_mlp(name, module):
            choices[id(module)] = Choice(parts.kind, module, parts.layers, parts, [name])
            taken.extend(join_path(name, child) for child in parts.replaced)
            continue
        view = linear_view(module)
        if view is not None and select_linear(name, module):
            choices[id(module)] = Choice(LINEAR, module, {"layer": view}, None, [name])
    return list(choices.values())


def build_block(
    choice: Choice,
    expert_dims: int | Sequence[int],
    decomposition: Decomposition,
    rank: int | Sequence[int] | str,
    options: dict[str, Any],
    device: torch.device | str | None = None,
) -> tuple[nn.Module, dict[str, FactorizedExperts]]:
    """The μMoE replacement of ``choice`` and its factorized layers by role (on ``device``: the layers' own)."""
    views = choice.layers
    first = views.get("up", views.get("layer"))
    factory = {"device": first.device if device is None else device, "dtype": first.dtype}
    bias = any(view.bias is not None for view in views.values())
    if not choice.kind.mlp:
        layer = MuMoE(
            first.in_features,
            first.out_features,
            expert_dims,
            decomposition,
            **_ranks_or_match(rank, "linear"),
            bias=bias,
            **factory,
            **options,
        )
        return layer, {"layer": layer.experts}
    down, activation = views["down"], choice.parts.activation
    block = {
        "bias": bias,
        "hidden_activation": nn.Identity() if activation is None else copy.deepcopy(activation),
        **factory,
        **options,
    }
    kind = mlp_block_for(decomposition)
    hidden = first.out_features
    if kind.dense_encoder and isinstance(decomposition, ExpertNetwork):
        # The factorized network is the decoder: a recorded one gives the hidden width (a matched block may be
        # narrower than the MLP).
        hidden = decomposition.in_features
    new = kind.build(
        first.in_features, hidden, down.out_features, expert_dims, decomposition,
        **_ranks_or_match(rank, "mlp"), gated=choice.kind.gated, **block,
    )  # fmt: skip
    return new, new.expert_layers


def _ranks_or_match(rank: object, target: str) -> dict[str, object]:
    """``rank="match"`` parameter-matches (``match=target``); anything else gives explicit ranks."""
    return {"match": target} if rank == "match" else {"rank": rank}


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at the qualified name ``path`` of ``model``."""
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def install(model: nn.Module, choice: Choice, new: nn.Module) -> list[tuple[str, nn.Module]]:
    """Put ``new`` at every path of ``choice`` (for split blocks: at the target, the bypassed layers made identity).

    Returns the ``(path, module)`` pairs it replaced, latest last, for ``uninstall``.
    """
    bypass = () if choice.parts is None else choice.parts.bypass
    target = "" if choice.parts is None else choice.parts.target
    replaced = []
    for path in choice.paths:
        for child, module in ((target, new), *((child, nn.Identity()) for child in bypass)):
            full = join_path(path, child)
            replaced.append((full, model.get_submodule(full)))
            set_module(model, full, module)
    return replaced


def uninstall(model: nn.Module, replaced: Sequence[tuple[str, nn.Module]]) -> None:
    """Put back the modules ``install`` replaced, in reverse order."""
    for path, module in reversed(replaced):
        set_module(model, path, module)
