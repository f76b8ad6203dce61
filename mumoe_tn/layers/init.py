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

import math
from collections.abc import Mapping, Sequence

import torch

from mumoe_tn.layers.calibration import log_squared_norm
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
                    others = {dim for dim, other in enumerate(labels) if is_expert_leg(other) and other != label}
                    _apply_noise(cores[name], shape, sigma, others, generator)

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
    """Replicated template of an expert-mode core, or None when it must hold random values.

    The template is the identity of the contraction: a diagonal over the core's bonds, and ones
    along the physical legs it shares with other cores (the neutral element of a Hadamard
    product, so that ``C: n1 o`` next to ``D: i o`` starts every expert at ``D``). A core holding
    ``i`` or ``o`` gets one only where a core without expert legs holds that leg too and carries
    the random values; otherwise (None) it is a random slice replicated along its expert legs.
    """

    def drawn_elsewhere(leg: str) -> bool:
        return any(not any(is_expert_leg(label) for label in network.cores[other]) for other in network.cores_with(leg))

    if any(leg in rest and not drawn_elsewhere(leg) for leg in (INPUT_LEG, OUTPUT_LEG)):
        return None
    labels = network.cores[core]
    bonds = [label for label in rest if label in network.bonds]
    bond_sizes = [network.sizes[label] for label in bonds]
    diagonal = torch.zeros(bond_sizes, dtype=tensor.dtype, device=tensor.device)
    if len(bonds) <= 1:
        diagonal.fill_(1.0)
    else:
        for k in range(min(bond_sizes)):
            diagonal[(k,) * len(bonds)] = 1.0
    # Put the template's axes where the bonds sit and broadcast over the expert and shared legs.
    shape = [network.sizes[label] if label in bonds else 1 for label in labels]
    return diagonal.reshape(shape).expand(tensor.shape)


def _calibrate(
    network: ExpertNetwork,
    cores: Mapping[str, torch.Tensor],
    scalable: list[torch.Tensor],
    target: float,
    generator: torch.Generator | None = None,
) -> None:
    log_mean_square = log_squared_norm(network, cores, generator) - math.log(
        network.n_experts * network.in_features * network.out_features
    )
    if log_mean_square == -math.inf or not scalable:
        raise RuntimeError(f"cannot scale the initialisation of {network!r}: the expert matrix is identically zero")
    if not math.isfinite(log_mean_square):
        raise RuntimeError(f"cannot scale the initialisation of {network!r}: its squared norm is {log_mean_square}")
    scale = math.exp((math.log(target) - log_mean_square) * 0.5 / len(scalable))
    for tensor in scalable:
        tensor.mul_(scale)


#: Most elements of one draw of expert noise (larger cores are noised a slice at a time).
NOISE_CHUNK = 1 << 20


def _apply_noise(
    tensor: torch.Tensor, shape: list[int], sigma: float, expert_dims: set[int], generator: torch.Generator | None
) -> None:
    """Multiply ``tensor`` by ``N(1, σ)`` noise of ``shape`` (1 along ``expert_dims``), in slices."""
    if tensor.is_meta:  # no values to noise (a module built on the meta device only to read its shapes)
        return
    total = math.prod(shape)
    full = [dim for dim in range(len(shape)) if dim not in expert_dims and shape[dim] > 1]
    if total <= NOISE_CHUNK or not full:
        factor = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        tensor.mul_(factor.normal_(1.0, sigma, generator=generator))
        return
    dim = max(full, key=lambda d: shape[d])
    step = max(1, NOISE_CHUNK * shape[dim] // total)
    for start in range(0, shape[dim], step):
        piece = tensor.narrow(dim, start, min(step, shape[dim] - start))
        part = list(shape)
        part[dim] = piece.shape[dim]
        factor = torch.empty(part, dtype=tensor.dtype, device=tensor.device)
        piece.mul_(factor.normal_(1.0, sigma, generator=generator))
