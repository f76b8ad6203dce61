"""Parameters of transcoders and the latent count that meets a budget (torch-free).

A transcoder (Dunefsky et al. 2024) maps an MLP block's input to its output through a wide,
sparse hidden layer: ``z = σ(W_enc x + b_enc)``, ``ŷ = W_dec z + b_dec`` with ``M`` latents. A
skip transcoder (Paulo et al. 2025) adds a linear map of the input: ``ŷ = W_dec z + W_skip x + b_dec``.

Notes
-----
Parameters: ``(I + 1)·M + M·O + O`` (encoder with bias, decoder, output bias) and ``I·O`` more
with the skip. The count is affine in ``M``, so the latent count for a budget is the closest
integer, solved by [`solve_rank`][mumoe_tn.costs.matching.solve_rank] like every rank the library
matches (a tie goes to fewer parameters).
"""

from __future__ import annotations

from mumoe_tn.costs.matching import solve_rank
from mumoe_tn.validation import check_bool, check_size

__all__ = ["match_transcoder", "transcoder_parameters"]


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
