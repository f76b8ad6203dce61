"""Initialisation of expert-network cores (paper appendix "Weight initialization").

Two rules, both of which make every expert start as the same linear map, up to
multiplicative ``N(1, σ_e)`` noise on the cores of expert mode ``e``:

``"paper"`` (the rule of CP and TR formats; any network may ask for it)
    Expert-mode cores replicate along their expert leg: CP factor entries are ``N(1, σ)``,
    TR slices ``G(:, n, :)`` are diagonal with ``N(1, σ)`` entries. Every other core is drawn
    from ``U(±√k)``, ``k = 1 / fan_in``, where ``fan_in`` is the size of what that core is
    multiplied with in the forward pass: ``I`` for the input core, the product of its bond
    sizes for the output core.
``"linear"`` (any network)
    Expert-mode cores replicate one template along their expert legs: ones for one bond, a
    (rectangular) identity for two bonds, a diagonal for more, and a shared random tensor
    when the core also carries ``i`` or ``o``. The other cores are drawn from ``U(±1)`` (zero
    mean), the expert noise is applied, and then those cores are all scaled by one factor so
    that the entries of all expert matrices have a mean square of exactly ``1 / (3·fan_in)``,
    the variance of ``nn.Linear``'s default init. The mean square is ``‖W‖²/(N·I·O)``,
    contracted from the network and its copy; ``W`` is never materialised.

``σ`` is 1 on the first expert mode and 0 on the others by default (the paper's setting).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mumoe_tn.contractions.dense import squared_norm
from mumoe_tn.contractions.execute import run_plan
from mumoe_tn.contractions.plan import plan_forward
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork, is_expert_leg
from mumoe_tn.validation import check_positive_float, check_size

__all__ = ["INIT_RULES", "check_expert_noise", "default_expert_noise", "init_cores"]

INIT_RULES = ("auto", "paper", "linear")


def default_expert_noise(n_modes: int) -> tuple[float, ...]:
    """The paper's noise levels: ``σ = 1`` on the first expert mode, ``0`` on the others."""
    return (1.0,) + (0.0,) * (n_modes - 1)


def check_expert_noise(expert_noise: Sequence[float] | None, n_modes: int) -> tuple[float, ...]:
    """``expert_noise`` as ``n_modes`` finite non-negative floats (the default if None).

    Raises
    ------
    TypeError, ValueError
        If it is not a sequence of ``n_modes`` finite numbers ``>= 0``.
    """
    if expert_noise is None:
        return default_expert_noise(n_modes)
    if isinstance(expert_noise, (str, bytes)) or not isinstance(expert_noise, Sequence):
        raise TypeError(
            f"expert_noise must be a sequence of {n_modes} floats (one per expert mode), got {expert_noise!r}"
        )
    if len(expert_noise) != n_modes:
        raise ValueError(
            f"expert_noise needs {n_modes} value(s), one per expert mode, got {len(expert_noise)}: "
            f"{tuple(expert_noise)}"
        )
    return tuple(
        check_positive_float(f"expert_noise[{m}]", sigma, allow_zero=True) for m, sigma in enumerate(expert_noise)
    )


