"""The options every μMoE layer shares, documented once, and the checks of the layers' arguments.

[`LayerOptions`][mumoe_tn.layers.options.LayerOptions] holds what
[`MuMoE`][mumoe_tn.layers.moe.MuMoE], [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP],
[`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP] and
[`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders] share: matching, bias, the gate,
the input norm, initialisation, planning and the factory arguments. Each layer takes them as one
``options=LayerOptions(…)``, as keywords (``bias=False``, ``gate=TopKGate(2)``), or both (the
keywords win); a new shared option is one field here. The rest of the module resolves a layer's
network, ranks and parameter budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mumoe_tn.contractions.padding import PAD_MULTIPLE
from mumoe_tn.costs.matching import match_exact, resolve_target
from mumoe_tn.decompositions.resolve import Decomposition, Rank
from mumoe_tn.decompositions.resolve import resolve_network as resolve_decomposition
from mumoe_tn.gates.specs import GateSpec, gate_from_options
from mumoe_tn.network import ExpertNetwork
from mumoe_tn.validation import check_bool, check_size

__all__ = [
    "EXACT",
    "MAX_PLANS",
    "ExecutionOptions",
    "LayerOptions",
    "Match",
    "block_networks",
    "check_allocatable",
    "check_factory",
    "check_match_only_options",
    "match_target",
    "resolve_network",
    "split_rank_and_match",
]

#: What ``match=`` accepts: a target name, a number of parameters, or a fraction of the replaced layer's.
Match = str | int | float | None

#: ``rank=EXACT``: the smallest ranks at which every expert can equal any matrix of the layer (see
#: [`mumoe_tn.costs.match_exact`][mumoe_tn.costs.matching.match_exact]), the ranks that make upcycling exact.
EXACT = "exact"

#: Default size of a layer's plan cache: one slot per batch-size bucket (the next power of two)
#: in training and one in inference covers every bucket from 1 to 2⁶³.
MAX_PLANS = 64


@dataclass(frozen=True, kw_only=True)
class ExecutionOptions:
    """How a layer's factorized layers initialise, plan and run: the part of `LayerOptions` they take.

    Each field is documented in [`LayerOptions`][mumoe_tn.layers.options.LayerOptions];
    [`keywords`][mumoe_tn.layers.options.ExecutionOptions.keywords] gives them to
    [`FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts].
    """

    init: str = "auto"
    expert_noise: Sequence[float] | None = None
    optimize: Any = "auto"
    max_plans: int = MAX_PLANS
    memory_limit: int | str | None = None
    chunk_size: int | None = None
    recompute: bool = False
    precontract: bool = True
    pad_bonds: int | None = PAD_MULTIPLE
    lazy_optimizer: bool = False

    @classmethod
    def of(cls, options: ExecutionOptions) -> ExecutionOptions:
        """The execution options of ``options`` (a `LayerOptions`), alone."""
        return cls(**{field.name: getattr(options, field.name) for field in dataclasses.fields(cls)})

    def keywords(self) -> dict[str, Any]:
        """The keywords of [`FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts] (the factory aside)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(ExecutionOptions)}


