"""Records written from converted models and replayed on fresh ones.

[`convert`][mumoe_tn.conversion.convert.convert] describes what it built
([`extend_record`][mumoe_tn.conversion.persistence.replay.extend_record],
[`conversion_record`][mumoe_tn.conversion.persistence.replay.conversion_record]);
[`apply_conversion`][mumoe_tn.conversion.persistence.replay.apply_conversion] replays a
[`ConversionRecord`][mumoe_tn.conversion.persistence.record.ConversionRecord] on a fresh copy of the original
model — checked field by field by [`mumoe_tn.conversion.persistence.record`][mumoe_tn.conversion.persistence.record] and
held to the checkpoint's own tensors (``shapes=``) before anything is built — and
[`commit_conversion`][mumoe_tn.conversion.persistence.replay.commit_conversion] keeps what a replay built once
the weights have loaded.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.persistence.record import (
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
    shorten,
)
from mumoe_tn.conversion.persistence.record_checks import check_mask_argument, check_nested_paths, checkpoint_shapes
from mumoe_tn.conversion.surgery.adapters import linear_view
from mumoe_tn.conversion.surgery.block_kinds import block_kind
from mumoe_tn.conversion.surgery.blocks import mlp_parts
from mumoe_tn.conversion.surgery.building import Choice, build_block, install, join_path, uninstall
from mumoe_tn.layers import FactorizedExperts
from mumoe_tn.masking import install_mask_hook

__all__ = [
    "Rebuilt",
    "apply_conversion",
    "commit_conversion",
    "conversion_record",
    "extend_record",
    "replay_conversion",
]


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


def _describe(choice: Choice, new: nn.Module, layers: Mapping[str, FactorizedExperts]) -> ConvertedModule:
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


def extend_record(
    model: nn.Module, replaced: Sequence[tuple[Choice, nn.Module, dict]], mask_argument: str | None
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
        The record (from [`conversion_record`][mumoe_tn.conversion.persistence.replay.conversion_record], its
        ``to_dict()``, or its JSON).
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
Rebuilt = tuple[Choice, nn.Module, dict[str, FactorizedExperts]]


def replay_conversion(
    model: nn.Module,
    record: ConversionRecord | Mapping[str, Any] | str,
    *,
    shapes: Mapping[str, Any] | None = None,
) -> tuple[list[Rebuilt], ConversionRecord]:
    """The modules ``record`` puts into ``model``, built and checked but not installed (``model`` is unchanged).

    See [`apply_conversion`][mumoe_tn.conversion.persistence.replay.apply_conversion] for the arguments;
    [`commit_conversion`][mumoe_tn.conversion.persistence.replay.commit_conversion] installs the result.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    sized = None if shapes is None else checkpoint_shapes(shapes)
    record = ConversionRecord.from_dict(record)
    existing = conversion_record(model)
    if existing is not None and existing.modules:
        raise ValueError(
            f"the model is already converted ({len(existing.modules)} module(s), e.g. "
            f"{existing.modules[0].paths[0]!r}): apply a record to a fresh, unconverted copy of the model"
        )
    check_mask_argument(model, record.mask_argument)
    modules = dict(model.named_modules(remove_duplicate=False))
    choices = [_rebuild_choice(model, modules, entry, number) for number, entry in enumerate(record.modules)]
    check_nested_paths((path, number) for number, entry in enumerate(record.modules) for path in entry.paths)
    if sized is not None:
        _check_cores_held(record, sized)  # cheap, before any module is built on the meta device
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
    """Install [`replay_conversion`][mumoe_tn.conversion.persistence.replay.replay_conversion]'s modules, all or none.

    Installs every module, calls ``check(model)`` (e.g. checks and loads a checkpoint's weights),
    then writes the record and the mask hook. If installing or ``check`` raises, the old modules
    are put back and the error propagates: the model is as it was.
    """
    replaced: list[tuple[str, nn.Module]] = []
    try:
        for choice, new, _ in rebuilt:
            replaced.extend(install(model, choice, new))
        if check is not None:
            check(model)
        extend_record(model, rebuilt, record.mask_argument)
    except BaseException:
        uninstall(model, replaced)
        raise
    if record.mask_argument is not None:
        install_mask_hook(model, record.mask_argument)


