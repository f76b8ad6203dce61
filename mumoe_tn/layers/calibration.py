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
parameters or a small-batch forward's (or a one-row forward's, where that is larger; see
[`calibration_limit`][mumoe_tn.layers.calibration.calibration_limit]), so the calibration holds less
than the parameters themselves. The exact norm is taken where it fits and costs no more than the
most probes of the estimate would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from mumoe_tn.contractions.dense import squared_norm_plan
from mumoe_tn.contractions.pairwise import contract_pair
from mumoe_tn.contractions.plan import ContractionPlan, ContractionStep, plan_forward
from mumoe_tn.network import BATCH_LABEL, ExpertNetwork

__all__ = [
    "CALIBRATION_BATCH",
    "CALIBRATION_MINIMUM",
    "CALIBRATION_MIN_PROBES",
    "CALIBRATION_PROBES",
    "CALIBRATION_TOLERANCE",
    "calibration_limit",
    "log_squared_norm",
    "scaled_contract",
]

#: Batch of the forward pass whose largest intermediate bounds the calibration's.
CALIBRATION_BATCH = 64
#: The calibration may build intermediates of this many elements (256 KiB in float32) in any network:
#: small layers calibrate exactly.
CALIBRATION_MINIMUM = 1 << 16
#: Most random probes of the estimate used where the exact norm would need larger intermediates.
CALIBRATION_PROBES = 256
#: Fewest probes the estimate stops at ...
CALIBRATION_MIN_PROBES = 32
#: ... once the relative standard error of their mean is below this (about 1 % on the init's scale).
CALIBRATION_TOLERANCE = 0.02


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The cores' own dtype where its range holds a step's sums (float64, float32, bfloat16), else float32."""
    return dtype if dtype in (torch.float64, torch.float32, torch.bfloat16) else torch.float32


def _shares_storage(tensor: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    pointer = tensor.untyped_storage().data_ptr()
    return any(other.untyped_storage().data_ptr() == pointer for other in others)


#: A step whose operands exceed this many elements is computed in slices of one label ...
STEP_SLICE = 1 << 18
#: ... or, in the calibration, a ``SLICE_FRACTION``-th of the parameters where that is fewer ...
SLICE_FRACTION = 8
#: ... but not below this many elements (smaller slices are not worth their extra products).
SLICE_MINIMUM = 1 << 12


def _cast(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    if all(tensor.dtype == dtype for tensor in tensors):
        return list(tensors)
    cast = {id(tensor): tensor.to(dtype) for tensor in tensors}  # a core and its copy: cast once
    return [cast[id(tensor)] for tensor in tensors]


def _narrowed(
    picked: Sequence[torch.Tensor], operands: Sequence[tuple[str, ...]], label: str, start: int, count: int
) -> list[torch.Tensor]:
    return [
        tensor.narrow(labels.index(label), start, count) if label in labels else tensor
        for tensor, labels in zip(picked, operands, strict=True)
    ]


def _sliced_step(
    step: ContractionStep, picked: list[torch.Tensor], dtype: torch.dtype, slice_elements: int
) -> torch.Tensor:
    """One step, in slices of one label where an operand exceeds ``slice_elements`` elements.

    Laying a core out as a matrix (and casting it) copies it; slices keep those copies small. The
    sliced label is one every large operand carries: one the result keeps where there is one (each
    slice fills its part of the result, with the whole inner dimension in one product), else a
    summed one (slices add).
    """
    if len(picked) != 2:
        return contract_pair(step.operands, step.output, _cast(picked, dtype), step.equation)
    big = max(range(2), key=lambda k: picked[k].numel())
    largest = picked[big].numel()
    labels = step.operands[big]
    sizes = dict(zip(labels, picked[big].shape, strict=True))
    # A label every large operand carries, so that slicing leaves no large operand whole.
    shared = [
        label
        for label in labels
        if all(label in step.operands[k] for k in range(2) if picked[k].numel() > slice_elements)
    ]
    kept = [label for label in shared if label in step.output and sizes[label] > 1]
    summed = [label for label in shared if label not in step.output and label in step.operands[1 - big]]
    if largest <= slice_elements or not (kept or summed):
        return contract_pair(step.operands, step.output, _cast(picked, dtype), step.equation)
    # The outermost kept label slices the large operand into contiguous blocks.
    label = kept[0] if kept else max(summed, key=sizes.__getitem__)
    size = sizes[label]
    width = max(1, size * slice_elements // largest)
    if kept:
        shape = [
            next(t.shape[o.index(x)] for t, o in zip(picked, step.operands, strict=True) if x in o) for x in step.output
        ]
        total = torch.empty(shape, dtype=dtype, device=picked[0].device)
        axis = step.output.index(label)
    else:
        total = None
    for start in range(0, size, width):
        count = min(width, size - start)
        # The cast slices are freed as soon as their product is taken, before the next slice's.
        parts = _narrowed(picked, step.operands, label, start, count)
        part = contract_pair(step.operands, step.output, _cast(parts, dtype), step.equation)
        if kept:
            total.narrow(axis, start, count).copy_(part)
        else:
            total = part if total is None else total.add_(part)
    return total


def scaled_contract(
    plan: ContractionPlan, operands: Sequence[torch.Tensor], slice_elements: int | None = None
) -> tuple[torch.Tensor, float]:
    """Contract ``operands`` following ``plan``, each step's result divided by its largest magnitude.

    Parameters
    ----------
    plan : ContractionPlan
        The steps; ``len(operands)`` must equal ``len(plan.inputs)``.
    operands : Sequence of torch.Tensor
        Tensors whose dimensions follow ``plan.inputs``; never modified.
    slice_elements : int, optional
        A step with an operand larger than this runs in slices of about this size (default
        `STEP_SLICE`).

    Returns
    -------
    tuple of (torch.Tensor, float)
        ``(result, log_scale)``: the contraction equals ``result · exp(log_scale)``. The result
        has the operands' dtype (float32 for float16 operands).
    """
    slice_elements = STEP_SLICE if slice_elements is None else slice_elements
    dtype = _compute_dtype(operands[0].dtype)
    current = list(operands)
    log_scale = 0.0
    for step in plan.steps:
        picked = [current.pop(k) for k in step.positions]
        result = _sliced_step(step, picked, dtype, slice_elements)
        peak = torch.linalg.vector_norm(result, ord=math.inf).item() if result.numel() else 0.0
        if peak > 0.0 and math.isfinite(peak):
            # A step may return a view of an operand (a core): never divide that in place.
            result = result / peak if _shares_storage(result, picked) else result.div_(peak)
            log_scale += math.log(peak)
        current.append(result)
    return current[0], log_scale


def _row_logs(result: torch.Tensor, log_scale: float, axis: int) -> torch.Tensor:
    """``log ‖row‖²`` of every row (along ``axis``) of ``result · exp(log_scale)``, in float64 on the CPU."""
    rows = result.movedim(axis, 0).reshape(result.shape[axis], -1)
    norms = torch.linalg.vector_norm(rows, dim=1).double().cpu()  # a reduction: no squared copy
    return 2.0 * (norms.log() + log_scale)


def _log_mean(logs: torch.Tensor) -> tuple[float, float]:
    """``log`` of the mean of ``exp(logs)`` and the mean's relative standard error (``inf`` if undefined)."""
    top = logs.max().item()
    if top == -math.inf:
        return top, math.inf
    values = (logs - top).exp()
    mean = values.mean().item()
    error = values.std().item() / (mean * math.sqrt(len(values))) if len(values) > 1 else math.inf
    return top + math.log(mean), error


