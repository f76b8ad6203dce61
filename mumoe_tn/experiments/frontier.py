"""Deprecated: this module moved to [`mumoe_tn.distillation.study`][mumoe_tn.distillation.study].

Its command line moved to [`mumoe_tn.cli.distill_command`][mumoe_tn.cli.distill_command]. The old
path is removed in mumoe_tn 0.4.
"""

from mumoe_tn.deprecation import moved_module

__getattr__, __dir__ = moved_module(
    "mumoe_tn.experiments.frontier",
    "mumoe_tn.distillation.study",
    {
        "configure_parser": "mumoe_tn.cli.distill_command:configure",
        "config_from": "mumoe_tn.cli.distill_command",
        "run": "mumoe_tn.cli.distill_command",
    },
)
