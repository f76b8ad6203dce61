"""Fitting: experts that start from trained weights, and factorized tensors of other libraries.

- [`upcycling`][mumoe_tn.conversion.fitting.upcycling]: experts that start as a trained layer
  (closed forms where a format has one), and dense expert tensors decomposed into any network.
- [`als`][mumoe_tn.conversion.fitting.als]: alternating least squares on any expert network.
- [`interop`][mumoe_tn.conversion.fitting.interop]: tensorly-torch factorized tensors.

Fitting imports no other part of ``mumoe_tn.conversion``.
"""
