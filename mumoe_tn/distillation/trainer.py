"""One replacement's training step: its optimiser, warm-up, loss terms and unit-norm projection.

[`distill`][mumoe_tn.distillation.training.distill] keeps one
[`ReplacementTrainer`][mumoe_tn.distillation.trainer.ReplacementTrainer] per block and method, built
from a [`Recipe`][mumoe_tn.distillation.trainer.Recipe] (``RECIPES`` by name); the names are also
importable from [`mumoe_tn.distillation.training`][mumoe_tn.distillation.training].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from mumoe_tn.distillation.codes import code_module, recording_code, recording_preactivations
from mumoe_tn.distillation.losses import Loss, LossInputs, resolve_losses

__all__ = [
    "RECIPES",
    "Recipe",
    "ReplacementTrainer",
    "project_column_gradients",
    "renormalise_columns",
    "unit_norm_parameters",
]


@dataclass(frozen=True)
class Recipe:
    """How [`distill`][mumoe_tn.distillation.training.distill] optimises every replacement.

    Attributes
    ----------
    name : str
        Its name in ``RECIPES``.
    lr : float
        The learning rate (``distill(lr=...)`` overrides it); with ``reference_latents`` the rate
        at that many latents.
    optimizer : {"adam", "adamw"}
        ``torch.optim.Adam`` or ``torch.optim.AdamW``.
    weight_decay : float
        AdamW's weight decay.
    warmup : float
        Linear warm-up over this fraction of the run's steps, then a constant learning rate.
    betas : tuple of float
        Adam's decay rates of the moment estimates.
    eps : float
        Adam's term added to the denominator.
    reference_latents : int or None
        None: ``lr`` for every replacement. An int: the rate scales as ``lr · sqrt(reference_latents
        / M)`` with the replacement's number of latents ``M`` (its ``latents`` attribute), as Gao
        et al. 2024 scale theirs.
    clip_norm : float or None
        Clip the gradient of the replacement's parameters to this total norm before each step
        (None: no clipping).
    """

    name: str
    lr: float
    optimizer: str
    weight_decay: float
    warmup: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    reference_latents: int | None = None
    clip_norm: float | None = None

    def rate(self, module: nn.Module, lr: float | None = None) -> float:
        """The learning rate of ``module``: ``lr`` (default the recipe's), scaled by its latents if the recipe says so.

        Raises
        ------
        ValueError
            If the recipe scales by latents and ``module`` has no positive int ``latents``.
        """
        base = self.lr if lr is None else lr
        if self.reference_latents is None:
            return base
        latents = getattr(module, "latents", None)
        if isinstance(latents, bool) or not isinstance(latents, int) or latents < 1:
            raise ValueError(
                f"the recipe {self.name!r} scales its learning rate by the number of latents, which "
                f"{type(module).__name__} does not state (a positive int `latents` attribute, as a Transcoder's): "
                "use it for transcoders only"
            )
        return base * (self.reference_latents / latents) ** 0.5

    def build(self, parameters: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        """The optimiser of one replacement: torch's fused implementation where the parameters allow it.

        The fused kernel updates every parameter in one pass (a third of the for-loop's time on a
        small replacement); parameters it does not support (a device or dtype without the kernel)
        get the multi-tensor (``foreach``) one.
        """
        kind = torch.optim.AdamW if self.optimizer == "adamw" else torch.optim.Adam
        settings = {"lr": lr, "weight_decay": self.weight_decay, "betas": self.betas, "eps": self.eps}
        try:
            return kind(parameters, **settings, fused=True)
        except RuntimeError:
            return kind(parameters, **settings, foreach=True)


#: The Mixture of Decoders authors' warm-up: 5,000 of 117,188 steps (480 M tokens in batches of 4,096).
MXD_WARMUP = 5_000 / (480e6 / 4096)

RECIPES = {
    "mxd-paper": Recipe("mxd-paper", lr=4e-4, optimizer="adamw", weight_decay=0.0, warmup=MXD_WARMUP),
    "plain": Recipe("plain", lr=1e-3, optimizer="adam", weight_decay=0.0, warmup=0.0),
    "adam-warmup": Recipe("adam-warmup", lr=1e-3, optimizer="adam", weight_decay=0.0, warmup=MXD_WARMUP),
    "low-lr": Recipe("low-lr", lr=2e-4, optimizer="adam", weight_decay=0.0, warmup=MXD_WARMUP),
    "topk-paper": Recipe(
        "topk-paper", lr=2e-4, optimizer="adam", weight_decay=0.0, warmup=0.0, eps=6.25e-10, reference_latents=2**14
    ),
    "topk-transcoder": Recipe(
        "topk-transcoder",
        lr=2e-4,
        optimizer="adam",
        weight_decay=0.0,
        warmup=0.0,
        eps=6.25e-10,
        reference_latents=2**14,
        clip_norm=1.0,
    ),
}
"""The training recipes by name.

``"mxd-paper"``: the Mixture of Decoders authors' (AdamW without weight decay at 4e-4, constant
after a warm-up of 5,000 of their 117,188 steps — 480 M tokens in batches of 4,096 — the same
fraction of this run's steps). ``"plain"``: Adam at 1e-3, no warm-up. ``"adam-warmup"``: Adam at
1e-3 after the same warm-up. ``"low-lr"``: Adam at 2e-4 after the same warm-up. ``"topk-paper"``:
the TopK autoencoders' of Gao et al. 2024 ("Scaling and evaluating sparse autoencoders", as
EleutherAI's ``sparsify`` trains its transcoders): Adam with ``eps`` 6.25e-10 at
``2e-4 / sqrt(M / 2**14)`` for ``M`` latents (1.13e-3 for 512), no warm-up; the factories build a
transcoder for it with unit-norm decoder columns, the encoder the decoder's transpose and the
auxiliary-k term (see ``recipe=`` of
[`transcoder_factory`][mumoe_tn.distillation.replacements.transcoder_factory]).
``"topk-transcoder"``: the same optimiser as EleutherAI's ``sparsify`` trains a transcoder with it
— the gradient clipped to norm 1 — and a transcoder built as there: the decoder zero and free (no
unit-norm columns), the auxiliary-k term on.
"""


def _warmup_factor(step: int, *, steps: int) -> float:
    return 1.0 if steps <= 0 else min(1.0, (step + 1) / steps)


def unit_norm_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter, int]]:
    """The parameters ``module`` declares unit-norm, with the dim along which each slice has norm 1.

    A replacement declares them in a ``unit_norm`` attribute: a mapping of its parameter names to
    a dim (``{"decoder.C_n1": 1}``: every row of ``C_n1`` — a Mixture of Decoders' expert vector
    ``c_n`` — has norm 1; see
    [`MixtureOfDecoders.expert_vectors`][mumoe_tn.layers.decoders.MixtureOfDecoders.expert_vectors]).

    Raises
    ------
    TypeError, ValueError
        If ``unit_norm`` is not such a mapping, names no parameter, or a dim is out of range.
    """
    declared = getattr(module, "unit_norm", None)
    if declared is None:
        return []
    if not isinstance(declared, Mapping):
        raise TypeError(f"unit_norm of {type(module).__name__} must map parameter names to dims, got {declared!r:.80}")
    parameters = dict(module.named_parameters())
    found = []
    for name, dim in declared.items():
        if name not in parameters:
            raise ValueError(
                f"unit_norm names {name!r}, not a parameter of {type(module).__name__}: {sorted(parameters)}"
            )
        parameter = parameters[name]
        if isinstance(dim, bool) or not isinstance(dim, int) or not -parameter.ndim <= dim < parameter.ndim:
            raise ValueError(
                f"unit_norm dim of {name!r} must be an int in [-{parameter.ndim}, {parameter.ndim}), got {dim!r}"
            )
        found.append((name, parameter, dim))
    return found


@torch.no_grad()
def renormalise_columns(parameter: torch.Tensor, dim: int) -> None:
    """Scale every slice of ``parameter`` along ``dim`` to norm 1, in place (a zero slice stays zero)."""
    parameter.div_(parameter.norm(dim=dim, keepdim=True).clamp_min(1e-12))


@torch.no_grad()
def project_column_gradients(parameter: torch.Tensor, dim: int) -> None:
    """Remove from ``parameter.grad`` the component parallel to each slice along ``dim``, in place.

    For unit-norm slices ``c``: ``g ← g − (gᵀc) c``, the gradient in the tangent space of the
    sphere (the Mixture of Decoders authors' ``norm_dec``). Nothing happens without a gradient.
    """
    grad = parameter.grad
    if grad is None:
        return
    unit = parameter / parameter.norm(dim=dim, keepdim=True).clamp_min_(1e-12)
    grad.addcmul_(torch.linalg.vecdot(grad, unit, dim=dim).unsqueeze(dim), unit, value=-1)


class ReplacementTrainer:
    """One replacement's training step: its module, optimiser, warm-up, loss terms and their state.

    [`distill`][mumoe_tn.distillation.training.distill] keeps one per block and method; a step is
    forward, the summed loss terms, backward, the unit-norm projection, the optimiser and the
    warm-up schedule, and returns the loss without reading it on the host (no device sync).

    Parameters
    ----------
    module : nn.Module
        The replacement (put in training mode; its unit-norm parameters are renormalised).
    recipe : str or Recipe, optional
        The optimiser, learning rate and warm-up (default ``"mxd-paper"``, see ``RECIPES``).
    steps : int, optional
        The run's optimiser steps (the warm-up is a fraction of them; default 1).
    lr : float, optional
        The learning rate (default the recipe's).
    losses : str or Loss or Sequence, optional
        The run's loss terms (default ``"normalised-mse"``); the module's own
        ``distillation_losses`` are added.
    optimizer : Callable, optional
        ``optimizer(parameters)`` builds the optimiser instead of the recipe.
    name : str, optional
        How error messages name the replacement (default ``"the replacement"``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        recipe: str | Recipe = "mxd-paper",
        steps: int = 1,
        lr: float | None = None,
        losses: str | Loss | Sequence[str | Loss] = "normalised-mse",
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        name: str = "the replacement",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{name} must be an nn.Module, got {type(module).__name__}")
        if isinstance(recipe, str):
            if recipe not in RECIPES:
                raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
            recipe = RECIPES[recipe]
        parameters = [p for p in module.parameters() if p.requires_grad]
        if not parameters:
            raise ValueError(f"{name} has no trainable parameters")
        self.module = module.train()
        self.terms = _terms_of(module, resolve_losses(losses), name)
        self.loss_state: dict[str, dict[str, torch.Tensor]] = {term.name: {} for term in self.terms}
        self.unit_norm = unit_norm_parameters(module)
        for _, parameter, dim in self.unit_norm:
            renormalise_columns(parameter, dim)
        rate = recipe.rate(module, lr)
        self.optimizer = optimizer(parameters) if optimizer is not None else recipe.build(parameters, rate)
        self.parameters, self.clip_norm = parameters, recipe.clip_norm
        warmup = partial(_warmup_factor, steps=round(recipe.warmup * steps))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup)
        self._records_code = any(term.needs_code for term in self.terms)
        self._records_preactivations = any(term.needs_preactivations for term in self.terms)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The summed loss terms on ``(x, y)`` (with gradients)."""
        module = self.module
        if not (self._records_code or self._records_preactivations):
            inputs = LossInputs(module, x, y, module(x))
            return self._summed(inputs)
        with ExitStack() as stack:
            codes = stack.enter_context(recording_code(module)) if self._records_code else None
            pre = stack.enter_context(recording_preactivations(module)) if self._records_preactivations else None
            prediction = module(x)
            inputs = LossInputs(module, x, y, prediction, codes[0] if codes else None, pre[0] if pre else None)
            return self._summed(inputs)

    def _summed(self, inputs: LossInputs) -> torch.Tensor:
        values = []
        for term in self.terms:
            inputs.state = self.loss_state[term.name]
            values.append(term(inputs))
        total = values[0]
        for value in values[1:]:  # in order: one addition per term where stack().sum() takes two passes
            total = total + value
        return total

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimiser step on ``(x, y)``; returns the loss before the step (detached, not synced)."""
        loss = self.loss(x, y)
        for group in self.optimizer.param_groups:  # zero_grad(set_to_none=True), without its profiling hooks
            for parameter in group["params"]:
                parameter.grad = None
        loss.backward()
        for _, parameter, dim in self.unit_norm:
            project_column_gradients(parameter, dim)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters, self.clip_norm, foreach=True)
        self.optimizer.step()
        self.schedule.step()
        for _, parameter, dim in self.unit_norm:
            renormalise_columns(parameter, dim)
        return loss.detach()


def _terms_of(module: nn.Module, losses: tuple[Loss, ...], name: str) -> tuple[Loss, ...]:
    """The run's loss terms and the ones ``module`` adds in its ``distillation_losses`` attribute."""
    own = getattr(module, "distillation_losses", ())
    own = tuple(own) if isinstance(own, (tuple, list)) else own
    if not isinstance(own, tuple) or not all(isinstance(term, Loss) for term in own):
        raise TypeError(f"distillation_losses of {name} must be a tuple of Loss terms, got {own!r:.80}")
    names = [term.name for term in losses]
    terms = losses + tuple(term for term in own if term.name not in names)
    for term in terms:
        if (term.needs_code or term.needs_preactivations) and code_module(module) is None:
            raise TypeError(
                f"the loss term {term.name!r} needs the sparse code of {name} ({type(module).__name__}), which "
                "exposes none: give it a `code_module` attribute"
            )
    return terms
