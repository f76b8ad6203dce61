"""Read linear-like layers of any library: weight as ``(out, in)`` or ``(in, out)``, bias, sizes.

[`convert`][mumoe_tn.conversion.convert.convert] and upcycling see every layer through a
[`LinearView`][mumoe_tn.conversion.surgery.adapters.LinearView], made by the
[`LayerAdapter`][mumoe_tn.conversion.surgery.adapters.LayerAdapter] registered
for the layer's class (found along its MRO). ``nn.Linear`` is built in; Hugging Face
``transformers.pytorch_utils.Conv1D`` (GPT-2's projections, weight stored ``(in, out)``) is registered by its qualified
class name, so
this module never imports transformers. A user describes any other layer with a small adapter::

    register_adapter(MyProjection, LayerAdapter(layout="in_out", weight="kernel", bias="offset"))

An adapter only says how to *read* the layer; the layer's forward must compute ``x @ W (+ b)``
with ``W`` read in the declared layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from mumoe_tn.registry import Registry

__all__ = ["ADAPTERS", "LayerAdapter", "LinearView", "adapter_for", "linear_view", "register_adapter"]

Reader = str | Callable[[nn.Module], torch.Tensor | None]
LAYOUTS = ("out_in", "in_out")


@dataclass(frozen=True)
class LayerAdapter:
    """How to read a linear-like layer.

    Parameters
    ----------
    layout : {"out_in", "in_out"}
        How the weight is stored: ``(out, in)`` like ``nn.Linear`` or ``(in, out)`` like
        Hugging Face ``Conv1D``.
    weight : str or Callable, optional
        Attribute name of the weight, or a function ``module -> tensor`` (default ``"weight"``).
    bias : str or Callable or None, optional
        Attribute name of the bias (a missing attribute or ``None`` value means no bias), a
        function ``module -> tensor or None``, or None for layers without bias.
    """

    layout: Literal["out_in", "in_out"] = "out_in"
    weight: Reader = "weight"
    bias: Reader | None = "bias"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        for what, reader in (("weight", self.weight), ("bias", self.bias)):
            if reader is not None and not isinstance(reader, str) and not callable(reader):
                raise TypeError(f"{what} must be an attribute name or a function module -> tensor, got {reader!r}")

    def view(self, module: nn.Module) -> LinearView:
        """Read ``module`` as a [`LinearView`][mumoe_tn.conversion.surgery.adapters.LinearView]."""
        weight = _read(module, self.weight)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError(
                f"the adapter for {type(module).__name__} reads a 2-D weight, got "
                f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}"
            )
        weight = weight if self.layout == "out_in" else weight.T
        bias = None if self.bias is None else _read(module, self.bias)
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
            raise ValueError(
                f"the bias of {type(module).__name__} must be a tensor of shape ({weight.shape[0]},), got "
                f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}"
            )
        return LinearView(module, weight, bias)


def _read(module: nn.Module, reader: Reader) -> torch.Tensor | None:
    if isinstance(reader, str):
        return getattr(module, reader, None)
    return reader(module)


@dataclass(frozen=True)
class LinearView:
    """A linear-like layer seen as ``y = x Wᵀ + b`` with ``weight`` of shape ``(out, in)``.

    ``weight`` and ``bias`` are views of the layer's own parameters (not copies).
    ``rows(start, stop)`` views the output slice ``start:stop`` (a half of a packed
    gate/up projection).
    """

    module: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None

    @property
    def in_features(self) -> int:
        """Input size."""
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        """Output size."""
        return self.weight.shape[0]

    @property
    def device(self) -> torch.device:
        """Device of the weight."""
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weight."""
        return self.weight.dtype

    @property
    def frozen(self) -> bool:
        """Whether no parameter of the layer requires grad."""
        return not any(p.requires_grad for p in self.module.parameters())

    def rows(self, start: int, stop: int) -> LinearView:
        """The layer restricted to outputs ``start:stop``."""
        bias = None if self.bias is None else self.bias[start:stop]
        return LinearView(self.module, self.weight[start:stop], bias)

    def matrix(self, *, bias_row: bool | None = None) -> torch.Tensor:
        """``[Wᵀ; b]`` of shape ``(in + 1, out)``, detached: the μMoE's ``i × o`` layout.

        Parameters
        ----------
        bias_row : bool, optional
            Append the bias row (zeros for a layer without bias); default: when the layer has a
            bias.

        Returns
        -------
        torch.Tensor
        """
        weight = self.weight.detach().T
        if bias_row is None:
            bias_row = self.bias is not None
        if not bias_row:
            return weight
        bias = torch.zeros_like(weight[0]) if self.bias is None else self.bias.detach()
        return torch.cat([weight, bias[None]], dim=0)


def _check_adapter(layer_type: object, adapter: object) -> None:
    if not isinstance(adapter, LayerAdapter):
        raise TypeError(f"adapter must be a LayerAdapter, got {type(adapter).__name__}")
    if not (isinstance(layer_type, str) or (isinstance(layer_type, type) and issubclass(layer_type, nn.Module))):
        raise TypeError(f"layer_type must be an nn.Module subclass or its qualified name, got {layer_type!r}")


#: How each layer class is read, by class or, for classes of optional libraries that are never
#: imported here, by ``module.qualname`` (a [`Registry`][mumoe_tn.registry.Registry]).
ADAPTERS: Registry[type | str, LayerAdapter] = Registry(
    "layer adapter",
    check=_check_adapter,
    entries={nn.Linear: LayerAdapter(), "transformers.pytorch_utils.Conv1D": LayerAdapter(layout="in_out")},
)


def register_adapter(layer_type: type | str, adapter: LayerAdapter, *, replace: bool = False) -> None:
    """Teach `linear_view` (hence `convert`) to read a layer class.

    Parameters
    ----------
    layer_type : type or str
        The class (subclasses inherit the adapter) or its qualified name
        ``"package.module.Class"`` (so the library need not be imported).
    adapter : LayerAdapter
        How to read it.
    replace : bool, optional
        Replace the adapter already registered for ``layer_type`` (default: raise).

    Raises
    ------
    TypeError
        If ``layer_type`` is not an ``nn.Module`` subclass or a name, or ``adapter`` not a ``LayerAdapter``.
    ValueError
        If another adapter is registered for ``layer_type`` and ``replace`` is False.
    """
    ADAPTERS.register(layer_type, adapter, replace=replace)


def adapter_for(module: nn.Module) -> LayerAdapter | None:
    """The adapter registered for ``module``'s class or its nearest base class, else None."""
    for cls in type(module).__mro__:
        adapter = ADAPTERS.get(cls) or ADAPTERS.get(f"{cls.__module__}.{cls.__qualname__}")
        if adapter is not None:
            return adapter
    return None


def linear_view(module: nn.Module) -> LinearView | None:
    """``module`` read as a linear layer, or None when no adapter is registered for it."""
    adapter = adapter_for(module)
    return None if adapter is None else adapter.view(module)
