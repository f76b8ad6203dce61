"""Cost model: parameters, FLOPs (1 FMA = 1 FLOP), memory, rank bounds, baselines, matching.

Everything here works from an [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork] alone — no torch, no
module — so cost tables are instant and hold for custom decompositions as for named ones.
"""

from mumoe_tn.costs.baselines import Baseline, dense_moe, linear, mlp, moe_block, sparse_moe
from mumoe_tn.costs.flops import LayerFlops, dense_forward_fma, gate_fma, layer_flops, materialise_fma, matmul_fma
from mumoe_tn.costs.matching import (
    TOLERANCE,
    Match,
    MatchingWarning,
    bond_cap,
    match_block,
    match_exact,
    match_layer,
    resolve_target,
    scaled_bonds,
    solve_bonds,
    solve_rank,
    upcycle_capacity,
)
from mumoe_tn.costs.params import ParameterCount, block_parameters, layer_parameters
from mumoe_tn.costs.rank import collapsed_expert_modes, min_cut, rank_bound
from mumoe_tn.costs.table import COLUMNS, CostRow, CostTable, compare

__all__ = [
    "COLUMNS",
    "TOLERANCE",
    "Baseline",
    "CostRow",
    "CostTable",
    "LayerFlops",
    "Match",
    "MatchingWarning",
    "ParameterCount",
    "block_parameters",
    "bond_cap",
    "collapsed_expert_modes",
    "compare",
    "dense_forward_fma",
    "dense_moe",
    "gate_fma",
    "layer_flops",
    "layer_parameters",
    "linear",
    "match_block",
    "match_exact",
    "match_layer",
    "materialise_fma",
    "matmul_fma",
    "min_cut",
    "mlp",
    "moe_block",
    "rank_bound",
    "resolve_target",
    "scaled_bonds",
    "solve_bonds",
    "solve_rank",
    "sparse_moe",
    "upcycle_capacity",
]
