"""Put μMoE layers into existing models, start them from trained weights, and save and load the result.

- [`convert`][mumoe_tn.conversion.convert]: replace linear layers and MLP blocks of any model,
  recognising causal models and wiring their token masks; the report of what changed. It joins
  the three parts below.
- [`surgery`][mumoe_tn.conversion.surgery]: how layers of any library are read, which modules are
  MLP blocks, and the blocks built and installed in their place.
- [`persistence`][mumoe_tn.conversion.persistence]: the conversion as plain data — written,
  validated and replayed on a fresh model — saved with the weights and read back as data, so a
  converted model reloads as itself; every bound a loaded file is held to is in
  [`bounds`][mumoe_tn.conversion.persistence.bounds].
- [`fitting`][mumoe_tn.conversion.fitting]: experts that start as a trained layer (closed forms,
  or alternating least squares on any network), dense expert tensors decomposed into any
  network, and tensorly-torch factorized tensors.

Imports between the parts point one way: ``convert`` imports all three; persistence imports the
surgery; the surgery and the fitting import neither of the others.

Distillation — MLP blocks of a trained model distilled into sparse replacements — lives in
[`mumoe_tn.distillation`][mumoe_tn.distillation].
"""

from mumoe_tn.conversion.convert import ConversionReport, Replacement, convert, find_mlp_blocks, is_causal_model
from mumoe_tn.conversion.fitting.upcycling import UpcycleWarning, decompose_dense, upcycle_experts, upcycle_linear
from mumoe_tn.conversion.persistence.checkpoints import load_converted, save_converted
from mumoe_tn.conversion.persistence.record import ConversionRecord, ConvertedModule
from mumoe_tn.conversion.persistence.replay import apply_conversion, conversion_record
from mumoe_tn.conversion.surgery.adapters import LayerAdapter, LinearView, linear_view, register_adapter

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
