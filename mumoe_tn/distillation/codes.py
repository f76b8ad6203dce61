"""The sparse code of a replacement: which module makes it, recording it, its pre-activations, replacing it.

The sparse code is the output of a replacement's ``code_module`` (a
[`Transcoder`][mumoe_tn.distillation.transcoders.Transcoder]'s latents), or of the ``gate`` of a μMoE
block (its expert coefficients, one tensor per expert mode). Its *pre-activations* are what the
code's nonlinearity reads: the normalised gate logits of every expert mode of an
[`ExpertGate`][mumoe_tn.gates.modules.ExpertGate] (the outputs of its ``norms``), otherwise the
input of the code module (a transcoder's encoder output, before its TopK).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mumoe_tn.gates.modules import ExpertGate
from mumoe_tn.layers.base import MuMoEBase
from mumoe_tn.layers.experts import FactorizedExperts

__all__ = ["code_module", "recording_code", "recording_preactivations", "substituted_code", "unit_parameters"]


def code_module(replacement: nn.Module) -> nn.Module | None:
    """The submodule whose output is ``replacement``'s sparse code, or None if it names none.

    A module's ``code_module`` attribute if it has one; the ``gate`` of a μMoE
    block (its expert coefficients).
    """
    named = getattr(replacement, "code_module", None)
    if isinstance(named, nn.Module):
        return named
    if isinstance(replacement, MuMoEBase):
        return replacement.gate
    return None


def unit_parameters(replacement: nn.Module) -> set[str]:
    """Names of the parameters indexed by the code's units (each unit owns a slice of them).

    A module's ``unit_parameters`` attribute if it declares one (a transcoder: its decoder's
    columns); otherwise the cores of every factorized layer that carry an expert leg (a μMoE
    block's expert factors: ``C`` of a Mixture of Decoders, the expert factor of CP, the expert
    cores of TR). The parameters shared by all units (encoders, ``D``, the input and output
    factors, biases) are not among them.
    """
    declared = getattr(replacement, "unit_parameters", None)
    if declared is not None:
        return set(declared)
    names = set()
    for prefix, module in replacement.named_modules():
        if isinstance(module, FactorizedExperts):
            network = module.network
            for core, legs in network.cores.items():
                if set(legs) & set(network.expert_legs):
                    names.add(f"{prefix}.{core}" if prefix else core)
    return names


def _required_code_module(replacement: nn.Module, use: str) -> nn.Module:
    module = code_module(replacement)
    if module is None:
        raise TypeError(
            f"{type(replacement).__name__} exposes no sparse code: give it a `code_module` attribute (the submodule "
            f"whose output is the code) to {use}"
        )
    return module


def _parts(output: Any) -> tuple[torch.Tensor, ...]:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


@contextmanager
def recording_code(replacement: nn.Module) -> Iterator[list[tuple[torch.Tensor, ...]]]:
    """Record the sparse code of every forward pass of ``replacement`` inside the block (with gradients).

    Yields a list that receives, per forward pass, the code as a tuple of tensors ``(…, units)``
    (one per expert mode for a μMoE block).
    """
    module = _required_code_module(replacement, "use an L1 penalty or measure L0")
    codes: list[tuple[torch.Tensor, ...]] = []

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        codes.append(_parts(output))

    handle = module.register_forward_hook(hook)
    try:
        yield codes
    finally:
        handle.remove()


@contextmanager
def recording_preactivations(replacement: nn.Module) -> Iterator[list[tuple[torch.Tensor, ...]]]:
    """Record the pre-activations of the sparse code of every forward pass (with gradients).

    Yields a list that receives, per forward pass, a tuple of tensors ``(rows, units_e)`` (one per
    expert mode): the normalised logits of an [`ExpertGate`][mumoe_tn.gates.modules.ExpertGate], or
    the input of any other code module.
    """
    module = _required_code_module(replacement, "train on its pre-activations (auxiliary-k loss)")
    records: list[tuple[torch.Tensor, ...]] = []
    handles = []
    if isinstance(module, ExpertGate):
        norms = list(module.norms.values())
        pending: list[torch.Tensor] = []

        def norm_hook(norm: nn.Module, args: tuple, output: torch.Tensor) -> None:
            pending.append(output)
            if len(pending) == len(norms):
                records.append(tuple(pending))
                pending.clear()

        handles = [norm.register_forward_hook(norm_hook) for norm in norms]
    else:

        def input_hook(module: nn.Module, args: tuple) -> None:
            records.append((args[0],))

        handles = [module.register_forward_pre_hook(input_hook)]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def substituted_code(replacement: nn.Module, code: Sequence[torch.Tensor]) -> Iterator[nn.Module]:
    """Within the block, ``replacement``'s forward passes use ``code`` as their sparse code.

    ``code`` holds one tensor per expert mode (one for a transcoder), shaped as the code module's
    output; the rest of the replacement (encoder, decoder, biases, skip) runs as usual.
    """
    module = _required_code_module(replacement, "substitute its code")
    code = tuple(code)

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        parts = _parts(output)
        if len(parts) != len(code) or any(p.shape != c.shape for p, c in zip(parts, code, strict=True)):
            raise ValueError(
                f"the substituted code has shapes {[tuple(c.shape) for c in code]}, the module's "
                f"{[tuple(p.shape) for p in parts]}"
            )
        return code if isinstance(output, (tuple, list)) else code[0]

    handle = module.register_forward_hook(hook)
    try:
        yield replacement
    finally:
        handle.remove()
