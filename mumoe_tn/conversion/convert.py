"""Put μMoE layers into existing models: conversion, upcycling and dense-tensor decomposition."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.fitting.upcycling import decompose_dense, upcycle_experts, upcycle_linear, warn_if_inexact
from mumoe_tn.conversion.persistence.replay import (
    apply_conversion,
    commit_conversion,
    conversion_record,
    extend_record,
    replay_conversion,
)
from mumoe_tn.conversion.surgery.adapters import LinearView, linear_view
from mumoe_tn.conversion.surgery.blocks import mlp_parts
from mumoe_tn.conversion.surgery.building import Choice, build_block, choose, install
from mumoe_tn.decompositions.resolve import Decomposition, format_of
from mumoe_tn.gates.specs import CausalityWarning, gate_from_options
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.layers.mlp_blocks import mlp_block_for
from mumoe_tn.masking import accepts_argument, install_mask_hook
from mumoe_tn.network import ExpertNetwork

__all__ = [
    "ConversionReport",
    "Replacement",
    "apply_conversion",
    "commit_conversion",
    "conversion_record",
    "convert",
    "decompose_dense",
    "find_mlp_blocks",
    "is_causal_model",
    "replay_conversion",
    "upcycle_linear",
]
# decompose_dense and upcycle_linear live in mumoe_tn.conversion.fitting.upcycling, the record's functions in
# mumoe_tn.conversion.persistence.replay; re-exported here where they were first documented.

Selector = str | Callable[[str, nn.Module], bool] | None


# ----------------------------------------------------------------------------- conversion
@dataclass(frozen=True)
class Replacement:
    """One replaced module.

    Attributes
    ----------
    name : str
        Qualified name of the replaced module (an MLP block's name for blocks).
    kind : {"linear", "mlp", "gated", "split"}
        A linear layer, a plain MLP block, a gated (SwiGLU/GeGLU) block, or a BERT-style block
        split across two sibling modules (see
        [`mumoe_tn.conversion.surgery.blocks`][mumoe_tn.conversion.surgery.blocks]).
    params_before, params_after : int
        Parameters of the replaced layers and of their μMoE replacement.
    expert_dims : tuple of int
        Experts of the replacement.
    ranks : str
        Bond sizes of its (first) expert network.
    upcycle_error : float or None
        With ``upcycle=True``: the largest relative error ``‖M − Ŵ_n‖_F / ‖M‖_F`` over the
        replaced layers' matrices (0 up to rounding when every expert equals them).
    aliases : tuple of str
        Further names of the same module (a module shared at several paths is replaced at
        every one of them by the same new module).
    """

    name: str
    kind: str
    params_before: int
    params_after: int
    expert_dims: tuple[int, ...]
    ranks: str
    upcycle_error: float | None = None
    aliases: tuple[str, ...] = ()


@dataclass
class ConversionReport:
    """What [`convert`][mumoe_tn.conversion.convert.convert] replaced.

    Attributes
    ----------
    replacements : list of Replacement
        One per replaced module.
    causal : bool
        Whether the model was treated as causal (see [`is_causal_model`][mumoe_tn.conversion.convert.is_causal_model]).
    notes : list of str
        Choices conversion made for the user (e.g. the causal-safe gate), printed under the table.
    """

    replacements: list[Replacement] = field(default_factory=list)
    causal: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def params_before(self) -> int:
        """Parameters of the replaced modules before conversion."""
        return sum(r.params_before for r in self.replacements)

    @property
    def params_after(self) -> int:
        """Parameters of their μMoE replacements."""
        return sum(r.params_after for r in self.replacements)

    def to_markdown(self) -> str:
        """The report as a Markdown table."""
        lines = ["| module | kind | params before | params after | experts | ranks | upcycle error |"]
        lines.append("|---|---|---:|---:|---|---|---:|")
        for r in self.replacements:
            error = "" if r.upcycle_error is None else f"{r.upcycle_error:.2e}"
            experts = "×".join(map(str, r.expert_dims))
            name = r.name + "".join(f" (= {alias})" for alias in r.aliases)
            lines.append(
                f"| {name} | {r.kind} | {r.params_before:,} | {r.params_after:,} | {experts} | {r.ranks} | {error} |"
            )
        lines.append(f"| **total** | | {self.params_before:,} | {self.params_after:,} | | | |")
        lines.extend(f"\n{note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def _select(selector: Selector, argument: str) -> Callable[[str, nn.Module], bool]:
    if selector is None:
        return lambda name, module: False
    if isinstance(selector, str):
        try:
            pattern = re.compile(selector)
        except re.error as error:
            raise ValueError(f"{argument}= is not a valid regular expression: {selector!r} ({error})") from None
        return lambda name, module: pattern.search(name) is not None
    if callable(selector):
        return selector
    raise TypeError(f"{argument}= must be a regex string or a callable (name, module) -> bool, got {selector!r}")


def find_mlp_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that ``convert`` treats as MLP blocks.

    Plain two-layer MLPs (``nn.Linear``, Hugging Face ``Conv1D`` or any layer type registered
    with
    [`mumoe_tn.conversion.surgery.adapters.register_adapter`][mumoe_tn.conversion.surgery.adapters.register_adapter]),
    gated MLPs (Llama-style
    ``gate_proj/up_proj/down_proj``, timm ``SwiGLU``/``GluMlp``) and BERT-style layers whose MLP
    is split into ``intermediate`` and ``output`` (the layer's name is listed); see
    [`mumoe_tn.conversion.surgery.blocks`][mumoe_tn.conversion.surgery.blocks].
    """
    return [name for name, module in model.named_modules() if name and mlp_parts(module) is not None]


def is_causal_model(model: nn.Module) -> bool:
    """Whether ``model`` is autoregressive: a position must not see later tokens.

    True when its config says it decodes (Hugging Face ``is_decoder`` or ``is_encoder_decoder``)
    or any submodule declares causal attention with ``is_causal = True`` (the attention modules
    of GPT-2, Llama, Mistral, Qwen, T5's decoder and many more do). A model whose causality lives
    only in the mask it is called with (e.g. ``nn.MultiheadAttention`` with a triangular
    ``attn_mask``) cannot be recognised: tell [`convert`][mumoe_tn.conversion.convert.convert] with ``causal=True``.

    Parameters
    ----------
    model : nn.Module
        The model whose config and attention modules are read.

    Returns
    -------
    bool
    """
    config = getattr(model, "config", None)
    if any(getattr(config, flag, False) is True for flag in ("is_decoder", "is_encoder_decoder")):
        return True
    return any(getattr(module, "is_causal", False) is True for module in model.modules())


def _causal_gate_options(causal: bool, options: dict[str, Any], report: ConversionReport) -> dict[str, Any]:
    """The layer options with a token-wise gate for a causal model; a warning for a gate that mixes tokens."""
    if not causal:
        return options
    if options.get("gate") is None and options.get("gate_norm") is None:
        report.notes.append(
            "Causal model: every gate normalises its logits per token (gate_norm='layer'), so no position "
            "sees later tokens in training (a BatchNorm gate would)."
        )
        return {**options, "gate_norm": "layer"}
    spec = gate_from_options(
        options.get("gate"),
        activation=options.get("activation"),
        norm=options.get("gate_norm"),
        init=options.get("gate_init"),
    )
    if getattr(spec, "mixes_tokens", False) is True:
        warnings.warn(
            f"the gate {spec!r} takes training-mode statistics over every token of the batch, later positions "
            "included: this causal model would see the future while training, and generate with other (running) "
            "statistics. Use gate_norm='layer' (or 'none'), or convert with causal=False if the model is not "
            "autoregressive",
            CausalityWarning,
            stacklevel=3,
        )
    return options


def _format_name(decomposition: Decomposition) -> str:
    fmt = format_of(decomposition)
    return str(decomposition) if fmt is None else fmt.name


def _ranks(network: ExpertNetwork) -> str:
    return ", ".join(f"{bond}={network.sizes[bond]}" for bond in network.bonds)


def _count(modules: Sequence[nn.Module]) -> int:
    unique = {id(p): p for module in modules for p in module.parameters()}
    return sum(p.numel() for p in unique.values())


def _upcycle(choice: Choice, new: nn.Module, layers: dict[str, FactorizedExperts], fit: dict[str, Any]) -> float:
    """Set every expert of each new layer to the replaced layer's matrix; the largest error.

    Layers the new module keeps dense (its ``dense_layers``, by role) are copied; a module with an
    ``output_bias`` outside its experts gets the last layer's bias there.
    """
    matrices = {}
    dense = getattr(new, "dense_layers", {})
    output_bias = getattr(new, "output_bias", None)
    for role, view in choice.layers.items():
        if view.device.type == "meta":
            raise ValueError(
                f"cannot upcycle {choice.paths[0]!r}: its weights are on the meta device (load them first, "
                "or convert with upcycle=False)"
            )
        matrix = view.matrix(bias_row=new.bias)
        if not torch.isfinite(matrix).all() or (view.bias is not None and not torch.isfinite(view.bias).all()):
            what = "its weights" if role == "layer" else f"its {role} layer's weights"
            raise ValueError(f"cannot upcycle {choice.paths[0]!r}: {what} contain NaN or inf")
        if role in dense:
            _copy_dense(choice.paths[0], role, view, dense[role])
        else:
            matrices[role] = matrix
    if output_bias is not None:
        last = choice.layers[next(reversed(list(matrices)))]
        with torch.no_grad():
            if last.bias is None:
                output_bias.zero_()
            else:
                output_bias.copy_(last.bias)
    error = max(upcycle_experts(layers[role], matrix, **fit) for role, matrix in matrices.items())
    dtype = next(iter(choice.layers.values())).dtype
    networks = [experts.network for experts in layers.values()]
    warn_if_inexact(error, networks, dtype, f"{choice.paths[0]!r}")
    return error


def _copy_dense(path: str, role: str, view: LinearView, layer: nn.Linear) -> None:
    """Copy a replaced layer into the dense layer that keeps its role."""
    if tuple(layer.weight.shape) != (view.out_features, view.in_features):
        raise ValueError(
            f"cannot upcycle {path!r}: its {role} layer is {view.in_features} → {view.out_features} but the new "
            f"block's is {layer.in_features} → {layer.out_features} (a parameter-matched block is narrower; "
            "convert with rank='exact' to upcycle)"
        )
    with torch.no_grad():
        layer.weight.copy_(view.matrix(bias_row=False).T)
        if layer.bias is not None and view.bias is not None:
            layer.bias.copy_(view.bias)
        elif layer.bias is not None:
            layer.bias.zero_()


def convert(
    model: nn.Module,
    *,
    expert_dims: int | Sequence[int],
    linears: Selector = None,
    mlps: Selector = None,
    decomposition: Decomposition = "cp",
    rank: int | Sequence[int] | str | None = "match",
    upcycle: bool = False,
    max_iter: int = 200,
    tol: float = 1e-10,
    progress: bool | None = None,
    causal: bool | None = None,
    mask_argument: str | None = "auto",
    **layer_options: Any,
) -> ConversionReport:
    """Replace chosen linear layers and MLP blocks of ``model`` with μMoE layers, in place.

    Linear layers are any module with an adapter (``nn.Linear``, Hugging Face ``Conv1D``, or a
    type registered with
    [`mumoe_tn.conversion.surgery.adapters.register_adapter`][mumoe_tn.conversion.surgery.adapters.register_adapter]).
    Every replacement is built (and upcycled) before the model is touched, so a failing conversion leaves the model
    as it was. A replacement keeps the replaced module's train/eval mode; it is frozen
    (``requires_grad=False`` on all its parameters) when every parameter it replaces was
    frozen. A module shared at several paths is replaced at every path by one new module.

    Parameters
    ----------
    model : nn.Module
        The model; everything not selected is left as it is.
    expert_dims : int or Sequence[int]
        Experts of every new layer.
    linears : str or Callable, optional
        Linear layers to replace with [`MuMoE`][mumoe_tn.layers.moe.MuMoE]: a regex searched in the
        qualified module name, or a predicate ``(name, module) -> bool``.
    mlps : str or Callable, optional
        MLP blocks (see [`find_mlp_blocks`][mumoe_tn.conversion.convert.find_mlp_blocks]) to replace, selected the
        same way: plain
        blocks by [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP], gated ones by
        [`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP]. Dropout inside a block is not carried over.
    decomposition : str or Callable, optional
        Decomposition of every new layer.
    rank : int or Sequence[int] or "match" or "exact" or None, optional
        ``"match"`` (default) parameter-matches each replacement to what it replaces (gating
        counted); ``"exact"`` (or None, as for [`upcycle_linear`][mumoe_tn.conversion.fitting.upcycling.upcycle_linear])
        gives each the
        smallest ranks at which every expert can equal the replaced layers (see
        [`mumoe_tn.costs.match_exact`][mumoe_tn.costs.matching.match_exact]); otherwise explicit ranks.
    upcycle : bool, optional
        Start every expert of each new layer as the layer it replaces (for blocks: each of the
        block's layers; see
        [`upcycle_experts`][mumoe_tn.conversion.fitting.upcycling.upcycle_experts]). With
        ``rank="exact"`` the converted model computes what the original did, for any gate output, up
        to rounding. At other ranks each layer is the best approximation the format's closed form
        gives (the Eckart–Young truncation of its matrix for CP, TR, TT and Tucker) or the generic
        fit finds; the report gives the error, and an
        [`UpcycleWarning`][mumoe_tn.conversion.fitting.upcycling.UpcycleWarning] names
        every module whose error exceeds [`upcycle_threshold`][mumoe_tn.conversion.fitting.upcycling.upcycle_threshold]
        with the exact
        rank. Parameter-matched ranks are usually far below it: upcycling then starts the model
        close to, not at, the original.
    max_iter, tol, progress : optional
        Bounds and progress bar of the generic fit for networks without a closed form (see
        [`mumoe_tn.conversion.fitting.upcycling.upcycle_experts`][mumoe_tn.conversion.fitting.upcycling.upcycle_experts]).
    causal : bool, optional
        Whether the model is autoregressive (default: recognised by
        [`is_causal_model`][mumoe_tn.conversion.convert.is_causal_model]). In a causal model a gate must be
        token-wise in training too: without gate options, every gate then normalises its logits per
        token (``gate_norm="layer"``) and the report says so; a gate with batch statistics
        (``gate_norm="batch"``) gives a [`CausalityWarning`][mumoe_tn.gates.specs.CausalityWarning].
    mask_argument : str or None, optional
        The argument of ``model.forward`` that says which tokens are real (True/1) and which are
        padding: every call of the converted model then hands it to the μMoE layers inside, so
        padding never enters their gate statistics, losses or records (see
        [`mumoe_tn.masking`][mumoe_tn.masking]). ``"auto"`` (default): ``"attention_mask"`` when
        ``forward`` takes one (Hugging Face models do); None: none.
    **layer_options
        Further layer arguments (activation, gate_norm, input_norm, …).

    Returns
    -------
    ConversionReport

    Raises
    ------
    ValueError
        An invalid regex, nothing selected, weights with NaN/inf or on the meta device when
        upcycling.
    """
    select_linear, select_mlp = _select(linears, "linears"), _select(mlps, "mlps")
    if not isinstance(upcycle, bool):
        raise TypeError(f"upcycle must be a bool, got {upcycle!r}")
    if rank is None:
        rank = "exact"
    fit = {"max_iter": max_iter, "tol": tol, "progress": progress}
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool or None (recognise it), got {causal!r}")
    choices = choose(model, select_linear, select_mlp)
    if not choices:
        hint = ""
        if mlp_parts(model) is not None or linear_view(model) is not None:
            hint = "; convert replaces submodules, not the model itself: wrap it, e.g. nn.Sequential(model)"
        raise ValueError(
            f"no module was selected: check the linears=/mlps= patterns (see find_mlp_blocks(model)){hint}"
        )
    for choice in choices:
        for role, view in choice.layers.items():
            if not view.dtype.is_floating_point:
                what = "its weight" if role == "layer" else f"its {role} layer's weight"
                raise TypeError(
                    f"cannot convert {choice.paths[0]!r}: {what} has dtype {view.dtype}, not a floating dtype "
                    "(dequantize the model first)"
                )
    if mask_argument == "auto":
        mask_argument = "attention_mask" if accepts_argument(model, "attention_mask") else None
    elif mask_argument is not None and not accepts_argument(model, mask_argument):
        raise ValueError(
            f"mask_argument={mask_argument!r} is not an argument of {type(model).__name__}.forward; give the name "
            "of the argument that marks real tokens, or None"
        )
    report = ConversionReport(causal=is_causal_model(model) if causal is None else causal)
    layer_options = _causal_gate_options(report.causal, layer_options, report)
    built = []
    keeps_widths = upcycle and rank == "match" and mlp_block_for(decomposition).dense_encoder
    if keeps_widths and any(choice.kind.mlp for choice in choices):
        report.notes.append(
            f"Upcycled {_format_name(decomposition)!r} blocks keep the MLP's hidden width (the encoder is copied, so "
            "the block computes what the MLP did): they hold the MLP's parameters plus their experts'. Without "
            "upcycle=True, rank='match' narrows the hidden layer to the MLP's parameter count instead."
        )
    for choice in choices:
        block_rank = "exact" if keeps_widths and choice.kind.mlp else rank
        try:
            new, layers = build_block(choice, expert_dims, decomposition, block_rank, layer_options)
        except (ValueError, TypeError) as error:
            kind = TypeError if isinstance(error, TypeError) else ValueError
            raise kind(f"cannot convert {choice.paths[0]!r}: {error}") from error
        error = _upcycle(choice, new, layers, fit) if upcycle else None
        if all(view.frozen for view in choice.layers.values()):
            new.requires_grad_(False)
        new.train(choice.module.training)
        built.append((choice, new, layers, error))
    for choice, new, layers, error in built:
        install(model, choice, new)
        network = next(iter(layers.values())).network
        before = _count([view.module for view in choice.layers.values()])
        name, *aliases = choice.paths
        report.replacements.append(
            Replacement(
                name, choice.kind, before, _count([new]), network.expert_dims, _ranks(network), error, tuple(aliases)
            )
        )
    extend_record(model, [(choice, new, layers) for choice, new, layers, _ in built], mask_argument)
    if mask_argument is not None:
        install_mask_hook(model, mask_argument)
        report.notes.append(
            f"Padding: every call hands its {mask_argument!r} to the μMoE layers, whose gates then count real "
            "tokens only."
        )
    return report
