"""What every μMoE layer shares: one gate, the input norm, per-thread records, token masks, ablation."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any, Self

import torch
from torch import nn

from mumoe_tn.gates.records import PerThreadRecords
from mumoe_tn.gates.specs import GateSpec
from mumoe_tn.layers.construction import LayerSpec
from mumoe_tn.layers.experts import FactorizedExperts
from mumoe_tn.layers.fused import LeanCoefficients
from mumoe_tn.layers.program import LayerProgram, ProgramEntry
from mumoe_tn.masking import resolve_token_mask
from mumoe_tn.validation import check_bool

__all__ = ["A_LAYER", "GATE_INPUTS", "MuMoEBase"]

#: What a μMoE layer is, in the library's errors about an argument that must be one.
A_LAYER = "a μMoE layer (MuMoE, MuMoEMLP, MuMoEGatedMLP, MixtureOfDecoders)"

#: What the gate of a layer reads: the experts' (normalised) input, or the raw input.
GATE_INPUTS = ("normed", "raw")

#: What a call records, as a call the layer's program serves gives it to `_remember_eager`.
_RECORDED = ("coefficients", "token_mask")


class MuMoEBase(PerThreadRecords):
    """Base of layers whose factorized expert layers share one gate: MuMoE, MuMoEMLP, MuMoEGatedMLP.

    It holds the gate, the input norm, the per-thread record of the coefficients and any
    active ablation. A subclass resolves a [`LayerSpec`][mumoe_tn.layers.construction.LayerSpec] in its
    constructor and builds from it in ``_build`` (after this class's), lists its factorized
    layers in ``_expert_layers`` and, in ``forward``, gets ``z, coefficients = self._gate(x)``
    and contracts each layer with ``self._contract(experts, z, coefficients)``.
    """

    in_features: int
    bias: bool
    input_norm: nn.Module
    gate: nn.Module
    gate_spec: GateSpec

    #: The example of ``hidden_activation`` the error about a wrong one names.
    activation_example = "nn.GELU()"

    #: Whether the factorized layers' leg ``i`` holds the bias column.
    folds_bias = True

    #: The roles of the factorized layers, in order (the ``networks`` of a spec this class builds from).
    spec_roles: tuple[str, ...] = ()

    @classmethod
    def from_spec(cls, spec: LayerSpec) -> Self:
        """A new layer built from ``spec`` (see [`mumoe_tn.layers.construction`][mumoe_tn.layers.construction]).

        Parameters
        ----------
        spec : LayerSpec
            A spec of this kind of layer (from [`layer_spec`][mumoe_tn.layers.construction.layer_spec]), its
            fields replaced where wanted (``dataclasses.replace``). Its ``hidden_activation`` is copied, so
            layers built from one spec share no module.

        Returns
        -------
        MuMoEBase
            A layer of this class, its parameters freshly initialised.

        Raises
        ------
        TypeError
            If ``spec`` is not a ``LayerSpec``.
        ValueError
            If its factorized layers are not this class's.
        """
        if not isinstance(spec, LayerSpec):
            raise TypeError(f"spec must be a LayerSpec, got {type(spec).__name__}")
        if spec.roles != cls.spec_roles:
            raise ValueError(
                f"a spec with the factorized layers {list(spec.roles)} (a {spec.layer}) does not build a "
                f"{cls.__name__}, whose layers are {list(cls.spec_roles)}"
            )
        if spec.hidden_activation is not None:
            spec = dataclasses.replace(spec, hidden_activation=copy.deepcopy(spec.hidden_activation))
        layer = cls.__new__(cls)
        MuMoEBase.__init__(layer)
        layer._build(spec)
        return layer

    def _build(self, spec: LayerSpec) -> None:
        """Make the layer's modules from ``spec``: the gate and the input norm here, the rest in the subclass."""
        if spec.gate_input not in GATE_INPUTS:
            raise ValueError(f"gate_input must be one of {list(GATE_INPUTS)}, got {spec.gate_input!r}")
        in_features, factory = spec.in_features, spec.factory()
        self.in_features = in_features
        self.bias = spec.folded_bias
        self.expert_dims = spec.expert_dims
        self.gate_input = spec.gate_input
        check_bool("input_norm", spec.input_norm)
        self.input_norm = nn.LayerNorm(in_features, **factory) if spec.input_norm else nn.Identity()
        self.gate_spec = spec.gate
        module = spec.gate.build(in_features, spec.expert_dims, **factory)
        if not isinstance(module, nn.Module):
            raise TypeError(f"the gate descriptor {spec.gate!r} built {type(module).__name__}, not an nn.Module")
        self.gate = module
        self.ablation: Any = None
        self._program = LayerProgram()

    def __setstate__(self, state: dict[str, Any]) -> None:
        for derived in ("_fused", "_checked_inputs", "_lean_programs"):  # what a 0.3 layer pickled instead
            state.pop(derived, None)
        super().__setstate__(state)
        self.__dict__.setdefault("_program", LayerProgram())

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
        """Which tokens of this thread's last eager forward pass were real (None: all of them)."""
        return self._recall("token_mask")

    @property
    def last_coefficients(self) -> tuple[torch.Tensor, ...] | None:
        """The (detached) coefficients of this thread's last eager forward pass, one per expert mode.

        A call compiled by ``torch.compile`` records none (see
        [`PerThreadRecords`][mumoe_tn.gates.records.PerThreadRecords]): call the layer eagerly to
        read them.
        """
        return self._recall("coefficients")

    @last_coefficients.setter
    def last_coefficients(self, value: tuple[torch.Tensor, ...] | None) -> None:
        self._remember("coefficients", value)

    def _expert_layers(self) -> tuple[FactorizedExperts, ...]:
        raise NotImplementedError

    def _input_layers(self) -> tuple[FactorizedExperts, ...]:
        """The expert layers that read the gate's ``z`` itself (inference fuses their first product with the gate's)."""
        return ()

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

    def clear_inference_cache(self) -> None:
        """Drop what inference keeps from the weights (folded gate, padded and laid-out cores, plans' operands).

        Needed only after editing a parameter through ``.data`` in place, the one change PyTorch
        does not track (see [`mumoe_tn.caching`][mumoe_tn.caching]); any other change of the
        weights is noticed on the next call.
        """
        self._program.clear()
        for module in self.modules():
            cache = getattr(module, "clear_inference_cache", None)
            if module is not self and callable(cache):
                cache()

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
            if not hasattr(self.gate_spec, option):
                raise ValueError(
                    f"this layer's gate {self.gate_spec!r} has no {option} option, so it records no {key!r} loss: "
                    f"use a gate that has one (e.g. Gate or TopKGate with {option}=True)"
                )
            raise ValueError(
                f"this layer's gate {self.gate_spec!r} does not record the {key!r} loss: build it with {option}=True"
            )
        return losses[key]

    def _check_input(self, x: torch.Tensor) -> None:
        """Validate the layer's input; a combination of width, dtype and device that passed once is not re-checked."""
        key = None
        if type(x) is torch.Tensor and not torch.jit.is_tracing() and not torch.compiler.is_compiling():
            experts = self._expert_layers()[0]
            weight = getattr(experts, next(iter(experts.network.cores)))
            device = x.device  # (each read makes a device object)
            if device == weight.device:  # (autocast is asked of known devices only)
                key = (x.shape[-1:], x.dtype, device, weight.dtype, torch.is_autocast_enabled(device.type))
                if key in self._program.checked:
                    return
        self._check_new_input(x)
        if key is not None:
            self._program.remember_checked(key)

    def _check_new_input(self, x: torch.Tensor) -> None:
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
        experts = self._expert_layers()[0]
        weight = getattr(experts, next(iter(experts.network.cores)))
        if x.device != weight.device:
            raise ValueError(f"input is on {x.device} but the layer's parameters are on {weight.device}")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"input has dtype {x.dtype} but the layer's parameters have dtype {weight.dtype}: "
                f"cast the input (x.to({weight.dtype})) or the layer (layer.to({x.dtype}))"
            )

    def _gate(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Validate ``x``, normalise it, compute and record the coefficients, apply any ablation mask.

        The projection step is the layer's [`LayerProgram`][mumoe_tn.layers.program.LayerProgram]
        entry where one serves the call (a plain inference call with a
        [`ProgramGate`][mumoe_tn.gates.gate_protocol.ProgramGate]: see
        [`fused_entry`][mumoe_tn.layers.program.LayerProgram.fused_entry]): the gate's projection
        (eval-mode norms folded in) and the input layers' first products run as one matrix product
        ``z @ [Gᵀ | M_1 | …]``, then the gate's own normalisation, map and records. Otherwise the
        gate runs as a module. Every other step is the same either way.
        """
        entry = self._program.fused_entry(self, x, mask)  # (made for a validated signature, and no mask applies)
        if entry is not None:
            return self._gate_fused(x, entry)
        if not torch.compiler.is_compiling():
            self._program.adopt_children(self)
        self._check_input(x)
        lead = x.shape[:-1]
        tokens = resolve_token_mask(mask, tuple(lead), x.device)
        z = self.input_norm(x)
        coefficients = self._gate_module(x if self.gate_input == "raw" else z, tokens)
        self._remember_all(
            coefficients=tuple(a.detach() if a.requires_grad else a for a in coefficients),
            token_mask=None if tokens is None else tokens.reshape(lead),
        )
        if not torch.is_autocast_enabled(z.device.type):
            coefficients = _in_dtype(coefficients, z.dtype)
        if self.ablation is not None:
            coefficients = self.ablation.mask(coefficients)
        return z, coefficients

    def _gate_fused(self, x: torch.Tensor, entry: ProgramEntry) -> tuple[torch.Tensor, LeanCoefficients]:
        """`_gate`'s steps where the program's ``entry`` serves the call: no gradient, mask, ablation or autocast."""
        z = x if entry.identity else self.input_norm(x)
        flat = z if z.ndim == 2 else z.reshape(-1, z.shape[-1])
        rows, heads = entry.run(flat)
        rows = tuple(rows)
        if z.ndim == 2:
            coefficients = rows
        else:
            lead = z.shape[:-1]
            coefficients = tuple([a.reshape(*lead, a.shape[-1]) for a in rows])
        self._remember_eager(_RECORDED, (coefficients, None))  # (eager, and nothing requires a gradient here)
        coefficients = _in_dtype(coefficients, z.dtype)  # (autocast is off: the entry admits no autocast call)
        return z, LeanCoefficients(coefficients, z, flat, rows, heads)

    def _gate_module(self, gated: torch.Tensor, tokens: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The coefficients of the gate called as a module (or through the ablation), checked to be a tuple."""
        options = {} if tokens is None else self._gate_mask_options(tokens)
        if self.ablation is None:
            coefficients = self.gate(gated, **options)
        else:
            coefficients = self.ablation.gate(self.gate, gated, **options)
        if type(coefficients) is not tuple and (
            isinstance(coefficients, torch.Tensor) or not isinstance(coefficients, Sequence)
        ):
            raise TypeError(
                f"the gate {type(self.gate).__name__} must return a tuple of tensors, one per expert mode, "
                f"got {type(coefficients).__name__}"
            )
        return tuple(coefficients)

    def _contract(
        self, experts: FactorizedExperts, z: torch.Tensor, coefficients: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        if type(coefficients) is LeanCoefficients and z is coefficients.z:
            found = coefficients.projected.get(id(experts))
            if found is not None:
                executor, position, head = found
                y = executor([*coefficients.rows, coefficients.flat], (position, head))
                return y if z.ndim == 2 else y.reshape(*z.shape[:-1], y.shape[-1])
        y = experts(z, coefficients, append_one=self.bias)
        if self.ablation is None:
            return y
        return self.ablation.correct(experts, z, coefficients, y, append_one=self.bias)


def _in_dtype(coefficients: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``coefficients`` in ``dtype`` (the same tuple where every one already is)."""
    for a in coefficients:
        if a.dtype != dtype:
            return tuple([a.to(dtype) for a in coefficients])
    return coefficients
