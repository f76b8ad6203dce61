"""PyTorch modules: the factorized expert tensor and the μMoE layer."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.contractions.dense import expert_matrix, materialize
from mumoe_tn.contractions.execute import run_plan
from mumoe_tn.contractions.plan import ContractionPlan, plan_forward, resolve_optimizer
from mumoe_tn.costs.baselines import linear as linear_cost
from mumoe_tn.costs.baselines import mlp as mlp_cost
from mumoe_tn.costs.matching import match_block, match_layer
from mumoe_tn.decompositions.registry import available, build
from mumoe_tn.gating import ExpertGate
from mumoe_tn.init import INIT_RULES, init_cores
from mumoe_tn.network import INPUT_LEG, ExpertNetwork, normalize_expert_dims

__all__ = ["FactorizedExperts", "MuMoE", "MuMoEMLP", "resolve_network"]

Decomposition = str | ExpertNetwork | Callable[..., ExpertNetwork]
Rank = int | Sequence[int] | Mapping[str, int] | str | None


def resolve_network(
    decomposition: Decomposition,
    expert_dims: int | Sequence[int] | None,
    in_features: int,
    out_features: int,
    rank: Rank,
    *,
    bias: bool = True,
    options: Mapping[str, Any] | None = None,
) -> ExpertNetwork:
    """The expert network of a layer ``in_features -> out_features`` (leg ``i`` = in + bias).

    Parameters
    ----------
    decomposition : str or ExpertNetwork or Callable
        A registered name, a spec string (``"n1 a b, a i c, b c o"``), a ready network whose
        legs must match, or a builder ``(expert_dims, i, o, rank, **options)``.
    expert_dims : int or Sequence[int] or None
        Expert mode sizes (optional with a ready network, where they must match).
    in_features, out_features : int
        The layer's sizes.
    rank : int or Sequence[int] or Mapping[str, int] or str
        The builder's ranks; a matching target name (``"linear"``, ``"mlp"``) builds with
        rank 1, to be scaled by the caller.
    bias : bool, optional
        Whether leg ``i`` has a folded bias column.
    options : Mapping[str, Any], optional
        Extra builder options.

    Returns
    -------
    ExpertNetwork
    """
    options = dict(options or {})
    width = in_features + int(bias)
    if isinstance(decomposition, ExpertNetwork):
        network = decomposition
        if network.in_features != width or network.out_features != out_features:
            raise ValueError(
                f"the network has legs i={network.in_features}, o={network.out_features} but this layer "
                f"needs i={width} (in_features={in_features}{' + 1 bias' if bias else ''}), o={out_features}"
            )
        if expert_dims is not None and normalize_expert_dims(expert_dims) != network.expert_dims:
            raise ValueError(f"expert_dims={expert_dims!r} but the network has expert dims {network.expert_dims}")
        return network
    if expert_dims is None:
        raise TypeError("expert_dims is required unless decomposition is an ExpertNetwork")
    if rank is None:
        raise TypeError(f"rank is required for decomposition {decomposition!r}")
    if isinstance(rank, str):
        if rank not in ("linear", "mlp"):
            raise ValueError(f"rank must be ranks or a matching target 'linear'/'mlp', got {rank!r}")
        if isinstance(decomposition, str) and decomposition.lower() not in available():
            raise ValueError(
                f"rank={rank!r} matches parameters of named decompositions only; for a custom network name the "
                "bonds to scale with mumoe_tn.costs.match_layer and pass the matched ExpertNetwork"
            )
        rank = 1
    if callable(decomposition) and not isinstance(decomposition, str):
        network = decomposition(expert_dims, width, out_features, rank, **options)
        if not isinstance(network, ExpertNetwork):
            raise TypeError(f"the decomposition builder returned {type(network).__name__}, not an ExpertNetwork")
        return network
    if not isinstance(decomposition, str):
        raise TypeError(
            f"decomposition must be a name, a spec string, an ExpertNetwork or a builder, got {decomposition!r}"
        )
    if decomposition.lower() in available():
        return build(decomposition, expert_dims, width, out_features, rank, **options)
    if "," in decomposition or " " in decomposition.strip():
        return ExpertNetwork.from_spec(
            decomposition, expert_dims=expert_dims, in_features=width, out_features=out_features, ranks=rank
        )
    raise ValueError(f"unknown decomposition {decomposition!r}; registered: {available()}, or give a spec string")


def _check_bias(bias: object) -> None:
    if not isinstance(bias, bool):
        raise TypeError(f"bias must be a bool, got {bias!r}")


def _matched_bonds(network: ExpertNetwork) -> tuple[str, ...] | None:
    return network.bonds if network.name == "tucker" else None


#: Batch size of the plan used while ``torch.compile`` traces a layer (made at construction).
COMPILE_PLAN_BATCH = 1024


def _batch_bucket(batch: int) -> int:
    """Plans are made for the next power of two: the path depends on the batch only coarsely."""
    return 1 << max(batch - 1, 0).bit_length()


class FactorizedExperts(nn.Module):
    """The expert tensor ``W`` of a μMoE layer, stored as the cores of an `ExpertNetwork`.

    Every core is one ``nn.Parameter`` named after the core, so ``state_dict`` keys are the
    core names. The forward pass contracts the cores with the expert coefficients and the
    input along a path planned once per batch-size bucket (a power of two) and cached in a
    bounded per-module cache; ``W`` is never materialised. While ``torch.compile`` traces the
    module it uses one plan made at construction (for a batch of [`COMPILE_PLAN_BATCH`][mumoe_tn.layers]):
    a plan's steps are valid for every batch size, so dynamic batch sizes neither replan
    inside the trace nor recompile.

    Parameters
    ----------
    network : ExpertNetwork
        The decomposition.
    init : {"auto", "paper", "linear"}, optional
        Initialisation rule, see [`mumoe_tn.init.init_cores`][mumoe_tn.init.init_cores].
    fan_in : int, optional
        ``fan_in`` the ``"linear"`` rule targets (default: the size of leg ``i``).
    expert_noise : Sequence[float], optional
        ``σ_e`` per expert mode (default: 1 on the first mode, 0 on the others).
    optimize : str or object, optional
        Path optimizer, see [`mumoe_tn.contractions.resolve_optimizer`][mumoe_tn.contractions.plan.resolve_optimizer]
        (default ``"dp"``).
    max_plans : int, optional
        Size of the plan cache (default 16 batch-size buckets).
    device, dtype : optional
        Factory arguments for the parameters.
    """

    def __init__(
        self,
        network: ExpertNetwork,
        *,
        init: str = "auto",
        fan_in: int | None = None,
        expert_noise: Sequence[float] | None = None,
        optimize: Any = "dp",
        max_plans: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(network, ExpertNetwork):
            raise TypeError(f"network must be an ExpertNetwork, got {type(network).__name__}")
        if init not in INIT_RULES:
            raise ValueError(f"unknown init rule {init!r}; choose one of {list(INIT_RULES)}")
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise ValueError(f"max_plans must be a positive int, got {max_plans!r}")
        self.network = network
        self.init = init
        self.fan_in = fan_in
        self.expert_noise = None if expert_noise is None else tuple(expert_noise)
        self.optimize = resolve_optimizer(optimize)
        self.max_plans = max_plans
        self._plans: dict[int, ContractionPlan] = {}
        self._compile_plan = plan_forward(network, COMPILE_PLAN_BATCH, self.optimize)
        for name, shape in network.core_shapes.items():
            if hasattr(self, name):
                raise ValueError(f"core name {name!r} clashes with an attribute of FactorizedExperts; rename the core")
            self.register_parameter(name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.reset_parameters()

    @classmethod
    def from_tensors(
        cls,
        cores: Mapping[str, str | Sequence[str]],
        tensors: Mapping[str, torch.Tensor],
        *,
        name: str = "custom",
        optimize: Any = "dp",
    ) -> FactorizedExperts:
        """Build the module from existing core tensors (sizes inferred, bond sizes checked).

        Parameters
        ----------
        cores : Mapping[str, str | Sequence[str]]
            Core name -> labels.
        tensors : Mapping[str, torch.Tensor]
            Core name -> tensor; all on one device with one floating dtype.
        name : str, optional
            Name of the network.
        optimize : str or object, optional
            Path optimizer.

        Returns
        -------
        FactorizedExperts
        """
        network = ExpertNetwork.from_shapes(cores, {core: tuple(t.shape) for core, t in tensors.items()}, name=name)
        first = next(iter(tensors.values()))
        module = cls(network, optimize=optimize, device=first.device, dtype=first.dtype)
        with torch.no_grad():
            for core, tensor in tensors.items():
                getattr(module, core).copy_(tensor)
        return module

    @property
    def cores(self) -> dict[str, nn.Parameter]:
        """The core parameters, by name, in network order."""
        return {name: getattr(self, name) for name in self.network.cores}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-initialise the cores with this module's init rule."""
        init_cores(
            self.network,
            self.cores,
            rule=self.init,
            fan_in=self.fan_in,
            expert_noise=self.expert_noise,
            generator=generator,
        )

    def plan(self, batch_size: int) -> ContractionPlan:
        """The cached contraction plan used for a flattened batch of ``batch_size`` rows."""
        bucket = _batch_bucket(batch_size)
        plan = self._plans.get(bucket)
        if plan is None:
            if len(self._plans) >= self.max_plans:
                self._plans.pop(next(iter(self._plans)))
            plan = plan_forward(self.network, bucket, self.optimize)
            self._plans[bucket] = plan
        return plan

    def forward(
        self, z: torch.Tensor, coefficients: Sequence[torch.Tensor], *, append_one: bool = False
    ) -> torch.Tensor:
        """``y = W ×_1 a_1 … ×_E a_E ×_{E+1} z``, contracted in factorized form.

        Parameters
        ----------
        z : torch.Tensor
            Input of shape ``(…, I)`` (``I`` is the size of leg ``i``), or ``(…, I - 1)`` with
            ``append_one=True``.
        coefficients : Sequence of torch.Tensor
            One tensor of shape ``(…, N_e)`` per expert mode, with the same leading dims as
            ``z``.
        append_one : bool, optional
            ``z`` omits the last entry of leg ``i``, which is 1 (the folded bias). Computed
            without concatenating a column of ones.

        Returns
        -------
        torch.Tensor
            Shape ``(…, O)``.
        """
        self._check_inputs(z, coefficients, append_one)
        lead = z.shape[:-1]
        batch = math.prod(lead)
        operands = [*self.cores.values()]
        operands += [a.reshape(batch, a.shape[-1]) for a in coefficients]
        operands.append(z.reshape(batch, z.shape[-1]))
        plan = self._compile_plan if torch.compiler.is_compiling() else self.plan(batch)
        y = run_plan(plan, operands, ones_appended=INPUT_LEG if append_one else None)
        return y.reshape(*lead, self.network.out_features)

    def _check_inputs(self, z: torch.Tensor, coefficients: Sequence[torch.Tensor], append_one: bool) -> None:
        net = self.network
        if not isinstance(z, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(z).__name__}")
        width = net.in_features - int(append_one)
        if z.ndim < 1 or z.shape[-1] != width:
            extra = " with append_one=True" if append_one else ""
            raise ValueError(
                f"input must have shape (..., {width}) (leg 'i' of {net.name!r}{extra}), got {tuple(z.shape)}"
            )
        if isinstance(coefficients, torch.Tensor) or not isinstance(coefficients, Sequence):
            raise TypeError(f"coefficients must be a sequence of {net.n_expert_modes} tensors, one per expert mode")
        if len(coefficients) != net.n_expert_modes:
            raise ValueError(
                f"expected {net.n_expert_modes} coefficient tensor(s) for expert legs {net.expert_legs}, "
                f"got {len(coefficients)}"
            )
        weight = next(iter(self.cores.values()))
        autocast = torch.is_autocast_enabled(z.device.type)
        for name, tensor in [("input", z), *((f"coefficients[{k}]", a) for k, a in enumerate(coefficients))]:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device != weight.device:
                raise ValueError(f"{name} is on {tensor.device} but the expert cores are on {weight.device}")
            if not autocast and tensor.dtype != weight.dtype:
                raise TypeError(f"{name} has dtype {tensor.dtype} but the expert cores have dtype {weight.dtype}")
        for k, (a, leg) in enumerate(zip(coefficients, net.expert_legs, strict=True)):
            expected = (*z.shape[:-1], net.sizes[leg])
            if tuple(a.shape) != expected:
                raise ValueError(
                    f"coefficients[{k}] (expert leg {leg!r}) must have shape {expected}, got {tuple(a.shape)}"
                )

    def to_dense(self) -> torch.Tensor:
        """Materialise ``W`` of shape ``(N_1, …, N_E, I, O)`` (for checks; memory ``∏N_e·I·O``)."""
        return materialize(self.network, self.cores)

    def expert(self, index: int | Sequence[int]) -> torch.Tensor:
        """Expert ``index``'s ``I × O`` matrix, computed without materialising ``W``."""
        return expert_matrix(self.network, self.cores, index)

    def extra_repr(self) -> str:
        net = self.network
        dims = "×".join(map(str, net.expert_dims))
        return (
            f"{net.name!r}, '{net.to_spec()}', experts={dims}, in={net.in_features}, "
            f"out={net.out_features}, params={net.n_params:,}"
        )


