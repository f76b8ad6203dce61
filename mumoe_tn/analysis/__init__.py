"""Expert analysis and editing: coefficients, ablation, polysemanticity, re-writing, steering."""

from mumoe_tn.analysis.ablation import ExpertAblation, ablate
from mumoe_tn.analysis.coefficients import ExpertStatistics, LayerCoefficients, collect_coefficients, mumoe_layers
from mumoe_tn.analysis.polysemanticity import Polysemanticity, class_accuracies, class_polysemanticity
from mumoe_tn.analysis.rewriting import (
    blind_threshold,
    equality_of_opportunity,
    max_min_fairness,
    mean_coefficients,
    rewrite,
    std_bias,
    subpopulation_accuracies,
)
from mumoe_tn.analysis.steering import steer

__all__ = [
    "ExpertAblation",
    "ExpertStatistics",
    "LayerCoefficients",
    "Polysemanticity",
    "ablate",
    "blind_threshold",
    "class_accuracies",
    "class_polysemanticity",
    "collect_coefficients",
    "equality_of_opportunity",
    "max_min_fairness",
    "mean_coefficients",
    "mumoe_layers",
    "rewrite",
    "std_bias",
    "steer",
    "subpopulation_accuracies",
]
