"""One construction spec for every μMoE layer: a layer's arguments resolved once, then built from.

[`layer_spec`][mumoe_tn.layers.construction.layer_spec] is the one function that turns the
arguments of [`MuMoE`][mumoe_tn.layers.moe.MuMoE], [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP],
[`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP] or
[`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders] — sizes, expert modes, the
decomposition, ranks or ``match=``, [`LayerOptions`][mumoe_tn.layers.options.LayerOptions] and the
builder's keywords — into a [`LayerSpec`][mumoe_tn.layers.construction.LayerSpec]: the resolved
expert network of every factorized layer (exact or matched ranks applied), the gate descriptor, what
the gate reads, the input norm, the bias, the execution options and the factory arguments. Every
layer class builds from a spec: its constructor resolves one, and
[`from_spec`][mumoe_tn.layers.base.MuMoEBase.from_spec] builds a layer from a spec made before
(the same layer again, or one with other execution options through ``dataclasses.replace``).

What differs between the layer classes is only how their networks are resolved and matched: each
class answers that in its ``resolve_networks`` class method, which ``layer_spec`` calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from mumoe_tn.decompositions.resolve import Decomposition, Rank
from mumoe_tn.gates.specs import GateSpec
from mumoe_tn.layers.experts import FactorizedExperts
from mumoe_tn.layers.options import ExecutionOptions, LayerOptions, Match
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.validation import check_bool

__all__ = ["LayerArguments", "LayerSpec", "NetworkResolver", "layer_spec"]


@dataclass(frozen=True)
class LayerArguments:
    """What a layer class's ``resolve_networks`` reads: the arguments, the options checked, the gate made.

    Attributes
    ----------
    layer : str
        The layer class's name, for messages.
    in_features, hidden_features, out_features : int
        The sizes (``hidden_features`` None for a single layer; ``out_features`` its default applied).
    expert_dims, decomposition, rank, match
        As given to the layer.
    options : LayerOptions
        The layer's options, its keywords applied.
    builder_options : Mapping
        The keywords for the decomposition's builder.
    gate : GateSpec
        The gate descriptor.
    gated : bool
        The GLU variant (a Mixture of Decoders).
    """

    layer: str
    in_features: int
    hidden_features: int | None
    out_features: int
    expert_dims: int | Sequence[int] | None
    decomposition: Decomposition
    rank: Rank | None
    match: Match
    options: LayerOptions
    builder_options: Mapping[str, Any]
    gate: GateSpec
    gated: bool = False


class NetworkResolver(Protocol):
    """A layer class: how its expert networks follow from its arguments."""

    __name__: str

    #: The example of ``hidden_activation`` named in the error about a wrong one.
    activation_example: str

    #: Whether the networks' leg ``i`` holds the bias column (False: the biases are layers of their own).
    folds_bias: bool

    def resolve_networks(self, arguments: LayerArguments) -> tuple[tuple[tuple[str, ExpertNetwork], ...], int | None]:
        """``((role, network), …)`` in the layer's order, and the parameter budget matched (None: not matched)."""
        ...


