"""Deprecated: this module moved to [`mumoe_tn.cli.design_command`][mumoe_tn.cli.design_command].

The old path is removed in mumoe_tn 0.4.
"""

from mumoe_tn.deprecation import moved_module

__getattr__, __dir__ = moved_module(
    "mumoe_tn.design.command",
    "mumoe_tn.cli.design_command",
    {"configure_parser": "mumoe_tn.cli.design_command:configure"},
)
