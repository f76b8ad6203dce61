"""Expert analysis and editing: coefficients, ablation, polysemanticity, re-writing, steering, the explorer."""

from mumoe_tn.analysis.ablation import ExpertAblation, ablate
from mumoe_tn.analysis.coefficients import (
    Coefficients,
    DeadExpertWarning,
    ExpertStatistics,
    LayerCoefficients,
    collect_coefficients,
    mumoe_layers,
)
from mumoe_tn.analysis.effects import AblationEffects, ablation_effects, expert_units
from mumoe_tn.analysis.explorer import Exploration, explore
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
from mumoe_tn.analysis.tokens import TokenCoefficients, token_coefficients

__all__ = [
    "AblationEffects",
    "Coefficients",
    "DeadExpertWarning",
    "ExpertAblation",
    "ExpertStatistics",
    "Exploration",
    "LayerCoefficients",
    "Polysemanticity",
    "TokenCoefficients",
    "ablate",
    "ablation_effects",
    "blind_threshold",
    "class_accuracies",
    "class_polysemanticity",
    "collect_coefficients",
    "equality_of_opportunity",
    "expert_units",
    "explore",
    "max_min_fairness",
    "mean_coefficients",
    "mumoe_layers",
    "rewrite",
    "std_bias",
    "steer",
    "subpopulation_accuracies",
    "token_coefficients",
]
