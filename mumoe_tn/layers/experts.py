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

from mumoe_tn.caching import DerivedValues
from mumoe_tn.contractions.autotune import fastest_plan
from mumoe_tn.contractions.dense import expert_matrix, materialise
from mumoe_tn.contractions.execute import constant_intermediates, run_plan
from mumoe_tn.contractions.inference_plan import plan_inference
from mumoe_tn.contractions.padding import PAD_MULTIPLE, bond_padding, pad_cores
from mumoe_tn.contractions.plan import (
    BATCH_LABEL,
    OPTIMIZERS,
    ContractionPlan,
    autotune_candidates,
    check_memory_limit,
    plan_forward,
    resolve_optimizer,
)
from mumoe_tn.contractions.prepared import PreparedPlan
from mumoe_tn.contractions.saved import read_plans, write_plans
from mumoe_tn.layers.init import INIT_RULES, check_expert_noise, init_cores
from mumoe_tn.layers.options import (
    MAX_PLANS,
    check_allocatable,
    check_factory,
)
from mumoe_tn.network import INPUT_LEG, ExpertNetwork
from mumoe_tn.validation import check_bool, check_size

__all__ = ["COMPILE_PLAN_BATCH", "MAX_PLANS", "FactorizedExperts", "batch_bucket"]

_MAX_FAN_IN = 1 << 40

#: Batch size of the plan used while ``torch.compile`` traces a layer (made at construction).
COMPILE_PLAN_BATCH = 1024

#: Smallest batch bucket whose inference runs on the padded cores (see ``pad_bonds``): below it the
#: products are matrix-vector-like, bound by reading the cores, and padding only adds bytes (on the
#: benchmarks' CPU a ``(1 × 544) @ (544 × 3072)`` product took 1.05× the unpadded ``529``).
MIN_PADDED_ROWS = 256


def batch_bucket(batch: int) -> int:
    """Plans are made for the next power of two: the path depends on the batch only coarsely."""
    return 1 << max(batch - 1, 0).bit_length()


