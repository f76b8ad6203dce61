"""Planned factorized contractions and their dense references."""

from mumoe_tn.contractions.dense import dense_forward, expert_matrix, materialize, squared_norm
from mumoe_tn.contractions.execute import run_plan
from mumoe_tn.contractions.plan import (
    OPTIMIZERS,
    ContractionPlan,
    ContractionStep,
    plan_contraction,
    plan_dense,
    plan_forward,
    resolve_optimizer,
)

__all__ = [
    "OPTIMIZERS",
    "ContractionPlan",
    "ContractionStep",
    "dense_forward",
    "expert_matrix",
    "materialize",
    "plan_contraction",
    "plan_dense",
    "plan_forward",
    "resolve_optimizer",
    "run_plan",
    "squared_norm",
]
