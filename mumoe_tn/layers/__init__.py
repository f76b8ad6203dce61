"""μMoE layers as PyTorch modules.

- [`experts`][mumoe_tn.layers.experts]: [`FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts], the
  expert tensor held as a network's cores and contracted along planned paths.
- [`base`][mumoe_tn.layers.base]: [`MuMoEBase`][mumoe_tn.layers.base.MuMoEBase], what every layer shares — one
  gate, the input norm, per-thread records, token masks, ablation.
- [`moe`][mumoe_tn.layers.moe]: [`MuMoE`][mumoe_tn.layers.moe.MuMoE], the drop-in for ``nn.Linear``.
- [`mlp`][mumoe_tn.layers.mlp]: [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP] and
  [`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP], drop-ins for MLP blocks.
- [`decoders`][mumoe_tn.layers.decoders]: [`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders], an MLP
  block with a dense encoder and a μMoE decoder (the Mixture of Decoders layer, GLU variant too).
- [`construction`][mumoe_tn.layers.construction]: [`LayerSpec`][mumoe_tn.layers.construction.LayerSpec], a
  layer's arguments resolved once by [`layer_spec`][mumoe_tn.layers.construction.layer_spec] (networks, gate,
  execution options), what every layer class builds from.
- [`options`][mumoe_tn.layers.options] and [`init`][mumoe_tn.layers.init]: the options every layer shares
  ([`LayerOptions`][mumoe_tn.layers.options.LayerOptions], documented once), and the initialisation of any
  network's cores.
- [`groups`][mumoe_tn.layers.groups]: [`parameter_groups`][mumoe_tn.layers.groups.parameter_groups], optimiser
  groups for the gates, the expert-mode cores and the rest.
"""

from mumoe_tn.layers.base import GATE_INPUTS, MuMoEBase
from mumoe_tn.layers.construction import LayerSpec, layer_spec
from mumoe_tn.layers.decoders import MixtureOfDecoders, decoder_block_parameters
from mumoe_tn.layers.experts import COMPILE_PLAN_BATCH, FactorizedExperts
from mumoe_tn.layers.groups import PARAMETER_KINDS, parameter_groups
from mumoe_tn.layers.mlp import MuMoEGatedMLP, MuMoEMLP, gated_mlp_parameters
from mumoe_tn.layers.moe import MuMoE
from mumoe_tn.layers.options import ExecutionOptions, LayerOptions, resolve_network

__all__ = [
    "COMPILE_PLAN_BATCH",
    "GATE_INPUTS",
    "PARAMETER_KINDS",
    "ExecutionOptions",
    "FactorizedExperts",
    "LayerOptions",
    "LayerSpec",
    "MixtureOfDecoders",
    "MuMoE",
    "MuMoEBase",
    "MuMoEGatedMLP",
    "MuMoEMLP",
    "decoder_block_parameters",
    "gated_mlp_parameters",
    "layer_spec",
    "parameter_groups",
    "resolve_network",
]
