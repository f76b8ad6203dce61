"""The conversion of a model as plain data: which modules became which μMoE layers, saved with checkpoints.

[`convert`][mumoe_tn.conversion.convert.convert] writes a
[`ConversionRecord`][mumoe_tn.conversion.persistence.record.ConversionRecord]
for every model it changes: for each replaced module its paths, its kind, the expert network of every
factorized layer (cores, labels, sizes and format name), the gate descriptor and the execution
options. It is JSON-able data — for a Hugging Face model it lives in ``model.config`` under
``"mumoe_conversion"`` and so travels in ``config.json`` — and
[`apply_conversion`][mumoe_tn.conversion.persistence.replay.apply_conversion] replays it on a fresh copy of the original
model, after which the checkpoint's state dict loads as it is (see
[`mumoe_tn.conversion.persistence.checkpoints`][mumoe_tn.conversion.persistence.checkpoints]).

Nothing in a record is code. A record is read as a checkpoint is: every field is checked against
its rule before anything is built, and a field that breaks one gets a ``ValueError`` naming the
field and quoting its value. A gate descriptor is rebuilt only from a class in the allow-list of
[`mumoe_tn.gates.registry`][mumoe_tn.gates.registry], looked up by name without importing anything,
and only from fields the class declares; a format only from the format registry; execution
options are names and numbers checked against their rules (the recorded path optimizer runs
when the layer first plans, never while loading, and only within the effort bound of
``mumoe_tn.contractions.effort``: beyond it the plan is greedy's and its note says why). Sizes
are bounded here only by their rule; how large a record's layers may be is checked against the
checkpoint's own tensors by [`apply_conversion`][mumoe_tn.conversion.persistence.replay.apply_conversion]
(``shapes=``) before any tensor is made.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mumoe_tn.contractions.plan import OPTIMIZERS
from mumoe_tn.conversion.persistence.bounds import (
    EXECUTION_OPTIONS,
    MAX_CORE_ELEMENTS,
    MAX_GATE_LIST,
    MAX_GATE_STRING,
    MAX_MASK_ARGUMENT_CHARS,
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    MAX_NETWORK_WORK,
    MAX_RECORD_CORES,
    MAX_RECORD_MODULES,
    MAX_RECORD_PAD,
    MAX_RECORD_PATHS,
    MAX_RECORD_PLANS,
    MAX_RECORD_SIZE,
    RECORD_VERSION,
)
from mumoe_tn.conversion.surgery.block_kinds import BLOCK_KINDS, block_kind
from mumoe_tn.decompositions import available, get_format
from mumoe_tn.gates.registry import gate_class, gate_class_name, registered_gates
from mumoe_tn.layers import GATE_INPUTS
from mumoe_tn.network import ExpertNetwork

__all__ = [
    "RECORD_KEY",
    "ConversionRecord",
    "ConvertedModule",
    "gate_from_data",
    "gate_to_data",
    "network_from_data",
    "network_to_data",
    "record_in_config",
]

#: Where a record lives: the attribute of a converted model, the key in a Hugging Face config and in
#: the metadata of a safetensors file.
RECORD_KEY = "mumoe_conversion"

#: The ``quant_method`` of a converted Hugging Face model's ``quantization_config``: it selects
#: mumoe_tn's ``from_pretrained`` hook (see
#: [`mumoe_tn.conversion.persistence.quantizer`][mumoe_tn.conversion.persistence.quantizer]).
QUANT_METHOD = "mumoe_tn"


#: The roles of a block whose encoders stay dense (a Mixture of Decoders): its decoder alone.
DECODER_ROLES = ("down",)

_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 80, 80, 6, 6, 3


def _quote(value: object) -> str:
    """``repr(value)``, shortened (a record can be large)."""
    return _short.repr(value)


def shorten(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text``, its middle elided when it is longer than ``limit`` characters."""
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def invalid(field: str, value: object, rule: str) -> ValueError:
    """The error for a record field that breaks its rule: names the field, quotes the value, states the rule.

    The message is at most [`MAX_MESSAGE_CHARS`][mumoe_tn.conversion.persistence.bounds.MAX_MESSAGE_CHARS] long,
    whatever the record holds.
    """
    return ValueError(shorten(f"conversion record: {shorten(field, 200)} = {_quote(value)} is invalid: {rule}"))


