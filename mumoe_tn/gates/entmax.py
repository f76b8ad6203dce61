"""Sparsemax and 1.5-entmax, exact and traceable by ``torch.compile`` and ``torch.func``.

The ``entmax`` package computes the same maps, but its autograd Functions define ``forward`` as a
classmethod, which dynamo cannot trace when gradients are required (torch 2.13: "Argument mismatch
when attempting to trace function forward"). The library's maps use the same closed-form,
sort-based thresholds (Martins & Astudillo 2016; Peters, Niculae & Martins 2019) and their known
Jacobian-vector products; the test suite checks every form of them against ``entmax``.

[`entmax15`][mumoe_tn.gates.activation_maps.entmax15],
[`sparsemax`][mumoe_tn.gates.activation_maps.sparsemax] and
[`inference_map`][mumoe_tn.gates.activation_maps.inference_map] live in
[`mumoe_tn.gates.activation_maps`][mumoe_tn.gates.activation_maps], which chooses their form per
call (NumPy on the CPU, Triton on CUDA, torch operations under ``torch.compile`` and ``torch.func``);
this module is where earlier releases documented them, and imports them from there.
"""

from __future__ import annotations

from mumoe_tn.gates.activation_maps import entmax15, inference_map, sparsemax

__all__ = ["entmax15", "inference_map", "sparsemax"]
