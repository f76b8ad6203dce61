"""Gate descriptors: what a μMoE layer's gate is, what it costs, and how to build it (torch-free).

A gate turns a token ``z ∈ R^I`` into one coefficient vector ``a_e ∈ R^{N_e}`` per expert mode.
A *descriptor* is a small immutable object that answers three questions without torch:

- ``parameter_count(in_features, expert_dims)`` — trainable parameters of the gate;
- ``fma_per_token(in_features, expert_dims)`` — fused multiply-adds per token;
- ``build(in_features, expert_dims, *, device=None, dtype=None)`` — the ``nn.Module`` (torch is
  imported only here). Its ``forward(z)`` maps ``(…, I)`` to a tuple of ``(…, N_e)`` tensors;
  it may define ``losses() -> dict[str, Tensor]`` (auxiliary training losses of the last
  forward pass in the calling thread) and ``reset_parameters()``.

Anything with these three methods is a gate ([`GateSpec`][mumoe_tn.gates.specs.GateSpec] is the protocol): the layers
(``MuMoE(…, gate=spec)``) and the cost model (``layer_parameters(net, gate=spec)``,
``gate_fma(net, gate=spec)``) use it with no edits to the package. The cost model also takes
``True`` (the default gate, ``I·ΣN_e`` parameters and FMAs) and ``False`` (gating not counted).

Shipped descriptors: [`Gate`][mumoe_tn.gates.specs.Gate] (entmax15 / sparsemax / softmax / α-entmax with batch,
layer or no normalisation of the logits) [`TopKGate`][mumoe_tn.gates.specs.TopKGate] (a softmax top-k router) and
[`ReLUTopKGate`][mumoe_tn.gates.specs.ReLUTopKGate] (the Mixture of Decoders gate: top-k of ReLU'd
logits, not renormalised). They count ``I·ΣN_e`` parameters (plus ``ΣN_e`` for the biases of a
``ReLUTopKGate``; the logit norms have no affine parameters) and ``I·ΣN_e`` FMAs (the logits; the
bias, the norm and φ are elementwise and not counted, as in the paper's tables).
Activation and norm *names* are checked against the registries of
[`mumoe_tn.gates.modules`][mumoe_tn.gates.modules] when the gate is built (the layer's constructor), so
registering a new norm needs no edit here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from mumoe_tn.gates.choices import GATE_INITS, TOKEN_MIXING_NORMS
from mumoe_tn.gates.gate_checks import check_flag, check_gate_options, check_k, check_name, check_zero_init_bias
from mumoe_tn.gates.registry import register_gate

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "DEFAULT_GATE",
    "GATE_INITS",
    "TOKEN_MIXING_NORMS",
    "CausalityWarning",
    "Gate",
    "GateSpec",
    "ReLUTopKGate",
    "TopKGate",
    "gate_fma_per_token",
    "gate_from_options",
    "gate_parameter_count",
]


@runtime_checkable
class GateSpec(Protocol):
    """What the layers and the cost model ask of a gate descriptor."""

    def parameter_count(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        """Trainable parameters of the gate for input width ``I`` and expert dims ``N_1 … N_E``."""
        ...

    def fma_per_token(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        """Fused multiply-adds the gate spends on one token."""
        ...

    def build(
        self, in_features: int, expert_dims: tuple[int, ...], *, device: Any = None, dtype: Any = None
    ) -> nn.Module:
        """The gate module: ``forward(z)`` returns one ``(…, N_e)`` tensor per expert mode."""
        ...


class CausalityWarning(UserWarning):
    """A gate whose training-mode coefficients mix the tokens of a batch, put into a causal model."""


class _LinearLogits:
    """Costs and building shared by gates whose logits are one ``I × N_e`` projection per mode."""

    norm: str
    init: str
    balance_loss: bool
    z_loss: bool
    #: The class of `mumoe_tn.gates.modules` that ``build`` makes, the field it takes after the
    #: sizes (its selection: the activation or ``k``), and the fields it takes as options besides
    #: the norm and the init.
    _module_class: ClassVar[str]
    _selection_field: ClassVar[str]
    _option_fields: ClassVar[tuple[str, ...]] = ("balance_loss", "z_loss")

    @property
    def mixes_tokens(self) -> bool:
        """Whether, in training mode, one token's coefficients depend on the other tokens of the batch.

        True for a norm with batch statistics (``"batch"``, see
        [`TOKEN_MIXING_NORMS`][mumoe_tn.gates.choices]): in a causal language model such a gate lets every
        position see the later tokens of its sequence while training (and the model then generates with
        other, running, statistics). In eval mode every gate is token-wise. ``"layer"`` and ``"none"``
        are token-wise in both modes. The auxiliary losses are batch means either way: they shape
        the gradients, never a token's output.
        """
        return self.norm in TOKEN_MIXING_NORMS

    def _check_shared_options(self) -> None:
        """The norm name, the init and the two loss flags, which every linear-logit gate has."""
        check_name("norm", self.norm)
        check_gate_options(self.init, balance_loss=self.balance_loss, z_loss=self.z_loss)

    def build(
        self, in_features: int, expert_dims: tuple[int, ...], *, device: Any = None, dtype: Any = None
    ) -> nn.Module:
        """The gate module of `mumoe_tn.gates.modules` this descriptor names, with its options.

        An [`ExpertGate`][mumoe_tn.gates.modules.ExpertGate] for a ``Gate``, a
        [`TopKRouter`][mumoe_tn.gates.modules.TopKRouter] for a ``TopKGate``, a
        [`ReLUTopKRouter`][mumoe_tn.gates.modules.ReLUTopKRouter] for a ``ReLUTopKGate``.
        """
        from mumoe_tn.gates import modules

        module_class = getattr(modules, self._module_class)
        options = {name: getattr(self, name) for name in self._option_fields}
        selection = getattr(self, self._selection_field)
        return module_class(
            in_features, expert_dims, selection, self.norm, init=self.init, device=device, dtype=dtype, **options
        )

    def parameter_count(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        """``I·ΣN_e``: the projections (the logit norms have no affine parameters)."""
        return in_features * sum(expert_dims)

    def fma_per_token(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        """``I·ΣN_e``: the logits ``G_eᵀ z``."""
        return in_features * sum(expert_dims)


@register_gate
@dataclass(frozen=True)
class Gate(_LinearLogits):
    """The paper's gate ``a_e = φ(norm(G_eᵀ z))`` for every expert mode (the default).

    Parameters
    ----------
    activation : str or float, optional
        φ: ``"entmax15"`` (default, the paper's), ``"sparsemax"``, ``"softmax"``, or a finite
        float ``α > 1`` for α-entmax by bisection.
    norm : str, optional
        Normalisation of the logits: ``"batch"`` (default, BatchNorm without affine as in the
        paper), ``"layer"`` (LayerNorm without affine) or ``"none"``. ``"batch"`` is not causal:
        in training mode its statistics come from every token of the batch, later positions
        included; autoregressive models need ``"layer"`` or ``"none"`` (the paper's authors advise
        LayerNorm there), which [`convert`][mumoe_tn.conversion.convert.convert] chooses for causal models.
    init : {"default", "zeros"}, optional
        ``"default"``: nn.Linear's initialisation; ``"zeros"``: all projections zero, so every
        coefficient starts at ``1/N_e`` (the authors' GPT-2 configuration; entmax15, sparsemax
        and softmax all map equal logits to the uniform vector, with the full support).
    balance_loss : bool, optional
        Record a Switch-style load-balancing loss after each forward pass (see
        [`mumoe_tn.gates.modules.ExpertGate`][mumoe_tn.gates.modules.ExpertGate]).
    z_loss : bool, optional
        Record the router z-loss (mean squared logsumexp of the logits).
    """

    activation: str | float = "entmax15"
    norm: str = "batch"
    init: str = "default"
    balance_loss: bool = False
    z_loss: bool = False

    _module_class: ClassVar[str] = "ExpertGate"
    _selection_field: ClassVar[str] = "activation"

    def __post_init__(self) -> None:
        activation = self.activation
        if isinstance(activation, bool) or not isinstance(activation, (str, int, float)):
            raise TypeError(f"activation must be a name or a float alpha, got {activation!r}")
        if isinstance(activation, (int, float)) and not (math.isfinite(activation) and activation > 1):
            raise ValueError(
                f"entmax alpha must be a finite number > 1 (1 is softmax: use 'softmax'), got {activation!r}"
            )
        self._check_shared_options()


@register_gate
@dataclass(frozen=True)
class TopKGate(_LinearLogits):
    """A softmax top-k router per expert mode: the ``k`` largest logits, renormalised.

    Every token keeps ``k`` experts of each mode, weighted by the softmax of their logits
    (the softmax of all logits restricted to the top ``k`` and renormalised); the others get
    exactly 0. With hierarchical expert dims each mode routes on its own.

    Parameters
    ----------
    k : int or Sequence[int], optional
        Experts kept per token, one int for every mode or one per mode (default 1).
    norm : str, optional
        Normalisation of the logits (default ``"none"``, as in Switch/Mixtral routers).
    init : {"default", "zeros"}, optional
        As for [`Gate`][mumoe_tn.gates.specs.Gate]. Zero logits all tie: ``k`` experts (``torch.topk`` picks which)
        get ``1/k`` each, so unlike a dense gate a zero-initialised router starts by training
        only those; the balance loss then spreads the routing.
    balance_loss, z_loss : bool, optional
        As for [`Gate`][mumoe_tn.gates.specs.Gate]; the balance loss uses the router's full softmax and the top-k
        dispatch fractions.
    """

    short_name: ClassVar[str] = "softmax"
    k: int | tuple[int, ...] = 1
    norm: str = "none"
    init: str = "default"
    balance_loss: bool = False
    z_loss: bool = False

    _module_class: ClassVar[str] = "TopKRouter"
    _selection_field: ClassVar[str] = "k"

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", check_k(self.k))
        self._check_shared_options()


@register_gate
@dataclass(frozen=True)
class ReLUTopKGate(_LinearLogits):
    """The Mixture of Decoders gate: ``a_e = TopK_k(ReLU(G_eᵀ z + b_e))`` per expert mode.

    Every token keeps, per mode, its ``k`` largest ReLU'd logits *as they are* — not
    renormalised, so a row sums to whatever they add up to (0 when no logit is positive) — and
    every other coefficient is exactly 0 (Oldfield et al., "Towards Interpretability Without
    Sacrifice: Faithful Dense Layer Decomposition with Mixture of Decoders", 2025). Gradients reach
    the projections and biases through the kept entries. With hierarchical expert dims each mode
    gates on its own.

    Parameters
    ----------
    k : int or Sequence[int], optional
        Experts kept per token, one int for every mode or one per mode (default 1). A ``k``
        larger than its mode's ``N_e`` is refused when the gate is built.
    bias : bool, optional
        A bias ``b_e`` per logit (default True, as in the authors' gate): ``ΣN_e`` more
        parameters, no FMAs counted.
    norm : str, optional
        Normalisation of the logits after the bias (default ``"none"``, the authors' gate);
        ``"batch"`` mixes the tokens of a batch in training mode (see ``mixes_tokens``).
    init : {"default", "zeros"}, optional
        ``"default"``: nn.Linear's initialisation. ``"zeros"``: zero projections and every bias at
        ``1/k``, so ``k`` experts (``torch.topk`` picks which among the tied logits) start at
        ``1/k`` each; needs ``bias=True``, since zero logits are all cut by the ReLU and get no
        gradient.
    """

    short_name: ClassVar[str] = "relu"
    k: int | tuple[int, ...] = 1
    bias: bool = True
    norm: str = "none"
    init: str = "default"

    _module_class: ClassVar[str] = "ReLUTopKRouter"
    _selection_field: ClassVar[str] = "k"
    _option_fields: ClassVar[tuple[str, ...]] = ("bias",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", check_k(self.k))
        check_flag("bias", self.bias)
        check_name("norm", self.norm)
        check_gate_options(self.init)
        check_zero_init_bias(self.init, self.bias)

    def parameter_count(self, in_features: int, expert_dims: tuple[int, ...]) -> int:
        """``I·ΣN_e`` for the projections, ``+ ΣN_e`` with the biases."""
        return (in_features + int(self.bias)) * sum(expert_dims)


#: The gate every layer uses unless told otherwise: entmax15 on BatchNorm'd logits.
DEFAULT_GATE = Gate()


def _as_spec(gate: object) -> GateSpec | None:
    if gate is True:
        return DEFAULT_GATE
    if gate is False:
        return None
    if not isinstance(gate, GateSpec):
        raise TypeError(
            "gate must be True (the default gate), False (not counted) or a gate descriptor with "
            f"parameter_count, fma_per_token and build (see mumoe_tn.gates.specs.GateSpec), got {gate!r}"
        )
    return gate


def _count(gate: bool | GateSpec, what: str, in_features: int, expert_dims: Sequence[int]) -> int:
    """The descriptor's ``what`` (``parameter_count`` or ``fma_per_token``), checked; 0 without a gate."""
    spec = _as_spec(gate)
    if spec is None:
        return 0
    value = getattr(spec, what)(in_features, tuple(expert_dims))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"the gate {spec!r} reported {what} = {value!r}; it must be a non-negative int")
    return value


def gate_parameter_count(gate: bool | GateSpec, in_features: int, expert_dims: Sequence[int]) -> int:
    """Parameters of ``gate`` (``True``: the default gate, ``False``: 0) for ``I`` and ``N_1 … N_E``.

    Parameters
    ----------
    gate : bool or GateSpec
        What to count.
    in_features : int
        Width ``I`` of the gate's input.
    expert_dims : Sequence[int]
        ``N_1 … N_E``.

    Returns
    -------
    int
    """
    return _count(gate, "parameter_count", in_features, expert_dims)


def gate_fma_per_token(gate: bool | GateSpec, in_features: int, expert_dims: Sequence[int]) -> int:
    """FMAs per token of ``gate`` (``True``: the default gate, ``False``: 0).

    Parameters
    ----------
    gate : bool or GateSpec
        What to count.
    in_features : int
        Width ``I`` of the gate's input.
    expert_dims : Sequence[int]
        ``N_1 … N_E``.

    Returns
    -------
    int
    """
    return _count(gate, "fma_per_token", in_features, expert_dims)


def gate_from_options(
    gate: GateSpec | None = None,
    *,
    activation: str | float | None = None,
    norm: str | None = None,
    init: str | None = None,
) -> GateSpec:
    """The descriptor a layer uses: ``gate`` itself, or a [`Gate`][mumoe_tn.gates.specs.Gate] from the short options.

    Parameters
    ----------
    gate : GateSpec, optional
        A ready descriptor; then the other options must be left unset.
    activation, norm, init : optional
        [`Gate`][mumoe_tn.gates.specs.Gate] fields (defaults ``"entmax15"``, ``"batch"``, ``"default"``).

    Returns
    -------
    GateSpec
    """
    if gate is None:
        options = {"activation": activation, "norm": norm, "init": init}
        return Gate(**{key: value for key, value in options.items() if value is not None})
    if isinstance(gate, bool) or not isinstance(gate, GateSpec):
        raise TypeError(
            "gate must be a gate descriptor with parameter_count, fma_per_token and build "
            f"(e.g. mumoe_tn.gates.specs.Gate or TopKGate), got {gate!r}"
        )
    options = {"activation": activation, "gate_norm": norm, "gate_init": init}
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise TypeError(f"pass either gate= or {', '.join(given)}, not both (the descriptor {gate!r} holds them)")
    return gate