@torch.no_grad()
def init_cores(
    network: ExpertNetwork,
    cores: Mapping[str, torch.Tensor],
    *,
    rule: str = "auto",
    fan_in: int | None = None,
    expert_noise: Sequence[float] | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Initialise ``cores`` in place.

    On the meta device (deferred initialisation: build on ``device="meta"``, then
    ``module.to_empty(device=…)`` and ``reset_parameters()``) the draws are no-ops and the
    ``"linear"`` rule's final scaling, which needs values, is skipped.

    Parameters
    ----------
    network : ExpertNetwork
        The network the cores belong to.
    cores : Mapping[str, torch.Tensor]
        One tensor per core, shaped as ``network.core_shape(name)``.
    rule : {"auto", "paper", "linear"}, optional
        ``"auto"`` uses the network's format's [`init_rule`][mumoe_tn.decompositions.format.Format]
        (``"paper"`` for CP and TR) and ``"linear"`` for a network without a format.
    fan_in : int, optional
        ``fan_in`` of the ``nn.Linear`` whose variance the ``"linear"`` rule targets; the size
        of leg ``i`` by default (pass the layer's ``in_features`` when a bias is folded).
    expert_noise : Sequence[float], optional
        ``σ_e`` for every expert mode; [`default_expert_noise`][mumoe_tn.layers.init.default_expert_noise] by default.
    generator : torch.Generator, optional
        Random generator on the cores' device, for reproducible draws.
    """
    if rule not in INIT_RULES:
        raise ValueError(f"unknown init rule {rule!r}; choose one of {list(INIT_RULES)}")
    if rule == "auto":
        rule = "linear" if network.format is None else network.format.init_rule
    if rule not in ("paper", "linear"):
        raise ValueError(f"the format of {network.name!r} names an unknown init rule {rule!r}")
    n_modes = network.n_expert_modes
    noise = check_expert_noise(expert_noise, n_modes)
    fan_in = network.in_features if fan_in is None else check_size("fan_in", fan_in)

    scalable = []
    for name, labels in network.cores.items():
        tensor = cores[name]
        rest = [label for label in labels if not is_expert_leg(label)]
        if len(rest) == len(labels):
            if rule == "paper":
                bound = _paper_fan_in(network, name) ** -0.5
                tensor.uniform_(-bound, bound, generator=generator)
            else:
                tensor.uniform_(-1.0, 1.0, generator=generator)
                scalable.append(tensor)
            continue
        template = _template(network, name, rest, tensor, generator)
        if template is None:
            # The core carries i or o as well: a shared random slice, replicated.
            shape = [1 if is_expert_leg(label) else network.sizes[label] for label in labels]
            shared = torch.empty(shape, dtype=tensor.dtype, device=tensor.device).uniform_(
                -1.0, 1.0, generator=generator
            )
            tensor.copy_(shared.expand_as(tensor))
            scalable.append(tensor)
        else:
            tensor.copy_(template)

    for name, labels in network.cores.items():
        for label in labels:
            if is_expert_leg(label):
                sigma = noise[int(label[1:]) - 1]
                if sigma > 0:
                    shape = [1 if is_expert_leg(other) and other != label else network.sizes[other] for other in labels]
                    factor = torch.empty(shape, dtype=cores[name].dtype, device=cores[name].device)
                    cores[name].mul_(factor.normal_(1.0, sigma, generator=generator))

    if rule == "linear" and not any(tensor.is_meta for tensor in cores.values()):
        # Meta tensors (deferred initialisation) hold no values to scale.
        _calibrate(network, cores, scalable, target=1.0 / (3.0 * fan_in), generator=generator)


def _paper_fan_in(network: ExpertNetwork, core: str) -> int:
    labels = network.cores[core]
    if INPUT_LEG in labels and OUTPUT_LEG not in labels:
        return network.sizes[INPUT_LEG]
    total = 1
    for label in labels:
        if label != OUTPUT_LEG:
            total *= network.sizes[label]
    return total


def _template(
    network: ExpertNetwork,
    core: str,
    rest: list[str],
    tensor: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor | None:
    """Replicated template of an expert-mode core, or None when it also holds ``i``/``o``."""
    if INPUT_LEG in rest or OUTPUT_LEG in rest:
        return None
    labels = network.cores[core]
    bond_sizes = [network.sizes[label] for label in rest]
    diagonal = torch.zeros(bond_sizes, dtype=tensor.dtype, device=tensor.device)
    if len(rest) == 1:
        diagonal.fill_(1.0)
    else:
        for k in range(min(bond_sizes)):
            diagonal[(k,) * len(rest)] = 1.0
    # Put the template's axes where the bonds sit and broadcast over the expert legs.
    shape = [1 if is_expert_leg(label) else network.sizes[label] for label in labels]
    return diagonal.reshape(shape).expand(tensor.shape)


#: Batch of the forward pass whose largest intermediate bounds the calibration's.
CALIBRATION_BATCH = 64
#: The calibration may always build intermediates of this many elements (8 MiB in float64).
CALIBRATION_FLOOR = 1 << 20
#: Random probes of the estimate used where the exact norm would need larger intermediates.
CALIBRATION_PROBES = 256


def _calibrate(
    network: ExpertNetwork,
    cores: Mapping[str, torch.Tensor],
    scalable: list[torch.Tensor],
    target: float,
    generator: torch.Generator | None = None,
) -> None:
    total = _squared_norm(network, cores, generator)
    mean_square = total / (network.n_experts * network.in_features * network.out_features)
    if mean_square == 0.0 or not scalable:
        raise RuntimeError(f"cannot scale the initialisation of {network!r}: the expert matrix is identically zero")
    scale = (target / mean_square) ** (0.5 / len(scalable))
    for tensor in scalable:
        tensor.mul_(scale)


def _random_expert(size: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Rows ``√size · e_k`` with ``k`` uniform: ``E[a aᵀ] = I``."""
    index = torch.randint(0, size, (CALIBRATION_BATCH,), device=like.device, generator=generator)
    rows = torch.zeros(CALIBRATION_BATCH, size, dtype=like.dtype, device=like.device)
    return rows.index_put_((torch.arange(CALIBRATION_BATCH, device=like.device), index), rows.new_tensor(size**0.5))


def _squared_norm(
    network: ExpertNetwork, cores: Mapping[str, torch.Tensor], generator: torch.Generator | None
) -> float:
    """``‖W‖²`` with no intermediate beyond a small-batch forward's (or `CALIBRATION_FLOOR`).

    Exact (the network contracted with its copy) where a path keeps within that; otherwise
    estimated from `CALIBRATION_PROBES` forward passes, each of a random expert (one index per
    mode, drawn uniformly; its coefficient ``√N_e``) and random signs (±1) as the input, whose
    squared outputs have expectation ``‖W‖²`` (Hutchinson's estimator over sampled experts; at
    initialisation the experts differ little, so few probes suffice, where Gaussian coefficients
    would multiply into a heavy-tailed product). Computed in float64 (a product of
    many cores under- or overflows float32).
    """
    limit = max(plan_forward(network, CALIBRATION_BATCH).largest_intermediate, CALIBRATION_FLOOR)
    values = {name: tensor.double() for name, tensor in cores.items()}
    try:
        return squared_norm(network, values, memory_limit=limit).item()
    except ValueError:
        pass
    plan = plan_forward(network, CALIBRATION_BATCH, memory_limit=limit)
    first = next(iter(values.values()))
    total = 0.0
    for _ in range(CALIBRATION_PROBES // CALIBRATION_BATCH):
        probes = [_random_expert(network.sizes[leg], first, generator) for leg in network.expert_legs]
        signs = torch.randint(0, 2, (CALIBRATION_BATCH, network.in_features), device=first.device, generator=generator)
        probes.append(signs.to(first.dtype).mul_(2).sub_(1))
        output = run_plan(plan, [values[name] for name in network.cores] + probes)
        total += output.pow(2).sum().item()
    return total / (CALIBRATION_PROBES // CALIBRATION_BATCH * CALIBRATION_BATCH)
