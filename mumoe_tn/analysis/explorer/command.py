"""Deprecated: this module moved to [`mumoe_tn.cli.explore_command`][mumoe_tn.cli.explore_command].

The old path is removed in mumoe_tn 0.4.
"""

from mumoe_tn.deprecation import moved_module

__getattr__, __dir__ = moved_module(
    "mumoe_tn.analysis.explorer.command",
    "mumoe_tn.cli.explore_command",
    {"configure_parser": "mumoe_tn.cli.explore_command:configure"},
)
