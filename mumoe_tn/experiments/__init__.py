"""Deprecated: the experiments behind ``mumoe-tn demo`` and ``mumoe-tn specialisation`` moved.

They are command modules of [`mumoe_tn.cli`][mumoe_tn.cli] (``demo_command``,
``specialisation_command``), and the ``distill`` study lives in
[`mumoe_tn.distillation.study`][mumoe_tn.distillation.study]. The old paths are removed in
mumoe_tn 0.4.
"""
