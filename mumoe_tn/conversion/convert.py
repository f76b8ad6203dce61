"""Put μMoE layers into existing models: conversion, upcycling and dense-tensor decomposition."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.adapters import LinearView, linear_view
from mumoe_tn.conversion.blocks import MLPParts, mlp_parts
from mumoe_tn.conversion.record import (
    EXECUTION_OPTIONS,
    QUANT_METHOD,
    RECORD_KEY,
    ConversionRecord,
    ConvertedModule,
    execution_from_data,
    gate_from_data,
    gate_to_data,
    network_from_data,
    network_to_data,
)
from mumoe_tn.conversion.upcycling import decompose_dense, upcycle_experts, upcycle_linear, warn_if_inexact
from mumoe_tn.decompositions.resolve import Decomposition, format_of
from mumoe_tn.gates.specs import CausalityWarning, gate_from_options
from mumoe_tn.layers import FactorizedExperts, MixtureOfDecoders, MuMoE, MuMoEMLP
from mumoe_tn.layers.mlp import MuMoEGatedMLP
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
# decompose_dense and upcycle_linear live in mumoe_tn.conversion.upcycling; re-exported here for convenience.

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
        split across two sibling modules (see [`mumoe_tn.conversion.blocks`][mumoe_tn.conversion.blocks]).
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
    with [`mumoe_tn.conversion.adapters.register_adapter`][mumoe_tn.conversion.adapters.register_adapter]), gated
    MLPs (Llama-style
    ``gate_proj/up_proj/down_proj``, timm ``SwiGLU``/``GluMlp``) and BERT-style layers whose MLP
    is split into ``intermediate`` and ``output`` (the layer's name is listed); see
    [`mumoe_tn.conversion.blocks`][mumoe_tn.conversion.blocks].
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
        Any model.

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


def _ranks(network: ExpertNetwork) -> str:
    return ", ".join(f"{bond}={network.sizes[bond]}" for bond in network.bonds)


def _count(modules: Sequence[nn.Module]) -> int:
    unique = {id(p): p for module in modules for p in module.parameters()}
    return sum(p.numel() for p in unique.values())


def _join(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if child else prefix


@dataclass
class _Choice:
    """A module chosen for replacement, with every path it sits at."""

    kind: str
    module: nn.Module
    layers: dict[str, LinearView]
    parts: MLPParts | None
    paths: list[str]


def _choose(model: nn.Module, select_linear: Callable, select_mlp: Callable) -> list[_Choice]:
    choices: dict[int, _Choice] = {}
    taken: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or any(name == t or name.startswith(t + ".") for t in taken):
            continue
        known = choices.get(id(module))
        if known is not None:  # the same module at a second path
            known.paths.append(name)
            if known.parts is not None:
                taken.extend(_join(name, child) for child in known.parts.replaced)
            continue
        parts = mlp_parts(module)
        if parts is not None and select_mlp(name, module):
            choices[id(module)] = _Choice(parts.kind, module, parts.layers, parts, [name])
            taken.extend(_join(name, child) for child in parts.replaced)
            continue
        view = linear_view(module)
        if view is not None and select_linear(name, module):
            choices[id(module)] = _Choice("linear", module, {"layer": view}, None, [name])
    return list(choices.values())


def _new_module(
    choice: _Choice,
    expert_dims: int | Sequence[int],
    decomposition: Decomposition,
    rank: int | Sequence[int] | str,
    options: dict[str, Any],
    device: torch.device | str | None = None,
) -> tuple[nn.Module, dict[str, FactorizedExperts]]:
    """The μMoE replacement of ``choice`` and its factorized layers by role (on ``device``: the layers' own)."""
    views = choice.layers
    first = views.get("up", views.get("layer"))
    factory = {"device": first.device if device is None else device, "dtype": first.dtype}
    bias = any(view.bias is not None for view in views.values())
    if choice.kind == "linear":
        layer = MuMoE(
            first.in_features,
            first.out_features,
            expert_dims,
            decomposition,
            **_ranks_or_match(rank, "linear"),
            bias=bias,
            **factory,
            **options,
        )
        return layer, {"layer": layer.experts}
    down, activation = views["down"], choice.parts.activation
    block = {
        "bias": bias,
        "hidden_activation": nn.Identity() if activation is None else copy.deepcopy(activation),
        **factory,
        **options,
    }
    fmt = format_of(decomposition)
    if fmt is not None and fmt.mlp_block == "decoders":
        # A recorded network gives the hidden width (a matched block may be narrower than the MLP).
        hidden = decomposition.in_features if isinstance(decomposition, ExpertNetwork) else first.out_features
        decoders = MixtureOfDecoders(
            first.in_features, hidden, down.out_features, expert_dims, decomposition,
            **_ranks_or_match(rank, "mlp"), gated=choice.kind == "gated", **block,
        )  # fmt: skip
        return decoders, decoders.expert_layers
    sizes = (first.in_features, first.out_features, down.out_features, expert_dims, decomposition)
    if choice.kind == "gated":
        gated = MuMoEGatedMLP(*sizes, **_ranks_or_match(rank, "mlp"), **block)
        return gated, gated.expert_layers
    mlp = MuMoEMLP(*sizes, **_ranks_or_match(rank, "mlp"), **block)
    return mlp, {"up": mlp.experts1, "down": mlp.experts2}


def _ranks_or_match(rank: object, target: str) -> dict[str, object]:
    """``rank="match"`` parameter-matches (``match=target``); anything else gives explicit ranks."""
    return {"match": target} if rank == "match" else {"rank": rank}


def _upcycle(choice: _Choice, new: nn.Module, layers: dict[str, FactorizedExperts], fit: dict[str, Any]) -> float:
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


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


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
    [`mumoe_tn.conversion.adapters.register_adapter`][mumoe_tn.conversion.adapters.register_adapter]). Every replacement
    is built (and upcycled) before the model is touched, so a failing conversion leaves the model
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
        counted); ``"exact"`` (or None, as for [`upcycle_linear`][mumoe_tn.conversion.upcycling.upcycle_linear])
        gives each the
        smallest ranks at which every expert can equal the replaced layers (see
        [`mumoe_tn.costs.match_exact`][mumoe_tn.costs.matching.match_exact]); otherwise explicit ranks.
    upcycle : bool, optional
        Start every expert of each new layer as the layer it replaces (for blocks: each of the
        block's layers; see
        [`mumoe_tn.conversion.upcycling.upcycle_experts`][mumoe_tn.conversion.upcycling.upcycle_experts]). With
        ``rank="exact"`` the converted model computes what the original did, for any gate output, up
        to rounding. At other ranks each layer is the best approximation the format's closed form
        gives (the Eckart–Young truncation of its matrix for CP, TR, TT and Tucker) or the generic
        fit finds; the report gives the error, and an
        [`UpcycleWarning`][mumoe_tn.conversion.upcycling.UpcycleWarning] names
        every module whose error exceeds [`upcycle_threshold`][mumoe_tn.conversion.upcycling.upcycle_threshold]
        with the exact
        rank. Parameter-matched ranks are usually far below it: upcycling then starts the model
        close to, not at, the original.
    max_iter, tol, progress : optional
        Bounds and progress bar of the generic fit for networks without a closed form (see
        [`mumoe_tn.conversion.upcycling.upcycle_experts`][mumoe_tn.conversion.upcycling.upcycle_experts]).
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
    choices = _choose(model, select_linear, select_mlp)
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
    fmt = format_of(decomposition)
    keeps_widths = upcycle and rank == "match" and fmt is not None and fmt.mlp_block == "decoders"
    if keeps_widths and any(choice.kind != "linear" for choice in choices):
        report.notes.append(
            f"Upcycled {fmt.name!r} blocks keep the MLP's hidden width (the encoder is copied, so the block computes "
            "what the MLP did): they hold the MLP's parameters plus their experts'. Without upcycle=True, "
            "rank='match' narrows the hidden layer to the MLP's parameter count instead."
        )
    for choice in choices:
        block_rank = "exact" if keeps_widths and choice.kind != "linear" else rank
        try:
            new, layers = _new_module(choice, expert_dims, decomposition, block_rank, layer_options)
        except (ValueError, TypeError) as error:
            kind = TypeError if isinstance(error, TypeError) else ValueError
            raise kind(f"cannot convert {choice.paths[0]!r}: {error}") from error
        error = _upcycle(choice, new, layers, fit) if upcycle else None
        if all(view.frozen for view in choice.layers.values()):
            new.requires_grad_(False)
        new.train(choice.module.training)
        built.append((choice, new, layers, error))
    for choice, new, layers, error in built:
        _install(model, choice, new)
        network = next(iter(layers.values())).network
        before = _count([view.module for view in choice.layers.values()])
        name, *aliases = choice.paths
        report.replacements.append(
            Replacement(
                name, choice.kind, before, _count([new]), network.expert_dims, _ranks(network), error, tuple(aliases)
            )
        )
    _extend_record(model, [(choice, new, layers) for choice, new, layers, _ in built], mask_argument)
    if mask_argument is not None:
        install_mask_hook(model, mask_argument)
        report.notes.append(
            f"Padding: every call hands its {mask_argument!r} to the μMoE layers, whose gates then count real "
            "tokens only."
        )
    return report