def _check_cores_held(record: ConversionRecord, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every recorded core must be a tensor of the checkpoint, under one of its module's paths, with the core's shape.

    Linear in the checkpoint's keys and the record's cores: a record that does not fit the weights
    is refused before any module is built or planned.
    """
    layers: dict[str, dict[str, dict[str, tuple[int, ...]]]] = {}  # module prefix -> layer prefix -> core -> shape
    for key, shape in shapes.items():
        layer, _, core = str(key).rpartition(".")
        parts = layer.split(".")
        for depth in (1, 2):  # a layer sits in the block (``mlp.experts1``) or in its target (``output.decoder``)
            if len(parts) > depth:
                owner = ".".join(parts[:-depth])
                layers.setdefault(owner, {}).setdefault(layer, {})[core] = shape
    for number, entry in enumerate(record.modules):
        for role, data in entry.networks:
            sizes = data["sizes"]
            cores = {core: tuple(sizes[label] for label in labels) for core, labels in data["cores"]}
            candidates = [found for path in entry.paths for found in layers.get(path, {}).items()]
            if any(all(held.get(core) == shape for core, shape in cores.items()) for _, held in candidates):
                continue
            best = max(candidates, key=lambda item: _closeness(cores, item[1]), default=None)
            for core, shape in cores.items():
                if best is None or core not in best[1]:
                    raise ValueError(
                        shorten(
                            f"conversion record: record.modules[{number}] implies a {role!r} core {core!r} of shape "
                            f"{shape} under {entry.paths[0]!r}, which the checkpoint does not hold: the record does "
                            "not fit its weights"
                        )
                    )
                if best[1][core] != shape:
                    raise ValueError(
                        shorten(
                            f"conversion record: record.modules[{number}] implies {best[0] + '.' + core!r} of shape "
                            f"{shape}, the checkpoint holds {best[1][core]}: the record does not fit its weights"
                        )
                    )


def _closeness(cores: Mapping[str, tuple[int, ...]], held: Mapping[str, tuple[int, ...]]) -> tuple[int, int, int]:
    """How near the tensors ``held`` by one layer come to a recorded network's ``cores``: names, then equal sizes."""
    found = [(shape, held[core]) for core, shape in cores.items() if core in held]
    equal = sum(a == b for shape, stored in found for a, b in zip(shape, stored, strict=False))
    return len(found), sum(shape == stored for shape, stored in found), equal


def _check_shapes(choice: Choice, new: nn.Module, shapes: Mapping[str, tuple[int, ...]], number: int) -> None:
    """Every tensor of ``new`` must be in ``shapes`` (at one path of the module at least) with its shape."""
    target = "" if choice.parts is None else choice.parts.target
    for key, tensor in new.state_dict(keep_vars=True).items():
        names = [join_path(join_path(path, target), key) for path in choice.paths]
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


def _rebuild_choice(model: nn.Module, modules: Mapping[str, nn.Module], entry: ConvertedModule, number: int) -> Choice:
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
        raise ValueError(
            shorten(f"the conversion record has one module at {list(entry.paths)}; this model has several")
        )
    kind = block_kind(entry.kind)
    if not kind.mlp:
        view = linear_view(module)
        parts, layers = None, None if view is None else {"layer": view}
    else:
        parts = mlp_parts(module)
        layers = None if parts is None or parts.kind != kind else parts.layers
    if layers is None:
        raise ValueError(
            f"the conversion record replaced a {entry.kind!r} module at {entry.paths[0]!r}, but this model has a "
            f"{type(module).__name__} there that is not one"
        )
    return Choice(kind, module, layers, parts, list(entry.paths))


def _rebuild(
    choice: Choice, entry: ConvertedModule, device: torch.device | None = None
) -> tuple[nn.Module, dict[str, FactorizedExperts]]:
    """The μMoE module of a record entry, with the recorded networks (checked) and options."""
    path = entry.paths[0]
    # The recorded optimizer is a checked name, resolved only when the layer first plans.
    execution = {**execution_from_data(entry.execution), "lazy_optimizer": True}
    try:
        networks = {role: network_from_data(data) for role, data in entry.networks}
        gating = {"gate": gate_from_data(entry.gate), "gate_input": entry.gate_input, "input_norm": entry.input_norm}
        options = {**gating, **execution}
        first = next(iter(networks.values()))
        new, layers = build_block(choice, first.expert_dims, first, None, options, device=device)
    except (ValueError, TypeError) as error:
        raise ValueError(shorten(f"the conversion record does not fit the model at {path!r}: {error}")) from error
    for role, network in networks.items():
        built = layers.get(role)
        if built is None or built.network != network:
            found = None if built is None else built.network
            raise ValueError(
                shorten(
                    f"the conversion record does not fit the model at {path!r}: its {role!r} layer is recorded as "
                    f"{network!r}, the model gives {found!r}"
                )
            )
    return new, layers
