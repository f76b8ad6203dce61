"""Choose the network for a budget: a structure and rank search with a Pareto front.

[`design`][mumoe_tn.design.structure_search.design] searches CP, TR, TT, Tucker, every factorization of the
number of experts into expert modes and generated topologies (chains, rings, stars, trees),
matches each to the budget with the library's matcher, and keeps the Pareto front of
parameters, FMAs per token, peak memory and the expert-rank bound (and the upcycle error of a
pretrained layer, when one is given). The search itself is torch-free; fitting a pretrained layer
and measuring latency import torch on use.

Examples
--------
>>> from mumoe_tn.design import design
>>> result = design(32, 48, 16, budget=0.5, max_modes=2, families=("cp", "tr", "tucker"))
>>> result.best.n_expert_modes >= 1 and all(p in result.points for p in result.front)
True
"""

from mumoe_tn.design.front import dominates, pareto_front
from mumoe_tn.design.result import DesignPoint, DesignResult
from mumoe_tn.design.space import TOPOLOGIES, Shape, expert_factorizations, families, search_space
from mumoe_tn.design.structure_search import design, evaluate

__all__ = [
    "TOPOLOGIES",
    "DesignPoint",
    "DesignResult",
    "Shape",
    "design",
    "dominates",
    "evaluate",
    "expert_factorizations",
    "families",
    "pareto_front",
    "search_space",
]
