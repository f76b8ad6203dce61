"""Shared construction of tensor-ring and tensor-train chains over the legs n1…nE, i, o."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mumoe_tn.decompositions.registry import normalise_ranks
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork, physical_sizes


def chain_ranks(decomposition: str, rank: int | Sequence[int], n_bonds: int, expert_rank: int) -> tuple[int, ...]:
    """Ranks of a chain whose last bond is the one that reaches the output core.

    An int ``R`` gives the bond joining the input and output cores the rank ``R`` and every
    other bond ``expert_rank`` (the paper's ``R1 = R2 = 4``); a sequence gives every bond.
    """
    if isinstance(rank, int) and not isinstance(rank, bool):
        (expert_rank,) = normalise_ranks(f"{decomposition} expert_rank", expert_rank, 1)
        (rank,) = normalise_ranks(decomposition, rank, 1)
        return (expert_rank,) * (n_bonds - 1) + (rank,)
    return normalise_ranks(decomposition, rank, n_bonds)


def chain(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    ranks: Sequence[int],
    *,
    closed: bool,
) -> ExpertNetwork:
    """A chain of three-leg cores ``(r_k, leg, r_{k+1})`` over ``n1 … nE, i, o``.

    With ``closed=True`` the last core's right bond is the first core's left bond (a ring);
    otherwise the ends have no boundary bond (a train).
    """
    sizes = physical_sizes(expert_dims, in_features, out_features)
    legs = [leg for leg in sizes if leg not in (INPUT_LEG, OUTPUT_LEG)] + [INPUT_LEG, OUTPUT_LEG]
    n_bonds = len(legs) if closed else len(legs) - 1
    bonds = [f"r{k}" for k in range(1, n_bonds + 1)]
    cores = {}
    for position, leg in enumerate(legs):
        if closed:
            left, right = bonds[position], bonds[(position + 1) % n_bonds]
            labels = (left, leg, right)
        else:
            left = (bonds[position - 1],) if position > 0 else ()
            right = (bonds[position],) if position < n_bonds else ()
            labels = (*left, leg, *right)
        cores[f"G_{leg}"] = labels
    sizes.update(zip(bonds, ranks, strict=True))
    return ExpertNetwork(cores, sizes)


def pass_through_expert_cores(network: ExpertNetwork, cores: Mapping[str, Any]) -> None:
    """Set every expert core of a chain to pass bond index 0 through along its expert leg.

    Three-leg cores ``(r, n, r')`` get a (rectangular) identity in every slice; the first core of
    a train ``(n1, r1)`` gets ones in column 0. The product along the chain then has entry
    ``(0, 0)`` equal to 1 for every expert.
    """
    for leg in network.expert_legs:
        core = cores[f"G_{leg}"]
        core.zero_()
        if core.ndim == 2:
            core[:, 0] = 1.0
        else:
            for k in range(min(core.shape[0], core.shape[2])):
                core[k, :, k] = 1.0
