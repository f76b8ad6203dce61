"""mumoe_tn: multilinear mixture-of-experts layers over arbitrary tensor networks.

The expert weight tensor ``W ∈ R^{N_1×…×N_E×I×O}`` of a μMoE layer is held as a labelled
tensor network (`ExpertNetwork`); the forward pass is one planned contraction of that
network with the expert coefficients and the input, and ``W`` is never materialised.

The torch-free parts (`mumoe_tn.network`, `mumoe_tn.decompositions`,
`mumoe_tn.costs`) import without torch; the layers are loaded on first access.
"""

from __future__ import annotations

from mumoe_tn import decompositions
from mumoe_tn.decompositions import Format, register
from mumoe_tn.lazy_names import lazy_getattr as _lazy_getattr
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.plugins import install_transformers_hook as _install_transformers_hook

__version__ = "0.4.1"

_LAZY = {
    "ExpertGate": "mumoe_tn.gates.modules",
    "FactorizedExperts": "mumoe_tn.layers",
    "LayerOptions": "mumoe_tn.layers.options",
    "MuMoE": "mumoe_tn.layers",
    "MuMoEMLP": "mumoe_tn.layers",
    "MuMoEGatedMLP": "mumoe_tn.layers.mlp",
    "MixtureOfDecoders": "mumoe_tn.layers.decoders",
    "Gate": "mumoe_tn.gates.specs",
    "ReLUTopKGate": "mumoe_tn.gates.specs",
    "TopKGate": "mumoe_tn.gates.specs",
    "register_gate": "mumoe_tn.gates.registry",
    "compare": "mumoe_tn.costs",
    "convert": "mumoe_tn.conversion.convert",
    "apply_conversion": "mumoe_tn.conversion.persistence.replay",
    "conversion_record": "mumoe_tn.conversion.persistence.replay",
    "load_converted": "mumoe_tn.conversion.persistence.checkpoints",
    "save_converted": "mumoe_tn.conversion.persistence.checkpoints",
    "decompose_dense": "mumoe_tn.conversion.fitting.upcycling",
    "distill": "mumoe_tn.distillation.training",
    "explore": "mumoe_tn.analysis.explorer.explore",
    "upcycle_linear": "mumoe_tn.conversion.fitting.upcycling",
    "dense_forward": "mumoe_tn.contractions.dense",
    "expert_matrix": "mumoe_tn.contractions.dense",
    "materialise": "mumoe_tn.contractions.dense",
    "init_cores": "mumoe_tn.layers.init",
    "parameter_groups": "mumoe_tn.layers.groups",
    "plan_forward": "mumoe_tn.contractions.plan",
    "token_mask": "mumoe_tn.masking",
}

# Stock from_pretrained rebuilds converted models (registered when transformers' quantizer registry loads).
_install_transformers_hook()

__all__ = ["ExpertNetwork", "Format", "decompositions", "register", *sorted(_LAZY)]

__getattr__ = _lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    # The public API, loaded or not, and the module's dunders; the sub-packages that have been
    # imported are attributes too, but only `decompositions` is part of the top-level API.
    return sorted({*__all__, *(name for name in globals() if name.startswith("__") and name.endswith("__"))})
