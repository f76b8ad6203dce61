"""The conversion of a model as plain data: which modules became which μMoE layers, saved with checkpoints.

[`convert`][mumoe_tn.conversion.convert.convert] writes a
[`ConversionRecord`][mumoe_tn.conversion.record.ConversionRecord]
for every model it changes: for each replaced module its paths, its kind, the expert network of every
factorized layer (cores, labels, sizes and format name), the gate descriptor and the execution
options. It is JSON-able data — for a Hugging Face model it lives in ``model.config`` under
``"mumoe_conversion"`` and so travels in ``config.json`` — and
[`apply_conversion`][mumoe_tn.conversion.convert.apply_conversion] replays it on a fresh copy of the original
model, after which the checkpoint's state dict loads as it is (see
[`mumoe_tn.conversion.checkpoints`][mumoe_tn.conversion.checkpoints]).

Nothing in a record is executed: a gate descriptor is rebuilt only from a class that is already
imported (mumoe_tn's own, or one the user's code imported), and a format only from the registry.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mumoe_tn.decompositions import available, get_format
from mumoe_tn.network import ExpertNetwork

__all__ = [
    "RECORD_KEY",
    "ConversionRecord",
    "ConvertedModule",
    "gate_from_data",
    "gate_to_data",
    "network_from_data",
    "network_to_data",
]

#: Where a record lives: the attribute of a converted model, the key in a Hugging Face config and in
#: the metadata of a safetensors file.
RECORD_KEY = "mumoe_conversion"

#: Version of the record's layout; a reader refuses records of a later version.
RECORD_VERSION = 1

#: The modules of the library whose gate descriptor classes a record may name without their being imported.
_LIBRARY = "mumoe_tn."

#: Execution options of a factorized layer a record carries (name -> accepted JSON types).
EXECUTION_OPTIONS = ("optimize", "max_plans", "chunk_size", "recompute", "precontract", "pad_bonds")


def network_to_data(network: ExpertNetwork) -> dict[str, Any]:
    """An expert network as JSON-able data: name, format name, cores with their labels, label sizes."""
    return {
        "name": network.name,
        "format": None if network.format is None else network.format.name,
        # pairs, not a mapping: core order fixes the contraction's operand order, and JSON writers sort keys
        "cores": [[core, list(labels)] for core, labels in network.cores.items()],
        "sizes": dict(network.sizes),
    }


def network_from_data(data: Mapping[str, Any]) -> ExpertNetwork:
    """The expert network described by [`network_to_data`][mumoe_tn.conversion.record.network_to_data]'s output.

    Raises
    ------
    ValueError
        If the data is malformed or names a format that is not registered in this process.
    """
    if not isinstance(data, Mapping) or not {"cores", "sizes"} <= set(data):
        raise ValueError(f"an expert network record needs 'cores' and 'sizes', got {data!r}")
    fmt = data.get("format")
    if fmt is not None and fmt not in available():
        raise ValueError(
            f"the record's network follows the format {fmt!r}, which is not registered in this process: "
            f"import the code that registers it first (registered: {available()})"
        )
    cores = data["cores"]
    if not isinstance(cores, Sequence) or not all(isinstance(pair, Sequence) and len(pair) == 2 for pair in cores):
        raise ValueError(f"an expert network record lists its cores as [name, labels] pairs, got {cores!r}")
    return ExpertNetwork(
        {core: tuple(labels) for core, labels in cores},
        dict(data["sizes"]),
        name=data.get("name"),
        format=None if fmt is None else get_format(fmt),
    )


def gate_to_data(spec: object) -> dict[str, Any]:
    """A gate descriptor as data: its class's qualified name and its dataclass fields.

    Raises
    ------
    TypeError
        If ``spec`` is not a dataclass instance with JSON-able fields.
    """
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        raise TypeError(
            f"the gate descriptor {spec!r} is not a dataclass, so a checkpoint cannot record it: write it as a "
            "frozen dataclass (like mumoe_tn.Gate) to save and reload converted models"
        )
    fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec) if field.init}
    data = {"class": f"{type(spec).__module__}.{type(spec).__qualname__}", "fields": fields}
    try:
        json.dumps(data)
    except TypeError as error:
        raise TypeError(f"the gate descriptor {spec!r} has fields that are not JSON-able ({error})") from None
    return data


def gate_from_data(data: Mapping[str, Any]) -> object:
    """The gate descriptor described by [`gate_to_data`][mumoe_tn.conversion.record.gate_to_data]'s output.

    A class of mumoe_tn is imported if needed; any other class must already be imported (a record
    never imports code of its own accord).
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("class"), str) or "fields" not in data:
        raise ValueError(f"a gate record needs 'class' and 'fields', got {data!r}")
    module_name, _, qualname = data["class"].rpartition(".")
    module = sys.modules.get(module_name)
    if module is None and (module_name + ".").startswith(_LIBRARY):
        module = importlib.import_module(module_name)
    cls = None if module is None else getattr(module, qualname, None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise ValueError(
            f"the record's gate descriptor class {data['class']!r} is not available: import the module that "
            "defines it before loading the checkpoint"
        )
    fields = {key: tuple(value) if isinstance(value, list) else value for key, value in data["fields"].items()}
    return cls(**fields)


@dataclass(frozen=True)
class ConvertedModule:
    """One module of a model that conversion replaced.

    Attributes
    ----------
    paths : tuple of str
        Every qualified name the replaced module sat at (a shared module has several).
    kind : {"linear", "mlp", "gated", "split"}
        What was replaced (see [`Replacement`][mumoe_tn.conversion.convert.Replacement]).
    networks : tuple of (str, dict)
        ``(role, network)`` for every factorized layer in the block's order (``"layer"``; ``"up"``,
        ``"down"``; ``"gate"``, ``"up"``, ``"down"``), each network as data.
    gate : dict
        The gate descriptor, as data.
    gate_input : str
        What the gate reads (``"normed"`` or ``"raw"``).
    input_norm : bool
        Whether the block has an input LayerNorm.
    execution : dict
        The factorized layers' execution options (optimizer name, plan cache, chunks, padding).
    """

    paths: tuple[str, ...]
    kind: str
    networks: tuple[tuple[str, dict[str, Any]], ...]
    gate: dict[str, Any]
    gate_input: str
    input_norm: bool
    execution: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able data."""
        data = dataclasses.asdict(self)
        return {**data, "paths": list(self.paths), "networks": [[role, net] for role, net in self.networks]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConvertedModule:
        """Read the output of [`to_dict`][mumoe_tn.conversion.record.ConvertedModule.to_dict]."""
        names = {field.name for field in dataclasses.fields(cls)}
        if not isinstance(data, Mapping) or set(data) != names:
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"a converted-module record has the keys {sorted(names)}, got {got}")
        networks = data["networks"]
        if not isinstance(networks, Sequence) or not all(isinstance(p, Sequence) and len(p) == 2 for p in networks):
            raise ValueError(f"a converted-module record lists its networks as [role, network] pairs, got {networks!r}")
        return cls(**{**data, "paths": tuple(data["paths"]), "networks": tuple((r, n) for r, n in networks)})


@dataclass(frozen=True)
class ConversionRecord:
    """Every module conversion replaced in a model, in the order it replaced them.

    Replay it on a fresh copy of the original model with
    [`apply_conversion`][mumoe_tn.conversion.convert.apply_conversion]; read it from a model with
    [`conversion_record`][mumoe_tn.conversion.convert.conversion_record].
    """

    modules: tuple[ConvertedModule, ...] = ()
    #: The argument of the model's ``forward`` that carries its token mask (see
    #: [`mumoe_tn.masking`][mumoe_tn.masking]), or None.
    mask_argument: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able data (what ``config.json`` and safetensors metadata hold)."""
        return {
            "version": RECORD_VERSION,
            "modules": [module.to_dict() for module in self.modules],
            "mask_argument": self.mask_argument,
        }

    def to_json(self) -> str:
        """The record as a JSON string."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConversionRecord:
        """Read the output of [`to_dict`][mumoe_tn.conversion.record.ConversionRecord.to_dict].

        Raises
        ------
        ValueError
            If ``data`` is not a record or comes from a later version of the library.
        """
        if isinstance(data, ConversionRecord):
            return data
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as error:
                raise ValueError(f"a conversion record string must be JSON ({error})") from None
        if not isinstance(data, Mapping) or not isinstance(data.get("modules"), Sequence):
            raise ValueError(f"a conversion record is a mapping with 'version' and 'modules', got {data!r:.200}")
        version = data.get("version")
        if not isinstance(version, int) or version > RECORD_VERSION:
            raise ValueError(
                f"the conversion record has version {version!r}; this mumoe_tn reads versions up to "
                f"{RECORD_VERSION}: upgrade mumoe_tn"
            )
        mask_argument = data.get("mask_argument")
        if mask_argument is not None and not isinstance(mask_argument, str):
            raise ValueError(f"a conversion record's mask_argument is a name or null, got {mask_argument!r}")
        return cls(tuple(ConvertedModule.from_dict(module) for module in data["modules"]), mask_argument)

    def __add__(self, other: ConversionRecord) -> ConversionRecord:
        return ConversionRecord(self.modules + other.modules, other.mask_argument or self.mask_argument)
