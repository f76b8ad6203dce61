"""Put μMoE layers into existing models, start them from trained weights, and save and load the result.

- [`convert`][mumoe_tn.conversion.convert]: replace linear layers and MLP blocks of any model,
  recognising causal models and wiring their token masks; the report of what changed.
  [`building`][mumoe_tn.conversion.building] chooses the modules and builds their blocks.
- [`adapters`][mumoe_tn.conversion.adapters] and [`blocks`][mumoe_tn.conversion.blocks]: how layers of any
  library are read, and which modules are MLP blocks.
- [`upcycling`][mumoe_tn.conversion.upcycling] and [`fitting`][mumoe_tn.conversion.fitting]: experts that start
  as a trained layer (closed forms, or alternating least squares on any network), and dense
  expert tensors decomposed into any network.
- [`record`][mumoe_tn.conversion.record]: the conversion as plain data — written, validated and replayed on a
  fresh model; [`checkpoints`][mumoe_tn.conversion.checkpoints] and [`files`][mumoe_tn.conversion.files]: saved
  with the weights and read back as data, so a converted model reloads as itself.
- [`interop`][mumoe_tn.conversion.interop]: tensorly-torch factorized tensors.

Distillation — MLP blocks of a trained model distilled into sparse replacements — lives in
[`mumoe_tn.distillation`][mumoe_tn.distillation].
"""

from mumoe_tn.conversion.adapters import LayerAdapter, LinearView, linear_view, register_adapter
from mumoe_tn.conversion.checkpoints import load_converted, save_converted
from mumoe_tn.conversion.convert import ConversionReport, Replacement, convert, find_mlp_blocks, is_causal_model
from mumoe_tn.conversion.record import ConversionRecord, ConvertedModule
from mumoe_tn.conversion.replay import apply_conversion, conversion_record
from mumoe_tn.conversion.upcycling import UpcycleWarning, decompose_dense, upcycle_experts, upcycle_linear

__all__ = [
    "ConversionRecord",
    "ConversionReport",
    "ConvertedModule",
    "LayerAdapter",
    "LinearView",
    "Replacement",
    "UpcycleWarning",
    "apply_conversion",
    "conversion_record",
    "convert",
    "decompose_dense",
    "find_mlp_blocks",
    "is_causal_model",
    "linear_view",
    "load_converted",
    "register_adapter",
    "save_converted",
    "upcycle_experts",
    "upcycle_linear",
]