def _mapping(
    field: str, value: object, *, required: Sequence[str] = (), allowed: Sequence[str] | None = None
) -> Mapping:
    if not isinstance(value, Mapping):
        raise invalid(field, value, "it must be a mapping")
    if not all(isinstance(key, str) for key in value):
        raise invalid(field, value, "its keys must be strings")
    missing = [key for key in required if key not in value]
    if missing:
        raise invalid(field, value, f"it lacks the key(s) {missing}")
    if allowed is not None:
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise invalid(f"{field}[{unknown[0]!r}]", value[unknown[0]], f"the keys of {field} are {list(allowed)}")
    return value


def _list(field: str, value: object, *, length: int | None = None, limit: int | None = None) -> Sequence:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise invalid(field, value, "it must be a list")
    if length is not None and len(value) != length:
        raise invalid(field, value, f"it must have {length} entries")
    if limit is not None and len(value) > limit:
        raise invalid(field, f"<{len(value)} entries>", f"it may have at most {limit} entries")
    return value


def _name(field: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(field, value, "it must be a non-empty string")
    if len(value) > MAX_NAME_CHARS:
        raise invalid(field, value, f"a name may have at most {MAX_NAME_CHARS} characters")
    return value


def _int(field: str, value: object, *, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f" and at most {high:,}" if high is not None else ""
        raise invalid(field, value, f"it must be an int of at least {low}{bound}")
    return value


def parse_json(text: str | bytes, what: str) -> Any:
    """``json.loads(text)``, with the library's error for text that is not JSON (or nests too deeply)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"the {what} is not valid JSON ({type(error).__name__}: {_quote(str(error))})") from None


def network_to_data(network: ExpertNetwork) -> dict[str, Any]:
    """An expert network as JSON-able data: name, format name, cores with their labels, label sizes."""
    return {
        "name": network.name,
        "format": None if network.format is None else network.format.name,
        # pairs, not a mapping: core order fixes the contraction's operand order, and JSON writers sort keys
        "cores": [[core, list(labels)] for core, labels in network.cores.items()],
        "sizes": dict(network.sizes),
    }


def network_from_data(data: Mapping[str, Any], field: str = "network") -> ExpertNetwork:
    """The expert network that [`network_to_data`][mumoe_tn.conversion.persistence.record.network_to_data] wrote.

    Parameters
    ----------
    data : Mapping
        The network as data.
    field : str, optional
        Where ``data`` sits in the record (quoted in errors).

    Raises
    ------
    ValueError
        If the data is malformed (at most [`MAX_RECORD_CORES`][mumoe_tn.conversion.persistence.bounds.MAX_RECORD_CORES]
        cores, sizes positive ints up to 2**40) or names a format that is not registered in this process.
    """
    _mapping(field, data, required=("cores", "sizes"), allowed=("name", "format", "cores", "sizes"))
    fmt = data.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in available()):
        raise invalid(
            f"{field}.format",
            fmt,
            f"it names no format registered in this process: import the code that registers it first "
            f"(registered: {available()})",
        )
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"{field}.name", name, "it must be a string or null")
    cores = _list(f"{field}.cores", data["cores"], limit=MAX_RECORD_CORES)
    parsed: dict[str, tuple[str, ...]] = {}
    for number, pair in enumerate(cores):
        where = f"{field}.cores[{number}]"
        core, labels = _list(where, pair, length=2)
        _name(f"{where}[0]", core)
        if core in parsed:
            raise invalid(f"{where}[0]", core, "a core name may appear once")
        labels = _list(f"{where}[1]", labels, limit=MAX_RECORD_CORES + 8)
        for position, label in enumerate(labels):
            _name(f"{where}[1][{position}]", label)
        parsed[core] = tuple(labels)
    sizes = _mapping(f"{field}.sizes", data["sizes"])
    if len(sizes) > sum(len(labels) for labels in parsed.values()):
        raise invalid(f"{field}.sizes", f"<{len(sizes)} labels>", "it gives sizes for labels no core has")
    for label, size in sizes.items():
        _int(f"{field}.sizes[{_quote(label)}]", size, high=MAX_RECORD_SIZE)
    _check_network_work(field, parsed)
    for number, (core, labels) in enumerate(parsed.items()):
        elements = 1
        for label in labels:
            elements *= sizes.get(label, 1)
            if elements > MAX_CORE_ELEMENTS:
                raise invalid(
                    f"{field}.cores[{number}]",
                    [core, list(labels)],
                    f"its sizes give it more than {MAX_CORE_ELEMENTS:,} elements (2**59), more than any device holds",
                )
    try:
        return ExpertNetwork(parsed, dict(sizes), name=name, format=None if fmt is None else get_format(fmt))
    except (TypeError, ValueError) as error:
        raise invalid(field, data, f"it is not a valid expert network ({shorten(str(error), 400)})") from None


def _check_network_work(field: str, cores: Mapping[str, tuple[str, ...]]) -> None:
    """A recorded network's cores × labels × largest hyperedge degree must be within ``MAX_NETWORK_WORK``."""
    owners: dict[str, int] = {}
    for labels in cores.values():
        for label in set(labels):
            owners[label] = owners.get(label, 0) + 1
    degree = max(owners.values(), default=0)
    work = len(cores) * len(owners) * degree
    if work > MAX_NETWORK_WORK:
        raise invalid(
            f"{field}.cores",
            f"<{len(cores)} cores, {len(owners)} labels, a label joining {degree} cores>",
            f"cores × labels × the most cores a label joins is {work:,}, above the bound {MAX_NETWORK_WORK:,} (2**19) "
            "a checkpoint's network may ask of the checks and the planner",
        )


def gate_to_data(spec: object) -> dict[str, Any]:
    """A gate descriptor as data: its class's qualified name and its dataclass fields.

    Raises
    ------
    TypeError
        If ``spec`` is not an instance of a registered gate descriptor class (see
        [`register_gate`][mumoe_tn.gates.registry.register_gate]) with JSON-able fields.
    """
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        raise TypeError(
            f"the gate descriptor {spec!r} is not a dataclass, so a checkpoint cannot record it: write it as a "
            "frozen dataclass (like mumoe_tn.Gate) and register it with mumoe_tn.register_gate to save and reload "
            "converted models"
        )
    name = gate_class_name(type(spec))
    if gate_class(name) is not type(spec):
        raise TypeError(
            f"the gate descriptor class {name} is not registered, so a checkpoint could not rebuild it: register it "
            "with mumoe_tn.register_gate (as a format registers) to save and reload converted models"
        )
    fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec) if field.init}
    data = {"class": name, "fields": fields}
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"the gate descriptor {spec!r} has fields that are not JSON-able ({error})") from None
    return data