class _GatedExperts(nn.Module):
    """What MuMoE and MuMoEMLP share: the gate, the input norm, recording and ablation."""

    in_features: int
    bias: bool
    input_norm: nn.Module
    gate: ExpertGate

    def _setup_gate(
        self,
        in_features: int,
        expert_dims: tuple[int, ...],
        *,
        bias: bool,
        activation: str | float,
        gate_norm: str,
        input_norm: bool,
        factory: dict,
    ) -> None:
        self.in_features = in_features
        self.bias = bias
        self.expert_dims = expert_dims
        self.input_norm = nn.LayerNorm(in_features, **factory) if input_norm else nn.Identity()
        self.gate = ExpertGate(in_features, expert_dims, activation, gate_norm, **factory)
        self.last_coefficients: tuple[torch.Tensor, ...] | None = None
        self.ablation: Any = None

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Re-initialise the gate, the input norm and the expert cores."""
        for module in (*self.gate.projections.values(), *self.gate.norms.values(), self.input_norm):
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for experts in self._expert_layers():
            experts.reset_parameters()

    def _gate(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Validate ``x``, normalise it, compute and record the coefficients, apply any ablation mask."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"input must have shape (..., {self.in_features}), got {tuple(x.shape)}")
        z = self.input_norm(x)
        coefficients = self.gate(z) if self.ablation is None else self.ablation.gate(self.gate, z)
        self.last_coefficients = tuple(a.detach() for a in coefficients)
        if not torch.is_autocast_enabled(z.device.type):
            coefficients = tuple(a.to(z.dtype) for a in coefficients)
        if self.ablation is not None:
            coefficients = self.ablation.mask(coefficients)
        return z, coefficients

    def _contract(
        self, experts: FactorizedExperts, z: torch.Tensor, coefficients: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        y = experts(z, coefficients, append_one=self.bias)
        if self.ablation is None:
            return y
        return self.ablation.correct(experts, z, coefficients, y, append_one=self.bias)


class MuMoE(_GatedExperts):
    """A μMoE layer: a drop-in replacement for ``nn.Linear(in_features, out_features)``.

    ``a_e = φ(norm(G_eᵀ z))`` for every expert mode ``e``, then
    ``y = W ×_1 a_1 … ×_E a_E ×_{E+1} [z; 1]`` with ``W`` held in factorized form. With
    ``bias=True`` (default) each expert's bias is folded into the input leg (``I + 1``).

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the input and output features.
    expert_dims : int or Sequence[int]
        Number of experts ``N``, or ``(N_1, …, N_E)`` for a hierarchical layer.
    decomposition : str or ExpertNetwork or Callable, optional
        A registered name (``"cp"`` default, ``"tr"``, ``"tt"``, ``"tucker"``), a spec string
        such as ``"n1 a b, a i c, b c o"`` (bond sizes from ``rank``), a ready
        [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork] whose legs match the layer, or a builder
        ``(expert_dims, in, out, rank) -> ExpertNetwork``.
    rank : int or Sequence[int] or Mapping[str, int] or "linear"
        Ranks for the decomposition (a mapping of bond -> size for spec strings), or
        ``"linear"`` to parameter-match ``nn.Linear(in_features, out_features)`` with gating
        counted (CP scales ``R``, TR/TT the input–output bond, Tucker all bonds; see
        [`mumoe_tn.costs.matching`][mumoe_tn.costs.matching]). Not needed with an
        [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork].
    bias : bool, optional
        Fold a per-expert bias into the input leg (default True).
    activation : str or float, optional
        Gate activation φ: ``"entmax15"`` (default), ``"sparsemax"``, ``"softmax"`` or an
        entmax ``α``.
    gate_norm : {"batch", "layer", "none"}, optional
        Normalisation of the gate logits (default ``"batch"``, as in the paper).
    input_norm : bool, optional
        Apply a LayerNorm (with affine parameters) to the input first (default False).
    init : {"auto", "paper", "linear"}, optional
        Core initialisation rule (see [`mumoe_tn.init`][mumoe_tn.init]).
    expert_noise : Sequence[float], optional
        ``σ_e`` per expert mode for the initialisation.
    optimize : str or object, optional
        Path optimizer for the factorized contraction (default ``"dp"``).
    device, dtype : optional
        Factory arguments.
    **decomposition_options
        Passed to the named builder (e.g. ``expert_rank=`` for TR/TT).

    Attributes
    ----------
    last_coefficients : tuple of torch.Tensor or None
        The (detached) expert coefficients of the last forward pass, one per expert mode
        (before any ablation).
    ablation : object or None
        An active counterfactual ablation (see [`mumoe_tn.analysis.ablation`][mumoe_tn.analysis.ablation]): it masks
        coefficients inside the contraction, or removes single experts' contributions, and
        never touches the weights.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        expert_dims: int | Sequence[int] | None = None,
        decomposition: str | ExpertNetwork | Callable[..., ExpertNetwork] = "cp",
        rank: int | Sequence[int] | Mapping[str, int] | None = None,
        *,
        bias: bool = True,
        activation: str | float = "entmax15",
        gate_norm: str = "batch",
        input_norm: bool = False,
        init: str = "auto",
        expert_noise: Sequence[float] | None = None,
        optimize: Any = "dp",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **decomposition_options: Any,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        _check_bias(bias)
        self.out_features = out_features
        network = resolve_network(
            decomposition, expert_dims, in_features, out_features, rank, bias=bias, options=decomposition_options
        )
        if rank == "linear":
            target = linear_cost(in_features, out_features, bias=bias).params
            matched = match_layer(network, target, bonds=_matched_bonds(network), bias=bias, input_norm=input_norm)
            network = matched.networks[0]
        gate = {"activation": activation, "gate_norm": gate_norm, "input_norm": input_norm, "factory": factory}
        self._setup_gate(in_features, network.expert_dims, bias=bias, **gate)
        self.experts = FactorizedExperts(
            network, init=init, fan_in=in_features, expert_noise=expert_noise, optimize=optimize, **factory
        )

    @property
    def network(self) -> ExpertNetwork:
        """The expert network (its leg ``i`` includes the bias column when ``bias=True``)."""
        return self.experts.network

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.experts,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``."""
        z, coefficients = self._gate(x)
        return self._contract(self.experts, z, coefficients)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias}"


class MuMoEMLP(_GatedExperts):
    """The paper's two-layer μMoE block (Section "Large language/vision μMoE networks").

    ``a = φ(norm(Gᵀ z))`` once per token, shared by both layers:
    ``y = W2 ×_1 a ×_2 [act(W1 ×_1 a ×_2 [z; 1]); 1]`` — a drop-in for a transformer or
    mixer MLP ``Linear(I, H) → GELU → Linear(H, O)``.

    Parameters
    ----------
    in_features, hidden_features : int
        Input and hidden sizes.
    out_features : int, optional
        Output size (default ``in_features``).
    expert_dims : int or Sequence[int]
        ``N`` or ``(N_1, …, N_E)``, shared by both layers.
    decomposition : str or Callable, optional
        As for [`MuMoE`][mumoe_tn.layers.MuMoE] (a name, spec string or builder; both layers use it).
    rank : int or Sequence[int] or Mapping[str, int] or "mlp"
        Ranks of both layers, or ``"mlp"`` to parameter-match the MLP block ``I → H → O``
        (one rank for both layers, the one gate counted).
    bias : bool, optional
        Fold a bias into both layers' input legs (default True).
    activation : str or float, optional
        Gate activation φ (default ``"entmax15"``).
    gate_norm : {"batch", "layer", "none"}, optional
        Normalisation of the gate logits.
    input_norm : bool, optional
        LayerNorm on the block's input first.
    hidden_activation : nn.Module, optional
        Non-linearity between the layers (default ``nn.GELU()``).
    init, expert_noise, optimize, device, dtype, **decomposition_options
        As for [`MuMoE`][mumoe_tn.layers.MuMoE].

    Attributes
    ----------
    last_coefficients : tuple of torch.Tensor or None
        The (detached) shared coefficients of the last forward pass.
    ablation : object or None
        An active counterfactual ablation, applied to both layers (see [`MuMoE`][mumoe_tn.layers.MuMoE]).
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        expert_dims: int | Sequence[int] | None = None,
        decomposition: Decomposition = "cp",
        rank: Rank = None,
        *,
        bias: bool = True,
        activation: str | float = "entmax15",
        gate_norm: str = "batch",
        input_norm: bool = False,
        hidden_activation: nn.Module | None = None,
        init: str = "auto",
        expert_noise: Sequence[float] | None = None,
        optimize: Any = "dp",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **decomposition_options: Any,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        out_features = in_features if out_features is None else out_features
        if isinstance(decomposition, ExpertNetwork):
            raise TypeError("MuMoEMLP builds two networks: pass a name, a spec string or a builder, not one network")
        _check_bias(bias)
        self.hidden_features, self.out_features = hidden_features, out_features
        shared = {"bias": bias, "options": decomposition_options}
        first = resolve_network(decomposition, expert_dims, in_features, hidden_features, rank, **shared)
        second = resolve_network(decomposition, expert_dims, hidden_features, out_features, rank, **shared)
        if rank == "mlp":
            target = mlp_cost(in_features, hidden_features, out_features, bias=bias).params
            first, second = match_block(first, second, target, bonds=_matched_bonds(first), bias=bias).networks
        elif isinstance(rank, str):
            raise ValueError(f"MuMoEMLP matches rank='mlp' (the MLP block it replaces), got {rank!r}")
        gate = {"activation": activation, "gate_norm": gate_norm, "input_norm": input_norm, "factory": factory}
        self._setup_gate(in_features, first.expert_dims, bias=bias, **gate)
        layer = {"init": init, "expert_noise": expert_noise, "optimize": optimize, **factory}
        self.experts1 = FactorizedExperts(first, fan_in=in_features, **layer)
        self.experts2 = FactorizedExperts(second, fan_in=hidden_features, **layer)
        self.hidden_activation = nn.GELU() if hidden_activation is None else hidden_activation

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.experts1, self.experts2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``."""
        z, coefficients = self._gate(x)
        hidden = self.hidden_activation(self._contract(self.experts1, z, coefficients))
        return self._contract(self.experts2, hidden, coefficients)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
            f"out_features={self.out_features}, bias={self.bias}"
        )
