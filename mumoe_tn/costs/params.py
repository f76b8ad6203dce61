"""Parameter counts of μMoE layers and blocks (torch-free).

Conventions (the paper's tables): the expert tensor's cores and the gating ``G_e ∈ R^{I×N_e}``
per expert mode are counted separately and summed; BatchNorm and LayerNorm on the gate logits
have no affine parameters (0); an input LayerNorm has ``2·I``. With ``bias=True`` the network's
input leg is ``I + 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mumoe_tn.gates.specs import GateSpec, gate_parameter_count
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.validation import check_bool

__all__ = ["ParameterCount", "block_parameters", "layer_in_features", "layer_parameters"]


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a μMoE layer or block.

    Attributes
    ----------
    cores : Mapping[str, int]
        Parameters per expert-tensor core (block cores are prefixed ``"1."`` and ``"2."``).
    gate : int
        Gating parameters (0 when gating is not counted).
    norm : int
        Normalisation parameters.
    """

    cores: Mapping[str, int]
    gate: int
    norm: int

    @property
    def experts(self) -> int:
        """Parameters of the expert tensor(s)."""
        return sum(self.cores.values())

    @property
    def total(self) -> int:
        """Everything: experts, gating and normalisation."""
        return self.experts + self.gate + self.norm


def layer_in_features(network: ExpertNetwork, bias: bool) -> int:
    """The layer's ``in_features``: the input leg less the folded bias column."""
    if not isinstance(network, ExpertNetwork):
        raise TypeError(f"expected an ExpertNetwork, got {network!r} ({type(network).__name__})")
    check_bool("bias", bias)
    in_features = network.in_features - int(bias)
    if in_features < 1:
        raise ValueError(f"bias=True needs an input leg of size >= 2, the network has i={network.in_features}")
    return in_features


def layer_parameters(
    network: ExpertNetwork, *, bias: bool = True, gate: bool | GateSpec = True, input_norm: bool = False
) -> ParameterCount:
    """Parameters of a [`MuMoE`][mumoe_tn.layers.moe.MuMoE] layer built on ``network``.

    Parameters
    ----------
    network : ExpertNetwork
        The expert network (leg ``i`` includes the bias column when ``bias``).
    bias : bool, optional
        Whether leg ``i`` holds a folded bias column.
    gate : bool or GateSpec, optional
        ``True``: count the default gate's ``I·ΣN_e``; ``False``: do not count gating; a gate
        descriptor ([`mumoe_tn.gates.specs`][mumoe_tn.gates.specs]): count what it reports.
    input_norm : bool, optional
        Count an input LayerNorm (``2·I``).

    Returns
    -------
    ParameterCount
    """
    in_features = layer_in_features(network, bias)
    gating = gate_parameter_count(gate, in_features, network.expert_dims)
    return ParameterCount(dict(network.core_params), gating, 2 * in_features if input_norm else 0)


def block_parameters(
    first: ExpertNetwork, second: ExpertNetwork, *, bias: bool = True, gate: bool | GateSpec = True
) -> ParameterCount:
    """Parameters of a two-layer μMoE block sharing one set of coefficients (one gate).

    Parameters
    ----------
    first, second : ExpertNetwork
        The networks of the two layers (``I → H`` and ``H → O``), with equal expert dims.
    bias : bool, optional
        Whether both input legs hold a folded bias column.
    gate : bool or GateSpec, optional
        Count the one gate: ``True`` the default (``I·ΣN_e``), ``False`` none, or a descriptor.

    Returns
    -------
    ParameterCount
    """
    if first.expert_dims != second.expert_dims:
        raise ValueError(
            f"a block's layers share coefficients: expert dims {first.expert_dims} != {second.expert_dims}"
        )
    if layer_in_features(second, bias) != first.out_features:
        raise ValueError(
            f"the second layer's input ({layer_in_features(second, bias)}) must be the first layer's output "
            f"({first.out_features})"
        )
    cores = {f"1.{k}": v for k, v in first.core_params.items()} | {f"2.{k}": v for k, v in second.core_params.items()}
    gating = gate_parameter_count(gate, layer_in_features(first, bias), first.expert_dims)
    return ParameterCount(cores, gating, 0)
