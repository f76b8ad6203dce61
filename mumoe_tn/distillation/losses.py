"""The distillation losses: small registered objects that the training step sums.

A loss term is a [`Loss`][mumoe_tn.distillation.losses.Loss]: called with one step's
[`LossInputs`][mumoe_tn.distillation.losses.LossInputs] of one replacement (its input, the block's
output, its prediction, its sparse code and pre-activations when the term asks for them, and a
per-replacement state that checkpoints keep), it returns a scalar. A class registers itself when
it is defined with a ``name=`` keyword, as formats do; [`register_loss`][mumoe_tn.distillation.losses.register_loss]
does the same for a class defined without one. A new loss is one class in one place:

```python
from mumoe_tn.distillation.losses import Loss

class Cosine(Loss, name="cosine"):
    def __call__(self, inputs):
        similarity = torch.cosine_similarity(inputs.prediction, inputs.target, dim=-1)
        return self.weight * (1 - similarity).mean()
```

``distill(..., loss=["normalised-mse", "cosine"])`` then trains on the sum. The registered terms:

- ``"normalised-mse"``: ``mean_{t,o} (ŷ_{t,o} − y_{t,o})² / ‖y_t‖₂`` — the Mixture of Decoders
  paper's loss (Oldfield et al. 2025, its authors' code), the default;
- ``"fvu"``: ``Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t‖²`` — the fraction of variance unexplained that the
  frontier reports as normalised MSE;
- ``"l1"``: ``weight · mean_t ‖z_t‖₁`` on the sparse code ``z`` (a ReLU transcoder's sparsity);
- ``"aux-k"``: the auxiliary-k loss on dead units (Gao et al. 2024, "Scaling and evaluating
  sparse autoencoders"), see [`AuxK`][mumoe_tn.distillation.losses.AuxK];
- ``"gate-balance"``: a Switch-style load-balancing loss on a μMoE block's routing, see
  [`GateBalance`][mumoe_tn.distillation.losses.GateBalance].

Names are case-insensitive and unique. This module is the only place that maps a name to a loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from mumoe_tn.distillation.codes import code_module, substituted_code, unit_parameters
from mumoe_tn.gates.modules import ExpertGate
from mumoe_tn.gates.selection import keep_top_k
from mumoe_tn.registry import Registry
from mumoe_tn.validation import check_positive_float, check_size

__all__ = [
    "FVU",
    "GATE_BALANCE_WEIGHT",
    "L1",
    "LOSSES",
    "AuxK",
    "GateBalance",
    "Loss",
    "LossInputs",
    "NormalisedMSE",
    "available_losses",
    "get_loss",
    "normalised_mse",
    "register_loss",
    "resolve_losses",
    "unregister_loss",
]

_Class = TypeVar("_Class", bound=type)

GATE_BALANCE_WEIGHT = 4e-5
"""The default weight of [`GateBalance`][mumoe_tn.distillation.losses.GateBalance]."""


def normalised_mse(prediction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The distillation loss ``mean_{t,o} (ŷ_{t,o} − y_{t,o})² / ‖y_t‖₂`` over the real tokens.

    Parameters
    ----------
    prediction, target : torch.Tensor
        ``(…, O)`` each.
    mask : torch.Tensor, optional
        ``(…)`` booleans, True = real token; padding tokens do not enter the mean.

    Returns
    -------
    torch.Tensor
        A scalar. A token whose target is zero is divided by ``1e-8`` instead of 0.
    """
    if prediction.shape != target.shape:
        raise ValueError(
            f"prediction and target must have the same shape, got {tuple(prediction.shape)} and {tuple(target.shape)}"
        )
    error = (prediction - target).pow(2) / target.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    if mask is None:
        return error.mean()
    if mask.shape != target.shape[:-1]:
        raise ValueError(f"mask must have shape {tuple(target.shape[:-1])}, got {tuple(mask.shape)}")
    return error[mask.bool()].mean()