def _install(model: nn.Module, choice: _Choice, new: nn.Module) -> list[tuple[str, nn.Module]]:
    """Put ``new`` at every path of ``choice`` (for split blocks: at the target, the bypassed layers made identity).

    Returns the ``(path, module)`` pairs it replaced, latest last, for ``_uninstall``.
    """
    bypass = () if choice.parts is None else choice.parts.bypass
    target = "" if choice.parts is None else choice.parts.target
    replaced = []
    for path in choice.paths:
        for child, module in ((target, new), *((child, nn.Identity()) for child in bypass)):
            full = _join(path, child)
            replaced.append((full, model.get_submodule(full)))
            _set(model, full, module)
    return replaced


def _uninstall(model: nn.Module, replaced: Sequence[tuple[str, nn.Module]]) -> None:
    """Put back the modules ``_install`` replaced, in reverse order."""
    for path, module in reversed(replaced):
        _set(model, path, module)


# ----------------------------------------------------------------------------- the conversion record
def _hf_config(model: nn.Module) -> Any:
    """The model's Hugging Face-style config (one that saves itself as JSON), or None."""
    config = getattr(model, "config", None)
    return config if callable(getattr(config, "to_json_string", None)) else None


def conversion_record(model: nn.Module) -> ConversionRecord | None:
    """The record of what [`convert`][mumoe_tn.conversion.convert.convert] did to a model (None if nothing).

    Parameters
    ----------
    model : nn.Module
        Any model.

    Returns
    -------
    ConversionRecord or None
        None for a model that was never converted. For a Hugging Face model the record is read
        from ``model.config.mumoe_conversion``, so it is saved by ``save_pretrained``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    config = _hf_config(model)
    data = getattr(config, RECORD_KEY, None) if config is not None else model.__dict__.get(RECORD_KEY)
    return None if data is None else ConversionRecord.from_dict(data)


def _describe(choice: _Choice, new: nn.Module, layers: Mapping[str, FactorizedExperts]) -> ConvertedModule:
    """The record of one replacement, read from the module that was built."""
    first = next(iter(layers.values()))
    execution = {option: getattr(first, option) for option in EXECUTION_OPTIONS}
    if not isinstance(execution["optimize"], str):
        raise TypeError(
            f"the path optimizer {execution['optimize']!r} is an object, which a checkpoint cannot record: "
            "give optimize= a name ('auto', 'dp', 'greedy', 'autotune', …) to save and reload converted models"
        )
    return ConvertedModule(
        paths=tuple(choice.paths),
        kind=choice.kind,
        networks=tuple((role, network_to_data(experts.network)) for role, experts in layers.items()),
        gate=gate_to_data(new.gate_spec),
        gate_input=new.gate_input,
        input_norm=isinstance(new.input_norm, nn.LayerNorm),
        execution=execution,
    )


def _extend_record(
    model: nn.Module, replaced: Sequence[tuple[_Choice, nn.Module, dict]], mask_argument: str | None
) -> None:
    """Add these replacements to ``model``'s record (its HF config, or an attribute of the model)."""
    try:
        described = tuple(_describe(choice, new, layers) for choice, new, layers in replaced)
        added = ConversionRecord(described, mask_argument)
    except TypeError as error:
        warnings.warn(
            f"the conversion cannot be recorded, so the converted model will not reload from a checkpoint by "
            f"itself: {error}",
            UserWarning,
            stacklevel=3,
        )
        return
    record = conversion_record(model)
    data = (added if record is None else record + added).to_dict()
    config = _hf_config(model)
    if config is not None:
        setattr(config, RECORD_KEY, data)
        if getattr(config, "quantization_config", None) is None:  # selects the from_pretrained hook
            config.quantization_config = {"quant_method": QUANT_METHOD}
    else:
        model.__dict__[RECORD_KEY] = data