def _gate_value(field: str, value: object, *, nested: bool = False) -> object:
    """A JSON scalar, or a short list of them (as a tuple)."""
    if isinstance(value, str) and len(value) > MAX_GATE_STRING:
        raise invalid(field, value, f"a gate field's string has at most {MAX_GATE_STRING} characters")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise invalid(field, value, "a gate field's number must be finite")
        return value
    if not nested and isinstance(value, Sequence) and not isinstance(value, bytes):
        items = _list(field, value, limit=MAX_GATE_LIST)
        return tuple(_gate_value(f"{field}[{position}]", item, nested=True) for position, item in enumerate(items))
    raise invalid(field, value, "a gate field is a string, a number, a bool, null or a list of those")


def gate_from_data(data: Mapping[str, Any], field: str = "gate") -> object:
    """The gate descriptor described by [`gate_to_data`][mumoe_tn.conversion.persistence.record.gate_to_data]'s output.

    The class must be registered (see [`register_gate`][mumoe_tn.gates.registry.register_gate]): it is
    looked up by name in the allow-list, nothing is imported, and it is constructed only with the
    fields it declares, each a JSON value.

    Raises
    ------
    ValueError
        If the class is not registered, a field is unknown or not a plain value, or the class
        refuses the values.
    """
    _mapping(field, data, required=("class", "fields"), allowed=("class", "fields"))
    name = _name(f"{field}.class", data["class"])
    cls = gate_class(name)
    if cls is None:
        raise invalid(
            f"{field}.class",
            name,
            "it is not a registered gate descriptor class: import the module that defines it and register it with "
            f"mumoe_tn.register_gate before loading (registered: {registered_gates()})",
        )
    declared = [item.name for item in dataclasses.fields(cls) if item.init]
    fields = _mapping(f"{field}.fields", data["fields"], allowed=declared)
    values = {key: _gate_value(f"{field}.fields[{key!r}]", value) for key, value in fields.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise invalid(f"{field}.fields", dict(fields), f"{name} refuses them ({shorten(str(error), 400)})") from None


def execution_from_data(data: Mapping[str, Any], field: str = "execution") -> dict[str, Any]:
    """The execution options of a record entry, each checked against its rule (nothing is resolved or planned).

    Raises
    ------
    ValueError
        If an option is unknown or its value breaks its rule.
    """
    _mapping(field, data, allowed=EXECUTION_OPTIONS)
    checked: dict[str, Any] = {}
    for option, value in data.items():
        where = f"{field}[{option!r}]"
        if option == "optimize":
            if not isinstance(value, str) or value not in OPTIMIZERS:
                raise invalid(where, value, f"it must be one of the optimizer names {list(OPTIMIZERS)}")
        elif option in ("recompute", "precontract"):
            if not isinstance(value, bool):
                raise invalid(where, value, "it must be true or false")
        elif option == "max_plans":
            _int(where, value, high=MAX_RECORD_PLANS)
        elif option == "pad_bonds" and value is not None:
            _int(where, value, high=MAX_RECORD_PAD)
        elif value is not None:  # chunk_size: rows per chunk, any number
            _int(where, value, high=MAX_RECORD_SIZE)
        checked[option] = value
    return checked


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
    def from_dict(cls, data: Mapping[str, Any], field: str = "module") -> ConvertedModule:
        """Read [`to_dict`][mumoe_tn.conversion.persistence.record.ConvertedModule.to_dict]'s output, fields checked.

        Raises
        ------
        ValueError
            Naming the first field that breaks its rule, with its value.
        """
        names = [item.name for item in dataclasses.fields(cls)]
        _mapping(field, data, required=names, allowed=names)
        paths = _list(f"{field}.paths", data["paths"], limit=MAX_RECORD_PATHS)
        if not paths:
            raise invalid(f"{field}.paths", paths, "a module sits at one path at least")
        for number, path in enumerate(paths):
            where = f"{field}.paths[{number}]"
            if not isinstance(path, str) or not path or not all(path.split(".")):
                raise invalid(where, path, "a path is a module's qualified name: non-empty parts joined by '.'")
            _name(where, path)
        if len(set(paths)) != len(paths):
            raise invalid(f"{field}.paths", paths, "a path may appear once")
        kind = data["kind"]
        if not isinstance(kind, str) or kind not in BLOCK_KINDS:
            raise invalid(f"{field}.kind", kind, f"it must be one of {BLOCK_KINDS.names()}")
        registered = block_kind(kind)
        networks = _list(f"{field}.networks", data["networks"], limit=len(registered.roles))
        # Every layer of the block factorized, or (a Mixture of Decoders) only its decoder.
        choices = [registered.roles] + ([DECODER_ROLES] if registered.mlp else [])
        roles = next((each for each in choices if len(each) == len(networks)), None)
        if roles is None:
            raise invalid(f"{field}.networks", networks, f"a {kind!r} module records the roles {choices}")
        pairs = []
        for number, (role, expected) in enumerate(zip(networks, roles, strict=True)):
            role_name, network = _list(f"{field}.networks[{number}]", role, length=2)
            if role_name != expected:
                raise invalid(
                    f"{field}.networks[{number}][0]", role_name, f"a {kind!r} module records the roles {choices}"
                )
            network_from_data(network, f"{field}.networks[{number}][1]")
            pairs.append((role_name, dict(network)))
        gate_from_data(data["gate"], f"{field}.gate")
        if data["gate_input"] not in GATE_INPUTS or not isinstance(data["gate_input"], str):
            raise invalid(f"{field}.gate_input", data["gate_input"], f"it must be one of {list(GATE_INPUTS)}")
        if not isinstance(data["input_norm"], bool):
            raise invalid(f"{field}.input_norm", data["input_norm"], "it must be true or false")
        execution = execution_from_data(data["execution"], f"{field}.execution")
        return cls(
            paths=tuple(paths),
            kind=kind,
            networks=tuple(pairs),
            gate=dict(data["gate"]),
            gate_input=data["gate_input"],
            input_norm=data["input_norm"],
            execution=execution,
        )


@dataclass(frozen=True)
class ConversionRecord:
    """Every module conversion replaced in a model, in the order it replaced them.

    Replay it on a fresh copy of the original model with
    [`apply_conversion`][mumoe_tn.conversion.persistence.replay.apply_conversion]; read it from a model with
    [`conversion_record`][mumoe_tn.conversion.persistence.replay.conversion_record].
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
        """Read the output of [`to_dict`][mumoe_tn.conversion.persistence.record.ConversionRecord.to_dict].

        Raises
        ------
        ValueError
            If ``data`` is not a record or comes from a later version of the library.
        """
        if isinstance(data, ConversionRecord):
            return data
        if isinstance(data, (str, bytes)):
            data = parse_json(data, "conversion record")
        _mapping("record", data, required=("version", "modules"), allowed=("version", "modules", "mask_argument"))
        version = data["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise invalid("record.version", version, "a record's version is a positive int")
        if version > RECORD_VERSION:
            raise ValueError(
                f"conversion record: record.version = {version!r}: this mumoe_tn reads versions up to "
                f"{RECORD_VERSION}: upgrade mumoe_tn"
            )
        mask_argument = data.get("mask_argument")
        if mask_argument is not None and (
            not isinstance(mask_argument, str)
            or not mask_argument.isidentifier()
            or len(mask_argument) > MAX_MASK_ARGUMENT_CHARS
        ):
            raise invalid("record.mask_argument", mask_argument, "it is the name of an argument of forward, or null")
        modules = _list("record.modules", data["modules"], limit=MAX_RECORD_MODULES)
        parsed = []
        seen: dict[str, int] = {}
        for number, data in enumerate(modules):  # a repeated path is refused as soon as it is read
            module = ConvertedModule.from_dict(data, f"record.modules[{number}]")
            for path in module.paths:
                if path in seen:
                    raise invalid(
                        f"record.modules[{number}].paths", path, f"record.modules[{seen[path]}] already replaces it"
                    )
                seen[path] = number
            parsed.append(module)
        return cls(tuple(parsed), mask_argument)

    def __add__(self, other: ConversionRecord) -> ConversionRecord:
        return ConversionRecord(self.modules + other.modules, other.mask_argument or self.mask_argument)


# ----------------------------------------------------------------------------- records in checkpoint files
def record_in_config(config: Mapping[str, Any]) -> ConversionRecord | None:
    """The conversion record a Hugging Face ``config.json`` carries, every field checked (None: it has none).

    The config's ``quantization_config``, when present, must be the one that selects mumoe_tn's
    ``from_pretrained`` hook (see
    [`mumoe_tn.conversion.persistence.quantizer`][mumoe_tn.conversion.persistence.quantizer]).

    Raises
    ------
    ValueError
        If a field of the record breaks its rule, or the quantization config is another.
    """
    data = config.get(RECORD_KEY)
    if data is None:
        return None
    record = ConversionRecord.from_dict(data)
    quantization = config.get("quantization_config")
    if quantization is not None and quantization != {"quant_method": QUANT_METHOD}:
        raise ValueError(
            f"config.json: quantization_config = {quantization!r:.120} is invalid: a converted checkpoint has "
            f"{{'quant_method': {QUANT_METHOD!r}}}"
        )
    return record