@dataclass
class LossInputs:
    """What a loss term sees of one replacement at one step.

    Attributes
    ----------
    module : nn.Module
        The replacement (in training mode).
    x, target, prediction : torch.Tensor
        ``(rows, I)``, ``(rows, O)`` and ``module(x)`` ``(rows, O)`` (with gradients).
    code : tuple of torch.Tensor or None
        The sparse code of this forward pass, one ``(rows, units_e)`` per expert mode; set when a
        term has ``needs_code``.
    preactivations : tuple of torch.Tensor or None
        What the code's nonlinearity read, shaped as ``code`` (see
        [`recording_preactivations`][mumoe_tn.distillation.codes.recording_preactivations]); set
        when a term has ``needs_preactivations``.
    state : dict
        This term's state for this replacement (tensors), kept across steps and in checkpoints.
    """

    module: nn.Module
    x: torch.Tensor
    target: torch.Tensor
    prediction: torch.Tensor
    code: tuple[torch.Tensor, ...] | None = None
    preactivations: tuple[torch.Tensor, ...] | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)


class Loss:
    """A term of the distillation loss: ``term(inputs) -> scalar``.

    Subclass with ``name=`` to register (``class MyLoss(Loss, name="my-loss")``; a name already
    registered raises ``ValueError`` unless ``replace=True`` is given too) and implement ``__call__``.
    Set ``needs_code`` / ``needs_preactivations`` to receive the sparse code / its
    pre-activations in [`LossInputs`][mumoe_tn.distillation.losses.LossInputs].

    Parameters
    ----------
    weight : float, optional
        The term's weight (default 1).
    """

    name: ClassVar[str] = ""
    needs_code: ClassVar[bool] = False
    needs_preactivations: ClassVar[bool] = False

    def __init_subclass__(cls, *, name: str | None = None, replace: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            register_loss(cls, name=name, replace=replace)

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = check_positive_float("weight", weight, allow_zero=True)

    def __call__(self, inputs: LossInputs) -> torch.Tensor:
        """The term's value (a scalar tensor with gradients)."""
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(inputs)")

    def config(self) -> dict[str, Any]:
        """Plain data that identifies the term (its name and options), for checkpoints."""
        return {"name": self.name, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({options})"


#: The registered loss classes by lower-case name (a [`Registry`][mumoe_tn.registry.Registry]).
LOSSES: Registry[str, type[Loss]] = Registry("loss", normalise=str.lower)


def register_loss(cls: _Class, *, name: str | None = None, replace: bool = False) -> _Class:
    """Register a [`Loss`][mumoe_tn.distillation.losses.Loss] subclass under ``name`` (default its ``name``).

    Subclassing ``Loss`` with ``name=`` calls this for you.

    Parameters
    ----------
    cls : type
        A subclass of ``Loss``.
    name : str, optional
        The name (lower-cased); default the class's ``name`` attribute.
    replace : bool, optional
        Replace a loss already registered under that name (default: raise).

    Returns
    -------
    type
        ``cls``, for use as a decorator.

    Raises
    ------
    TypeError
        If ``cls`` is not a ``Loss`` subclass.
    ValueError
        If the name is empty, or taken and ``replace`` is False.
    """
    return LOSSES.register_subclass(cls, Loss, name=name, replace=replace)


def unregister_loss(name: str) -> None:
    """Remove the loss registered under ``name`` (e.g. at the end of a test); an unknown name is ignored."""
    LOSSES.unregister(name)


def available_losses() -> list[str]:
    """Sorted names of the registered losses."""
    return LOSSES.names()


def get_loss_class(name: str) -> type[Loss]:
    """The loss class registered under ``name`` (case-insensitive); ValueError listing the registered ones."""
    if not isinstance(name, str):
        raise TypeError(f"a loss name must be a string, got {name!r} ({type(name).__name__})")
    return LOSSES.lookup(name)


def get_loss(name: str, **options: Any) -> Loss:
    """A term of the loss registered under ``name``, built with ``options`` (e.g. ``weight=``)."""
    return get_loss_class(name)(**options)


def resolve_losses(spec: str | Loss | Sequence[str | Loss]) -> tuple[Loss, ...]:
    """Loss terms from a name, a term, or a non-empty sequence of them (names built with their defaults)."""
    items = [spec] if isinstance(spec, (str, Loss)) else spec
    if not isinstance(items, Sequence) or not items:
        raise TypeError(f"loss must be a name, a Loss, or a non-empty sequence of them, got {spec!r:.80}")
    terms = []
    for item in items:
        if isinstance(item, Loss):
            terms.append(item)
        elif isinstance(item, str):
            terms.append(get_loss(item))
        else:
            raise TypeError(f"a loss term must be a registered name or a Loss instance, got {item!r:.80}")
    names = [term.name for term in terms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"each loss term may appear once, got {repeated} more than once in {names}")
    return tuple(terms)


def _recorded(value: tuple[torch.Tensor, ...] | None, what: str, term: Loss) -> tuple[torch.Tensor, ...]:
    if value is None:
        raise ValueError(
            f"the loss term {term.name!r} needs the replacement's {what} in LossInputs (the training step records it)"
        )
    return value


def _active_units(code: torch.Tensor) -> torch.Tensor:
    """Booleans ``(units,)``: the unit is non-zero (or NaN) at some token of ``code`` ``(…, units)``.

    The largest and the smallest entry per unit, where ``(code != 0).any(0)`` takes two boolean
    passes that torch does not vectorise (five times the time on the CPU), and ``abs`` would write
    a code-sized temporary on every step.
    """
    flat = code.detach().reshape(-1, code.shape[-1])
    if flat.shape[0] == 0:
        return torch.zeros(flat.shape[-1], dtype=torch.bool, device=flat.device)
    return (flat.amax(0) != 0) | (flat.amin(0) != 0)


class NormalisedMSE(Loss, name="normalised-mse"):
    """``weight · mean_{t,o} (ŷ_{t,o} − y_{t,o})² / ‖y_t‖₂`` (the Mixture of Decoders paper's loss)."""

    def __call__(self, inputs: LossInputs) -> torch.Tensor:
        return self.weight * normalised_mse(inputs.prediction, inputs.target)


class FVU(Loss, name="fvu"):
    """``weight · Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t‖²``, the fraction of variance unexplained (about zero)."""

    def __call__(self, inputs: LossInputs) -> torch.Tensor:
        energy = inputs.target.pow(2).sum().clamp_min(1e-12)
        return self.weight * (inputs.prediction - inputs.target).pow(2).sum() / energy


class L1(Loss, name="l1"):
    """``weight · mean_t Σ_e ‖z_{t,e}‖₁`` on the sparse code (sparsity for a ReLU transcoder)."""

    needs_code = True

    def __call__(self, inputs: LossInputs) -> torch.Tensor:
        return self.weight * sum(part.abs().sum(-1).mean() for part in _recorded(inputs.code, "sparse code", self))


class GateBalance(Loss, name="gate-balance"):
    """``weight ·`` a Switch-style load-balancing loss on a μMoE block's routing.

    Per expert mode, ``N_e · Σ_i f_i · P_i``: ``f_i`` the fraction of the batch's routing slots
    given to expert ``i`` (each token's non-zero coefficients, ``1/k`` each) and ``P_i`` the mean
    over the batch of the softmax of the gate's normalised logits (its pre-activations); averaged
    over modes. It is 1 when the routing is balanced. Its gradient, through ``P`` only, lowers the
    logits of the experts that take more than their share and raises the others', so that experts
    no token picks come back into use (the formula of the gates' own ``balance_loss=True``, here
    computed by the gate's [`balance`][mumoe_tn.gates.modules.ExpertGate.balance] from the recorded
    logits and code, so the gate needs no option and keeps its inference path).

    Parameters
    ----------
    weight : float, optional
        ``λ`` (default [`GATE_BALANCE_WEIGHT`][mumoe_tn.distillation.losses.GATE_BALANCE_WEIGHT],
        measured for the normalised-MSE loss in the distillation guide; the Switch Transformer's
        0.01 is for a cross-entropy loss and here costs reconstruction).
    """

    needs_code = True
    needs_preactivations = True

    def __init__(self, weight: float = GATE_BALANCE_WEIGHT) -> None:
        super().__init__(weight)

    def __call__(self, inputs: LossInputs) -> torch.Tensor:
        gate = code_module(inputs.module)
        if not isinstance(gate, ExpertGate):
            raise TypeError(
                f"the loss term {self.name!r} balances a μMoE block's gate; {type(inputs.module).__name__} has no "
                "expert gate"
            )
        code = _recorded(inputs.code, "sparse code", self)
        pre = _recorded(inputs.preactivations, "pre-activations", self)
        return self.weight * gate.balance(pre, code)


class AuxK(Loss, name="aux-k"):
    """The auxiliary-k loss: the dead units learn to reconstruct what the live ones miss.

    Gao et al. 2024 ("Scaling and evaluating sparse autoencoders", §A.2): a unit is *dead* when it
    has not been active for ``dead_after`` tokens. Each step, the residual ``e = y − ŷ`` (detached)
    is reconstructed from a code made of the ``k_aux`` largest ``ReLU``'d pre-activations of the
    dead units only, ``ê = f(z_aux) − f(z_0)`` — the replacement's output with that code minus its
    output with the dead units' modes at zero, so biases and a skip cancel — and the term is
    ``weight · mean_{t,o} (ê − e)² / ‖e_t‖₂``. Its gradient reaches the dead units' parameters
    (a transcoder's encoder rows and decoder columns; a μMoE block's gate rows and experts), which
    move towards the directions of the error, so that they fire again. Zero while no unit is dead.

    For a μMoE block the units are the coefficients of every expert mode; a mode without dead
    units keeps its coefficients (detached) in both passes. It costs two more forward passes of
    the replacement (one without gradients) in a step with dead units.

    Parameters
    ----------
    weight : float, optional
        ``α`` (default 1/32, Gao et al.'s).
    k_aux : int, optional
        Dead units in the auxiliary code per mode (default 32; Gao et al. use about half the
        model width; fewer when fewer units are dead).
    dead_after : int, optional
        Tokens without activity after which a unit counts as dead (default 4,096).
    """

    needs_code = True
    needs_preactivations = True

    def __init__(self, weight: float = 1 / 32, k_aux: int = 32, dead_after: int = 4096) -> None:
        super().__init__(weight)
        self.k_aux = check_size("k_aux", k_aux)
        self.dead_after = check_size("dead_after", dead_after)

    def dead_units(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Booleans over every unit (modes concatenated): dead now; None before the first step."""
        idle = state.get("idle")
        return None if idle is None else idle >= self.dead_after

    def __call__(self, inputs: LossInputs) -> torch.Tensor:
        code = _recorded(inputs.code, "sparse code", self)
        pre = _recorded(inputs.preactivations, "pre-activations", self)
        rows = code[0].shape[0]
        active = torch.cat([_active_units(part) for part in code]).cpu()
        idle = inputs.state.get("idle")
        if idle is not None and tuple(idle.shape) != (active.numel(),):  # a resumed state of another replacement
            raise ValueError(
                f"the {self.name!r} term's state 'idle' has shape {tuple(idle.shape)}, but the replacement has "
                f"{active.numel()} units"
            )
        idle = torch.zeros(active.numel(), dtype=torch.int64) if idle is None else idle
        idle = (idle + rows).masked_fill_(active, 0)
        inputs.state["idle"] = idle
        zero = inputs.prediction.new_zeros(())
        if idle.numel() == 0 or int(idle.max()) < self.dead_after:  # no unit dead
            return zero
        dead = (idle >= self.dead_after).split([part.shape[-1] for part in code])
        auxiliary, baseline = [], []
        for part, logits, mode_dead in zip(code, pre, dead, strict=True):
            if not mode_dead.any():
                auxiliary.append(part.detach())
                baseline.append(part.detach())
                continue
            mask = mode_dead.to(logits.device)
            values = torch.relu(logits).masked_fill(~mask, 0.0)
            k = min(self.k_aux, int(mask.sum()))
            auxiliary.append(keep_top_k(values, k).to(part.dtype))
            baseline.append(torch.zeros_like(part))
        module, trained = inputs.module, unit_parameters(inputs.module)
        parameters = {name: p if name in trained else p.detach() for name, p in module.named_parameters()}
        with substituted_code(module, auxiliary):
            reconstructed = torch.func.functional_call(module, parameters, (inputs.x,))
        with torch.no_grad(), substituted_code(module, baseline):
            floor = module(inputs.x)
        reconstructed = reconstructed - floor
        residual = (inputs.target - inputs.prediction).detach()
        return self.weight * normalised_mse(reconstructed, residual)
