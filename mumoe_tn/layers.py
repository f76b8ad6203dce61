"""PyTorch modules: the factorized expert tensor and the μMoE layer."""

from __future__ import annotations

import inspect
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mumoe_tn.contractions.autotune import fastest_plan
from mumoe_tn.contractions.dense import expert_matrix, materialize
from mumoe_tn.contractions.execute import constant_intermediates, run_plan
from mumoe_tn.contractions.padding import PAD_MULTIPLE, bond_padding, pad_cores
from mumoe_tn.contractions.plan import (
    ContractionPlan,
    autotune_candidates,
    plan_forward,
    plan_inference,
    resolve_optimizer,
)
from mumoe_tn.costs.baselines import linear as linear_cost
from mumoe_tn.costs.baselines import mlp as mlp_cost
from mumoe_tn.costs.matching import match_block, match_exact, match_layer
from mumoe_tn.decompositions.resolve import Decomposition, Rank
from mumoe_tn.gates.records import PerThreadRecords
from mumoe_tn.gates.specs import GateSpec, gate_from_options
from mumoe_tn.init import INIT_RULES, check_expert_noise, init_cores
from mumoe_tn.layer_options import (
    EXACT,
    Match,
    block_networks,
    check_allocatable,
    check_factory,
    check_match_only_options,
    match_target,
    resolve_network,
    split_rank_and_match,
)
from mumoe_tn.masking import resolve_token_mask
from mumoe_tn.network import INPUT_LEG, ExpertNetwork
from mumoe_tn.validation import check_bool, check_size

__all__ = ["FactorizedExperts", "MuMoE", "MuMoEMLP", "SharedGateLayers", "resolve_network"]

