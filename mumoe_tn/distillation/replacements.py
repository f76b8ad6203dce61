"""Factories of parameter-matched sparse replacements of an MLP block.

They build what [`distill`][mumoe_tn.distillation.training.distill] trains.

A factory takes a [`BlockInfo`][mumoe_tn.distillation.streaming.BlockInfo] and returns a module
``(…, I) → (…, O)``. These build the replacements the field compares at one parameter budget:

- [`mumoe_factory`][mumoe_tn.distillation.replacements.mumoe_factory]: a μMoE block of any format,
  network or spec, flat or hierarchical, with a top-k gate, its ranks (or, for a Mixture of
  Decoders, its hidden width) solved by the library's matcher: the block the format names for an
  MLP ([`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP] / [`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP],
  or [`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders] for ``"mxd"``), as
  [`convert`][mumoe_tn.conversion.convert.convert] chooses it;
- [`transcoder_factory`][mumoe_tn.distillation.replacements.transcoder_factory]: a TopK or ReLU
  (skip) transcoder whose latent count is solved for the budget.

A budget is a number of parameters, or a float: that multiple of the block's own parameters;
without one, the Mixture of Decoders paper's: the parameters of a TopK transcoder with
``32 · I`` latents ([`paper_budget`][mumoe_tn.distillation.replacements.paper_budget]). A Mixture
of Decoders given no expert count keeps the block's hidden width (``4 · I`` in GPT-2, the authors'
``H``) and has its number of experts solved for the budget — about 1,800 for ``I = 64`` — as the
authors size theirs (≈ 21.5 k experts for GPT-2 small).

A Mixture of Decoders is built with its authors' recipe by default
([`mxd_paper_init`][mumoe_tn.distillation.replacements.mxd_paper_init]: unit-norm expert vectors,
zero decoder). A block with one expert mode and a softmax top-k gate trains with a small
load-balancing term on its routing ([`GateBalance`][mumoe_tn.distillation.losses.GateBalance]) by
default, which keeps its experts alive at about the same reconstruction error; the auxiliary-k loss on dead
experts ([`AuxK`][mumoe_tn.distillation.losses.AuxK]) is off by default (both measured in the
distillation guide).

Given plain arguments (a registered format's name, expert counts, ``k``, a budget, a top-k gate's
name, a recipe, ``aux_k`` as a bool, ``balance`` as a number; no ``layer=``, ``gate=`` or block
options), every module these factories build carries ``replacement_spec``, a
[`ReplacementSpec`][mumoe_tn.distillation.replacement_specs.ReplacementSpec] of those arguments;
[`factory_from_spec`][mumoe_tn.distillation.methods.factory_from_spec] gives the factory back,
so a saved run ([`save_frontier`][mumoe_tn.distillation.run_files.save_frontier]) rebuilds its
replacements from data.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.costs.baselines import match_transcoder, transcoder_parameters
from mumoe_tn.costs.matching import resolve_target
from mumoe_tn.decompositions.registry import available
from mumoe_tn.decompositions.resolve import Decomposition, format_of
from mumoe_tn.distillation.losses import GATE_BALANCE_WEIGHT, AuxK, GateBalance
from mumoe_tn.distillation.replacement_specs import MUMOE_KIND, TRANSCODER_KIND, ReplacementSpec
from mumoe_tn.distillation.streaming import BlockInfo
from mumoe_tn.distillation.training import RECIPES, Factory
from mumoe_tn.distillation.transcoders import Transcoder
from mumoe_tn.gates.modules import TopKRouter
from mumoe_tn.gates.registry import top_k_gates
from mumoe_tn.layers.decoders import MixtureOfDecoders
from mumoe_tn.layers.mlp_blocks import mlp_block_for
from mumoe_tn.validation import check_positive_float, check_size

__all__ = [
    "PAPER_EXPANSION",
    "TRANSCODER_RECIPES",
    "mode_split",
    "mumoe_factory",
    "mxd_paper_init",
    "paper_budget",
    "top_k_gate_names",
    "topk_paper_init",
    "transcoder_factory",
]


def top_k_gate_names() -> tuple[str, ...]:
    """What ``top_k`` may be: ``"auto"`` (the format's choice) and every registered top-k gate's short name.

    The registered top-k gates are [`top_k_gates`][mumoe_tn.gates.registry.top_k_gates]: ``"relu"``
    and ``"softmax"`` as shipped, and any gate class a user registers with a ``k`` field.
    """
    return ("auto", *top_k_gates())


#: Latents per input feature of the transcoder whose parameters the paper's budget matches.
PAPER_EXPANSION = 32


def paper_budget(block: BlockInfo) -> int:
    """Parameters of a TopK transcoder with ``32 · I`` latents: the Mixture of Decoders paper's budget."""
    latents = PAPER_EXPANSION * block.in_features
    return transcoder_parameters(block.in_features, latents, block.out_features)


@torch.no_grad()
def mxd_paper_init(block: MixtureOfDecoders) -> MixtureOfDecoders:
    """Initialise a Mixture of Decoders as its authors do, and declare its expert vectors unit-norm.

    The encoders and the gate at ``nn.Linear``'s initialisation; every expert vector ``c_n``
    (see [`expert_vectors`][mumoe_tn.layers.decoders.MixtureOfDecoders.expert_vectors]) drawn from
    ``U(−1, 1)`` and scaled to norm 1; the rest of the decoder (``D``) and the output bias zero, so
    the block starts at output 0. Sets ``block.unit_norm`` to the expert vectors, which
    [`distill`][mumoe_tn.distillation.training.distill] keeps at norm 1 (renormalised after every
    step, the gradient's component along each removed before it). Uses the global RNG.

    Raises
    ------
    ValueError
        If the decoder has no expert-vector cores (a CP or TR decoder).
    """
    if not isinstance(block, MixtureOfDecoders):
        raise TypeError(f"mxd_paper_init takes a MixtureOfDecoders, got {type(block).__name__}")
    vectors = block.expert_vectors()
    if not vectors:
        raise ValueError(
            f"the 'mxd-paper' recipe needs a decoder with expert vectors (cores of an expert leg and 'o', the 'mxd' "
            f"format), got the network {block.network.to_spec()!r}: use recipe='plain'"
        )
    for module in block.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    for name, core in block.decoder.cores.items():
        key = f"decoder.{name}"
        if key in vectors:
            core.uniform_(-1.0, 1.0)
            core.div_(core.norm(dim=vectors[key], keepdim=True).clamp_min(1e-12))
        else:
            core.zero_()
    if block.output_bias is not None:
        block.output_bias.zero_()
    block.unit_norm = dict(vectors)
    return block


def mode_split(total: int, modes: int) -> tuple[int, ...]:
    """``total`` as a product of ``modes`` factors as equal as possible, largest first.

    ``64, 2 → (8, 8)``; ``32, 2 → (8, 4)``.

    Parameters
    ----------
    total : int
        The product (experts, or active experts per token).
    modes : int
        Number of factors.

    Returns
    -------
    tuple of int
    """
    check_size("total", total)
    check_size("modes", modes)
    factors, rest = [], total
    for left in range(modes, 1, -1):
        target = math.log(rest) / left
        small = [d for d in range(1, math.isqrt(rest) + 1) if rest % d == 0]
        divisors = set(small) | {rest // d for d in small}
        factor = min(divisors, key=lambda d: (abs(math.log(d) - target), -d))
        factors.append(factor)
        rest //= factor
    factors.append(rest)
    return tuple(sorted(factors, reverse=True))


def _budget(budget: int | float, block: BlockInfo) -> int:
    return resolve_target(budget, block.parameters)


def mumoe_factory(
    decomposition: Decomposition,
    expert_dims: int | Sequence[int] | None,
    k: int | Sequence[int],
    budget: int | float | None = None,
    *,
    layer: type[nn.Module] | None = None,
    top_k: str = "auto",
    recipe: str | None = None,
    aux_k: bool | AuxK | None = None,
    balance: float | None = None,
    **options: Any,
) -> Factory:
    """A factory of parameter-matched μMoE blocks with a top-k gate.

    Parameters
    ----------
    decomposition : str or Format or ExpertNetwork or Callable
        Any decomposition a μMoE block takes: a format name (``"cp"``, ``"tr"``, …), a custom
        network or spec.
    expert_dims : int or Sequence[int] or None
        ``N`` (flat) or ``(N_1, …, N_E)`` (hierarchical). None for a Mixture of Decoders without
        bonds (``"mxd"``): its number of experts is solved for the budget, at the block's hidden
        width.
    k : int or Sequence[int]
        Experts kept per token, per mode; with several modes an int is split by
        [`mode_split`][mumoe_tn.distillation.replacements.mode_split] so that ``∏ k_e`` experts are
        active. The gate is a softmax top-k ([`TopKGate`][mumoe_tn.gates.specs.TopKGate]), or for a
        Mixture of Decoders the authors' ``TopK(ReLU(G x + b))``
        ([`ReLUTopKGate`][mumoe_tn.gates.specs.ReLUTopKGate]), which may keep fewer than ``k``
        where fewer logits are positive (see ``top_k``); ``gate=`` in ``options`` replaces it.
    budget : int or float, optional
        Parameters of the block (its gate counted): an int, or a multiple of the replaced block's
        parameters. Default: the paper's, a TopK transcoder of ``32 · I`` latents
        ([`paper_budget`][mumoe_tn.distillation.replacements.paper_budget]).
    layer : type, optional
        The block class, called as ``layer(I, H, O, expert_dims, decomposition, match=…, gate=…,
        bias=…, hidden_activation=…, device=…, dtype=…, **options)``: any μMoE block class with
        that constructor. By default the block the format names for an MLP (its ``mlp_block``, see
        [`mumoe_tn.layers.mlp_blocks`][mumoe_tn.layers.mlp_blocks]):
        [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP] for a plain block,
        [`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP] for a gated one,
        [`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders] (``gated=`` for a gated
        block) for a decoder format such as ``"mxd"``.
    top_k : str, optional
        The top-k gate: ``"auto"`` (default) the gate the format names (its ``top_k_gate``: the
        ReLU top-k for a Mixture of Decoders, the softmax top-k otherwise, and the softmax top-k
        for a custom network), or the short name of any registered top-k gate (see
        [`top_k_gate_names`][mumoe_tn.distillation.replacements.top_k_gate_names]) for every block.
    recipe : {"mxd-paper", "plain"}, optional
        ``"mxd-paper"`` (the default for a Mixture of Decoders whose decoder has expert vectors,
        the ``"mxd"`` format): the authors' initialisation and unit-norm expert vectors
        ([`mxd_paper_init`][mumoe_tn.distillation.replacements.mxd_paper_init]). ``"plain"`` (the
        default otherwise): the block's own initialisation.
    aux_k : bool or AuxK, optional
        Train with the auxiliary-k loss on dead experts ([`AuxK`][mumoe_tn.distillation.losses.AuxK],
        attached as the block's ``distillation_losses``): True for its defaults, an ``AuxK`` for
        others, False or None (the default) for none. It is off by default: on flat blocks it left
        more experts dead at the same error and doubled the step's time, on a Mixture of Decoders
        with its authors' ReLU top-k gate it raised the error, and on blocks with several expert
        modes it made training erratic (all measured in the distillation guide).
    balance : float, optional
        The weight of the load-balancing term on the block's routing
        ([`GateBalance`][mumoe_tn.distillation.losses.GateBalance], attached as the block's
        ``distillation_losses``); 0 for none. Default
        [`GATE_BALANCE_WEIGHT`][mumoe_tn.distillation.losses.GATE_BALANCE_WEIGHT] for a block with
        one expert mode and a softmax top-k gate ([`TopKRouter`][mumoe_tn.gates.modules.TopKRouter]),
        where without it a fifth to a half of 256 experts were never picked at L0 8; 0 otherwise
        (a block with several expert modes keeps most of its experts alive, and a Mixture of
        Decoders' ReLU gate is no softmax router).
    **options
        Further arguments of the μMoE block (``rank_multiple``, ``input_norm``, …).

    Returns
    -------
    Factory
    """
    dims = None if expert_dims is None else (expert_dims,) if isinstance(expert_dims, int) else tuple(expert_dims)
    if dims is not None and isinstance(k, int) and len(dims) > 1:
        k = mode_split(k, len(dims))

    fmt = format_of(decomposition)
    kind = mlp_block_for(decomposition) if layer is None else None
    decoders = kind is not None and isinstance(kind.build, type) and issubclass(kind.build, MixtureOfDecoders)
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    if recipe == "mxd-paper" and not decoders:
        raise ValueError(
            f"recipe='mxd-paper' initialises a Mixture of Decoders; {decomposition!r} builds another block: use 'plain'"
        )
    if dims is None and not decoders:
        raise ValueError(
            "expert_dims=None (solved for the budget) needs a Mixture of Decoders format such as 'mxd'; give the "
            f"number of experts of {decomposition!r}"
        )
    if aux_k is not None and not isinstance(aux_k, (bool, AuxK)):
        raise TypeError(f"aux_k must be a bool or an AuxK term, got {aux_k!r:.80}")
    if balance is not None:
        balance = check_positive_float("balance", balance, allow_zero=True)
    gates = top_k_gates()
    if not isinstance(top_k, str) or top_k not in ("auto", *gates):
        raise ValueError(f"top_k must be one of {list(top_k_gate_names())}, got {top_k!r}")
    chosen = (fmt.top_k_gate if fmt is not None else "softmax") if top_k == "auto" else top_k
    if chosen not in gates:
        raise ValueError(
            f"format {fmt.name!r} names the top-k gate {chosen!r}, which is not registered; "
            f"registered top-k gates: {sorted(gates)}"
        )
    plain = isinstance(decomposition, str) and decomposition.lower() in available() and layer is None
    described = plain and not options and not isinstance(aux_k, AuxK)
    spec = None
    if described:
        ks = k if isinstance(k, int) else tuple(k)
        spec = ReplacementSpec(MUMOE_KIND, ks, budget, False, decomposition, dims, top_k, recipe, aux_k, balance)  # type: ignore[arg-type]
    gate = options.pop("gate", None) or gates[chosen](k=k)

    def build(block: BlockInfo) -> nn.Module:
        activation = nn.GELU() if block.activation is None else copy.deepcopy(block.activation)
        extra = dict(options)
        if kind is None:
            cls = layer
        else:
            cls, extra["gated"] = kind.build, block.kind.gated
        target = paper_budget(block) if budget is None else _budget(budget, block)
        module = cls(
            block.in_features, block.hidden_features, block.out_features, expert_dims, decomposition,
            match=target, gate=gate, bias=block.bias, hidden_activation=activation,
            device=block.device, dtype=block.dtype, **extra,
        )  # fmt: skip
        paper = decoders and (recipe == "mxd-paper" or (recipe is None and bool(module.expert_vectors())))
        if paper:
            mxd_paper_init(module)
        flat = len(module.expert_dims) == 1
        weight = balance
        if weight is None:
            weight = GATE_BALANCE_WEIGHT if flat and isinstance(module.gate, TopKRouter) else 0.0
        terms: list[GateBalance | AuxK] = [GateBalance(weight)] if weight > 0 else []
        if aux_k is True or isinstance(aux_k, AuxK):
            terms.append(aux_k if isinstance(aux_k, AuxK) else AuxK())
        if terms:
            module.distillation_losses = tuple(terms)
        if spec is not None:
            module.replacement_spec = spec
        return module

    return build


def topk_paper_init(transcoder: Transcoder) -> Transcoder:
    """Initialise ``transcoder`` as Gao et al. 2024 initialise their TopK autoencoders, in place.

    Every decoder column a random direction of norm 1, the encoder the decoder's transpose, both
    biases and the skip zero; the decoder columns are declared unit-norm (``unit_norm``: the
    training step keeps them at norm 1 and removes the gradient's component along them, see
    [`unit_norm_parameters`][mumoe_tn.distillation.trainer.unit_norm_parameters]).

    Raises
    ------
    TypeError
        If ``transcoder`` is not a [`Transcoder`][mumoe_tn.distillation.transcoders.Transcoder].
    ValueError
        If its input and output widths differ (the encoder cannot be the decoder's transpose).
    """
    if not isinstance(transcoder, Transcoder):
        raise TypeError(f"topk_paper_init takes a Transcoder, got {type(transcoder).__name__}")
    if transcoder.in_features != transcoder.out_features:
        raise ValueError(
            "the 'topk-paper' initialisation sets the encoder to the decoder's transpose, which needs equal input and "
            f"output widths, got {transcoder.in_features} and {transcoder.out_features}: use recipe=None"
        )
    with torch.no_grad():
        decoder = transcoder.decoder.weight
        decoder.normal_()
        decoder.div_(decoder.norm(dim=0, keepdim=True).clamp_min(1e-12))
        transcoder.encoder.weight.copy_(decoder.T)
        transcoder.encoder.bias.zero_()
        transcoder.decoder.bias.zero_()
    transcoder.unit_norm = {"decoder.weight": 0}
    return transcoder


TRANSCODER_RECIPES = ("topk-paper", "topk-transcoder")
"""The recipes a transcoder factory initialises its transcoder for (``recipe=`` of ``transcoder_factory``)."""


def transcoder_factory(
    k: int | None, budget: int | float | None = None, *, skip: bool = False, recipe: str | None = None
) -> Factory:
    """A factory of (skip) transcoders whose latent count meets ``budget``.

    Parameters
    ----------
    k : int or None
        TopK latents kept per token; None for a ReLU transcoder (sparse through an L1 penalty).
    budget : int or float, optional
        Parameters, or a multiple of the replaced block's parameters (default the paper's:
        ``32 · I`` latents without a skip).
    skip : bool, optional
        A skip transcoder.
    recipe : {None, "topk-paper", "topk-transcoder"}, optional
        None (default): the transcoder papers' initialisation (decoder and skip zero).
        ``"topk-paper"``: Gao et al.'s ([`topk_paper_init`][mumoe_tn.distillation.replacements.topk_paper_init])
        with their auxiliary-k term on dead latents ([`AuxK`][mumoe_tn.distillation.losses.AuxK],
        weight 1/32), to train with the ``"topk-paper"`` recipe. ``"topk-transcoder"``: the
        papers' initialisation with that auxiliary-k term (as EleutherAI's ``sparsify`` builds a
        transcoder), to train with the ``"topk-transcoder"`` recipe.

    Returns
    -------
    Factory
    """
    if recipe is not None and recipe not in TRANSCODER_RECIPES:
        raise ValueError(
            f"recipe of a transcoder factory must be None, 'topk-paper' or 'topk-transcoder', got {recipe!r:.80}"
        )

    def build(block: BlockInfo) -> nn.Module:
        target = paper_budget(block) if budget is None else _budget(budget, block)
        latents = match_transcoder(target, block.in_features, block.out_features, skip=skip)
        module = Transcoder(
            block.in_features, latents, block.out_features, k=k, skip=skip, device=block.device, dtype=block.dtype
        )
        if recipe == "topk-paper":
            topk_paper_init(module)
        if recipe is not None:
            module.distillation_losses = (AuxK(),)
        module.replacement_spec = spec
        return module

    spec = ReplacementSpec(TRANSCODER_KIND, k, budget, skip)
    return build
