"""The sparse peers of a μMoE block when a dense MLP is decomposed: transcoders and skip transcoders.

A transcoder (Dunefsky, Chlenski & Nanda 2024, "Transcoders find interpretable LLM feature
circuits") replaces an MLP block by a wide sparse MLP trained to reproduce the block's output
from its input::

    z = σ(W_enc x + b_enc)        ŷ = W_dec z + b_dec

with ``σ`` a ReLU (sparsity then comes from an L1 penalty on ``z``) or TopK: the ``k`` largest
pre-activations kept and passed through a ReLU, every other latent exactly 0 (Gao et al. 2024,
"Scaling and evaluating sparse autoencoders"). A skip transcoder (Paulo, Shabalin & Belrose 2025,
"Transcoders beat sparse autoencoders for interpretability") adds a linear skip ``W_skip x``. As in
those papers the decoder and the skip start at zero, so a fresh transcoder outputs ``b_dec``
(zero) and learns the block's output from there.

The latents are the units whose activity is measured (L0, dead latents): the output of the
transcoder's [`code_module`][mumoe_tn.distillation.transcoders.Transcoder.code_module].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mumoe_tn.costs.baselines import transcoder_parameters
from mumoe_tn.gates.selection import keep_top_k
from mumoe_tn.validation import check_bool, check_size

__all__ = ["TopK", "Transcoder"]


class TopK(nn.Module):
    """Keep the ``k`` largest entries of the last dimension, pass them through a ReLU, zero the rest.

    Parameters
    ----------
    k : int
        Entries kept per row.
    """

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = check_size("k", k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``ReLU`` of the top ``k`` entries of each row of ``x``, zeros elsewhere."""
        if x.shape[-1] < self.k:
            raise ValueError(f"TopK keeps k={self.k} entries but the input has only {x.shape[-1]}")
        return keep_top_k(x, self.k, relu=True)

    def extra_repr(self) -> str:
        return f"k={self.k}"


class Transcoder(nn.Module):
    """A (skip) transcoder ``I → M → O``: ``ŷ = W_dec σ(W_enc x + b_enc) + b_dec (+ W_skip x)``.

    Parameters
    ----------
    in_features : int
        ``I``, the block's input width.
    latents : int
        ``M``, the number of latents.
    out_features : int, optional
        ``O`` (default ``in_features``).
    k : int, optional
        TopK latents: keep the ``k`` largest per token (``1 ≤ k ≤ M``). None (default): a ReLU,
        whose sparsity an L1 penalty on the latents sets.
    skip : bool, optional
        Add the linear skip ``W_skip x`` (a skip transcoder).
    device, dtype : optional
        Where and in what dtype the parameters live.

    Attributes
    ----------
    encoder : nn.Linear
        ``W_enc``, ``b_enc`` (``nn.Linear``'s default initialisation).
    decoder : nn.Linear
        ``W_dec``, ``b_dec`` (zero at the start).
    skip : nn.Linear or None
        ``W_skip`` without bias (zero at the start), or None.
    activation : nn.Module
        ``σ``: [`TopK`][mumoe_tn.distillation.transcoders.TopK] or ``nn.ReLU``.
    """

    def __init__(
        self,
        in_features: int,
        latents: int,
        out_features: int | None = None,
        *,
        k: int | None = None,
        skip: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        out_features = in_features if out_features is None else out_features
        for name, size in (("in_features", in_features), ("latents", latents), ("out_features", out_features)):
            check_size(name, size)
        check_bool("skip", skip)
        if k is not None and check_size("k", k) > latents:
            raise ValueError(f"k must be at most the number of latents {latents}, got k={k}")
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.in_features, self.latents, self.out_features, self.k = in_features, latents, out_features, k
        self.encoder = nn.Linear(in_features, latents, **factory)
        self.decoder = nn.Linear(latents, out_features, **factory)
        self.skip = nn.Linear(in_features, out_features, bias=False, **factory) if skip else None
        self.activation: nn.Module = nn.ReLU() if k is None else TopK(k)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Encoder as ``nn.Linear``; decoder, output bias and skip zero (as in the papers)."""
        self.encoder.reset_parameters()
        nn.init.zeros_(self.decoder.weight)
        nn.init.zeros_(self.decoder.bias)
        if self.skip is not None:
            nn.init.zeros_(self.skip.weight)

    @property
    def code_module(self) -> nn.Module:
        """The module whose output is the latents ``z`` (what L0 and dead latents count)."""
        return self.activation

    @property
    def unit_parameters(self) -> tuple[str, ...]:
        """The parameters each latent owns a slice of that the auxiliary-k loss trains: the decoder's columns."""
        return ("decoder.weight",)

    def parameter_count(self) -> int:
        """``(I + 1)·M + M·O + O`` (plus ``I·O`` with the skip); equals the number of parameters."""
        return transcoder_parameters(self.in_features, self.latents, self.out_features, skip=self.skip is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``x`` of shape ``(…, in_features)`` to ``(…, out_features)``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"input must have shape (..., {self.in_features}), got {tuple(x.shape)}")
        y = self.decoder(self.activation(self.encoder(x)))
        return y if self.skip is None else y + self.skip(x)

    def extra_repr(self) -> str:
        sparsity = "ReLU" if self.k is None else f"TopK k={self.k}"
        return (
            f"in_features={self.in_features}, latents={self.latents}, out_features={self.out_features}, "
            f"{sparsity}, skip={self.skip is not None}"
        )