_MAX_FAN_IN = 1 << 40

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
    bounded, thread-safe, least-recently-used per-module cache; ``W`` is never materialised.
    While ``torch.compile`` traces the module it uses one plan made at construction (for a
    batch of [`COMPILE_PLAN_BATCH`][mumoe_tn.layers]): a plan's steps are valid for every batch size, so
    dynamic batch sizes neither replan inside the trace nor recompile.

    In eval mode with gradients off (``torch.no_grad`` or ``torch.inference_mode``) the
    contraction is planned with the cores constant: core-only sub-networks are contracted
    once and reused while the cores are unchanged (tracked by their version counters and
    storage), when that saves FMAs per call. Results are exact either way.

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
        (default ``"auto"``: bounded planning time, FMA-optimal on small networks). ``"autotune"``
        also times the cheapest candidate paths, batch-leading and in their natural layout, on
        the first batch of each bucket and keeps the fastest: forward and backward together when
        that batch needs gradients (training), the forward alone otherwise (see
        [`mumoe_tn.contractions.autotune_candidates`][mumoe_tn.contractions.plan.autotune_candidates]). Named optimizers
        are resolved afresh for every plan.
    max_plans : int, optional
        Size of the plan cache (default 16 batch-size buckets).
    chunk_size : int, optional
        Contract at most this many rows at a time (bounds the intermediates of huge batches;
        exact). Default: the whole batch at once.
    recompute : bool, optional
        Save only the operands for backward and recompute the contraction's intermediates
        there (``torch.utils.checkpoint``), trading time for activation memory. Exact.
    precontract : bool, optional
        Reuse core-only intermediates in inference as described above (default True).
    pad_bonds : int or None, optional
        Execute the contraction with every bond of at least 256 zero-padded to a multiple of
        this (default 16; exact, see [`mumoe_tn.contractions.padding`][mumoe_tn.contractions.padding]):
        matrix products of aligned sizes run faster. None pads nothing. Parameters, costs and
        the plan keep the true sizes.
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
        optimize: Any = "auto",
        max_plans: int = 16,
        chunk_size: int | None = None,
        recompute: bool = False,
        precontract: bool = True,
        pad_bonds: int | None = PAD_MULTIPLE,
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
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")
        check_bool("recompute", recompute)
        check_bool("precontract", precontract)
        factory = check_factory(device, dtype)
        check_allocatable(network)
        self.network = network
        self.init = init
        if fan_in is not None and check_size("fan_in", fan_in) >= _MAX_FAN_IN:
            raise ValueError(f"fan_in={fan_in} is too large (at most {_MAX_FAN_IN - 1:,}); it is a layer's input width")
        self.fan_in = fan_in
        self.expert_noise = None if expert_noise is None else check_expert_noise(expert_noise, network.n_expert_modes)
        resolve_optimizer(optimize)  # validates; names are resolved afresh for every plan
        self.optimize = optimize
        self.max_plans = max_plans
        self.chunk_size = chunk_size
        self.recompute = recompute
        self.precontract = precontract
        self.pad_bonds = pad_bonds  # checked by the property
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._plans_lock = threading.RLock()
        self._compile_plan = plan_forward(network, COMPILE_PLAN_BATCH, self._path_optimizer())
        for name, shape in network.core_shapes.items():
            if hasattr(self, name):
                raise ValueError(f"core name {name!r} clashes with an attribute of FactorizedExperts; rename the core")
            self.register_parameter(name, nn.Parameter(torch.empty(shape, **factory)))
        self.reset_parameters()

    def __getstate__(self) -> dict[str, Any]:
        # Locks do not pickle; plans and cached intermediates are rebuilt on demand.
        state = dict(super().__getstate__())
        state.pop("_plans_lock", None)
        state["_plans"] = OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_pad_bonds", PAD_MULTIPLE)  # pickled before the option existed
        self._plans_lock = threading.RLock()

    @property
    def pad_bonds(self) -> int | None:
        """The multiple that bonds of at least 256 are zero-padded to when executing (None: no padding)."""
        return self._pad_bonds

    @pad_bonds.setter
    def pad_bonds(self, value: int | None) -> None:
        if value is not None:
            check_size("pad_bonds", value)
        self._pad_bonds = value

    @classmethod
    def from_tensors(
        cls,
        cores: Mapping[str, str | Sequence[str]],
        tensors: Mapping[str, torch.Tensor],
        *,
        name: str = "custom",
        optimize: Any = "auto",
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

    def _path_optimizer(self) -> Any:
        """A fresh optimizer for one plan (``"autotune"`` plans like ``"auto"`` without operands)."""
        return "auto" if self.optimize == "autotune" else resolve_optimizer(self.optimize)

    def _cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        """Look ``key`` up in the LRU plan cache, making and inserting it on a miss."""
        with self._plans_lock:
            found = self._plans.get(key)
            if found is not None:
                self._plans.move_to_end(key)
                return found
            found = make()
            self._plans[key] = found
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
            return found

    def plan(
        self,
        batch_size: int,
        operands: Sequence[torch.Tensor] | None = None,
        *,
        ones_appended: str | None = None,
    ) -> ContractionPlan:
        """The cached contraction plan used for a flattened batch of ``batch_size`` rows.

        Parameters
        ----------
        batch_size : int
            Rows of the flattened batch.
        operands : Sequence of torch.Tensor, optional
            The call's operands; with ``optimize="autotune"`` the first call of a bucket times
            the candidate plans on them (without them it plans like ``"auto"``).
        ones_appended : str, optional
            As for [`mumoe_tn.contractions.run_plan`][mumoe_tn.contractions.execute.run_plan], when timing ``operands``.

        Returns
        -------
        ContractionPlan
        """
        bucket = _batch_bucket(batch_size)

        def make() -> ContractionPlan:
            if self.optimize == "autotune" and operands is not None:
                candidates = autotune_candidates(self.network, bucket)
                return fastest_plan(candidates, operands, ones_appended=ones_appended)
            return plan_forward(self.network, bucket, self._path_optimizer())

        return self._cached(("train", bucket), make)

    def _core_versions(self) -> tuple | None:
        """What identifies the cores' current values, or None where it cannot be tracked."""
        try:
            return tuple((p._version, p.data_ptr(), p.device, p.dtype, p.shape) for p in self.cores.values())
        except RuntimeError:  # inference tensors have no version counter
            return None

    def _inference_constants(self, batch: int) -> tuple[ContractionPlan, dict[int, torch.Tensor]] | None:
        """The inference plan for ``batch`` and its core-only intermediates, if worth caching."""
        versions = self._core_versions()
        if versions is None:
            return None
        bucket = _batch_bucket(batch)
        plan, steps = self._cached(("inference", bucket), lambda: plan_inference(self.network, bucket))
        if not steps:
            return None
        key = ("constants", bucket)
        with self._plans_lock:
            found = self._plans.get(key)
            if found is not None and found[0] == versions:
                self._plans.move_to_end(key)
                return plan, found[1]
        constants = constant_intermediates(plan, list(self.cores.values()), steps)
        with self._plans_lock:
            self._plans[key] = (versions, constants)
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
        return plan, constants

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
        rows = [a.reshape(batch, a.shape[-1]) for a in coefficients]
        rows.append(z.reshape(batch, z.shape[-1]))
        ones = INPUT_LEG if append_one else None
        cores = _ExecutionCores(self)  # padded at most once per call, whatever the chunks
        if torch.compiler.is_compiling():
            y = self._contract(self._compile_plan, rows, ones, None, cores)
        elif self.chunk_size is not None and batch > self.chunk_size:
            chunks = zip(*(tensor.split(self.chunk_size) for tensor in rows), strict=True)
            y = torch.cat([self._contract_rows(list(chunk), ones, cores) for chunk in chunks])
        else:
            y = self._contract_rows(rows, ones, cores)
        return y.reshape(*lead, self.network.out_features)

    def _contract_rows(self, rows: list[torch.Tensor], ones: str | None, cores: _ExecutionCores) -> torch.Tensor:
        """Contract the cores with one block of flattened rows (coefficients, then input)."""
        batch = rows[-1].shape[0]
        if self.precontract and not self.training and not torch.is_grad_enabled():
            cached = self._inference_constants(max(batch, 1))
            if cached is not None:
                return self._contract(cached[0], rows, ones, cached[1], cores)
        operands = [*cores.padded(), *rows] if self.optimize == "autotune" else None  # timed as they will run
        return self._contract(self.plan(max(batch, 1), operands, ones_appended=ones), rows, ones, None, cores)

    def _contract(
        self,
        plan: ContractionPlan,
        rows: list[torch.Tensor],
        ones: str | None,
        constants: dict[int, torch.Tensor] | None,
        cores: _ExecutionCores,
    ) -> torch.Tensor:
        if constants is not None:  # cached from the unpadded cores
            return run_plan(plan, [*cores.unpadded, *rows], ones_appended=ones, constants=constants)
        if self.recompute and torch.is_grad_enabled():
            # Padded inside the checkpoint: the padded copies are recomputed, not kept.
            run = partial(_run_padded, plan, ones, cores.padding, cores.labels, len(cores.unpadded))
            return checkpoint(run, *cores.unpadded, *rows, use_reentrant=False)
        return run_plan(plan, [*cores.padded(), *rows], ones_appended=ones)

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


class _ExecutionCores:
    """A layer's cores for one call: as they are, and padded by its ``pad_bonds`` (made once, on demand)."""

    def __init__(self, experts: FactorizedExperts) -> None:
        self.unpadded = list(experts.cores.values())
        self.padding = bond_padding(experts.network, experts.pad_bonds)
        self.labels = list(experts.network.cores.values())
        self._padded: list[torch.Tensor] | None = None

    def padded(self) -> list[torch.Tensor]:
        """The cores with their large bonds padded (the cores themselves when none is)."""
        if self._padded is None:
            self._padded = pad_cores(self.unpadded, self.labels, self.padding) if self.padding else self.unpadded
        return self._padded


def _run_padded(
    plan: ContractionPlan,
    ones: str | None,
    padding: Mapping[str, int],
    labels: list[tuple[str, ...]],
    n_cores: int,
    *operands: torch.Tensor,
) -> torch.Tensor:
    """`run_plan` on the cores (the first ``n_cores`` operands) padded by ``padding``, then the rows.

    The operands are positional for ``torch.utils.checkpoint``, which then recomputes the padding
    rather than keeping the padded copies.
    """
    cores, rows = operands[:n_cores], operands[n_cores:]
    if padding:
        cores = pad_cores(cores, labels, padding)
    return run_plan(plan, [*cores, *rows], ones_appended=ones)


#: What the gate of a layer reads: the experts' (normalised) input, or the raw input.
GATE_INPUTS = ("normed", "raw")


class SharedGateLayers(PerThreadRecords):
    """Base of layers whose factorized expert layers share one gate: MuMoE, MuMoEMLP, MuMoEGatedMLP.

    It holds the gate, the input norm, the per-thread record of the coefficients and any
    active ablation. A subclass calls ``_setup_gate`` in its constructor, lists its factorized
    layers in ``_expert_layers`` and, in ``forward``, gets ``z, coefficients = self._gate(x)``
    and contracts each layer with ``self._contract(experts, z, coefficients)``.
    """

    in_features: int
    bias: bool
    input_norm: nn.Module
    gate: nn.Module
    gate_spec: GateSpec

    def _setup_gate(
        self,
        in_features: int,
        expert_dims: tuple[int, ...],
        *,
        bias: bool,
        gate: GateSpec,
        gate_input: str,
        input_norm: bool,
        factory: dict,
    ) -> None:
        if gate_input not in GATE_INPUTS:
            raise ValueError(f"gate_input must be one of {list(GATE_INPUTS)}, got {gate_input!r}")
        self.in_features = in_features
        self.bias = bias
        self.expert_dims = expert_dims
        self.gate_input = gate_input
        check_bool("input_norm", input_norm)
        self.input_norm = nn.LayerNorm(in_features, **factory) if input_norm else nn.Identity()
        self.gate_spec = gate
        module = gate.build(in_features, expert_dims, **factory)
        if not isinstance(module, nn.Module):
            raise TypeError(f"the gate descriptor {gate!r} built {type(module).__name__}, not an nn.Module")
        self.gate = module
        self.ablation: Any = None

    def _gate_mask_options(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"mask": tokens}`` for a gate whose ``forward`` takes a token mask; nothing for a token-wise one."""
        parameters = inspect.signature(self.gate.forward).parameters
        if "mask" in parameters:
            return {"mask": tokens}
        if getattr(self.gate_spec, "mixes_tokens", False) is True:
            raise TypeError(
                f"the gate {type(self.gate).__name__} mixes tokens but its forward takes no token mask: give it "
                "forward(z, mask=None) (mask: (rows,) booleans, True = real token) to train on padded batches"
            )
        return {}

    @property
    def last_token_mask(self) -> torch.Tensor | None:
        """Which tokens of this thread's last forward pass were real (None: all of them)."""
        return self._recall("token_mask")

    @property
    def last_coefficients(self) -> tuple[torch.Tensor, ...] | None:
        """The (detached) coefficients of this thread's last forward pass, one per expert mode."""
        return self._recall("coefficients")

    @last_coefficients.setter
    def last_coefficients(self, value: tuple[torch.Tensor, ...] | None) -> None:
        self._remember("coefficients", value)

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Re-initialise the gate, the input norm and the expert cores."""
        if hasattr(self.gate, "reset_parameters"):
            self.gate.reset_parameters()
        else:
            for module in self.gate.modules():
                if module is not self.gate and hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        if hasattr(self.input_norm, "reset_parameters"):
            self.input_norm.reset_parameters()
        for experts in self._expert_layers():
            experts.reset_parameters()

    def gate_losses(self) -> dict[str, torch.Tensor]:
        """The gate's auxiliary losses from this thread's last forward pass (empty if it has none).

        Returns
        -------
        dict of str to torch.Tensor
            ``"balance"`` (load balancing) and/or ``"z"`` (router z-loss), scalars in float32
            (or wider) that carry gradients to the gate: ``loss = task + λ * layer.gate_losses()["balance"]``.
        """
        losses = getattr(self.gate, "losses", None)
        return {} if losses is None else losses()

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward pass (needs a gate with ``balance_loss=True``)."""
        return self._named_loss("balance", "balance_loss")

    def z_loss(self) -> torch.Tensor:
        """The router z-loss of the last forward pass (needs a gate with ``z_loss=True``)."""
        return self._named_loss("z", "z_loss")

    def _named_loss(self, key: str, option: str) -> torch.Tensor:
        losses = self.gate_losses()
        if key not in losses:
            raise ValueError(
                f"this layer's gate {self.gate_spec!r} does not record the {key!r} loss: build it with {option}=True"
            )
        return losses[key]

    def _check_input(self, x: torch.Tensor) -> None:
        if torch.jit.is_tracing():
            raise RuntimeError(
                f"{type(self).__name__} cannot be traced with torch.jit.trace: its contraction plan and sparse gate "
                "depend on the batch size and the data, which a trace would freeze. Use torch.export.export "
                "(dynamic batch: dynamic_shapes={'x': {0: torch.export.Dim('batch')}}) or torch.compile instead"
            )
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.is_complex() or not x.is_floating_point():
            raise TypeError(f"input must be a real floating-point tensor, got dtype {x.dtype}")
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"input must have shape (..., {self.in_features}), got {tuple(x.shape)}")
        weight = next(iter(self._expert_layers()[0].cores.values()))
        if x.device != weight.device:
            raise ValueError(f"input is on {x.device} but the layer's parameters are on {weight.device}")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"input has dtype {x.dtype} but the layer's parameters have dtype {weight.dtype}: "
                f"cast the input (x.to({weight.dtype})) or the layer (layer.to({x.dtype}))"
            )

    def _gate(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Validate ``x``, normalise it, compute and record the coefficients, apply any ablation mask."""
        self._check_input(x)
        tokens = resolve_token_mask(mask, tuple(x.shape[:-1]), x.device)
        z = self.input_norm(x)
        gated = x if self.gate_input == "raw" else z
        options = {} if tokens is None else self._gate_mask_options(tokens)
        if self.ablation is None:
            coefficients = self.gate(gated, **options)
        else:
            coefficients = self.ablation.gate(self.gate, gated, **options)
        if isinstance(coefficients, torch.Tensor) or not isinstance(coefficients, Sequence):
            raise TypeError(
                f"the gate {type(self.gate).__name__} must return a tuple of tensors, one per expert mode, "
                f"got {type(coefficients).__name__}"
            )
        self._remember("coefficients", tuple(a.detach() for a in coefficients))
        self._remember("token_mask", None if tokens is None else tokens.reshape(x.shape[:-1]))
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


class MuMoE(SharedGateLayers):
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
    decomposition : str or Format or ExpertNetwork or Callable, optional
        A registered name (``"cp"`` default, ``"tr"``, ``"tt"``, ``"tucker"``, or any format you
        registered), a [`Format`][mumoe_tn.decompositions.format.Format], a spec string such as
        ``"n1 a b, a i c, b c o"`` (bond sizes from ``rank``), a ready [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork]
        whose legs match the layer, or a builder ``(expert_dims, in, out, rank) -> ExpertNetwork``.
    rank : int or Sequence[int] or Mapping[str, int] or "exact", optional
        Ranks for the decomposition (a mapping of bond -> size for spec strings). Not needed
        with an [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork]; with ``match=`` it sets the bonds matching leaves
        alone (1 by default). ``"exact"``: the smallest ranks of the bonds matching would scale at
        which every expert can equal any ``I × O`` matrix — what makes upcycling exact, for any
        network (see [`mumoe_tn.costs.match_exact`][mumoe_tn.costs.matching.match_exact]).
    match : "linear" or int or float, optional
        Parameter-match instead of giving ranks: ``"linear"`` matches
        ``nn.Linear(in_features, out_features)`` with gating counted, an int is a parameter
        budget, a float a fraction of the Linear's parameters (as tensorly-torch's
        ``rank=0.5``). The format chooses the bonds to scale (CP ``R``, TR/TT the input–output
        bond, Tucker and custom networks every bond) unless ``match_bonds`` names them; see
        [`mumoe_tn.costs.matching`][mumoe_tn.costs.matching] (a
        [`MatchingWarning`][mumoe_tn.costs.matching.MatchingWarning] reports a missed target or collapsed experts).
    match_bonds : Sequence[str], optional
        The bonds ``match=`` scales.
    rank_multiple : int, optional
        With ``match=``, give the scaled bonds a multiple of this (default 1). Matrix-multiply
        kernels are markedly faster when inner sizes are multiples of the SIMD width or
        tensor-core tile: 16 costs at most 8 rank units of parameter resolution and, e.g., takes
        CP's matched ``R = 529`` (768 → 3072) to 528.
    bias : bool, optional
        Fold a per-expert bias into the input leg (default True).
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
        [`TopKGate`][mumoe_tn.gates.specs.TopKGate] or your own); excludes the three options above.
    gate_input : {"normed", "raw"}, optional
        Gate on the experts' input (default; ``LayerNorm(x)`` with ``input_norm=True``) or on
        the raw ``x`` (the authors' GPT-2 configuration); see [`mumoe_tn.gates.modules`][mumoe_tn.gates.modules].
    input_norm : bool, optional
        Apply a LayerNorm (with affine parameters) to the input first (default False).
    init : {"auto", "paper", "linear"}, optional
        Core initialisation rule (see [`mumoe_tn.init`][mumoe_tn.init]).
    expert_noise : Sequence[float], optional
        ``σ_e`` per expert mode for the initialisation.
    optimize : str or object, optional
        Path optimizer for the factorized contraction (default ``"auto"``, see
        [`FactorizedExperts`][mumoe_tn.layers.FactorizedExperts]).
    device, dtype : optional
        Factory arguments.
    **decomposition_options
        Passed to the named builder (e.g. ``expert_rank=`` for TR/TT).

    Attributes
    ----------
    last_coefficients : tuple of torch.Tensor or None
        The (detached) expert coefficients of the last forward pass in the calling thread,
        one per expert mode (before any ablation).
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
        decomposition: Decomposition = "cp",
        rank: Rank | None = None,
        *,
        match: Match = None,
        match_bonds: Sequence[str] | None = None,
        rank_multiple: int = 1,
        bias: bool = True,
        activation: str | float | None = None,
        gate_norm: str | None = None,
        gate_init: str | None = None,
        gate: GateSpec | None = None,
        gate_input: str = "normed",
        input_norm: bool = False,
        init: str = "auto",
        expert_noise: Sequence[float] | None = None,
        optimize: Any = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **decomposition_options: Any,
    ) -> None:
        super().__init__()
        factory = check_factory(device, dtype)
        gate = gate_from_options(gate, activation=activation, norm=gate_norm, init=gate_init)
        rank, match = split_rank_and_match(rank, match, "MuMoE")
        build_rank = 1 if match is not None and rank is None else rank
        network = resolve_network(
            decomposition, expert_dims, in_features, out_features, build_rank, bias=bias, options=decomposition_options
        )
        if match == EXACT:
            network = match_exact([network], bonds=match_bonds, multiple=rank_multiple)[1][0]
        elif match is not None:
            reference = linear_cost(in_features, out_features, bias=bias).params
            target = match_target(match, reference, "linear", "MuMoE")
            matched = match_layer(
                network, target, bonds=match_bonds, bias=bias, gate=gate, input_norm=input_norm,
                rank_multiple=rank_multiple,
            )  # fmt: skip
            network = matched.networks[0]
        else:
            check_match_only_options(match_bonds, rank_multiple)
        check_allocatable(network)
        self.out_features = out_features
        gating = {"gate": gate, "gate_input": gate_input, "input_norm": input_norm, "factory": factory}
        self._setup_gate(in_features, network.expert_dims, bias=bias, **gating)
        self.experts = FactorizedExperts(
            network, init=init, fan_in=in_features, expert_noise=expert_noise, optimize=optimize, **factory
        )

    @property
    def network(self) -> ExpertNetwork:
        """The expert network (its leg ``i`` includes the bias column when ``bias=True``)."""
        return self.experts.network

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.experts,)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``.

        ``mask`` (shape ``x.shape[:-1]``, True/1 = real token) keeps padding out of the gate's
        statistics, losses and records (see [`mumoe_tn.masking`][mumoe_tn.masking]); by default the
        enclosing [`token_mask`][mumoe_tn.masking.token_mask] context's, if any.
        """
        z, coefficients = self._gate(x, mask)
        return self._contract(self.experts, z, coefficients)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias}"