@dataclass(frozen=True)
class LayerOptions(ExecutionOptions):
    """The options every μMoE layer shares (give them as ``options=`` or as keywords of the layer).

    The execution options (``init`` to ``lazy_optimizer``) are keyword-only.

    Attributes
    ----------
    match_bonds : Sequence[str], optional
        The bonds ``match=`` scales (default: the format's choice — CP ``R``, TR/TT the
        input–output bond, Tucker and custom networks every bond).
    rank_multiple : int, optional
        With ``match=``, give the scaled bonds a multiple of this (default 1). Matrix-multiply
        kernels are markedly faster when inner sizes are multiples of the SIMD width or
        tensor-core tile: 16 costs at most 8 rank units of parameter resolution and, e.g., takes
        CP's matched ``R = 529`` (768 → 3072) to 528.
    bias : bool, optional
        Fold a per-expert bias into the input leg (default True; for a Mixture of Decoders, the
        encoder biases and the output bias).
    activation : str or float, optional
        Gate activation φ: ``"entmax15"`` (default), ``"sparsemax"``, ``"softmax"`` or an
        entmax ``α`` (shorthand for ``gate=Gate(activation=…)``).
    gate_norm : {"batch", "layer", "none"}, optional
        Normalisation of the gate logits (default ``"batch"``, as in the paper). ``"batch"`` is not
        causal: in training its statistics span every token of the batch, later positions included.
        In an autoregressive model use ``"layer"`` (the paper's authors' advice) or ``"none"``;
        [`convert`][mumoe_tn.conversion.convert.convert] does so for causal models.
    gate_init : {"default", "zeros"}, optional
        Gate projection init (default nn.Linear's; ``"zeros"`` starts every coefficient at 1/N).
    gate : GateSpec, optional
        A gate descriptor ([`Gate`][mumoe_tn.gates.specs.Gate],
        [`TopKGate`][mumoe_tn.gates.specs.TopKGate], [`ReLUTopKGate`][mumoe_tn.gates.specs.ReLUTopKGate]
        or your own); excludes the three options above. A block's one gate is shared by its layers.
    gate_input : {"normed", "raw"}, optional
        Gate on the experts' input (default; ``LayerNorm(x)`` with ``input_norm=True``) or on
        the raw ``x`` (the authors' GPT-2 configuration); see [`mumoe_tn.gates.modules`][mumoe_tn.gates.modules].
    input_norm : bool, optional
        Apply a LayerNorm (with affine parameters) to the input first (default False).
    init : {"auto", "paper", "linear"}, optional
        Core initialisation rule (see [`mumoe_tn.layers.init`][mumoe_tn.layers.init]); for a Mixture
        of Decoders, the decoder's.
    expert_noise : Sequence[float], optional
        ``σ_e`` per expert mode for the initialisation.
    optimize : str or object, optional
        Path optimizer for the factorized contraction (default ``"auto"``, see
        [`FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts]).
    max_plans : int, optional
        Size of the layer's plan cache: one slot per batch-size bucket (the next power of two) in
        training and one in inference (default 64, every bucket from 1 to 2⁶³).
    memory_limit : int or "max_input", optional
        Most elements any intermediate of the contraction may hold (default: the planner's bound).
    chunk_size : int, optional
        Contract at most this many rows at a time (default: the whole batch at once).
    recompute : bool, optional
        Recompute the contraction's intermediates in backward instead of saving them (default False).
    precontract : bool, optional
        In inference, reuse the results of a plan's core-only steps (default True).
    pad_bonds : int or None, optional
        Zero-pad every bond of at least 256 to a multiple of this in execution (default 16; None:
        none).
    lazy_optimizer : bool, optional
        Check a named ``optimize`` now and resolve it only when the layer first plans (default
        False). These five are as in [`FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts].
    device, dtype : optional
        Factory arguments.
    """

    match_bonds: Sequence[str] | None = None
    rank_multiple: int = 1
    bias: bool = True
    activation: str | float | None = None
    gate_norm: str | None = None
    gate_init: str | None = None
    gate: GateSpec | None = None
    gate_input: str = "normed"
    input_norm: bool = False
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None

    @classmethod
    def from_keywords(cls, options: LayerOptions | None, keywords: dict[str, Any]) -> tuple[LayerOptions, dict]:
        """``options`` updated with the keywords that name its fields, and the other keywords.

        Parameters
        ----------
        options : LayerOptions or None
            The layer's ``options=``.
        keywords : dict
            The layer's further keywords: fields of this class, and options of the decomposition's
            builder (e.g. ``expert_rank=`` for TR/TT).

        Returns
        -------
        tuple
            ``(options, builder_options)``.
        """
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be a LayerOptions, got {type(options).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        given = {key: value for key, value in keywords.items() if key in names}
        rest = {key: value for key, value in keywords.items() if key not in names}
        base = options if options is not None else cls()
        return (dataclasses.replace(base, **given) if given else base), rest

    def factory(self) -> dict[str, Any]:
        """``{"device": …, "dtype": …}``, checked (see [`check_factory`][mumoe_tn.layers.options.check_factory])."""
        return check_factory(self.device, self.dtype)

    def gate_spec(self) -> GateSpec:
        """The gate descriptor: ``gate``, or one built from ``activation``, ``gate_norm`` and ``gate_init``."""
        return gate_from_options(self.gate, activation=self.activation, norm=self.gate_norm, init=self.gate_init)

    def expert_options(self) -> dict[str, Any]:
        """The keywords of [`FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts] (the factory checked)."""
        return {**self.keywords(), **self.factory()}


def resolve_network(
    decomposition: Decomposition,
    expert_dims: int | Sequence[int] | None,
    in_features: int,
    out_features: int,
    rank: Rank | None,
    *,
    bias: bool = True,
    options: Mapping[str, Any] | None = None,
    resize: bool = False,
) -> ExpertNetwork:
    """The expert network of a layer ``in_features -> out_features`` (leg ``i`` = in + bias).

    Parameters
    ----------
    decomposition : str or Format or ExpertNetwork or Callable
        A registered name, a [`Format`][mumoe_tn.decompositions.format.Format], a spec string
        (``"n1 a b, a i c, b c o"``), a ready network whose legs must match, or a builder
        ``(expert_dims, i, o, rank, **options)``; see
        [`mumoe_tn.decompositions.resolve_network`][mumoe_tn.decompositions.resolve.resolve_network].
    expert_dims : int or Sequence[int] or None
        Expert mode sizes (optional with a ready network, where they must match).
    in_features, out_features : int
        The layer's sizes.
    rank : int or Sequence[int] or Mapping[str, int] or None
        The decomposition's ranks.
    bias : bool, optional
        Whether leg ``i`` has a folded bias column.
    options : Mapping[str, Any], optional
        Extra format or builder options.
    resize : bool, optional
        Give a ready network this layer's leg sizes instead of requiring them.

    Returns
    -------
    ExpertNetwork
    """
    for what, size in (("in_features", in_features), ("out_features", out_features)):
        check_size(what, size)
        if size >= _MAX_FEATURES:
            raise ValueError(f"{what}={size} is too large for a layer (at most {_MAX_FEATURES - 1:,})")
    check_bool("bias", bias)
    width = in_features + int(bias)
    return resolve_decomposition(decomposition, expert_dims, width, out_features, rank, options=options, resize=resize)


def split_rank_and_match(rank: object, match: object, layer: str) -> tuple[object, object]:
    """Separate ``rank=`` from ``match=``: ``rank=`` takes ranks or ``"exact"``, and no other string.

    Parameters
    ----------
    rank, match : object
        The layer's ``rank=`` and ``match=`` arguments.
    layer : str
        The layer's name, for messages.

    Returns
    -------
    tuple
        ``(rank, match)``.
    """
    if rank == EXACT:
        if match is not None:
            raise ValueError(f"{layer}: rank='exact' chooses the ranks; give it without match={match!r}")
        return None, EXACT
    if isinstance(rank, str):
        target = f"match={rank!r}" if rank in ("linear", "mlp", "match") else "match="
        raise ValueError(
            f"{layer}: rank must be ranks (int, sequence or mapping) or 'exact', got the string {rank!r}; "
            f"use {target} to match parameters"
        )
    return rank, match


def match_target(match: object, reference: int, allowed: str, layer: str) -> int:
    """The parameter budget of ``match=`` for a layer whose natural reference is ``allowed``.

    Parameters
    ----------
    match : str or int or float
        ``allowed`` (or ``"match"``): the reference; an int: a budget; a float: a fraction.
    reference : int
        Parameters of what the layer replaces.
    allowed : str
        The target name this layer accepts (``"linear"`` or ``"mlp"``).
    layer : str
        The layer's name, for messages.

    Returns
    -------
    int
    """
    if isinstance(match, str):
        if match in (allowed, "match"):
            return reference
        raise ValueError(
            f"{layer}: match={match!r} is not a target here; use {allowed!r}, a number of parameters (int) or a "
            "fraction of the replaced layer's parameters (float)"
        )
    return resolve_target(match, reference)


def check_factory(device: object, dtype: object) -> dict[str, Any]:
    """Validate ``device=``/``dtype=`` factory arguments before they reach torch.

    Parameters
    ----------
    device : torch.device or str or int or None
        Where the parameters live.
    dtype : torch.dtype or None
        A floating-point dtype.

    Returns
    -------
    dict
        ``{"device": …, "dtype": …}`` for the factory calls.
    """
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype such as torch.float32, got {dtype!r}")
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise TypeError(
                f"device must be a torch.device, a string such as 'cpu' or 'cuda:0', or None, got {device!r}"
            )
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise ValueError(f"unknown device {device!r}; use e.g. 'cpu', 'cuda', 'cuda:1' or 'mps'") from None
        if parsed.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} asks for CUDA, but torch.cuda.is_available() is False here")
        if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: there are only {torch.cuda.device_count()} CUDA device(s)")
    return {"device": device, "dtype": dtype}


