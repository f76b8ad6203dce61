"""``‖W‖²`` of an expert network for the ``"linear"`` init, within the cores' own memory.

The ``"linear"`` rule scales its cores so that the expert matrices have ``nn.Linear``'s variance,
which needs ``‖W‖²``. A product of many cores under- or overflows a floating type (48 uniform
``64 × 64`` cores in a row give ``‖W‖²`` near ``10⁴¹``, beyond float32), so every step of the contraction
is divided by its largest magnitude and the logarithm of what was taken out is carried alongside:
the result is ``log ‖W‖²``, exact up to rounding in the cores' precision. float64, float32 and
bfloat16 cores are read in place, in their own dtype (bfloat16 has float32's range; its matrix
products accumulate in float32); float16 cores, whose range a step's sum can exceed, are cast to
float32 one slice at a time. A step over a large core runs in slices of a summed label, so laying
the core out as a matrix copies a slice, not the core. No intermediate exceeds a sixth of the
parameters (or a one-row forward's, where that is larger; see
[`calibration_limit`][mumoe_tn.layers.calibration.calibration_limit]), so the calibration holds less
than the parameters themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from mumoe_tn.contractions.dense import squared_norm_plan
from mumoe_tn.contractions.pairwise import contract_pair
from mumoe_tn.contractions.plan import ContractionPlan, ContractionStep, plan_forward
from mumoe_tn.network import ExpertNetwork

__all__ = [
    "CALIBRATION_BATCH",
    "CALIBRATION_FLOOR",
    "CALIBRATION_MINIMUM",
    "CALIBRATION_PROBES",
    "calibration_limit",
    "log_squared_norm",
    "scaled_contract",
]

#: Batch of the forward pass whose largest intermediate bounds the calibration's.
CALIBRATION_BATCH = 64
#: The calibration may build intermediates of this many elements (4 MiB in float32) in networks of six
#: times as many parameters.
CALIBRATION_FLOOR = 1 << 20
#: ... and of this many elements (256 KiB in float32) in any network: small layers calibrate exactly.
CALIBRATION_MINIMUM = 1 << 16
#: Random probes of the estimate used where the exact norm would need larger intermediates.
CALIBRATION_PROBES = 256


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The cores' own dtype where its range holds a step's sums (float64, float32, bfloat16), else float32."""
    return dtype if dtype in (torch.float64, torch.float32, torch.bfloat16) else torch.float32


