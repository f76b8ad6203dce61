"""The factorized expert tensor: a network's cores as parameters, contracted along planned paths."""

from __future__ import annotations

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
    check_memory_limit,
    plan_forward,
    plan_inference,
    resolve_optimizer,
)
from mumoe_tn.contractions.saved import PLAN_KINDS, read_plans, write_plans
from mumoe_tn.layers.init import INIT_RULES, check_expert_noise, init_cores
from mumoe_tn.layers.options import (
    check_allocatable,
    check_factory,
)
from mumoe_tn.network import INPUT_LEG, ExpertNetwork
from mumoe_tn.validation import check_bool, check_size

__all__ = ["COMPILE_PLAN_BATCH", "FactorizedExperts"]

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
        Initialisation rule, see [`mumoe_tn.layers.init.init_cores`][mumoe_tn.layers.init.init_cores].
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
    memory_limit : int or "max_input", optional
        Most elements any intermediate of a planned contraction may hold (as opt_einsum's
        ``memory_limit``); default: the planner's bound (see
        [`mumoe_tn.contractions.choose_plan`][mumoe_tn.contractions.plan.choose_plan]).
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
        memory_limit: int | str | None = None,
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
        self.memory_limit = check_memory_limit(memory_limit)
        self.chunk_size = chunk_size
        self.recompute = recompute
        self.precontract = precontract
        self.pad_bonds = pad_bonds  # checked by the property
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._plans_lock = threading.RLock()
        self._compile_plan = plan_forward(
            network, COMPILE_PLAN_BATCH, self._path_optimizer(), memory_limit=self.memory_limit
        )
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
        self.__dict__.setdefault("memory_limit", None)  # likewise
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
                candidates = autotune_candidates(self.network, bucket, memory_limit=self.memory_limit)
                return fastest_plan(candidates, operands, ones_appended=ones_appended)
            return plan_forward(self.network, bucket, self._path_optimizer(), memory_limit=self.memory_limit)

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
        plan, steps = self._cached(
            ("inference", bucket), lambda: plan_inference(self.network, bucket, memory_limit=self.memory_limit)
        )
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

    def export_plans(self) -> dict[str, Any]:
        """The contraction plans made so far (one per kind and batch-size bucket), as a JSON-able dict.

        Save it with a checkpoint, or plan on one process and broadcast it: ``load_plans`` puts the
        plans into another layer's cache, which then runs them without searching. Plan a bucket
        first with ``plan(batch_size)``.
        """
        with self._plans_lock:
            cached = [(key, value) for key, value in self._plans.items() if key[0] in PLAN_KINDS]
        entries = [
            (kind, bucket, value, None) if kind == "train" else (kind, bucket, value[0], value[1])
            for (kind, bucket), value in cached
        ]
        return write_plans(self.network, entries)

    def load_plans(self, saved: Mapping[str, Any]) -> None:
        """Put plans written by ``export_plans`` into the plan cache.

        Every plan is checked against this layer's network first (a ``ValueError`` names the
        first that does not fit); nothing is loaded unless all fit.
        """
        entries = read_plans(self.network, saved)
        with self._plans_lock:
            for kind, bucket, plan, constant in entries:
                self._plans[(kind, bucket)] = plan if kind == "train" else (plan, constant)
                self._plans.move_to_end((kind, bucket))
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)


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