class FactorizedExperts(nn.Module):
    """The expert tensor ``W`` of a μMoE layer, stored as the cores of an `ExpertNetwork`.

    Every core is one ``nn.Parameter`` named after the core, so ``state_dict`` keys are the
    core names. The forward pass contracts the cores with the expert coefficients and the
    input along a path planned once per batch-size bucket and cached in a bounded,
    thread-safe, least-recently-used per-module cache; ``W`` is never materialised. A batch of
    ``B`` rows uses the bucket of the next power of two (``B = 5 … 8`` share bucket 8): a path
    depends on the batch only coarsely. Each bucket takes one cache slot in training and one in
    inference, so a server whose batch sizes fall into at most ``max_plans`` buckets (the
    default 64 covers every size from 1 to 2⁶³) plans each bucket once and then never again.
    While ``torch.compile`` traces the module it uses one plan made at construction (for a
    batch of [`COMPILE_PLAN_BATCH`][mumoe_tn.layers]): a plan's steps are valid for every batch size, so
    dynamic batch sizes neither replan inside the trace nor recompile.

    Without gradients (``torch.no_grad`` or ``torch.inference_mode``, as in inference) the
    contraction is planned with the cores constant: core-only sub-networks are contracted once
    and reused while the cores are unchanged, when that saves FMAs per call, and the padded
    cores (``pad_bonds``) are made once instead of on every call. Both are kept until a core
    changes by any tracked route (optimizer step, ``load_state_dict``, in-place edit, ``.to()``;
    see [`mumoe_tn.caching`][mumoe_tn.caching]) and can be dropped with
    [`clear_inference_cache`][mumoe_tn.layers.experts.FactorizedExperts.clear_inference_cache].
    Results are exact either way.

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
    lazy_optimizer : bool, optional
        Only check that ``optimize`` is a name now and resolve it when the layer first plans (the
        ``torch.compile`` plan uses ``"auto"``): a replayed record's optimizer is data (default False).
    max_plans : int, optional
        Size of the plan cache in slots (default [`MAX_PLANS`][mumoe_tn.layers.experts]; one slot per
        batch-size bucket and mode, training or inference).
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
        the plan keep the true sizes. Inference pads only batches of at least
        [`MIN_PADDED_ROWS`][mumoe_tn.layers.experts] rows.
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
        lazy_optimizer: bool = False,
        max_plans: int = MAX_PLANS,
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
        if not check_bool("lazy_optimizer", lazy_optimizer):
            resolve_optimizer(optimize)  # validates; names are resolved afresh for every plan
        elif not isinstance(optimize, str) or optimize not in OPTIMIZERS:
            raise ValueError(f"lazy_optimizer=True takes an optimizer name of {list(OPTIMIZERS)}, got {optimize!r}")
        self.optimize = optimize
        self.max_plans = max_plans
        self.memory_limit = check_memory_limit(memory_limit)
        self.chunk_size = chunk_size
        self.recompute = recompute
        self.precontract = precontract
        self.pad_bonds = pad_bonds  # checked by the property
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._plans_lock = threading.RLock()
        self._derived = DerivedValues()  # the prepared cores, per pad_bonds (see mumoe_tn.caching)
        self._checked: set[tuple] = set()
        optimizer = "auto" if lazy_optimizer else self._path_optimizer()
        self._compile_plan = plan_forward(network, COMPILE_PLAN_BATCH, optimizer, memory_limit=self.memory_limit)
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
        state["_checked"] = set()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.pop("_prepared", None)  # the holder a 0.3 layer pickled instead
        super().__setstate__(state)
        self._plans_lock = threading.RLock()
        self._derived = DerivedValues()
        self._checked = set()

    @property
    def pad_bonds(self) -> int | None:
        """The multiple that bonds of at least 256 are zero-padded to when executing (None: no padding)."""
        return self._pad_bonds

    @pad_bonds.setter
    def pad_bonds(self, value: int | None) -> None:
        if value is not None:
            check_size("pad_bonds", value)
        self._pad_bonds = value  # (the prepared cores are kept per value: nothing to forget)

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
        bucket = batch_bucket(batch_size)

        return self._cached(("train", bucket), lambda: self._make_plan(bucket, operands, ones_appended))

    def _make_plan(self, bucket: int, operands: Sequence[torch.Tensor] | None, ones: str | None) -> ContractionPlan:
        """A new plan for ``bucket``: autotuned on ``operands`` where asked and given, else by the optimizer."""
        if self.optimize == "autotune" and operands is not None:
            candidates = autotune_candidates(self.network, bucket, memory_limit=self.memory_limit)
            return fastest_plan(candidates, operands, ones_appended=ones)
        return plan_forward(self.network, bucket, self._path_optimizer(), memory_limit=self.memory_limit)

    def clear_inference_cache(self) -> None:
        """Drop what inference keeps from the cores (padded copies, pre-contracted sub-networks).

        Needed only after editing a core through ``.data`` in place (``core.data.mul_(2)``), the one
        change PyTorch does not track (see [`mumoe_tn.caching`][mumoe_tn.caching]); every other change
        is noticed on the next call.
        """
        self._derived.clear()

    def _inference_program(
        self, batch: int, prepared: _PreparedCores, rows: list[torch.Tensor], ones: str | None
    ) -> _InferenceProgram:
        """How inference contracts ``batch``'s bucket: its plan, cached steps and core layouts (made once).

        One cache slot per bucket: with ``precontract`` the plan of
        [`plan_inference`][mumoe_tn.contractions.inference_plan.plan_inference] where it caches core-only
        steps, otherwise the layer's own plan for the bucket.
        """
        bucket = batch_bucket(batch)

        def make() -> _InferenceProgram:
            steps: frozenset[int] = frozenset()
            if self.precontract:
                plan, steps = plan_inference(self.network, bucket, memory_limit=self.memory_limit)
            if not steps:
                operands = [*prepared.padded(), *rows] if self.optimize == "autotune" else None
                plan = self._make_plan(bucket, operands, ones)
            return _InferenceProgram(plan, steps, len(self.network.cores))

        return self._cached(("inference", bucket, self.precontract), make)

    def _prepared_cores(self, cores: list[torch.Tensor]) -> _PreparedCores:
        """What inference derives from ``cores`` (this layer's, in network order), kept until a core changes."""
        pad = self.pad_bonds
        return self._derived.get(
            self, ("prepared", pad), lambda: _PreparedCores(cores, self.network, bond_padding(self.network, pad))
        )

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
        if z.ndim == 2:  # already rows
            batch = z.shape[0]
            rows = [*coefficients, z]
        else:
            batch = math.prod(lead)
            rows = [a.reshape(batch, a.shape[-1]) for a in coefficients]
            rows.append(z.reshape(batch, z.shape[-1]))
        ones = INPUT_LEG if append_one else None
        cores = _ExecutionCores(self, rows)  # padded at most once per call, whatever the chunks
        if torch.compiler.is_compiling():
            y = self._contract(self._compile_plan, rows, ones, cores)
        elif self.chunk_size is not None and batch > self.chunk_size:
            chunks = zip(*(tensor.split(self.chunk_size) for tensor in rows), strict=True)
            y = torch.cat([self._contract_rows(list(chunk), ones, cores) for chunk in chunks])
        else:
            y = self._contract_rows(rows, ones, cores)
        return y if z.ndim == 2 else y.reshape(*lead, y.shape[-1])

    def _contract_rows(self, rows: list[torch.Tensor], ones: str | None, cores: _ExecutionCores) -> torch.Tensor:
        """Contract the cores with one block of flattened rows (coefficients, then input)."""
        batch = max(rows[-1].shape[0], 1)
        prepared = cores.prepared
        if prepared is not None and rows[-1].shape[0] > 0:
            return prepared.executor(self._inference_program(batch, prepared, rows, ones), ones)(rows)
        operands = [*cores.padded(), *rows] if self.optimize == "autotune" else None  # timed as they will run
        return self._contract(self.plan(batch, operands, ones_appended=ones), rows, ones, cores)

    def _contract(
        self, plan: ContractionPlan, rows: list[torch.Tensor], ones: str | None, cores: _ExecutionCores
    ) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # Padded inside the checkpoint: the padded copies are recomputed, not kept.
            run = partial(_run_padded, plan, ones, cores.padding, cores.labels, len(cores.unpadded))
            return checkpoint(run, *cores.unpadded, *rows, use_reentrant=False)
        return run_plan(plan, [*cores.padded(), *rows], ones_appended=ones)

    def inference_executor(self, batch: int, append_one: bool) -> PreparedPlan | None:
        """The prepared plan an inference call on ``batch`` rows runs, or None where it takes another route.

        Inference here is a call that records no gradient (``torch.no_grad``/``inference_mode``);
        the plan is bound to the cores as they are now, and is the one ``forward`` would run
        (not for ``optimize="autotune"``, which times candidates on the call's operands, nor for
        chunked batches).
        """
        if batch < 1 or self.optimize == "autotune" or torch.compiler.is_compiling():
            return None
        if self.chunk_size is not None and batch > self.chunk_size:
            return None
        cores = [getattr(self, name) for name in self.network.cores]
        prepared = self._prepared_cores(cores)
        ones = INPUT_LEG if append_one else None
        return prepared.executor(self._inference_program(batch, prepared, [], ones), ones)

    def _check_inputs(self, z: torch.Tensor, coefficients: Sequence[torch.Tensor], append_one: bool) -> None:
        """Validate the operands; a combination of shapes, dtypes and devices that passed once is not re-checked."""
        if torch.compiler.is_compiling():  # checked as traced; a set changed in the region would recompile
            self._check_operands(z, coefficients, append_one)
            return
        weight = getattr(self, next(iter(self.network.cores)))
        key = _operands_key(z, coefficients, append_one, weight)
        if key is not None and key in self._checked:
            return
        self._check_operands(z, coefficients, append_one)
        if key is not None:
            if len(self._checked) >= _MAX_CHECKED:
                self._checked.clear()
            self._checked.add(key)

    def _check_operands(self, z: torch.Tensor, coefficients: Sequence[torch.Tensor], append_one: bool) -> None:
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
        weight = getattr(self, next(iter(net.cores)))
        autocast = torch.is_autocast_enabled(z.device.type)
        for k, tensor in enumerate((z, *coefficients)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{_operand_name(k)} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device != weight.device:
                raise ValueError(
                    f"{_operand_name(k)} is on {tensor.device} but the expert cores are on {weight.device}"
                )
            if not autocast and tensor.dtype != weight.dtype:
                raise TypeError(
                    f"{_operand_name(k)} has dtype {tensor.dtype} but the expert cores have dtype {weight.dtype}"
                )
        for k, (a, leg) in enumerate(zip(coefficients, net.expert_legs, strict=True)):
            expected = (*z.shape[:-1], net.sizes[leg])
            if tuple(a.shape) != expected:
                raise ValueError(
                    f"coefficients[{k}] (expert leg {leg!r}) must have shape {expected}, got {tuple(a.shape)}"
                )

    def to_dense(self) -> torch.Tensor:
        """Materialise ``W`` of shape ``(N_1, …, N_E, I, O)`` (for checks; memory ``∏N_e·I·O``)."""
        return materialise(self.network, self.cores)

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
            cached = list(self._plans.items())
        entries = []
        for key, value in cached:
            if key[0] == "train":
                entries.append(("train", key[1], value, None))
            elif key[0] == "inference" and key[2]:  # the plans of the default, pre-contracting inference
                entries.append(("inference", key[1], value.plan, value.steps))
        return write_plans(self.network, entries)

    def load_plans(self, saved: Mapping[str, Any]) -> None:
        """Put plans written by ``export_plans`` into the plan cache.

        Every plan is checked against this layer's network and memory bound first (a ``ValueError``
        names the first that does not fit, see ``mumoe_tn.contractions.saved``);
        nothing is loaded unless all fit.
        """
        entries = read_plans(self.network, saved, memory_limit=self.memory_limit)
        with self._plans_lock:
            for kind, bucket, plan, constant in entries:
                if kind == "train":
                    key, value = ("train", bucket), plan
                else:
                    key, value = ("inference", bucket, True), _InferenceProgram(plan, constant, len(self.network.cores))
                self._plans[key] = value
                self._plans.move_to_end(key)
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)


#: Most operand signatures a layer remembers as checked (the set starts afresh beyond it).
_MAX_CHECKED = 256


def _operands_key(z: Any, coefficients: Any, append_one: bool, weight: torch.Tensor) -> tuple | None:
    """What decides whether ``forward``'s operands are valid: shapes, dtypes, devices (None: check in full)."""
    if type(z) is not torch.Tensor or type(coefficients) not in (tuple, list):
        return None
    device = z.device  # (one device object: each read of a tensor's device makes a new one)
    if any(type(a) is not torch.Tensor for a in coefficients) or device != weight.device:
        return None
    signature = tuple((a.shape, a.dtype, a.device) for a in coefficients)
    return (z.shape, z.dtype, device, signature, append_one, torch.is_autocast_enabled(device.type), weight.dtype)


def _operand_name(position: int) -> str:
    """How errors name the forward pass's operand at ``position`` (the input, then the coefficients)."""
    return "input" if position == 0 else f"coefficients[{position - 1}]"


def _constant_keys(plan: ContractionPlan, steps: frozenset[int]) -> dict[int, tuple]:
    """What each core-only step of ``plan`` computes: the cores it joins and its result's labels.

    Two plans (of different buckets) whose steps compute the same key compute the same tensor, so
    the inference cache keeps one copy of it for every bucket.
    """
    covered = [frozenset([k]) for k in range(len(plan.inputs))]
    keys = {}
    for number, step in enumerate(plan.steps):
        joined = frozenset().union(*(covered.pop(k) for k in step.positions))
        if number in steps:
            keys[number] = (joined, step.output)
        covered.append(joined)
    return keys


class _InferenceProgram:
    """One bucket's inference plan and the keys of its cached core-only steps."""

    def __init__(self, plan: ContractionPlan, steps: frozenset[int], n_cores: int) -> None:
        self.plan = plan
        self.steps = steps
        self.keys = _constant_keys(plan, steps)


class _PreparedCores:
    """What inference derives from one state of the cores: padded copies, core-only results, plans.

    Core-only steps are computed from the cores as they are; the cores of a plan without such
    steps are padded by the layer's ``pad_bonds``. Each plan is bound to its cores once
    ([`PreparedPlan`][mumoe_tn.contractions.prepared.PreparedPlan]), sharing the matrices it
    prepares with the other buckets' plans.
    """

    #: Most distinct core-only intermediates kept (different buckets rarely need different ones).
    MAX_CONSTANTS = 16
    #: Most bound plans kept (one per bucket and input form in use).
    MAX_EXECUTORS = 256

    def __init__(self, cores: list[torch.Tensor], network: ExpertNetwork, padding: dict[str, int]) -> None:
        self.cores = cores
        self._labels = list(network.cores.values())
        self._padding = padding
        self._padded: list[torch.Tensor] | None = None
        self._constants: dict[tuple, torch.Tensor] = {}
        self._derived: dict[bool, dict[tuple, torch.Tensor]] = {True: {}, False: {}}
        self._executors: dict[tuple, PreparedPlan] = {}

    def padded(self) -> list[torch.Tensor]:
        """Every core, padded (made once)."""
        if self._padded is None:
            self._padded = pad_cores(self.cores, self._labels, self._padding) if self._padding else self.cores
        return self._padded

    def executor(self, program: _InferenceProgram, ones: str | None) -> PreparedPlan:
        """``program``'s plan bound to these cores (made once per program and input form)."""
        key = (id(program), ones)
        found = self._executors.get(key)
        if found is None or found.plan is not program.plan:
            if len(self._executors) >= self.MAX_EXECUTORS:
                self._executors = {}
            cached = bool(program.keys)
            # Aligned bonds pay off in large products only: a few rows read the padding for nothing.
            padded = not cached and program.plan.sizes[BATCH_LABEL] >= MIN_PADDED_ROWS
            cores = self.padded() if padded else self.cores
            constants = self.constants(program) if cached else None
            found = PreparedPlan(program.plan, cores, constants, ones_appended=ones, derived=self._derived[padded])
            self._executors[key] = found
        return found

    def constants(self, program: _InferenceProgram) -> dict[int, torch.Tensor]:
        """The results of ``program``'s core-only steps, from the unpadded cores (computed once each)."""
        missing = {number for number, key in program.keys.items() if key not in self._constants}
        if missing:
            if len(self._constants) + len(missing) > self.MAX_CONSTANTS:
                # Start afresh; the bound plans and their matrices go too (they key constants by identity).
                self._constants, self._executors = {}, {}
                self._derived[False].clear()
                missing = set(program.keys)
            # Every core-only step of the plan runs: a missing one may read another's result, which
            # this plan's own steps must compute (a shared key says the same tensor, not the same step).
            computed = constant_intermediates(program.plan, self.cores, set(program.keys))
            for number in missing:
                self._constants[program.keys[number]] = computed[number]
        return {number: self._constants[key] for number, key in program.keys.items()}


class _ExecutionCores:
    """A layer's cores for one call: as they are, and padded by its ``pad_bonds`` (made once, on demand).

    When no gradient reaches the cores they come from the layer's inference cache (padded once per
    change of the cores); otherwise the padded copies are made for this call, inside autograd.
    """

    def __init__(self, experts: FactorizedExperts, rows: Sequence[torch.Tensor] = ()) -> None:
        cores = [getattr(experts, name) for name in experts.network.cores]
        self._experts = experts
        # The prepared cores serve calls that record no gradient at all (they may be inference tensors).
        constant = not torch.is_grad_enabled() or not any(t.requires_grad for t in (*cores, *rows))
        self.prepared = experts._prepared_cores(cores) if constant and not torch.compiler.is_compiling() else None
        self.unpadded = cores
        self._padded: list[torch.Tensor] | None = None

    @property
    def padding(self) -> dict[str, int]:
        """Bond → padded size, by the layer's ``pad_bonds``."""
        return bond_padding(self._experts.network, self._experts.pad_bonds)

    @property
    def labels(self) -> list[tuple[str, ...]]:
        """Each core's labels."""
        return list(self._experts.network.cores.values())

    def padded(self) -> list[torch.Tensor]:
        """The cores with their large bonds padded (the cores themselves when none is)."""
        if self._padded is None:
            if self.prepared is not None:
                self._padded = self.prepared.padded()
            else:
                padding = self.padding
                self._padded = pad_cores(self.unpadded, self.labels, padding) if padding else self.unpadded
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
