"""The expert explorer: one self-contained HTML page showing what each expert of a model does."""

from mumoe_tn.analysis.explorer.explore import Exploration, explore

__all__ = ["Exploration", "explore"]
