"""The checks every analysis makes of the layer it reads, and of the model that runs it."""

from __future__ import annotations

from torch import nn

from mumoe_tn.layers import MuMoEBase
from mumoe_tn.layers.base import A_LAYER
from mumoe_tn.validation import check_inside, check_instance, check_model

__all__ = ["check_layer", "check_layer_in_model"]


def check_layer(layer: object) -> MuMoEBase:
    """``layer`` if it is a μMoE layer; a ``TypeError`` naming the layer classes otherwise."""
    return check_instance("layer", layer, MuMoEBase, A_LAYER)


def check_layer_in_model(model: object, layer: object) -> tuple[nn.Module, MuMoEBase]:
    """``model`` and ``layer``, checked: a module, a μMoE layer, and the layer one of the model's modules.

    Raises
    ------
    TypeError
        If ``model`` is not an ``nn.Module`` or ``layer`` not a μMoE layer.
    ValueError
        If ``layer`` is not inside ``model`` (its hooks would never fire).
    """
    model = check_model("model", model)
    layer = check_layer(layer)
    check_inside(model, layer)
    return model, layer
