"""Steering (paper appendix "LLM steering"): add an expert's cluster centre to a layer's input."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mumoe_tn.analysis.layer_checks import check_layer
from mumoe_tn.layers import MuMoEBase
from mumoe_tn.validation import check_real, check_tensor

__all__ = ["steer"]


def steer(layer: MuMoEBase, direction: torch.Tensor, strength: float = 1.0) -> RemovableHandle:
    """Add ``strength · direction`` to every token's input of ``layer`` (a forward pre-hook).

    ``direction`` is typically an expert's cluster centre,
    ``collect_coefficients(..., centres=True)[name].modes[e].centres()[n]``.

    Parameters
    ----------
    layer : MuMoEBase
        The layer to steer.
    direction : torch.Tensor
        A vector of size ``in_features``.
    strength : float, optional
        Multiplier of the direction.

    Returns
    -------
    torch.utils.hooks.RemovableHandle
        Call ``.remove()`` to stop steering.
    """
    layer = check_layer(layer)
    direction = check_tensor("direction", direction, kind="float", finite=True)
    strength = check_real("strength", strength)
    if direction.ndim != 1 or direction.shape[0] != layer.in_features:
        raise ValueError(f"the steering direction must have shape ({layer.in_features},), got {tuple(direction.shape)}")
    direction = direction.detach().clone()

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        return (x + strength * direction.to(device=x.device, dtype=x.dtype), *args[1:])

    return layer.register_forward_pre_hook(hook)
