"""Planned factorized contractions and their dense references.

[`plan`][mumoe_tn.contractions.plan] is torch-free; the executors load torch on first access.
"""

from __future__ import annotations

from mumoe_tn.contractions.inference_plan import constant_steps, per_call_cost, per_call_fma, plan_inference
from mumoe_tn.contractions.plan import (
    OPTIMIZERS,
    ContractionPlan,
    ContractionStep,
    autotune_candidates,
    candidate_plans,
    check_memory_limit,
    choose_plan,
    forward_candidates,
    memory_bound,
    plan_contraction,
    plan_dense,
    plan_forward,
    resolve_optimizer,
)
from mumoe_tn.lazy_names import lazy_getattr

_LAZY = {
    "run_plan": "mumoe_tn.contractions.execute",
    "PreparedPlan": "mumoe_tn.contractions.prepared",
    "constant_intermediates": "mumoe_tn.contractions.execute",
    "fastest_plan": "mumoe_tn.contractions.autotune",
    "dense_forward": "mumoe_tn.contractions.dense",
    "expert_matrix": "mumoe_tn.contractions.dense",
    "materialise": "mumoe_tn.contractions.dense",
    "squared_norm": "mumoe_tn.contractions.dense",
    "squared_norm_plan": "mumoe_tn.contractions.dense",
}

__all__ = [
    "OPTIMIZERS",
    "ContractionPlan",
    "PreparedPlan",
    "ContractionStep",
    "autotune_candidates",
    "candidate_plans",
    "check_memory_limit",
    "choose_plan",
    "constant_steps",
    "forward_candidates",
    "memory_bound",
    "per_call_cost",
    "per_call_fma",
    "plan_contraction",
    "plan_dense",
    "plan_forward",
    "plan_inference",
    "resolve_optimizer",
    *sorted(_LAZY),
]

__getattr__ = lazy_getattr(__name__, _LAZY)
