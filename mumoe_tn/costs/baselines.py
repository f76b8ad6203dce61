"""Costs of the layers a μMoE is compared with, in the same units (torch-free).

Each baseline maps ``I → O``; with ``bias=True`` it carries one bias per output (per expert for
MoEs), counted as the paper does by folding it into the input (``I + 1``). FMAs are per token;
MoE routers (``I·N``) count when ``gate=True``.

Transcoders (Dunefsky et al. 2024), the peers of a distilled μMoE block, map an MLP block's
input to its output through a wide, sparse hidden layer: ``z = σ(W_enc x + b_enc)``,
``ŷ = W_dec z + b_dec`` with ``M`` latents; a skip transcoder (Paulo et al. 2025) adds a linear
map of the input, ``ŷ = W_dec z + W_skip x + b_dec``. Their parameters are
``(I + 1)·M + M·O + O`` and ``I·O`` more with the skip; the count is affine in ``M``, so the latent
count for a budget is the closest integer, solved by [`solve_rank`][mumoe_tn.costs.matching.solve_rank]
like every rank the library matches (a tie goes to fewer parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from mumoe_tn.costs.matching import solve_rank
from mumoe_tn.validation import check_bool, check_size

__all__ = [
    "Baseline",
    "dense_moe",
    "linear",
    "match_transcoder",
    "mlp",
    "moe_block",
    "sparse_moe",
    "transcoder_parameters",
]


@dataclass(frozen=True)
class Baseline:
    """Parameters, FMAs per token, activation size and expert rank of a reference layer.

    Attributes
    ----------
    name : str
        Display name.
    params : int
        Parameters, router included when counted.
    fma : int
        Fused multiply-adds per token.
    activations : int
        Elements of the largest intermediate per token (the output of every evaluated expert).
    max_rank : int
        Largest possible rank of one expert's (or the layer's) weight matrix.
    gate_params : int
        Router parameters included in ``params``.
    """

    name: str
    params: int
    fma: int
    activations: int
    max_rank: int
    gate_params: int = 0


def _sizes(**sizes: int) -> None:
    for name, size in sizes.items():
        check_size(name, size)


def linear(in_features: int, out_features: int, *, bias: bool = True) -> Baseline:
    """``nn.Linear(I, O)``: ``(I + bias)·O`` parameters and FMAs."""
    _sizes(in_features=in_features, out_features=out_features)
    width = in_features + int(bias)
    return Baseline("nn.Linear", width * out_features, width * out_features, out_features, min(width, out_features))


def mlp(in_features: int, hidden: int, out_features: int, *, bias: bool = True) -> Baseline:
    """A two-layer MLP block ``I → H → O`` (GELU between)."""
    _sizes(in_features=in_features, hidden=hidden, out_features=out_features)
    count = (in_features + int(bias)) * hidden + (hidden + int(bias)) * out_features
    rank = min(in_features + int(bias), hidden, out_features)
    return Baseline("MLP block", count, count, max(hidden, out_features), rank)


def dense_moe(n_experts: int, in_features: int, out_features: int, *, bias: bool = True, gate: bool = True) -> Baseline:
    """Dense (soft) MoE: every expert evaluated; ``N·(I + bias)·O`` parameters and FMAs."""
    return _moe(f"dense MoE (N={n_experts})", n_experts, n_experts, in_features, out_features, bias, gate)


def sparse_moe(
    n_experts: int, top_k: int, in_features: int, out_features: int, *, bias: bool = True, gate: bool = True
) -> Baseline:
    """Sparse top-``K`` MoE: ``N·(I + bias)·O`` parameters, ``K·(I + bias)·O`` FMAs."""
    _sizes(n_experts=n_experts, top_k=top_k)
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} cannot exceed the number of experts {n_experts}")
    return _moe(f"sparse top-{top_k} MoE (N={n_experts})", n_experts, top_k, in_features, out_features, bias, gate)


def _moe(name: str, n: int, active: int, in_features: int, out_features: int, bias: bool, gate: bool) -> Baseline:
    _sizes(n_experts=n, in_features=in_features, out_features=out_features)
    width = in_features + int(bias)
    router = in_features * n if gate else 0
    return Baseline(
        name,
        n * width * out_features + router,
        active * width * out_features + router,
        active * out_features,
        min(width, out_features),
        router,
    )


def moe_block(
    n_experts: int,
    active: int,
    in_features: int,
    hidden: int,
    out_features: int,
    *,
    bias: bool = True,
    gate: bool = True,
) -> Baseline:
    """A dense (``active = N``) or sparse (``active = K``) MoE of MLP blocks ``I → H → O``."""
    block = mlp(in_features, hidden, out_features, bias=bias)
    _sizes(n_experts=n_experts, active=active)
    router = in_features * n_experts if gate else 0
    kind = "dense MoE" if active == n_experts else f"sparse top-{active} MoE"
    return Baseline(
        f"{kind} of MLPs (N={n_experts})",
        n_experts * block.params + router,
        active * block.fma + router,
        active * block.activations,
        block.max_rank,
        router,
    )


def transcoder_parameters(in_features: int, latents: int, out_features: int, *, skip: bool = False) -> int:
    """Parameters of a transcoder ``I → M → O`` (with ``skip``: plus the ``I·O`` skip matrix).

    Parameters
    ----------
    in_features, latents, out_features : int
        ``I``, ``M`` and ``O``.
    skip : bool, optional
        Count the linear skip from input to output.

    Returns
    -------
    int
    """
    for name, size in (("in_features", in_features), ("latents", latents), ("out_features", out_features)):
        check_size(name, size)
    check_bool("skip", skip)
    count = (in_features + 1) * latents + latents * out_features + out_features
    return count + (in_features * out_features if skip else 0)


def match_transcoder(budget: int, in_features: int, out_features: int, *, skip: bool = False) -> int:
    """The latent count ``M`` whose transcoder's parameters are closest to ``budget``.

    Parameters
    ----------
    budget : int
        Parameters to match.
    in_features, out_features : int
        ``I`` and ``O``.
    skip : bool, optional
        A skip transcoder (the skip matrix counts against the budget).

    Returns
    -------
    int

    Raises
    ------
    ValueError
        If even one latent exceeds the budget.
    """
    what = f"a{' skip' if skip else ''} transcoder {in_features} → M → {out_features}"
    return solve_rank(lambda m: transcoder_parameters(in_features, m, out_features, skip=skip), budget, what=what)