def apply_conversion(
    model: nn.Module,
    record: ConversionRecord | Mapping[str, Any] | str,
    *,
    shapes: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Replay a conversion on a fresh copy of the original model, so the converted checkpoint loads into it.

    Every recorded module is rebuilt with the recorded networks, gate and options (no matching, no
    upcycling: the weights come from the checkpoint), checked against the record, and only then
    put into the model: a record that does not fit the model changes nothing. Nothing is planned
    with the recorded path optimizer here: the layers are built with the default bounded planner
    and use the recorded one when they first plan a batch.

    Parameters
    ----------
    model : nn.Module
        A model built like the one that was converted (same class and configuration), not yet converted.
    record : ConversionRecord or Mapping or str
        The record (from [`conversion_record`][mumoe_tn.conversion.convert.conversion_record], its ``to_dict()``, or its
        JSON).
    shapes : Mapping[str, tensor or shape], optional
        The checkpoint's tensors, or only their shapes (e.g. read from safetensors headers), by
        state-dict key. Given, every parameter and buffer the record implies is first built on the
        meta device and checked against them, so a record can only make tensors the checkpoint
        holds. Without it the record's sizes are trusted (as the model's own configuration is).

    Returns
    -------
    nn.Module
        ``model``, converted in place; ``model.load_state_dict(saved_state)`` then restores it.

    Raises
    ------
    ValueError
        If the record is malformed, the model is already converted, a recorded path is missing,
        of another kind or size, or a tensor the record implies is not in ``shapes`` with that shape.

    Examples
    --------
    >>> record = conversion_record(model)                       # doctest: +SKIP
    >>> torch.save({"record": record.to_dict(), "state": model.state_dict()}, "converted.pt")  # doctest: +SKIP
    >>> saved = torch.load("converted.pt")                      # doctest: +SKIP
    >>> fresh = apply_conversion(build_model(), saved["record"], shapes=saved["state"])  # doctest: +SKIP
    >>> fresh.load_state_dict(saved["state"])                   # doctest: +SKIP
    """
    rebuilt, record = replay_conversion(model, record, shapes=shapes)
    commit_conversion(model, rebuilt, record)
    return model


#: A rebuilt module: the module it replaces, the new module and its factorized layers by role.
Rebuilt = tuple[_Choice, nn.Module, dict[str, FactorizedExperts]]


def replay_conversion(
    model: nn.Module,
    record: ConversionRecord | Mapping[str, Any] | str,
    *,
    shapes: Mapping[str, Any] | None = None,
) -> tuple[list[Rebuilt], ConversionRecord]:
    """The modules ``record`` puts into ``model``, built and checked but not installed (``model`` is unchanged).

    See [`apply_conversion`][mumoe_tn.conversion.convert.apply_conversion] for the arguments;
    [`commit_conversion`][mumoe_tn.conversion.convert.commit_conversion] installs the result.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if shapes is not None and not isinstance(shapes, Mapping):
        raise TypeError(f"shapes must be a mapping of state-dict key -> tensor or shape, got {type(shapes).__name__}")
    record = ConversionRecord.from_dict(record)
    existing = conversion_record(model)
    if existing is not None and existing.modules:
        raise ValueError(
            f"the model is already converted ({len(existing.modules)} module(s), e.g. "
            f"{existing.modules[0].paths[0]!r}): apply a record to a fresh, unconverted copy of the model"
        )
    if record.mask_argument is not None and not accepts_argument(model, record.mask_argument):
        raise ValueError(
            f"the conversion record hands the argument {record.mask_argument!r} of forward to the μMoE layers, but "
            f"{type(model).__name__}.forward has none"
        )
    modules = dict(model.named_modules(remove_duplicate=False))
    choices = [_rebuild_choice(model, modules, entry, number) for number, entry in enumerate(record.modules)]
    if shapes is not None:
        sized = {key: _shape(value) for key, value in shapes.items()}
        meta = torch.device("meta")
        for number, (choice, entry) in enumerate(zip(choices, record.modules, strict=True)):
            new, _ = _rebuild(choice, entry, device=meta)
            _check_shapes(choice, new, sized, number)
            del new
    rebuilt = []
    for choice, entry in zip(choices, record.modules, strict=True):
        new, layers = _rebuild(choice, entry)
        new.train(choice.module.training)
        rebuilt.append((choice, new, layers))
    return rebuilt, record


