"""Deprecated: this module moved to [`mumoe_tn.distillation.training`][mumoe_tn.distillation.training].

The old path is removed in mumoe_tn 0.4.
"""

from mumoe_tn.deprecation import callable_module, moved_module

__getattr__, __dir__ = moved_module("mumoe_tn.conversion.distill", "mumoe_tn.distillation.training")
# `from mumoe_tn.conversion import distill` returns this module once it is imported: calling it
# still runs the function.
callable_module(__name__, "mumoe_tn.distillation.training", "distill")
