"""Dense references: materialising ``W``, single expert matrices and the naive forward pass.

These exist for checking and analysis. The layers' forward pass never calls them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mumoe_tn.contractions.execute import run_plan
from mumoe_tn.contractions.plan import ContractionPlan, plan_contraction, plan_dense
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork

__all__ = ["dense_forward", "expert_matrix", "materialise", "squared_norm", "squared_norm_plan"]


def materialise(network: ExpertNetwork, cores: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Contract the cores into the dense expert tensor ``W`` of shape ``(N_1, …, N_E, I, O)``.

    Parameters
    ----------
    network : ExpertNetwork
        The network the cores belong to.
    cores : Mapping[str, torch.Tensor]
        One tensor per core name, shaped as ``network.core_shape(name)``.

    Returns
    -------
    torch.Tensor
    """
    return run_plan(plan_dense(network), [cores[name] for name in network.cores])


def squared_norm(
    network: ExpertNetwork, cores: Mapping[str, torch.Tensor], *, memory_limit: int | None = None
) -> torch.Tensor:
    """``‖W‖_F²`` contracted from the network and its copy, without materialising ``W``.

    The copy's bonds are renamed and its physical legs are shared with the original, so the
    contraction sums ``W²`` over every entry (the standard tensor-network norm).

    Parameters
    ----------
    network : ExpertNetwork
        The network the cores belong to.
    cores : Mapping[str, torch.Tensor]
        One tensor per core name.
    memory_limit : int, optional
        Most elements an intermediate may hold (a ``ValueError`` from the planner when no path
        found keeps within it).

    Returns
    -------
    torch.Tensor
        A scalar.
    """
    plan = squared_norm_plan(network, memory_limit=memory_limit)
    operands = list(cores[name] for name in network.cores)
    return run_plan(plan, operands + operands)


def squared_norm_plan(
    network: ExpertNetwork, *, memory_limit: int | None = None, smallest_peak: bool = True
) -> ContractionPlan:
    """The plan of [`squared_norm`][mumoe_tn.contractions.dense.squared_norm]: the network and its copy.

    Its operands are the cores in network order, twice.

    Parameters
    ----------
    network : ExpertNetwork
        The network.
    memory_limit : int, optional
        Most elements an intermediate may hold (a ``ValueError`` when no path keeps within it).
    smallest_peak : bool, optional
        Whether the planner may add its search for the smallest peak where no other path fits
        (default True; see [`plan_contraction`][mumoe_tn.contractions.plan.plan_contraction]).

    Returns
    -------
    ContractionPlan
    """
    physical = {*network.expert_legs, INPUT_LEG, OUTPUT_LEG}
    copy = [tuple(x if x in physical else f"{x}'" for x in labels) for labels in network.cores.values()]
    inputs = [*network.cores.values(), *copy]
    sizes = {**network.sizes, **{f"{bond}'": network.sizes[bond] for bond in network.bonds}}
    return plan_contraction(inputs, (), sizes, memory_limit=memory_limit, smallest_peak=smallest_peak)


def expert_matrix(
    network: ExpertNetwork, cores: Mapping[str, torch.Tensor], index: int | Sequence[int]
) -> torch.Tensor:
    """The ``I × O`` weight matrix of one expert, without materialising ``W``.

    Each expert-mode core is sliced at the expert's index along its leg, and the rest of the
    network is contracted to ``(i, o)``.

    Parameters
    ----------
    network : ExpertNetwork
        The network the cores belong to.
    cores : Mapping[str, torch.Tensor]
        One tensor per core name.
    index : int or Sequence[int]
        The expert's index: an int for one expert mode, or one int per mode
        ``(n_1, …, n_E)``. Negative indices count from the end.

    Returns
    -------
    torch.Tensor
        Shape ``(I, O)``.
    """
    legs = network.expert_legs
    if isinstance(index, int) and not isinstance(index, bool):
        index = (index,)
    if isinstance(index, (bool, str)) or not isinstance(index, Sequence):
        raise TypeError(f"an expert index is an int or one int per expert mode {legs}, got {index!r}")
    index = tuple(index)
    if len(index) != len(legs) or not all(isinstance(k, int) and not isinstance(k, bool) for k in index):
        raise ValueError(f"an expert index needs one int per expert mode {legs}, got {index!r}")
    for leg, k in zip(legs, index, strict=True):
        if not -network.sizes[leg] <= k < network.sizes[leg]:
            raise ValueError(f"expert index {k} is out of range for leg {leg!r} of size {network.sizes[leg]}")
    chosen = dict(zip(legs, index, strict=True))
    inputs, operands = [], []
    for name, labels in network.cores.items():
        tensor = cores[name]
        for axis in reversed(range(len(labels))):
            if labels[axis] in chosen:
                tensor = tensor.select(axis, chosen[labels[axis]])
        kept = tuple(label for label in labels if label not in chosen)
        inputs.append(kept)
        operands.append(tensor)
    plan = plan_contraction(inputs, (INPUT_LEG, OUTPUT_LEG), network.sizes)
    return run_plan(plan, operands)


def dense_forward(weight: torch.Tensor, coefficients: Sequence[torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """The naive μMoE forward pass over a materialised ``W`` (paper Eq. 1 and its hierarchical sum).

    ``y = W ×_1 a_1 … ×_E a_E ×_{E+1} z``, computed as in the paper's description: first every
    expert's matrix times the input, then the sums over the expert modes weighted by the
    coefficients, one mode at a time.

    Parameters
    ----------
    weight : torch.Tensor
        Dense ``W`` of shape ``(N_1, …, N_E, I, O)``.
    coefficients : Sequence of torch.Tensor
        ``E`` tensors of shape ``(B, N_e)``.
    z : torch.Tensor
        Input of shape ``(B, I)``.

    Returns
    -------
    torch.Tensor
        Shape ``(B, O)``.
    """
    n_modes = weight.ndim - 2
    if len(coefficients) != n_modes:
        raise ValueError(f"W has {n_modes} expert modes but {len(coefficients)} coefficient tensors were given")
    # (B, N_1, …, N_E, O): every expert's output for every input.
    outputs = torch.einsum("bi,...io->b...o", z, weight)
    for a in coefficients:
        outputs = torch.einsum("bn,bn...->b...", a, outputs)
    return outputs
