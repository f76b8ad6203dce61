"""Deprecated: the analysis tools' checks joined [`mumoe_tn.validation`][mumoe_tn.validation].

The old path is removed in mumoe_tn 0.4; ``check_layer`` is
``check_instance(name, value, MuMoEBase, "a μMoE layer")``.
"""

from __future__ import annotations

import warnings
from typing import Any

from mumoe_tn.deprecation import moved_module
from mumoe_tn.layers.base import A_LAYER, MuMoEBase
from mumoe_tn.validation import check_instance

_forward, __dir__ = moved_module("mumoe_tn.analysis.validation", "mumoe_tn.validation")


def _check_layer(name: str, value: object) -> MuMoEBase:
    return check_instance(name, value, MuMoEBase, A_LAYER)


def __getattr__(name: str) -> Any:
    if name == "check_layer":
        warnings.warn(
            "mumoe_tn.analysis.validation.check_layer is now mumoe_tn.validation.check_instance(name, value, "
            "MuMoEBase, A_LAYER); the old path is removed in mumoe_tn 0.4",
            DeprecationWarning,
            stacklevel=2,
        )
        return _check_layer
    return _forward(name)
