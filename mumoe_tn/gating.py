"""Expert gating: ``a_e = φ(norm(G_eᵀ z))`` for every expert mode, computed in float32 or wider."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from entmax import entmax_bisect
from torch import nn
from torch.nn import functional as F

from mumoe_tn.activations import entmax15, sparsemax
from mumoe_tn.network import expert_leg, normalize_expert_dims

__all__ = ["ACTIVATIONS", "GATE_NORMS", "ExpertGate", "resolve_activation"]

#: Named gate activations; a float ``α > 1`` selects α-entmax (bisection).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "entmax15": lambda x: entmax15(x, dim=-1),
    "sparsemax": lambda x: sparsemax(x, dim=-1),
    "softmax": lambda x: torch.softmax(x, dim=-1),
}

#: Normalisations applied to the gate logits before the activation.
GATE_NORMS = ("batch", "layer", "none")


def resolve_activation(activation: str | float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the gate activation φ for a name or an entmax ``α``.

    Parameters
    ----------
    activation : str or float
        ``"entmax15"`` (the paper's default), ``"sparsemax"``, ``"softmax"``, or a float
        ``α > 1`` for α-entmax computed by bisection (``α = 1.5`` equals entmax15, ``α = 2``
        sparsemax).

    Returns
    -------
    Callable
        A function mapping logits ``(…, N)`` to coefficients on the simplex along the last dim.
    """
    if isinstance(activation, bool):
        raise TypeError(f"activation must be a name or a float alpha, got {activation!r}")
    if isinstance(activation, (int, float)):
        alpha = float(activation)
        if alpha <= 1.0:
            raise ValueError(f"entmax alpha must be > 1 (1 is softmax: use 'softmax'), got {alpha}")
        return lambda x: entmax_bisect(x, alpha=alpha, dim=-1)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)} or a float alpha > 1")
    return ACTIVATIONS[activation]


class ExpertGate(nn.Module):
    """Gating of every expert mode: ``a_e = φ(norm(G_eᵀ z))`` (paper Eq. 1 / hierarchy-sum).

    One bias-free projection ``G_e ∈ R^{I×N_e}`` per expert mode (stored as
    ``projections.n<e>.weight``), a per-mode normalisation of the logits (BatchNorm without
    affine parameters, as in the paper; LayerNorm without affine; or none), then φ. The
    computation runs with autocast disabled in ``float32`` (or the input's dtype when wider):
    entmax row sums drift by about 1 % in bfloat16.

    Parameters
    ----------
    in_features : int
        Width ``I`` of the input ``z``.
    expert_dims : int or Sequence[int]
        ``N_1 … N_E``.
    activation : str or float, optional
        See [`resolve_activation`][mumoe_tn.gating.resolve_activation]; ``"entmax15"`` by default.
    norm : {"batch", "layer", "none"}, optional
        Normalisation of the logits, ``"batch"`` by default.
    device, dtype : optional
        Factory arguments for the parameters.
    """

    def __init__(
        self,
        in_features: int,
        expert_dims: int | Sequence[int],
        activation: str | float = "entmax15",
        norm: str = "batch",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.expert_dims = normalize_expert_dims(expert_dims)
        self.activation = activation
        self._phi = resolve_activation(activation)
        if norm not in GATE_NORMS:
            raise ValueError(f"unknown gate norm {norm!r}; choose one of {list(GATE_NORMS)}")
        self.norm = norm
        legs = [expert_leg(m) for m in range(1, len(self.expert_dims) + 1)]
        self.projections = nn.ModuleDict(
            {
                leg: nn.Linear(in_features, n, bias=False, **factory)
                for leg, n in zip(legs, self.expert_dims, strict=True)
            }
        )
        self.norms = nn.ModuleDict(
            {leg: self._make_norm(n, factory) for leg, n in zip(legs, self.expert_dims, strict=True)}
        )

    def _make_norm(self, n: int, factory: dict) -> nn.Module:
        if self.norm == "batch":
            return nn.BatchNorm1d(n, affine=False, **factory)
        if self.norm == "layer":
            return nn.LayerNorm(n, elementwise_affine=False, **factory)
        return nn.Identity()

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Expert coefficients for input ``z`` of shape ``(…, I)``.

        Returns
        -------
        tuple of torch.Tensor
            One tensor ``(…, N_e)`` per expert mode, each row on the probability simplex.
        """
        lead = z.shape[:-1]
        compute = torch.promote_types(z.dtype, torch.float32)
        with torch.autocast(device_type=z.device.type, enabled=False):
            flat = z.reshape(-1, z.shape[-1]).to(compute)
            weights = [projection.weight.to(compute) for projection in self.projections.values()]
            logits = F.linear(flat, weights[0] if len(weights) == 1 else torch.cat(weights))
            coefficients = []
            for part, norm in zip(logits.split(self.expert_dims, dim=-1), self.norms.values(), strict=True):
                coefficients.append(self._phi(norm(part)).reshape(*lead, part.shape[-1]))
        return tuple(coefficients)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, expert_dims={self.expert_dims}, "
            f"activation={self.activation!r}, norm={self.norm!r}"
        )
