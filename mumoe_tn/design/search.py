"""Deprecated: this module moved to [`mumoe_tn.design.structure_search`][mumoe_tn.design.structure_search].

The old path is removed in mumoe_tn 0.4.
"""

from mumoe_tn.deprecation import moved_module

__getattr__, __dir__ = moved_module("mumoe_tn.design.search", "mumoe_tn.design.structure_search")
