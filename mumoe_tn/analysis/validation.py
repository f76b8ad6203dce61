"""Deprecated: this module moved to [`mumoe_tn.analysis.argument_checks`][mumoe_tn.analysis.argument_checks].

The old path is removed in mumoe_tn 0.4.
"""

from mumoe_tn.deprecation import moved_module

__getattr__, __dir__ = moved_module("mumoe_tn.analysis.validation", "mumoe_tn.analysis.argument_checks")
