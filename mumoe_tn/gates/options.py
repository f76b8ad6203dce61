"""Deprecated: this module moved to [`mumoe_tn.gates.choices`][mumoe_tn.gates.choices].

The old path is removed in mumoe_tn 0.4.
"""

from mumoe_tn.deprecation import moved_module

__getattr__, __dir__ = moved_module("mumoe_tn.gates.options", "mumoe_tn.gates.choices")
