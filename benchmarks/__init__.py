"""Benchmarks of mumoe_tn, in two kinds.

- Speed and memory: ``python -m benchmarks.run`` (its sections in ``benchmarks.sections``,
  ``benchmarks.scale``, ``benchmarks.anatomy``, ``benchmarks.compiled``; measured with
  ``benchmarks.measure``).
- Accuracy: ``python -m benchmarks.quality`` (training quality at equal parameters, over seeds;
  stored runs under ``benchmarks/data/quality/``) and ``python -m benchmarks.frontier`` (the
  distillation's sparsity–accuracy frontier, μMoE blocks against transcoders).
"""
