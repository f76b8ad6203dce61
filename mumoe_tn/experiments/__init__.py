"""Experiments behind the ``mumoe-tn demo`` and ``mumoe-tn specialisation`` commands.

- [`demo`][mumoe_tn.experiments.demo]: a μMoE classifier on real data, analysed end to end.
- [`specialisation`][mumoe_tn.experiments.specialisation]: do experts specialise as their number
  grows (the paper's Fig. 3)?
"""
