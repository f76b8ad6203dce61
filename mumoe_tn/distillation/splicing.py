"""Replacements put in place of a model's modules, in place or for the duration of a ``with`` block.

[`splice`][mumoe_tn.distillation.splicing.splice] swaps modules by their qualified names and
returns the ones taken out; [`spliced`][mumoe_tn.distillation.splicing.spliced] puts the
originals back when the block ends (the trained replacements of
[`distill`][mumoe_tn.distillation.training.distill] evaluated in the model).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from torch import nn

__all__ = ["splice", "spliced"]


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, child = name.rpartition(".")
    try:
        model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{name!r} is not a module of the model") from None
    return (model.get_submodule(parent) if parent else model), child


def splice(model: nn.Module, replacements: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """Put each replacement in place of the module of that name, in place; returns the replaced modules.

    Parameters
    ----------
    model : nn.Module
    replacements : Mapping[str, nn.Module]
        Qualified module name -> new module (e.g. ``Distillation.replacements[name][method]``).

    Returns
    -------
    dict of str to nn.Module
        The modules taken out, by name (``splice(model, old)`` puts them back).
    """
    if not isinstance(replacements, Mapping):
        raise TypeError(f"replacements must be a mapping of module name -> module, got {type(replacements).__name__}")
    for name, module in replacements.items():
        if not isinstance(module, nn.Module):
            raise TypeError(f"the replacement of {name!r} must be an nn.Module, got {type(module).__name__}")
    places = {name: _parent(model, name) for name in replacements}
    old = {}
    for name, module in replacements.items():
        parent, child = places[name]
        old[name] = getattr(parent, child)
        setattr(parent, child, module)
    return old


@contextmanager
def spliced(model: nn.Module, replacements: Mapping[str, nn.Module]) -> Iterator[nn.Module]:
    """[`splice`][mumoe_tn.distillation.splicing.splice] for the duration of the block, then put the originals back."""
    old = splice(model, replacements)
    try:
        yield model
    finally:
        splice(model, old)