def _shares_storage(tensor: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    pointer = tensor.untyped_storage().data_ptr()
    return any(other.untyped_storage().data_ptr() == pointer for other in others)


#: A step whose operands exceed this many elements is computed in slices of a summed label.
STEP_SLICE = 1 << 18


def _cast(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    if all(tensor.dtype == dtype for tensor in tensors):
        return list(tensors)
    cast = {id(tensor): tensor.to(dtype) for tensor in tensors}  # a core and its copy: cast once
    return [cast[id(tensor)] for tensor in tensors]


def _sliced_step(step: ContractionStep, picked: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One step, summed over slices of its largest summed label where an operand is large.

    Laying a core out as a matrix (and casting it) copies it; slices keep those copies small.
    """
    largest = max(tensor.numel() for tensor in picked)
    summed = []
    if len(picked) == 2 and largest > STEP_SLICE:
        first, second = step.operands
        summed = [label for label in first if label in second and label not in step.output]
    if not summed:
        return contract_pair(step.operands, step.output, _cast(picked, dtype), step.equation)
    label = max(summed, key=lambda name: picked[0].shape[step.operands[0].index(name)])
    size = picked[0].shape[step.operands[0].index(label)]
    width = max(1, size * STEP_SLICE // largest)
    total = None
    for start in range(0, size, width):
        count = min(width, size - start)
        parts = [
            tensor.narrow(labels.index(label), start, count)
            for tensor, labels in zip(picked, step.operands, strict=True)
        ]
        part = contract_pair(step.operands, step.output, _cast(parts, dtype), step.equation)
        total = part if total is None else total.add_(part)
    return total


def scaled_contract(plan: ContractionPlan, operands: Sequence[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Contract ``operands`` following ``plan``, each step's result divided by its largest magnitude.

    Parameters
    ----------
    plan : ContractionPlan
        The steps; ``len(operands)`` must equal ``len(plan.inputs)``.
    operands : Sequence of torch.Tensor
        Tensors whose dimensions follow ``plan.inputs``; never modified.

    Returns
    -------
    tuple of (torch.Tensor, float)
        ``(result, log_scale)``: the contraction equals ``result · exp(log_scale)``. The result
        has the operands' dtype (float32 for float16 operands).
    """
    dtype = _compute_dtype(operands[0].dtype)
    current = list(operands)
    log_scale = 0.0
    for step in plan.steps:
        picked = [current.pop(k) for k in step.positions]
        result = _sliced_step(step, picked, dtype)
        peak = torch.linalg.vector_norm(result, ord=math.inf).item() if result.numel() else 0.0
        if peak > 0.0 and math.isfinite(peak):
            # A step may return a view of an operand (a core): never divide that in place.
            result = result / peak if _shares_storage(result, picked) else result.div_(peak)
            log_scale += math.log(peak)
        current.append(result)
    return current[0], log_scale


def _log_sum(result: torch.Tensor, log_scale: float) -> float:
    """``log Σ (result · exp(log_scale))²``; ``-inf`` when the result is zero."""
    norm = torch.linalg.vector_norm(result).item()  # a reduction: no squared copy of the result
    return 2.0 * (math.log(norm) + log_scale) if norm > 0.0 else -math.inf


def _random_expert(size: int, count: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``count`` rows ``√size · e_k`` with ``k`` uniform: ``E[a aᵀ] = I``."""
    index = torch.randint(0, size, (count,), device=like.device, generator=generator)
    rows = torch.zeros(count, size, dtype=like.dtype, device=like.device)
    return rows.index_put_((torch.arange(count, device=like.device), index), rows.new_tensor(size**0.5))


def calibration_limit(network: ExpertNetwork) -> tuple[int, int]:
    """Most elements a calibration intermediate may hold, and the rows of one probe pass.

    The budget is a sixth of the parameter count, between `CALIBRATION_MINIMUM` and
    `CALIBRATION_FLOOR` elements: a step holds its two operands and its result, so constructing a
    large layer holds at most about 1.5× its parameters. Probe passes take `CALIBRATION_BATCH` rows,
    or fewer (a power of two) when a forward of that many rows exceeds the budget; the limit is the
    budget or that forward's largest intermediate, whichever is larger (a network whose one-row forward exceeds the
    budget calibrates within that forward's memory).

    Returns
    -------
    tuple of (int, int)
        ``(limit, rows)``.
    """
    budget = max(CALIBRATION_MINIMUM, min(CALIBRATION_FLOOR, network.n_params // 6))
    rows = CALIBRATION_BATCH
    peak = plan_forward(network, rows).largest_intermediate
    if peak > budget:  # intermediates grow about linearly with the rows: guess, then step down
        rows = max(1, 1 << max(0, int(math.log2(max(1, rows * budget // peak)))))
        peak = plan_forward(network, rows).largest_intermediate
        while rows > 1 and peak > budget:
            rows //= 2
            peak = plan_forward(network, rows).largest_intermediate
    return max(peak, budget), rows


def log_squared_norm(
    network: ExpertNetwork, cores: Mapping[str, torch.Tensor], generator: torch.Generator | None = None
) -> float:
    """``log ‖W‖²`` with no intermediate beyond [`calibration_limit`][mumoe_tn.layers.calibration.calibration_limit].

    Exact (the network contracted with its copy) where a path keeps within that; otherwise
    estimated from `CALIBRATION_PROBES` rows of forward passes, each row a random expert (one index per
    mode, drawn uniformly; its coefficient ``√N_e``) and random signs (±1) as the input, whose
    squared outputs have expectation ``‖W‖²`` (Hutchinson's estimator over sampled experts; at
    initialisation the experts differ little, so few probes suffice, where Gaussian coefficients
    would multiply into a heavy-tailed product). Both run through
    [`scaled_contract`][mumoe_tn.layers.calibration.scaled_contract].

    Parameters
    ----------
    network : ExpertNetwork
        The network the cores belong to.
    cores : Mapping[str, torch.Tensor]
        One tensor per core name, shaped as ``network.core_shape(name)``.
    generator : torch.Generator, optional
        Random generator of the probes (on the cores' device).

    Returns
    -------
    float
        ``-inf`` when ``W`` is zero.
    """
    limit, rows = calibration_limit(network)
    operands = [cores[name] for name in network.cores]
    try:
        plan = squared_norm_plan(network, memory_limit=limit)
    except ValueError:
        pass
    else:
        value, log_scale = scaled_contract(plan, operands + operands)  # already a sum of squares
        return math.log(value.item()) + log_scale if value.item() > 0.0 else -math.inf
    plan = plan_forward(network, rows, memory_limit=limit)
    like = torch.empty(0, dtype=_compute_dtype(operands[0].dtype), device=operands[0].device)
    logs = []
    for _ in range(max(1, CALIBRATION_PROBES // rows)):
        probes = [_random_expert(network.sizes[leg], rows, like, generator) for leg in network.expert_legs]
        signs = torch.randint(0, 2, (rows, network.in_features), device=like.device, generator=generator)
        probes.append(signs.to(like.dtype).mul_(2).sub_(1))
        logs.append(_log_sum(*scaled_contract(plan, operands + probes)))
    top = max(logs)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(value - top) for value in logs) / (len(logs) * rows))
