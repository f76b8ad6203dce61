"""Put μMoE layers into existing models: conversion, upcycling and dense-tensor decomposition."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from mumoe_tn.layers import Decomposition, MuMoE, MuMoEMLP
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.upcycling import decompose_dense, upcycle_linear

__all__ = [
    "ConversionReport",
    "Replacement",
    "convert",
    "decompose_dense",
    "find_mlp_blocks",
    "upcycle_linear",
]
# decompose_dense and upcycle_linear live in mumoe_tn.upcycling; re-exported here for convenience.

Selector = str | Callable[[str, nn.Module], bool] | None


# ----------------------------------------------------------------------------- conversion
@dataclass(frozen=True)
class Replacement:
    """One replaced module."""

    name: str
    kind: str
    params_before: int
    params_after: int
    expert_dims: tuple[int, ...]
    ranks: str
    upcycle_error: float | None = None


@dataclass
class ConversionReport:
    """What [`convert`][mumoe_tn.convert.convert] replaced."""

    replacements: list[Replacement] = field(default_factory=list)

    @property
    def params_before(self) -> int:
        """Parameters of the replaced modules before conversion."""
        return sum(r.params_before for r in self.replacements)

    @property
    def params_after(self) -> int:
        """Parameters of their μMoE replacements."""
        return sum(r.params_after for r in self.replacements)

    def to_markdown(self) -> str:
        """The report as a Markdown table."""
        lines = ["| module | kind | params before | params after | experts | ranks | upcycle error |"]
        lines.append("|---|---|---:|---:|---|---|---:|")
        for r in self.replacements:
            error = "" if r.upcycle_error is None else f"{r.upcycle_error:.2e}"
            experts = "×".join(map(str, r.expert_dims))
            lines.append(
                f"| {r.name} | {r.kind} | {r.params_before:,} | {r.params_after:,} | {experts} | {r.ranks} | {error} |"
            )
        lines.append(f"| **total** | | {self.params_before:,} | {self.params_after:,} | | | |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def _select(selector: Selector) -> Callable[[str, nn.Module], bool]:
    if selector is None:
        return lambda name, module: False
    if isinstance(selector, str):
        pattern = re.compile(selector)
        return lambda name, module: pattern.search(name) is not None
    if callable(selector):
        return selector
    raise TypeError(f"a module selector is a regex string or a callable (name, module) -> bool, got {selector!r}")


def _mlp_parts(module: nn.Module) -> tuple[nn.Linear, nn.Module | None, nn.Linear] | None:
    """``(first, activation, second)`` when ``module`` is an MLP block, else None.

    An MLP block has exactly two ``nn.Linear`` children (direct, in registration order) whose
    sizes chain ``I → H → O``, and no other child with parameters (so an attention block with
    two projections, e.g. ``nn.TransformerEncoderLayer``, is not one); the activation is the
    first other child between them that is not a Dropout.
    """
    children = list(module.children())
    positions = [k for k, child in enumerate(children) if isinstance(child, nn.Linear)]
    if len(positions) != 2:
        return None
    others = [child for k, child in enumerate(children) if k not in positions]
    if any(next(child.parameters(), None) is not None for child in others):
        return None
    first, second = children[positions[0]], children[positions[1]]
    if first.out_features != second.in_features:
        return None
    between = [c for c in children[positions[0] + 1 : positions[1]] if not isinstance(c, (nn.Linear, nn.Dropout))]
    if not between:
        between = [c for c in children if not isinstance(c, (nn.Linear, nn.Dropout))]
    return first, (between[0] if between else None), second


def find_mlp_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that [`convert`][mumoe_tn.convert.convert] treats as MLP blocks."""
    return [name for name, module in model.named_modules() if name and _mlp_parts(module) is not None]


def _ranks(network: ExpertNetwork) -> str:
    return ", ".join(f"{bond}={network.sizes[bond]}" for bond in network.bonds)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def convert(
    model: nn.Module,
    *,
    expert_dims: int | Sequence[int],
    linears: Selector = None,
    mlps: Selector = None,
    decomposition: Decomposition = "cp",
    rank: int | Sequence[int] | str = "match",
    upcycle: bool = False,
    **layer_options: Any,
) -> ConversionReport:
    """Replace chosen ``nn.Linear`` layers and MLP blocks of ``model`` with μMoE layers, in place.

    Parameters
    ----------
    model : nn.Module
        The model; everything not selected is left as it is.
    expert_dims : int or Sequence[int]
        Experts of every new layer.
    linears : str or Callable, optional
        ``nn.Linear`` modules to replace with [`MuMoE`][mumoe_tn.layers.MuMoE]: a regex searched
        in the qualified module name, or a predicate ``(name, module) -> bool``.
    mlps : str or Callable, optional
        MLP blocks (see [`find_mlp_blocks`][mumoe_tn.convert.find_mlp_blocks]) to replace with
        [`MuMoEMLP`][mumoe_tn.layers.MuMoEMLP], selected the same way. A block is replaced by its
        two linears and activation; dropout inside it is not carried over.
    decomposition : str or Callable, optional
        Decomposition of every new layer.
    rank : int or Sequence[int] or "match", optional
        ``"match"`` (default) parameter-matches each replacement to what it replaces (gating
        counted); otherwise explicit ranks.
    upcycle : bool, optional
        Start each replaced Linear's experts as that Linear ([`upcycle_linear`][mumoe_tn.upcycling.upcycle_linear]);
        with matched ranks this is the best approximation of its rank, and the report gives the error.
    **layer_options
        Further layer arguments (activation, gate_norm, input_norm, …).

    Returns
    -------
    ConversionReport
    """
    select_linear, select_mlp = _select(linears), _select(mlps)
    chosen: list[tuple[str, str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if _mlp_parts(module) is not None and select_mlp(name, module):
            chosen.append((name, "mlp", module))
            taken.append(name)
        elif isinstance(module, nn.Linear) and select_linear(name, module):
            chosen.append((name, "linear", module))
    if not chosen:
        raise ValueError("no module was selected: check the linears=/mlps= patterns (see find_mlp_blocks(model))")
    report = ConversionReport()
    for name, kind, module in chosen:
        error = None
        if kind == "linear":
            layer_rank = "linear" if rank == "match" else rank
            if upcycle:
                new, error = upcycle_linear(module, expert_dims, decomposition, layer_rank, **layer_options)
            else:
                new = MuMoE(
                    module.in_features,
                    module.out_features,
                    expert_dims,
                    decomposition,
                    layer_rank,
                    bias=module.bias is not None,
                    device=module.weight.device,
                    dtype=module.weight.dtype,
                    **layer_options,
                )
            network = new.network
        else:
            first, activation, second = _mlp_parts(module)
            new = MuMoEMLP(
                first.in_features,
                first.out_features,
                second.out_features,
                expert_dims,
                decomposition,
                "mlp" if rank == "match" else rank,
                bias=first.bias is not None,
                hidden_activation=copy.deepcopy(activation) if activation is not None else None,
                device=first.weight.device,
                dtype=first.weight.dtype,
                **layer_options,
            )
            network = new.experts1.network
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        before = _count(module)
        setattr(parent, child, new)
        report.replacements.append(
            Replacement(name, kind, before, _count(new), network.expert_dims, _ranks(network), error)
        )
    return report
