"""Search structures and ranks for a parameter budget; keep the Pareto front.

Every shape of the space ([`mumoe_tn.design.space`][mumoe_tn.design.space]) is matched to the budget by
[`mumoe_tn.costs.match_layer`][mumoe_tn.costs.matching.match_layer] (or `match_block` for an MLP block),
and costed like a [`compare`][mumoe_tn.costs.table.compare] row: total parameters (gating counted by
default), planned FMAs per token, the peak intermediate at ``batch`` tokens, and the expert-matrix
rank bound. A match that misses the budget by more than the matcher's
[`TOLERANCE`][mumoe_tn.costs.matching] or leaves an expert mode collapsed is dropped (and counted).
A shape with no bond to scale (MxD: its size is set by its legs, and the design fixes the number of
experts) is costed at its fixed size and kept only where that is within the tolerance of the budget;
otherwise it is dropped as ``"no bond to scale: misses the budget at its fixed size"``.
With a pretrained layer, every point also carries the relative error of upcycling it.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

from mumoe_tn.costs.baselines import linear, mlp
from mumoe_tn.costs.flops import layer_flops
from mumoe_tn.costs.matching import TOLERANCE, MatchingWarning, match_block, match_layer, resolve_target
from mumoe_tn.costs.params import block_parameters, layer_parameters
from mumoe_tn.costs.rank import collapsed_expert_modes, rank_bound
from mumoe_tn.design.front import pareto_front
from mumoe_tn.design.result import DesignPoint, DesignResult
from mumoe_tn.design.space import DEFAULT_EXPERT_RANKS, HADAMARD_LEGS, Shape, search_space
from mumoe_tn.design.space import families as all_families
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.validation import check_bool, check_size

__all__ = ["design", "evaluate"]


def _budget(budget: object, in_features: int, out_features: int, bias: bool) -> tuple[int, bool, str]:
    """``(parameters, block, reference name)`` of a budget."""
    reference = linear(in_features, out_features, bias=bias)
    if budget == "linear":
        return reference.params, False, reference.name
    if budget == "mlp":
        block = mlp(in_features, out_features, in_features, bias=bias)
        return block.params, True, block.name
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return resolve_target(budget, reference.params), False, reference.name
    raise ValueError(
        f"budget must be 'linear', 'mlp', a number of parameters (int) or a fraction of nn.Linear's (float), "
        f"got {budget!r}"
    )


def _distinct(points: list[DesignPoint]) -> list[DesignPoint]:
    """The first of points with equal objectives (named formats come first in the space)."""
    seen: set[tuple[float, ...]] = set()
    kept = []
    for point in points:
        if point.objectives() not in seen:
            seen.add(point.objectives())
            kept.append(point)
    return kept


def evaluate(
    shape: Shape,
    target: int,
    in_features: int,
    out_features: int,
    *,
    block: bool = False,
    bias: bool = True,
    gate: bool = True,
    batch: int = 1,
    rank_multiple: int = 1,
) -> DesignPoint | str:
    """Match ``shape`` to ``target`` parameters and cost it; a string says why it was dropped.

    A shape without a bond to scale (``shape.scaled`` empty) keeps its fixed size: it is costed as
    it is and dropped unless its parameters are within the matcher's ``TOLERANCE`` of ``target``.

    Parameters
    ----------
    shape : Shape
        The structure.
    target : int
        Parameter budget (layer, or block with ``block=True``).
    in_features, out_features : int
        The layer's sizes (a block is ``in → out → in``).
    block, bias, gate, batch, rank_multiple : optional
        As for [`design`][mumoe_tn.design.structure_search.design].

    Returns
    -------
    DesignPoint or str
    """
    width = in_features + int(bias)
    first = shape.make(width, out_features)
    if not shape.scaled:
        return _fixed(shape, first, target, in_features, out_features, block=block, bias=bias, gate=gate, batch=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MatchingWarning)
        try:
            if block:
                second = shape.make(out_features + int(bias), in_features)
                matched = match_block(
                    first, second, target, bonds=shape.scaled, bias=bias, gate=gate, rank_multiple=rank_multiple
                )
            else:
                matched = match_layer(
                    first, target, bonds=shape.scaled, bias=bias, gate=gate, rank_multiple=rank_multiple
                )
        except ValueError:
            return "cannot reach the budget"
    if matched.problems:
        return "collapsed expert mode" if "collapse" in " ".join(matched.problems) else "misses the budget"
    return _point(shape, matched.networks, matched.params, batch=batch, bias=bias, gate=gate)


#: Why a shape without a bond was dropped.
FIXED_MISS = "no bond to scale: misses the budget at its fixed size"


def _fixed(
    shape: Shape,
    first: ExpertNetwork,
    target: int,
    in_features: int,
    out_features: int,
    *,
    block: bool,
    bias: bool,
    gate: bool,
    batch: int,
) -> DesignPoint | str:
    """A shape with no bond, costed at its fixed size (kept within the matcher's tolerance of ``target``)."""
    if block:
        networks: tuple[ExpertNetwork, ...] = (first, shape.make(out_features + int(bias), in_features))
        params = block_parameters(*networks, bias=bias, gate=gate).total
    else:
        networks = (first,)
        params = layer_parameters(first, bias=bias, gate=gate).total
    if abs(params - target) > TOLERANCE * target:
        return FIXED_MISS
    if any(collapsed_expert_modes(net) for net in networks):
        return "collapsed expert mode"
    return _point(shape, networks, params, batch=batch, bias=bias, gate=gate)


def _point(
    shape: Shape, networks: tuple[ExpertNetwork, ...], params: int, *, batch: int, bias: bool, gate: bool
) -> DesignPoint:
    flops = [layer_flops(net, batch=batch, bias=bias, gate=gate) for net in networks]
    return DesignPoint(
        family=shape.family,
        structure=shape.label,
        networks=networks,
        params=params,
        fma=sum(f.per_token for f in flops),
        peak_elements=max(f.peak_elements for f in flops),
        rank_bound=min(rank_bound(net) for net in networks),
    )


def design(
    in_features: int = 768,
    out_features: int = 3072,
    experts: int | Sequence[int] = 256,
    *,
    budget: str | int | float = "linear",
    max_fma: float | None = None,
    max_peak: int | None = None,
    batch: int = 1,
    min_rank: int = 1,
    rank_multiple: int = 1,
    max_modes: int = 3,
    families: Sequence[str] | None = None,
    expert_ranks: Sequence[int] = DEFAULT_EXPERT_RANKS,
    topology_modes: int = 2,
    hadamard: Sequence[str] = HADAMARD_LEGS,
    bias: bool = True,
    gate: bool = True,
    weight: Any = None,
    fit_iterations: int = 50,
    measure: bool = False,
    progress: bool | None = None,
) -> DesignResult:
    """The Pareto front of expert networks for a parameter budget.

    Parameters
    ----------
    in_features, out_features : int
        The layer's sizes (the paper's GPT-2 MLP layer by default, 768 → 3072).
    experts : int or Sequence[int]
        The total number of experts, factored into 1 … ``max_modes`` expert modes, or fixed
        expert dims ``(N_1, …, N_E)``.
    budget : "linear" or "mlp" or int or float, optional
        Parameters: the nn.Linear of the same sizes (default), the MLP block ``in → out → in``
        (each point is then a block of two layers of the same structure), a number, or a fraction
        of the nn.Linear's.
    max_fma : float, optional
        Keep points with at most this many FMAs per token.
    max_peak : int, optional
        Keep points whose peak intermediate at ``batch`` tokens has at most this many elements.
    batch : int, optional
        Tokens per forward pass for the planned FMAs and the peak intermediate (default 1).
    min_rank : int, optional
        Keep points whose expert-matrix rank bound is at least this.
    rank_multiple : int, optional
        Matched ranks are multiples of this.
    max_modes, families, expert_ranks, topology_modes, hadamard : optional
        The search space; see [`search_space`][mumoe_tn.design.space.search_space].
    bias, gate : bool, optional
        Fold a bias into the input leg; count gating parameters and FMAs.
    weight : nn.Linear or torch.Tensor, optional
        A pretrained layer (nn.Linear, or its ``(out, in)`` weight) that every expert starts as,
        or a dense expert tensor ``(N_1, …, N_E, I, O)`` (``experts`` must then be its dims): each
        point's upcycle error becomes an objective.
    fit_iterations : int, optional
        Sweeps of the generic fit of a pretrained weight (networks without a closed form).
    measure : bool, optional
        Time the forward pass of every point of the front (CPU, ``batch`` tokens).
    progress : bool, optional
        Show a progress bar (default: when standard error is a terminal).

    Returns
    -------
    DesignResult
        ``result.front`` (the Pareto front), ``result.best`` (its chosen network, ready for
        ``MuMoE(..., decomposition=result.best)``) and every evaluated point.
    """
    for name, value in (("in_features", in_features), ("out_features", out_features), ("batch", batch)):
        check_size(name, value)
    check_size("min_rank", min_rank)
    check_size("rank_multiple", rank_multiple)
    check_bool("bias", bias)
    check_bool("gate", gate)
    check_bool("measure", measure)
    for name, value in (("max_fma", max_fma), ("max_peak", max_peak)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    target, block, reference = _budget(budget, in_features, out_features, bias)
    fit = None
    if weight is not None:
        from mumoe_tn.design.fit import upcycle_error_of

        if block:
            raise ValueError("a pretrained weight is fitted layer by layer: use budget='linear', a count or a fraction")
        fit = upcycle_error_of(
            weight, in_features, out_features, bias, max_iter=check_size("fit_iterations", fit_iterations)
        )
        experts = fit.expert_dims or experts
    shapes = search_space(
        experts, max_modes=max_modes, families=families, expert_ranks=expert_ranks, topology_modes=topology_modes,
        hadamard=hadamard,
    )  # fmt: skip
    from tqdm.auto import tqdm

    show = sys.stderr.isatty() if progress is None else bool(progress)
    points: list[DesignPoint] = []
    dropped: Counter[str] = Counter()
    for shape in tqdm(shapes, desc="design", unit="network", disable=not show, leave=False):
        point = evaluate(
            shape, target, in_features, out_features, block=block, bias=bias, gate=gate, batch=batch,
            rank_multiple=rank_multiple,
        )  # fmt: skip
        if isinstance(point, str):
            dropped[point] += 1
        elif max_fma is not None and point.fma > max_fma:
            dropped["above max_fma"] += 1
        elif max_peak is not None and point.peak_elements > max_peak:
            dropped["above max_peak"] += 1
        elif point.rank_bound < min_rank:
            dropped["below min_rank"] += 1
        else:
            points.append(point if fit is None else point.with_error(fit(point.network)))
    if not points:
        raise ValueError(
            f"no network of the search meets the budget of {target:,} parameters and the constraints "
            f"(dropped: {dict(dropped)}); loosen them or widen the search"
        )
    front = _distinct(pareto_front(points, DesignPoint.objectives))
    if measure:
        from mumoe_tn.design.fit import forward_latency

        front = [point.with_latency(forward_latency(point.networks[0], batch=batch, bias=bias)) for point in front]
    config = {
        "in_features": in_features,
        "out_features": out_features,
        "experts": experts if isinstance(experts, int) else list(experts),
        "budget": budget,
        "target_params": target,
        "reference": reference,
        "block": block,
        "max_fma": max_fma,
        "max_peak": max_peak,
        "batch": batch,
        "min_rank": min_rank,
        "rank_multiple": rank_multiple,
        "max_modes": max_modes,
        "families": list(all_families() if families is None else families),
        "expert_ranks": list(expert_ranks),
        "hadamard": list(hadamard),
        "bias": bias,
        "gate": gate,
        "fitted": fit is not None,
        "measured": measure,
        "searched": len(shapes),
        "dropped": dict(dropped),
    }
    return DesignResult(tuple(points), tuple(front), config)