def check_allocatable(network: ExpertNetwork) -> None:
    """Raise ``ValueError`` if a core of ``network`` has more elements than a tensor can index."""
    for core, count in network.core_params.items():
        if count >= _MAX_ELEMENTS:
            raise ValueError(
                f"core {core!r} of shape {network.core_shape(core)} has {count:.3g} elements, more than a tensor "
                f"can hold (2**63); lower the sizes or ranks"
            )


_MAX_ELEMENTS = 1 << 63
_MAX_FEATURES = 1 << 40


def check_match_only_options(match_bonds: Sequence[str] | None, rank_multiple: object) -> None:
    """Reject the options that only parameter matching reads when ``match=`` is not given.

    Parameters
    ----------
    match_bonds : Sequence of str or None
        The layer's ``match_bonds=``.
    rank_multiple : object
        The layer's ``rank_multiple=`` (1 is the default).
    """
    if match_bonds is not None:
        raise ValueError("match_bonds= names the bonds match= scales; give match= too")
    if check_size("rank_multiple", rank_multiple) != 1:
        raise ValueError(f"rank_multiple={rank_multiple} rounds the ranks match= chooses; give match= too")


def block_networks(
    decomposition: Decomposition,
    expert_dims: int | Sequence[int] | None,
    sizes: tuple[int, int, int],
    rank: Rank | None,
    match: object,
    match_bonds: Sequence[str] | None,
    rank_multiple: int,
    *,
    bias: bool,
    options: Mapping[str, Any],
    layer: str,
    matcher: Any,
) -> tuple[ExpertNetwork, ExpertNetwork]:
    """The two networks ``I → H`` and ``H → O`` of a block, parameter-matched when asked.

    Parameters
    ----------
    decomposition, expert_dims, rank, match, match_bonds, rank_multiple
        The block's arguments (see [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP]).
    sizes : tuple of int
        ``(in_features, hidden_features, out_features)``.
    bias : bool
        Whether every layer folds a bias into its input leg.
    options : Mapping[str, Any]
        Format or builder options.
    layer : str
        The block's name, for messages.
    matcher : Callable
        ``(first, second, match, match_bonds) -> (first, second)``: the block's own matching,
        called only when ``match`` is given.

    Returns
    -------
    tuple of ExpertNetwork
    """
    in_features, hidden_features, out_features = sizes
    check_size("hidden_features", hidden_features)
    rank, match = split_rank_and_match(rank, match, layer)
    build_rank = 1 if match is not None and rank is None else rank
    shared = {"bias": bias, "options": options, "resize": True}
    first = resolve_network(decomposition, expert_dims, in_features, hidden_features, build_rank, **shared)
    second = resolve_network(decomposition, expert_dims, hidden_features, out_features, build_rank, **shared)
    if match == EXACT:
        first, second = match_exact((first, second), bonds=match_bonds, multiple=rank_multiple)[1]
    elif match is not None:
        first, second = matcher(first, second, match, match_bonds)
    else:
        check_match_only_options(match_bonds, rank_multiple)
    check_allocatable(first)
    check_allocatable(second)
    return first, second
