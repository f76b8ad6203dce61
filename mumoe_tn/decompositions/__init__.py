"""Named decompositions (CP, TR, TT, Tucker) as builders of [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork].

Each builder is registered by name; [`build`][mumoe_tn.decompositions.registry.build] looks one up. A new decomposition
is one small module whose builder is decorated with [`register`][mumoe_tn.decompositions.registry.register].
"""

from mumoe_tn.decompositions.cp import cp
from mumoe_tn.decompositions.registry import (
    ClosedForms,
    available,
    build,
    closed_forms,
    get_builder,
    normalize_ranks,
    register,
)
from mumoe_tn.decompositions.tr import tr
from mumoe_tn.decompositions.tt import tt
from mumoe_tn.decompositions.tucker import tucker

__all__ = [
    "ClosedForms",
    "available",
    "build",
    "closed_forms",
    "cp",
    "get_builder",
    "normalize_ranks",
    "register",
    "tr",
    "tt",
    "tucker",
]