def commit_conversion(
    model: nn.Module,
    rebuilt: Sequence[Rebuilt],
    record: ConversionRecord,
    check: Callable[[nn.Module], None] | None = None,
) -> None:
    """Install modules from [`replay_conversion`][mumoe_tn.conversion.convert.replay_conversion], all or nothing.

    Installs every module, calls ``check(model)`` (e.g. checks and loads a checkpoint's weights),
    then writes the record and the mask hook. If installing or ``check`` raises, the old modules
    are put back and the error propagates: the model is as it was.
    """
    replaced: list[tuple[str, nn.Module]] = []
    try:
        for choice, new, _ in rebuilt:
            replaced.extend(_install(model, choice, new))
        if check is not None:
            check(model)
        _extend_record(model, rebuilt, record.mask_argument)
    except BaseException:
        _uninstall(model, replaced)
        raise
    if record.mask_argument is not None:
        install_mask_hook(model, record.mask_argument)


def _shape(value: Any) -> tuple[int, ...]:
    """A tensor's shape, or a shape given as a sequence of ints."""
    shape = getattr(value, "shape", value)
    return tuple(int(size) for size in shape)


def _check_shapes(choice: _Choice, new: nn.Module, shapes: Mapping[str, tuple[int, ...]], number: int) -> None:
    """Every tensor of ``new`` must be in ``shapes`` (at one path of the module at least) with its shape."""
    target = "" if choice.parts is None else choice.parts.target
    for key, tensor in new.state_dict(keep_vars=True).items():
        names = [_join(_join(path, target), key) for path in choice.paths]
        found = [name for name in names if name in shapes]
        if not found:
            raise ValueError(
                f"conversion record: record.modules[{number}] implies the tensor {names[0]!r} of shape "
                f"{tuple(tensor.shape)}, which the checkpoint does not hold: the record does not fit its weights"
            )
        for name in found:
            if shapes[name] != tuple(tensor.shape):
                raise ValueError(
                    f"conversion record: record.modules[{number}] implies {name!r} of shape {tuple(tensor.shape)}, the "
                    f"checkpoint holds {shapes[name]}: the record does not fit its weights"
                )


