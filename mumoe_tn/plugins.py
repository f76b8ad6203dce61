"""Where mumoe_tn plugs into other libraries when they load (torch-free; nothing is imported ahead of time).

``import mumoe_tn`` registers the ``"mumoe_tn"`` quantization method with transformers (see
[`mumoe_tn.conversion.persistence.quantizer`][mumoe_tn.conversion.persistence.quantizer]), so that stock
``from_pretrained`` rebuilds converted models. Importing transformers' quantizer registry takes
seconds and imports torch, so it is not imported here: if it is already loaded the method is
registered at once, otherwise a finder on ``sys.meta_path`` registers it right after
transformers loads that module (as it does before any ``from_pretrained``). The finder handles
that one module name and nothing else, and steps aside after it has run.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any

__all__ = ["install_transformers_hook"]

#: The transformers module whose loading triggers the registration.
TRIGGER = "transformers.quantizers.auto"


def _register() -> None:
    try:
        from mumoe_tn.conversion.persistence.quantizer import register_with_transformers
    except ImportError as error:  # a transformers without the quantizer registry: load_converted still works
        import warnings

        warnings.warn(
            f"mumoe_tn cannot register with transformers ({error}): from_pretrained will load converted "
            "checkpoints as dense models; use mumoe_tn.load_converted",
            ImportWarning,
            stacklevel=2,
        )
        return
    register_with_transformers()


class _RegisterAfterLoading:
    """A loader that runs another loader, then registers mumoe_tn's method."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _TransformersFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``TRIGGER`` that the other finders find."""

    def __init__(self) -> None:
        self._busy = threading.local()
        self.done = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TRIGGER or self.done or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.active = False
        if spec is None or spec.loader is None:
            return None
        self.done = True
        spec.loader = _RegisterAfterLoading(spec.loader)
        return spec


def install_transformers_hook() -> None:
    """Register the ``"mumoe_tn"`` method with transformers now or when its quantizer registry loads (idempotent)."""
    if TRIGGER in sys.modules:
        _register()
        return
    if any(isinstance(finder, _TransformersFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _TransformersFinder())