@dataclass(frozen=True)
class LayerSpec:
    """A μMoE layer, resolved: what its constructor builds, and nothing left to decide.

    Attributes
    ----------
    layer : str
        The name of the layer class it describes.
    in_features, out_features : int
        The layer's sizes.
    hidden_features : int or None
        The hidden width of a block (a matched Mixture of Decoders' may be narrower than asked).
    networks : tuple of (str, ExpertNetwork)
        The network of every factorized layer by role, in the layer's order (``"layer"``; ``"up"``,
        ``"down"``; ``"gate"``, ``"up"``, ``"down"``; a Mixture of Decoders' ``"down"``).
    gate : GateSpec
        The gate descriptor (one gate, shared by the factorized layers).
    gate_input : str
        What the gate reads (``"normed"`` or ``"raw"``).
    input_norm : bool
        An input LayerNorm.
    bias : bool
        The layer's ``bias`` argument.
    folded_bias : bool
        Whether the networks' leg ``i`` holds a bias column (a Mixture of Decoders keeps its biases outside).
    execution : ExecutionOptions
        How the factorized layers initialise, plan and run.
    device, dtype : optional
        Factory arguments (checked).
    gated : bool
        The GLU variant of a Mixture of Decoders.
    hidden_activation : nn.Module or None
        A block's non-linearity as given (None: the block's default).
    match : str or int or float or None
        ``match=`` as given (``"exact"`` for exact ranks).
    target : int or None
        The parameter budget that matching met (None: not matched).
    """

    layer: str
    in_features: int
    out_features: int
    networks: tuple[tuple[str, ExpertNetwork], ...]
    gate: GateSpec
    gate_input: str = "normed"
    input_norm: bool = False
    bias: bool = True
    folded_bias: bool = True
    execution: ExecutionOptions = field(default_factory=ExecutionOptions)
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None
    hidden_features: int | None = None
    gated: bool = False
    hidden_activation: nn.Module | None = None
    match: Match = None
    target: int | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles of the factorized layers, in the layer's order."""
        return tuple(role for role, _ in self.networks)

    @property
    def expert_dims(self) -> tuple[int, ...]:
        """The expert modes every factorized layer shares."""
        return self.networks[0][1].expert_dims

    def network(self, role: str) -> ExpertNetwork:
        """The network of the factorized layer ``role``."""
        for name, network in self.networks:
            if name == role:
                return network
        raise ValueError(f"this {self.layer} spec has no {role!r} layer; its layers are {list(self.roles)}")

    def factory(self) -> dict[str, Any]:
        """``{"device": …, "dtype": …}``."""
        return {"device": self.device, "dtype": self.dtype}

    def experts(self, role: str) -> FactorizedExperts:
        """A new factorized layer ``role`` (its fan-in: the network's input width without the bias column)."""
        network = self.network(role)
        fan_in = network.in_features - int(self.folded_bias)
        return FactorizedExperts(network, fan_in=fan_in, **self.execution.keywords(), **self.factory())


def layer_spec(
    layer: NetworkResolver,
    in_features: int,
    hidden_features: int | None,
    out_features: int | None,
    expert_dims: int | Sequence[int] | None,
    decomposition: Decomposition,
    rank: Rank | None,
    *,
    match: Match,
    options: LayerOptions | None,
    keywords: dict[str, Any],
    gated: bool = False,
    hidden_activation: nn.Module | None = None,
) -> LayerSpec:
    """The spec of a ``layer`` built with these arguments (the arguments of its constructor).

    Parameters
    ----------
    layer : type
        The layer class (see [`NetworkResolver`][mumoe_tn.layers.construction.NetworkResolver]).
    in_features, hidden_features, out_features, expert_dims, decomposition, rank, match, options
        The layer's arguments (``hidden_features`` None for a single layer, ``out_features`` None for
        a block's default, ``in_features``).
    keywords : dict
        The layer's further keywords: fields of ``LayerOptions`` and the builder's options.
    gated : bool, optional
        A Mixture of Decoders' ``gated`` (default False).
    hidden_activation : nn.Module, optional
        A block's ``hidden_activation``.

    Returns
    -------
    LayerSpec
    """
    options, builder_options = LayerOptions.from_keywords(options, keywords)
    factory = options.factory()
    folded = layer.folds_bias
    if not folded:  # a Mixture of Decoders: its biases are layers of their own, checked first
        check_bool("bias", options.bias)
        check_bool("gated", gated)
    out_features = in_features if out_features is None else out_features
    if hidden_activation is not None and not isinstance(hidden_activation, nn.Module):
        raise TypeError(
            f"hidden_activation must be an nn.Module instance such as {layer.activation_example}, "
            f"got {hidden_activation!r}"
        )
    gate = options.gate_spec()
    arguments = LayerArguments(
        layer.__name__, in_features, hidden_features, out_features, expert_dims, decomposition, rank, match,
        options, builder_options, gate, gated=gated,
    )  # fmt: skip
    networks, target = layer.resolve_networks(arguments)
    if hidden_features is not None and not folded:
        hidden_features = networks[0][1].in_features  # matching may have chosen the hidden width
    return LayerSpec(
        layer.__name__, in_features, out_features, networks, gate, gate_input=options.gate_input,
        input_norm=options.input_norm, bias=options.bias, folded_bias=folded and options.bias,
        execution=ExecutionOptions.of(options), hidden_features=hidden_features, gated=gated,
        hidden_activation=hidden_activation, match=match, target=target, **factory,
    )  # fmt: skip
