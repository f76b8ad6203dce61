"""mumoe_tn: multilinear mixture-of-experts layers over arbitrary tensor networks.

The expert weight tensor ``W ∈ R^{N_1×…×N_E×I×O}`` of a μMoE layer is held as a labelled
tensor network (:class:`ExpertNetwork`); the forward pass is one planned contraction of that
network with the expert coefficients and the input, and ``W`` is never materialised.
"""

from mumoe_tn import decompositions
from mumoe_tn.contractions import dense_forward, expert_matrix, materialize, plan_forward
from mumoe_tn.gating import ExpertGate
from mumoe_tn.init import init_cores
from mumoe_tn.layers import FactorizedExperts, MuMoE
from mumoe_tn.network import ExpertNetwork

__version__ = "0.1.0"

__all__ = [
    "ExpertGate",
    "ExpertNetwork",
    "FactorizedExperts",
    "MuMoE",
    "decompositions",
    "dense_forward",
    "expert_matrix",
    "init_cores",
    "materialize",
    "plan_forward",
]
