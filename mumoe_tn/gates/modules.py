"""Expert gating modules: ``a_e = φ(norm(G_eᵀ z))`` per expert mode, in float32 or wider.

The modules here are what the descriptors of [`mumoe_tn.gates.specs`][mumoe_tn.gates.specs] build.
Activations ([`ACTIVATIONS`][mumoe_tn.gates.modules]) and logit norms
([`GATE_NORMS`][mumoe_tn.gates.modules]) are registries ([`Registry`][mumoe_tn.registry.Registry]):
``ACTIVATIONS.register(name, fn)`` makes a new name available to [`Gate`][mumoe_tn.gates.specs.Gate].
Everything stored in a gate
is a module-level function or an ``nn.Module``, so gates pickle, deep-copy and
``torch.save`` as whole modules.

**What the gate sees.** By default a layer gates on the same ``z`` its experts receive: with
``input_norm=True`` that is ``LayerNorm(x)``. The authors' GPT-2 configuration gates on the
raw ``x`` instead (``gate_input="raw"``). mumoe_tn keeps ``"normed"`` as the default because it
is the paper's formulation (``a = φ(Gᵀz)`` with the experts' ``z``) and because it makes the
gate independent of the scale of the input: the residual stream of a transformer grows with
depth, and without a scale-free input ``gate_norm="none"``/``"layer"`` gates would get sharper
(sparser, for entmax) layer by layer for no reason the model chose. With ``gate_norm="batch"``
the two choices differ only through the LayerNorm's per-token centring. With
``input_norm=False`` both are the same.

**Zero initialisation.** ``init="zeros"`` starts every projection at 0: entmax15, sparsemax
and softmax all map equal logits to ``1/N_e`` with full support, so every expert gets
gradient from the first step. The layers keep nn.Linear's default init as the default: with
``gate_norm="batch"`` zero logits have zero batch variance, and the first gradient through
BatchNorm is scaled by ``1/√eps`` (about 316), which a random start avoids.

**Auxiliary losses** (opt in with ``balance_loss=True`` / ``z_loss=True``), recorded after
each forward pass for the calling thread and returned by
[`ExpertGate.losses`][mumoe_tn.gates.modules.ExpertGate.losses], in the gate's compute dtype (float32, or the
input's when wider) and not detached, so a training
loop adds them to its loss:

- ``"balance"``: Switch-style ``N_e · Σ_i f_i · P_i`` per mode, averaged over modes, where
  ``f_i`` is the fraction of the batch's routing slots dispatched to expert ``i`` (the top-k
  experts of a [`TopKRouter`][mumoe_tn.gates.modules.TopKRouter], the arg-max expert of a dense gate) and
  ``P_i`` the mean router probability of expert ``i`` (the full softmax of a router, the coefficients of a
  dense gate). It is 1 for perfectly balanced routing; gradients flow through ``P``.
- ``"z"``: the router z-loss ``mean_tokens (logsumexp logits)²``, averaged over modes, on
  the logits that enter φ (after the norm).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from entmax import entmax_bisect
from torch import nn
from torch.nn import functional as F

from mumoe_tn.caching import DerivedValues
from mumoe_tn.gates import activation_maps
from mumoe_tn.gates.activation_maps import entmax15, inference_map, sparsemax
from mumoe_tn.gates.batch_norm_step import batch_norm_matrix
from mumoe_tn.gates.gate_checks import check_gate_options, check_zero_init_bias, per_mode_k
from mumoe_tn.gates.gate_inference import GateSteps
from mumoe_tn.gates.gate_protocol import ModeLogits, gate_coefficients, mode_parts
from mumoe_tn.gates.records import PerThreadRecords
from mumoe_tn.gates.replicas import warn_unsynchronised
from mumoe_tn.gates.selection import top_k_mask
from mumoe_tn.network import expert_leg, normalise_expert_dims
from mumoe_tn.registry import Registry

__all__ = [
    "ACTIVATIONS",
    "GATE_NORMS",
    "ExpertGate",
    "LogitBatchNorm",
    "ReLUTopKRouter",
    "TopKRouter",
    "resolve_activation",
]


def _entmax15_last(x: torch.Tensor) -> torch.Tensor:
    return entmax15(x, dim=-1)


def _sparsemax_last(x: torch.Tensor) -> torch.Tensor:
    return sparsemax(x, dim=-1)


def _softmax_last(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


#: Named gate activations (module-level functions, so gates pickle); a float ``α > 1`` selects α-entmax.
#: A [`Registry`][mumoe_tn.registry.Registry]: ``ACTIVATIONS.register("mine", fn)`` adds one.
ACTIVATIONS: Registry[str, Callable[[torch.Tensor], torch.Tensor]] = Registry(
    "gate activation",
    entries={"entmax15": _entmax15_last, "sparsemax": _sparsemax_last, "softmax": _softmax_last},
)

#: The named activations that are the library's maps along the last dim (their quickest forms apply).
_LAST_DIM_MAPS = {_entmax15_last: entmax15, _sparsemax_last: sparsemax}


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float32, or ``dtype`` where it is wider: what gate statistics are kept and computed in."""
    return torch.promote_types(dtype, torch.float32)


