"""Gates: what a user declares (descriptors, torch-free), what runs (modules), and the entmax kernels.

- [`mumoe_tn.gates.specs`][mumoe_tn.gates.specs]: gate descriptors ([`Gate`][mumoe_tn.gates.specs.Gate],
  [`TopKGate`][mumoe_tn.gates.specs.TopKGate], [`ReLUTopKGate`][mumoe_tn.gates.specs.ReLUTopKGate],
  the [`GateSpec`][mumoe_tn.gates.specs.GateSpec] protocol) and their
  costs; no torch.
- [`mumoe_tn.gates.modules`][mumoe_tn.gates.modules]: the gate modules they build, with the registries of
  activations and logit norms.
- [`mumoe_tn.gates.activation_maps`][mumoe_tn.gates.activation_maps]: entmax15, sparsemax and the
  top-k maps, each choosing its form per call: NumPy ([`mumoe_tn.gates.simplex_numpy`][mumoe_tn.gates.simplex_numpy]),
  torch ([`mumoe_tn.gates.simplex_torch`][mumoe_tn.gates.simplex_torch]) or Triton.
- [`mumoe_tn.gates.kernels`][mumoe_tn.gates.kernels]: when entmax15, sparsemax and the top-k gates
  run as the Triton kernels of [`mumoe_tn.gates.triton_kernels`][mumoe_tn.gates.triton_kernels]
  (on CUDA by default; [`use_gate_kernels`][mumoe_tn.gates.kernels.use_gate_kernels] switches).
- [`mumoe_tn.gates.registry`][mumoe_tn.gates.registry]: the allow-list of descriptor classes a
  checkpoint may name ([`register_gate`][mumoe_tn.gates.registry.register_gate]).
- [`mumoe_tn.gates.records`][mumoe_tn.gates.records]: per-thread records of forward passes.
- [`mumoe_tn.gates.sync`][mumoe_tn.gates.sync]: BatchNorm gates synchronised across data-parallel
  ranks; [`mumoe_tn.gates.replicas`][mumoe_tn.gates.replicas]: the warning when they are not;
  [`mumoe_tn.gates.recompute`][mumoe_tn.gates.recompute]: activation checkpointing that leaves
  their running statistics alone.

The descriptors import without torch; the torch names load on first access.
"""

from __future__ import annotations

from mumoe_tn.gates.choices import GATE_INITS, TOKEN_MIXING_NORMS
from mumoe_tn.gates.registry import register_gate, registered_gates, unregister_gate
from mumoe_tn.gates.specs import DEFAULT_GATE, CausalityWarning, Gate, GateSpec, ReLUTopKGate, TopKGate
from mumoe_tn.lazy_names import lazy_getattr

_LAZY = {
    "ACTIVATIONS": "mumoe_tn.gates.modules",
    "GATE_NORMS": "mumoe_tn.gates.modules",
    "ExpertGate": "mumoe_tn.gates.modules",
    "LogitBatchNorm": "mumoe_tn.gates.modules",
    "ReLUTopKRouter": "mumoe_tn.gates.modules",
    "TopKRouter": "mumoe_tn.gates.modules",
    "gate_losses": "mumoe_tn.gates.records",
    "resolve_activation": "mumoe_tn.gates.modules",
    "entmax15": "mumoe_tn.gates.activation_maps",
    "sparsemax": "mumoe_tn.gates.activation_maps",
    "softmax_top_k": "mumoe_tn.gates.activation_maps",
    "relu_top_k": "mumoe_tn.gates.activation_maps",
    "gate_kernels": "mumoe_tn.gates.kernels",
    "use_gate_kernels": "mumoe_tn.gates.kernels",
    "PerThreadRecords": "mumoe_tn.gates.records",
    "SyncLogitBatchNorm": "mumoe_tn.gates.sync",
    "sync_gate_norms": "mumoe_tn.gates.sync",
    "UnsynchronisedNormWarning": "mumoe_tn.gates.replicas",
    "keep_statistics_on_recompute": "mumoe_tn.gates.recompute",
}

__all__ = [
    "DEFAULT_GATE",
    "GATE_INITS",
    "TOKEN_MIXING_NORMS",
    "CausalityWarning",
    "Gate",
    "GateSpec",
    "ReLUTopKGate",
    "TopKGate",
    "register_gate",
    "registered_gates",
    "unregister_gate",
    *sorted(_LAZY),
]

__getattr__ = lazy_getattr(__name__, _LAZY)
