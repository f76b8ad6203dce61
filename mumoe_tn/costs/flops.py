"""FLOP counts, in fused multiply-adds (torch-free).

**Unit.** One fused multiply-add (FMA) is one FLOP, the paper's convention (fvcore). A
product of an ``m × k`` and a ``k × n`` matrix is ``m·k·n`` FMAs; an elementwise product of
two length-``n`` vectors is ``n``; summing ``n`` numbers is ``n``. opt_einsum's ``opt_cost``
counts 2 per FMA except on steps that sum no index (counted once), and cotengra doubles both:
neither is used here except as a cross-check in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mumoe_tn.contractions.plan import plan_dense, plan_forward
from mumoe_tn.costs.params import layer_in_features
from mumoe_tn.gates.specs import GateSpec, gate_fma_per_token
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.validation import check_size

__all__ = [
    "LayerFlops",
    "dense_forward_fma",
    "gate_fma",
    "layer_flops",
    "materialise_fma",
    "matmul_fma",
]


def matmul_fma(m: int, k: int, n: int) -> int:
    """FMAs of an ``(m × k) · (k × n)`` matrix product: ``m·k·n``."""
    return m * k * n


def gate_fma(network: ExpertNetwork, *, bias: bool = True, gate: bool | GateSpec = True) -> int:
    """FMAs of the gate for one token.

    ``gate=True`` counts the default gate's logits ``G_eᵀ z`` (``I·ΣN_e``), ``False`` gives 0,
    and a gate descriptor ([`mumoe_tn.gates.specs`][mumoe_tn.gates.specs]) reports its own count.
    """
    return gate_fma_per_token(gate, layer_in_features(network, bias), network.expert_dims)


def materialise_fma(network: ExpertNetwork) -> int:
    """FMAs of materialising ``W`` from the cores (planned contraction)."""
    return plan_dense(network).fma


def dense_forward_fma(network: ExpertNetwork) -> int:
    """FMAs per token of the naive forward over a materialised ``W`` (paper Eq. 1 and its hierarchical sum).

    Every expert's matrix times the input (``N·I·O``, ``N = ∏N_e``), then the sums over the
    expert modes weighted by the coefficients (``N_1⋯N_E·O + N_2⋯N_E·O + … + N_E·O``).
    """
    total = network.n_experts * network.in_features * network.out_features
    remaining = network.n_experts
    for size in network.expert_dims:
        total += remaining * network.out_features
        remaining //= size
    return total


@dataclass(frozen=True)
class LayerFlops:
    """FLOPs (FMAs) of one μMoE layer for a batch of tokens.

    Attributes
    ----------
    batch : int
        Number of tokens.
    planned : int
        FMAs of the planned factorized contraction for the whole batch.
    gate : int
        FMAs of the gate logits for the whole batch (0 when not counted).
    closed_form : int or None
        The format's stated formula times the batch (None when the network has no format or
        the format states none).
    hand_order : int or None
        The format's hand-derived order's exact FMAs times the batch (None likewise).
    peak_elements : int
        Elements of the largest intermediate of the planned contraction.
    """

    batch: int
    planned: int
    gate: int
    closed_form: int | None
    hand_order: int | None
    peak_elements: int

    @property
    def total(self) -> int:
        """Planned contraction plus gating."""
        return self.planned + self.gate

    @property
    def per_token(self) -> float:
        """``total / batch``."""
        return self.total / self.batch


def layer_flops(
    network: ExpertNetwork,
    *,
    batch: int = 1,
    bias: bool = True,
    gate: bool | GateSpec = True,
    optimize: Any = "auto",
) -> LayerFlops:
    """FLOPs of one μMoE layer on ``batch`` tokens, from the plan the layer would run.

    Parameters
    ----------
    network : ExpertNetwork
        The expert network.
    batch : int, optional
        Number of tokens (the plan depends on it).
    bias : bool, optional
        Whether leg ``i`` holds a folded bias column (affects the gate's width).
    gate : bool or GateSpec, optional
        Count the gate: the default's logits (``True``), nothing (``False``), or a descriptor.
    optimize : str or object, optional
        Path optimizer, as for the layers.

    Returns
    -------
    LayerFlops
    """
    if not isinstance(network, ExpertNetwork):
        raise TypeError(f"layer_flops needs an ExpertNetwork, got {network!r} ({type(network).__name__})")
    check_size("batch", batch)
    plan = plan_forward(network, batch, optimize)
    fmt = network.format
    closed = None if fmt is None else fmt.closed_form_fma(network)
    hand = None if fmt is None else fmt.hand_fma(network)
    return LayerFlops(
        batch=batch,
        planned=plan.fma,
        gate=batch * gate_fma(network, bias=bias, gate=gate),
        closed_form=None if closed is None else batch * closed,
        hand_order=None if hand is None else batch * hand,
        peak_elements=plan.largest_intermediate,
    )