class LogitBatchNorm(nn.BatchNorm1d):
    """BatchNorm of gate logits without affine parameters, kept in float32 whatever the layer's dtype.

    The running statistics stay in float32 (or float64) when the module is cast with ``.to()``,
    ``.half()`` or ``.bfloat16()`` or built with a half-precision ``dtype``: the gate computes in
    float32, and statistics rounded to 8 bits of mantissa would shift every logit in eval mode.
    A batch of one in training mode gets an explanation instead of torch's error.
    """

    def __init__(self, num_features: int, **options: Any) -> None:
        dtype = options.pop("dtype", None) or torch.get_default_dtype()
        super().__init__(num_features, dtype=_statistics_dtype(dtype), **options)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LogitBatchNorm:
        before = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            wanted = _statistics_dtype(new.dtype)
            if new.dtype != wanted:  # cast to half precision: keep the float32 values on the new device
                self._buffers[name] = old.to(device=new.device, dtype=wanted)
        return self

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise ``(rows, N)`` logits; in training mode at least 2 rows must be real tokens.

        With a token ``mask`` (``(rows,)`` booleans, True = real) the training statistics and the
        running averages come from the real rows only; padding rows come out as zeros.
        """
        if self.training:
            warn_unsynchronised(self)
        if not self.training or mask is None:
            self._check_rows(input.shape[0])
            return self._batch_norm(input)
        real = input[mask]
        self._check_rows(real.shape[0], " real")
        normed = self._batch_norm(real)
        return torch.zeros_like(input).masked_scatter(mask[:, None].expand_as(input), normed)

    def _batch_norm(self, input: torch.Tensor) -> torch.Tensor:
        """``nn.BatchNorm1d.forward``: in its quicker form for this class itself, as inherited for a subclass."""
        normed = batch_norm_matrix(self, input) if type(self) is LogitBatchNorm else None
        return super().forward(input) if normed is None else normed

    def eval_affine(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The eval-mode map as ``(scale, shift)``: ``norm(x) = x · scale + shift`` (None in training).

        Lets an inference gate fold the norm into its projection (one matrix product, no norm).
        """
        if self.training or self.running_mean is None or self.running_var is None:
            return None
        scale = torch.rsqrt(self.running_var + self.eps)
        shift = -self.running_mean * scale
        if self.affine:
            scale, shift = scale * self.weight, shift * self.weight + self.bias
        return scale, shift

    def _check_rows(self, rows: int, what: str = "") -> None:
        if self.training and rows < 2:
            raise ValueError(
                f"gate_norm='batch' needs at least 2{what} tokens per batch in training mode, got {rows}: "
                "use gate_norm='layer' (or 'none'), or call layer.eval() for single-token inference"
            )


def _batch_norm(n: int, factory: dict[str, Any]) -> nn.Module:
    return LogitBatchNorm(n, affine=False, **factory)


def _layer_norm(n: int, factory: dict[str, Any]) -> nn.Module:
    return nn.LayerNorm(n, elementwise_affine=False, **factory)


def _no_norm(n: int, factory: dict[str, Any]) -> nn.Module:
    return nn.Identity()