def _rebuild_choice(model: nn.Module, modules: Mapping[str, nn.Module], entry: ConvertedModule, number: int) -> _Choice:
    """The module a record entry replaced, found in ``model`` and checked to be of the recorded kind."""
    found = []
    for path in entry.paths:
        module = modules.get(path)
        if module is None:
            raise ValueError(
                f"the conversion record replaces {path!r}, which this {type(model).__name__} does not have "
                f"(record.modules[{number}].paths): the checkpoint was converted from another model or configuration"
            )
        found.append(module)
    module = found[0]
    if any(other is not module for other in found[1:]):
        raise ValueError(f"the conversion record has one module at {list(entry.paths)}; this model has several")
    if entry.kind == "linear":
        view = linear_view(module)
        parts, layers = None, None if view is None else {"layer": view}
    else:
        parts = mlp_parts(module)
        layers = None if parts is None or parts.kind != entry.kind else parts.layers
    if layers is None:
        raise ValueError(
            f"the conversion record replaced a {entry.kind!r} module at {entry.paths[0]!r}, but this model has a "
            f"{type(module).__name__} there that is not one"
        )
    return _Choice(entry.kind, module, layers, parts, list(entry.paths))


def _rebuild(
    choice: _Choice, entry: ConvertedModule, device: torch.device | None = None
) -> tuple[nn.Module, dict[str, FactorizedExperts]]:
    """The μMoE module of a record entry, with the recorded networks (checked) and options."""
    path = entry.paths[0]
    try:
        networks = {role: network_from_data(data) for role, data in entry.networks}
        options = {
            "gate": gate_from_data(entry.gate),
            "gate_input": entry.gate_input,
            "input_norm": entry.input_norm,
            "optimize": "auto",  # the recorded optimizer plans later, when the layer first runs
        }
        first = next(iter(networks.values()))
        new, layers = _new_module(choice, first.expert_dims, first, None, options, device=device)
    except (ValueError, TypeError) as error:
        raise ValueError(f"the conversion record does not fit the model at {path!r}: {error}") from error
    for role, network in networks.items():
        built = layers.get(role)
        if built is None or built.network != network:
            found = None if built is None else built.network
            raise ValueError(
                f"the conversion record does not fit the model at {path!r}: its {role!r} layer is recorded as "
                f"{network!r}, the model gives {found!r}"
            )
    execution = execution_from_data(entry.execution)
    for experts in layers.values():
        for option, value in execution.items():
            setattr(experts, option, value)
    return new, layers