def _random_expert(size: int, count: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``count`` rows ``√size · e_k`` with ``k`` uniform: ``E[a aᵀ] = I``."""
    index = torch.randint(0, size, (count,), device=like.device, generator=generator)
    rows = torch.zeros(count, size, dtype=like.dtype, device=like.device)
    return rows.index_put_((torch.arange(count, device=like.device), index), rows.new_tensor(size**0.5))


def calibration_limit(network: ExpertNetwork) -> tuple[int, int]:
    """Most elements a calibration intermediate may hold, and the rows of one probe pass.

    The budget is a sixth of the parameter count, at most the largest intermediate of a
    `CALIBRATION_BATCH`-row forward and at least `CALIBRATION_MINIMUM` elements: a step holds two
    operands and its result, so constructing a large layer holds at most about 1.5× its parameters.
    Probe passes take `CALIBRATION_BATCH` rows, or fewer (a power of two) when a forward of that
    many rows exceeds the budget; the limit is the budget or that forward's largest intermediate,
    whichever is larger (a network whose one-row forward exceeds the budget calibrates within that
    forward's memory).

    Returns
    -------
    tuple of (int, int)
        ``(limit, rows)``.
    """
    rows = CALIBRATION_BATCH
    peak = plan_forward(network, rows).largest_intermediate
    budget = max(CALIBRATION_MINIMUM, min(network.n_params // 6, peak))
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
    estimated from rows of forward passes, each row a random expert (one index per mode, drawn
    uniformly; its coefficient ``√N_e``) and random signs (±1) as the input, whose squared outputs
    have expectation ``‖W‖²`` (Hutchinson's estimator over sampled experts; at initialisation the
    experts differ little, so few probes suffice, where Gaussian coefficients would multiply into
    a heavy-tailed product). Passes stop once at least `CALIBRATION_MIN_PROBES` rows give a mean
    whose relative standard error is within `CALIBRATION_TOLERANCE`, or after
    `CALIBRATION_PROBES` rows: a wide layer's rows agree closely and one pass does, where a
    low-rank one takes more. Both run through
    [`scaled_contract`][mumoe_tn.layers.calibration.scaled_contract].

    Parameters
    ----------
    network, cores
        As for [`materialise`][mumoe_tn.contractions.dense.materialise]: the network and a tensor per core name.
    generator : torch.Generator, optional
        Random generator of the probes (on the cores' device).

    Returns
    -------
    float
        ``-inf`` when ``W`` is zero.
    """
    limit, rows = calibration_limit(network)
    slices = min(STEP_SLICE, max(SLICE_MINIMUM, network.n_params // SLICE_FRACTION))
    operands = [cores[name] for name in network.cores]
    plan = plan_forward(network, rows, memory_limit=limit)
    try:
        # Without the smallest-peak search: where the usual finders' paths do not fit, the
        # estimate is cheaper than confirming that no path does (seconds on 16 operands).
        exact = squared_norm_plan(network, memory_limit=limit, smallest_peak=False)
    except ValueError:
        exact = None
    if exact is not None and exact.fma <= plan.fma * math.ceil(CALIBRATION_PROBES / rows):
        value, log_scale = scaled_contract(exact, operands + operands, slices)  # already a sum of squares
        return math.log(value.item()) + log_scale if value.item() > 0.0 else -math.inf
    axis = plan.output.index(BATCH_LABEL)
    like = torch.empty(0, dtype=_compute_dtype(operands[0].dtype), device=operands[0].device)
    logs = torch.empty(0, dtype=torch.float64)
    while len(logs) < CALIBRATION_PROBES:
        probes = [_random_expert(network.sizes[leg], rows, like, generator) for leg in network.expert_legs]
        signs = torch.randint(0, 2, (rows, network.in_features), device=like.device, generator=generator)
        probes.append(signs.to(like.dtype).mul_(2).sub_(1))
        result, log_scale = scaled_contract(plan, operands + probes, slices)
        logs = torch.cat([logs, _row_logs(result, log_scale, axis)])
        value, error = _log_mean(logs)
        if len(logs) >= CALIBRATION_MIN_PROBES and error <= CALIBRATION_TOLERANCE:
            break
    return value