#: Normalisations of the gate logits: name -> ``factory(N_e, {"device": …, "dtype": …})``.
#: A [`Registry`][mumoe_tn.registry.Registry]: ``GATE_NORMS.register("mine", factory)`` adds one.
GATE_NORMS: Registry[str, Callable[[int, dict[str, Any]], nn.Module]] = Registry(
    "gate norm", entries={"batch": _batch_norm, "layer": _layer_norm, "none": _no_norm}
)


def resolve_activation(activation: str | float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the gate activation φ for a name or an entmax ``α``.

    Parameters
    ----------
    activation : str or float
        A name of [`ACTIVATIONS`][mumoe_tn.gates.modules] (``"entmax15"``, the paper's default, ``"sparsemax"``,
        ``"softmax"``), or a finite float ``α > 1`` for α-entmax computed by bisection
        (``α = 1.5`` equals entmax15, ``α = 2`` sparsemax).

    Returns
    -------
    Callable
        A picklable function mapping logits ``(…, N)`` to coefficients on the simplex along
        the last dim.
    """
    if isinstance(activation, bool):
        raise TypeError(f"activation must be a name or a float alpha, got {activation!r}")
    if isinstance(activation, (int, float)):
        alpha = float(activation)
        if not (math.isfinite(alpha) and alpha > 1.0):
            raise ValueError(
                f"entmax alpha must be a finite number > 1 (1 is softmax: use 'softmax'), got {activation!r}"
            )
        return functools.partial(entmax_bisect, alpha=alpha, dim=-1)
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a name or a float alpha, got {activation!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)} or a float alpha > 1")
    return ACTIVATIONS[activation]


class ExpertGate(GateSteps, PerThreadRecords):
    """Gating of every expert mode: ``a_e = φ(norm(G_eᵀ z))`` (paper Eq. 1 and its hierarchical sum).

    One bias-free projection ``G_e ∈ R^{I×N_e}`` per expert mode (stored as
    ``projections.n<e>.weight``), a per-mode normalisation of the logits from
    [`GATE_NORMS`][mumoe_tn.gates.modules] (BatchNorm without affine parameters, as in the paper; LayerNorm without
    affine; or none), then φ. The computation runs with autocast disabled in ``float32`` (or
    the input's dtype when wider): entmax row sums drift by about 1 % in bfloat16. A row of
    non-finite logits gives NaN coefficients in that row only.

    Parameters
    ----------
    in_features : int
        Width ``I`` of the input ``z``.
    expert_dims : int or Sequence[int]
        ``N_1 … N_E``.
    activation : str or float, optional
        See [`resolve_activation`][mumoe_tn.gates.modules.resolve_activation]; ``"entmax15"`` by default.
    norm : str, optional
        A name of [`GATE_NORMS`][mumoe_tn.gates.modules], ``"batch"`` by default.
    init : {"default", "zeros"}, optional
        nn.Linear's init, or zero projections (every coefficient starts at ``1/N_e``).
    balance_loss, z_loss : bool, optional
        Record the auxiliary losses after each forward pass (see the module docstring).
    bias : bool, optional
        Give every projection a bias (``projections.n<e>.bias``), added to the logits before
        the norm. False by default, as in the paper's gate.
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
        init: str = "default",
        balance_loss: bool = False,
        z_loss: bool = False,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        if not isinstance(norm, str) or norm not in GATE_NORMS:
            raise ValueError(f"unknown gate norm {norm!r}; choose one of {list(GATE_NORMS)}")
        check_gate_options(init, balance_loss=balance_loss, z_loss=z_loss, bias=bias)
        self.in_features = in_features
        self.expert_dims = normalise_expert_dims(expert_dims)
        self.activation = activation
        self._phi = resolve_activation(activation)
        self.norm = norm
        self.init = init
        self.balance_loss = balance_loss
        self.z_loss = z_loss
        self.bias = bias
        legs = [expert_leg(m) for m in range(1, len(self.expert_dims) + 1)]
        self.projections = nn.ModuleDict(
            {
                leg: nn.Linear(in_features, n, bias=bias, **factory)
                for leg, n in zip(legs, self.expert_dims, strict=True)
            }
        )
        self.norms = nn.ModuleDict(
            {leg: GATE_NORMS[norm](n, factory) for leg, n in zip(legs, self.expert_dims, strict=True)}
        )
        self._derived = DerivedValues()
        self.reset_parameters()

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.pop("_inference_weights", None)  # the holder a 0.3 gate pickled instead
        super().__setstate__(state)
        self.__dict__.setdefault("_derived", DerivedValues())

    def reset_parameters(self) -> None:
        """Re-initialise the projections (by ``init``) and the norms' running statistics."""
        for projection in self.projections.values():
            if self.init == "zeros":
                nn.init.zeros_(projection.weight)
                if projection.bias is not None:
                    nn.init.zeros_(projection.bias)
            else:
                projection.reset_parameters()
        for norm in self.norms.values():
            if hasattr(norm, "reset_parameters"):
                norm.reset_parameters()

    def mode_map(self, mode: int, logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """φ of expert mode ``mode`` for normalised logits like ``logits``, in its quickest form for them.

        Logits that carry gradients (or a call being traced or transformed) get φ itself; others
        the form [`inference_map`][mumoe_tn.gates.entmax.inference_map] picks for their rows,
        dtype and device.
        """
        phi = self._phi
        if logits.requires_grad or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return phi
        return inference_map(_LAST_DIM_MAPS.get(phi, phi), logits)

    def _stacked_projection(self, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projections of every mode as one ``(ΣN_e, I)`` weight and ``(ΣN_e,)`` bias (or None), in ``compute``."""
        projections = list(self.projections.values())
        if len(projections) == 1:  # (no copy, no cast where the dtype is already the compute dtype's)
            weight, bias = projections[0].weight, projections[0].bias
            weight = weight if weight.dtype == compute else weight.to(compute)
            return weight, bias if bias is None or bias.dtype == compute else bias.to(compute)
        weight = torch.cat([projection.weight.to(compute) for projection in projections])
        if projections[0].bias is None:
            return weight, None
        return weight, torch.cat([projection.bias.to(compute) for projection in projections])

    def _balance_terms(
        self, logits: torch.Tensor, coefficients: torch.Tensor, mode: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router probabilities ``P`` and dispatch fractions ``f`` per row (each row sums to 1)."""
        top = coefficients.argmax(dim=-1)
        return coefficients, F.one_hot(top, coefficients.shape[-1]).to(coefficients.dtype)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Expert coefficients for input ``z`` of shape ``(…, I)``.

        Parameters
        ----------
        z : torch.Tensor
            The tokens, ``(…, I)``.
        mask : torch.Tensor, optional
            ``(∏…,)`` booleans, True = real token (see [`mumoe_tn.masking`][mumoe_tn.masking]): batch
            statistics and the auxiliary losses then use the real tokens only.

        Returns
        -------
        tuple of torch.Tensor
            One tensor ``(…, N_e)`` per expert mode, each row on the probability simplex.
        """
        if torch.is_autocast_enabled(z.device.type):
            with torch.autocast(device_type=z.device.type, enabled=False):
                coefficients = self._coefficients(z, mask)
        else:
            coefficients = self._coefficients(z, mask)
        if z.ndim == 2:
            return tuple(coefficients)
        return tuple(a.reshape(*z.shape[:-1], a.shape[-1]) for a in coefficients)

    def _coefficients(self, z: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
        """`forward`'s coefficients as ``(rows, N_e)`` tensors, computed in float32 or wider (autocast off)."""
        compute = torch.promote_types(z.dtype, torch.float32)
        flat = z if z.ndim == 2 else z.reshape(-1, z.shape[-1])
        flat = flat if flat.dtype == compute else flat.to(compute)
        if self.projection_applies(z):
            weight, bias, folded = self.projection(compute)
        else:  # the parameters themselves, for autograd, and the norms' batch statistics in training
            (weight, bias), folded = self._stacked_projection(compute), False
        return gate_coefficients(self, F.linear(flat, weight, bias), folded, mask)

    def record(self, logits: ModeLogits, coefficients: list[torch.Tensor], mask: torch.Tensor | None) -> None:
        """Record the auxiliary losses of a call (see the module notes) from its normalised logits."""
        if not (self.balance_loss or self.z_loss):
            return
        logits = mode_parts(logits, self.expert_dims)
        if mask is None:
            mean = functools.partial(torch.mean, dim=0)
        else:
            weights = mask.to(logits[0].dtype)
            count = weights.sum().clamp_min(1)

            def mean(values: torch.Tensor) -> torch.Tensor:
                return (values * weights.reshape(-1, *([1] * (values.ndim - 1)))).sum(0) / count

        losses = {}
        if self.balance_loss:
            losses["balance"] = self.balance(logits, coefficients, mean)
        if self.z_loss:
            losses["z"] = torch.stack([mean(torch.logsumexp(part, dim=-1).square()) for part in logits]).mean()
        self._remember("losses", losses)

    def balance(
        self,
        logits: Sequence[torch.Tensor],
        coefficients: Sequence[torch.Tensor],
        mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The Switch-style load-balancing loss of rows routed by this gate.

        Per expert mode ``N_e · Σ_i f_i · P_i`` (``f`` the rows' dispatch fractions, ``P`` the
        router probabilities, as this gate defines them), averaged over modes; 1 when balanced.

        Parameters
        ----------
        logits, coefficients : Sequence of torch.Tensor
            Per expert mode, the normalised logits and the coefficients of the same rows ``(rows, N_e)``.
        mean : Callable, optional
            The mean over rows (default ``torch.mean(·, dim=0)``; a masked mean for padded batches).

        Returns
        -------
        torch.Tensor
            A scalar, with the gradient through ``P``.
        """
        mean = functools.partial(torch.mean, dim=0) if mean is None else mean
        terms = []
        for mode, (part, a) in enumerate(zip(logits, coefficients, strict=True)):
            probabilities, dispatch = self._balance_terms(part, a, mode)
            terms.append(part.shape[-1] * (mean(dispatch) * mean(probabilities)).sum())
        return torch.stack(terms).mean()

    def losses(self) -> dict[str, torch.Tensor]:
        """The auxiliary losses of this thread's last forward pass (float32+ scalars, with grad).

        Returns
        -------
        dict of str to torch.Tensor
            ``"balance"`` and/or ``"z"``, as enabled; empty when none is.
        """
        if not (self.balance_loss or self.z_loss):
            return {}
        losses = self._recall("losses")
        if losses is None:
            raise ValueError("no forward pass of this gate in this thread yet: call the layer first, then its losses")
        return dict(losses)

    def extra_repr(self) -> str:
        defaults = {"init": "default", "balance_loss": False, "z_loss": False, "bias": False}
        extras = "".join(
            f", {key}={getattr(self, key)!r}" for key, off in defaults.items() if getattr(self, key) != off
        )
        return (
            f"in_features={self.in_features}, expert_dims={self.expert_dims}, "
            f"activation={self.activation!r}, norm={self.norm!r}{extras}"
        )


class TopKRouter(ExpertGate):
    """Softmax top-k routing per expert mode: the ``k`` largest logits, renormalised.

    Coefficients are dense ``(…, N_e)`` tensors with exactly ``k`` non-zeros per row, equal to
    ``softmax`` over the top-``k`` logits (the full softmax restricted to them and
    renormalised). A row with non-finite logits gives NaN in that row only.

    Parameters
    ----------
    in_features : int
        Width ``I`` of the input.
    expert_dims : int or Sequence[int]
        ``N_1 … N_E``.
    k : int or Sequence[int], optional
        Experts kept per token: one for every mode, or one per mode (each ``1 ≤ k ≤ N_e``).
    norm : str, optional
        A name of [`GATE_NORMS`][mumoe_tn.gates.modules], ``"none"`` by default.
    init, balance_loss, z_loss, device, dtype
        As for [`ExpertGate`][mumoe_tn.gates.modules.ExpertGate].
    """

    shares_map = False  # (each mode maps with its own k)

    def __init__(
        self,
        in_features: int,
        expert_dims: int | Sequence[int],
        k: int | Sequence[int] = 1,
        norm: str = "none",
        *,
        init: str = "default",
        balance_loss: bool = False,
        z_loss: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        options = {"init": init, "balance_loss": balance_loss, "z_loss": z_loss, "device": device, "dtype": dtype}
        super().__init__(in_features, expert_dims, "softmax", norm, **options)
        self.k = per_mode_k(k, self.expert_dims)

    def mode_map(self, mode: int, logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The softmax over the ``k`` largest logits of mode ``mode`` (the Triton kernel where it applies)."""
        return functools.partial(activation_maps.softmax_top_k, k=self.k[mode])

    def _balance_terms(
        self, logits: torch.Tensor, coefficients: torch.Tensor, mode: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k[mode]
        dispatch = torch.zeros_like(logits).masked_fill_(top_k_mask(logits, k), 1.0 / k)
        return torch.softmax(logits, dim=-1), dispatch

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.k}"


def _relu_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest of ``ReLU(logits)`` per row kept in place, every other entry 0 (NaN rows stay NaN)."""
    return activation_maps.relu_top_k(logits, k)


class ReLUTopKRouter(ExpertGate):
    """The Mixture of Decoders gate: ``a_e = TopK_k(ReLU(norm(G_eᵀ z + b_e)))`` per expert mode.

    Each row keeps its ``k`` largest ReLU'd logits as they are (not renormalised: a row's sum is
    whatever they add up to, and may be 0 when fewer than ``k`` logits are positive); every other
    coefficient is exactly 0. Gradients reach ``G_e`` and ``b_e`` through the kept, positive
    entries. The computation runs in float32 (or the input's dtype when wider) with autocast off,
    and a row with non-finite logits gives NaN in that row only, as in
    [`ExpertGate`][mumoe_tn.gates.modules.ExpertGate]. No auxiliary losses: they are defined for
    coefficients that are router probabilities.

    Parameters
    ----------
    in_features : int
        Width ``I`` of the input.
    expert_dims : int or Sequence[int]
        ``N_1 … N_E``.
    k : int or Sequence[int], optional
        Experts kept per token: one for every mode, or one per mode (each ``1 ≤ k ≤ N_e``).
    norm : str, optional
        A name of [`GATE_NORMS`][mumoe_tn.gates.modules], ``"none"`` by default (the authors' gate).
    bias : bool, optional
        A bias ``b_e`` per logit (default True, as in the authors' gate).
    init : {"default", "zeros"}, optional
        ``"default"``: nn.Linear's initialisation. ``"zeros"``: ``G_e = 0`` and ``b_e = 1/k``, so
        the logits all tie at ``1/k``: ``k`` experts (``torch.topk`` picks which) start at ``1/k``
        each and train ``G_e`` from the first step. Needs ``bias=True`` (zero logits are all cut
        by the ReLU and would get no gradient).
    device, dtype : optional
        Factory arguments for the parameters.
    """

    shares_map = False  # (each mode maps with its own k)

    def __init__(
        self,
        in_features: int,
        expert_dims: int | Sequence[int],
        k: int | Sequence[int] = 1,
        norm: str = "none",
        *,
        bias: bool = True,
        init: str = "default",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.k = per_mode_k(k, normalise_expert_dims(expert_dims))
        check_zero_init_bias(init, bias)
        super().__init__(in_features, expert_dims, "softmax", norm, init=init, bias=bias, device=device, dtype=dtype)
        self.activation = "relu-topk"

    def reset_parameters(self) -> None:
        """Re-initialise the projections (by ``init``: ``"zeros"`` puts every bias at ``1/k``) and the norms."""
        super().reset_parameters()
        if self.init == "zeros":
            with torch.no_grad():
                for projection, k in zip(self.projections.values(), self.k, strict=True):
                    projection.bias.fill_(1.0 / k)

    def mode_map(self, mode: int, logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The ``k`` largest ReLU'd logits of mode ``mode`` kept as they are."""
        return functools.partial(_relu_top_k, k=self.k[mode])

    def extra_repr(self) -> str:
        extras = "" if self.init == "default" else f", init={self.init!r}"
        return (
            f"in_features={self.in_features}, expert_dims={self.expert_dims}, k={self.k}, "
            f"norm={self.norm!r}, bias={self.bias}{extras}"
        )