class MuMoEMLP(SharedGateLayers):
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
    decomposition : str or Format or ExpertNetwork or Callable, optional
        As for [`MuMoE`][mumoe_tn.layers.MuMoE] (both layers use it; a ready network gives its structure and bond
        sizes, its legs are set to each layer's sizes).
    rank : int or Sequence[int] or Mapping[str, int] or "exact", optional
        Ranks of both layers; ``"exact"`` as for [`MuMoE`][mumoe_tn.layers.MuMoE] (one rank that suits both).
    match : "mlp" or int or float, optional
        Parameter-match instead: ``"mlp"`` matches the MLP block ``I → H → O`` (one rank for
        both layers, the one gate counted), an int is a budget, a float a fraction of the MLP
        block's parameters.
    match_bonds : Sequence[str], optional
        The bonds ``match=`` scales in both layers.
    rank_multiple : int, optional
        With ``match=``, give the scaled bonds a multiple of this (default 1; see
        [`MuMoE`][mumoe_tn.layers.MuMoE]).
    bias : bool, optional
        Fold a bias into both layers' input legs (default True).
    activation, gate_norm, gate_init, gate, gate_input : optional
        The one gate shared by both layers, as for [`MuMoE`][mumoe_tn.layers.MuMoE].
    input_norm : bool, optional
        LayerNorm on the block's input first.
    hidden_activation : nn.Module, optional
        Non-linearity between the layers (default ``nn.GELU()``).
    init, expert_noise, optimize, device, dtype, **decomposition_options
        As for [`MuMoE`][mumoe_tn.layers.MuMoE].

    Attributes
    ----------
    last_coefficients : tuple of torch.Tensor or None
        The (detached) shared coefficients of the last forward pass in the calling thread.
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
        rank: Rank | None = None,
        *,
        match: Match = None,
        match_bonds: Sequence[str] | None = None,
        rank_multiple: int = 1,
        bias: bool = True,
        activation: str | float | None = None,
        gate_norm: str | None = None,
        gate_init: str | None = None,
        gate: GateSpec | None = None,
        gate_input: str = "normed",
        input_norm: bool = False,
        hidden_activation: nn.Module | None = None,
        init: str = "auto",
        expert_noise: Sequence[float] | None = None,
        optimize: Any = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **decomposition_options: Any,
    ) -> None:
        super().__init__()
        factory = check_factory(device, dtype)
        out_features = in_features if out_features is None else out_features
        gate = gate_from_options(gate, activation=activation, norm=gate_norm, init=gate_init)

        def matcher(first: ExpertNetwork, second: ExpertNetwork, match: Any, bonds: Any) -> tuple:
            reference = mlp_cost(in_features, hidden_features, out_features, bias=bias).params
            target = match_target(match, reference, "mlp", "MuMoEMLP")
            block = match_block(first, second, target, bonds=bonds, bias=bias, gate=gate, rank_multiple=rank_multiple)
            return block.networks

        sizes = (in_features, hidden_features, out_features)
        first, second = block_networks(
            decomposition, expert_dims, sizes, rank, match, match_bonds, rank_multiple,
            bias=bias, options=decomposition_options, layer="MuMoEMLP", matcher=matcher,
        )  # fmt: skip
        self.hidden_features, self.out_features = hidden_features, out_features
        gating = {"gate": gate, "gate_input": gate_input, "input_norm": input_norm, "factory": factory}
        self._setup_gate(in_features, first.expert_dims, bias=bias, **gating)
        layer = {"init": init, "expert_noise": expert_noise, "optimize": optimize, **factory}
        self.experts1 = FactorizedExperts(first, fan_in=in_features, **layer)
        self.experts2 = FactorizedExperts(second, fan_in=hidden_features, **layer)
        if hidden_activation is not None and not isinstance(hidden_activation, nn.Module):
            raise TypeError(
                f"hidden_activation must be an nn.Module instance such as nn.GELU(), got {hidden_activation!r}"
            )
        self.hidden_activation = nn.GELU() if hidden_activation is None else hidden_activation

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        return (self.experts1, self.experts2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(…, in_features)``; returns ``(…, out_features)``.

        ``mask``: which tokens are real, as for [`MuMoE`][mumoe_tn.layers.MuMoE].
        """
        z, coefficients = self._gate(x, mask)
        hidden = self.hidden_activation(self._contract(self.experts1, z, coefficients))
        return self._contract(self.experts2, hidden, coefficients)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
            f"out_features={self.out_features}, bias={self.bias}"
        )
