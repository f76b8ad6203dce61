"""Benchmarks of mumoe_tn, in two kinds.

- Speed and memory: ``python -m benchmarks.run`` (its sections, listed in ``benchmarks.section_list``,
  in ``benchmarks.sections``, ``benchmarks.decoding_section`` and ``benchmarks.host_section``; the floors in
  ``benchmarks.floors``, the compiled cases in ``benchmarks.compiled_host``; measured with
  ``benchmarks.measure``), ``benchmarks.scale``, ``benchmarks.anatomy``, ``benchmarks.compiled``.
- Accuracy: ``python -m benchmarks.quality`` (training quality at equal parameters, over seeds;
  stored runs under ``benchmarks/data/quality/``) and ``python -m benchmarks.frontier`` (the
  distillation's sparsity–accuracy frontier, μMoE blocks against transcoders).
"""
