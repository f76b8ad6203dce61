"""A converted checkpoint's ``config.json``, checked field by field against the weights it will receive.

transformers builds the model its config describes, then loads the weights into it: a config that
declares 20,000 layers, a vocabulary of 16 M, ten million labels or an attention kernel from the
Hub costs minutes, gigabytes or an import before the weights are found not to fit, and a name it
does not know ends in a raw ``KeyError`` deep inside transformers. Every check here reads only the
config and the weights' headers (shapes, never data), and runs before transformers builds the model
[`load_converted`][mumoe_tn.conversion.persistence.checkpoints.load_converted] hands it:

- [`check_config_fields`][mumoe_tn.conversion.persistence.config_checks.check_config_fields], the config alone:
  at most [`MAX_CONFIG_FIELDS`][mumoe_tn.conversion.persistence.bounds.MAX_CONFIG_FIELDS] top-level fields and
  [`MAX_CONFIG_VALUES`][mumoe_tn.conversion.persistence.bounds.MAX_CONFIG_VALUES] values nested in them (the conversion
  record has its own bounds); ``dtype`` one of [`DTYPES`][mumoe_tn.conversion.persistence.bounds.DTYPES]; label
  maps of at most [`MAX_LABELS`][mumoe_tn.conversion.persistence.bounds.MAX_LABELS] entries that agree with
  ``num_labels`` and with each other; ``attn_implementation`` / ``experts_implementation`` one of
  transformers' built-in implementations (never a Hub kernel repository); activations in
  transformers' ``ACT2FN``; RoPE types in ``ROPE_INIT_FUNCTIONS``; head counts positive, the hidden
  size divisible by the heads and the heads by the key-value heads; layer counts and widths
  non-negative ints.
- [`check_config_widths`][mumoe_tn.conversion.persistence.config_checks.check_config_widths], against the
  headers: no width above the largest stored dimension (of a tensor holding elements).
- [`check_config_layout`][mumoe_tn.conversion.persistence.config_checks.check_config_layout], against the
  headers and the model class: the class is built on the meta device with one layer (and with two,
  to find its layer lists — ``transformer.h``, ``model.layers``…); every tensor it would receive
  must have the shape the checkpoint stores, every layer ``0 … n-1`` the config's count implies must
  have weights in the class's own layer list, and no weight of that list may have an index of ``n``
  or more.

On stock ``from_pretrained`` the hook of
[`mumoe_tn.conversion.persistence.quantizer`][mumoe_tn.conversion.persistence.quantizer]
runs the field checks when transformers asks for a quantizer and the width and layout checks when
transformers has found the weight files, both before it builds the model. Every refusal is a
``ValueError`` of at most [`MAX_MESSAGE_CHARS`][mumoe_tn.conversion.persistence.bounds.MAX_MESSAGE_CHARS] characters
naming the field and quoting the value; lists of keys show at most
[`MAX_LISTED_KEYS`][mumoe_tn.conversion.persistence.bounds.MAX_LISTED_KEYS] of them.
"""

from __future__ import annotations

import copy
import reprlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mumoe_tn.conversion.persistence.bounds import (
    DTYPES,
    MAX_CONFIG_FIELDS,
    MAX_CONFIG_VALUES,
    MAX_LABEL_CHARS,
    MAX_LABEL_ID_DIGITS,
    MAX_LABELS,
    MAX_LAYER_INDEX_DIGITS,
    MAX_LISTED_KEYS,
    MAX_UNSTORED_POSITIONS,
)
from mumoe_tn.conversion.persistence.record import RECORD_KEY, shorten

__all__ = [
    "ACTIVATION_FIELDS",
    "ATTENTION_FIELDS",
    "HEAD_FIELDS",
    "HIDDEN_FIELDS",
    "LAYER_COUNTS",
    "ROPE_FIELDS",
    "WIDTHS",
    "ModelLayout",
    "check_config_fields",
    "check_config_layout",
    "check_config_widths",
    "config_fields",
    "listed",
    "model_layout",
]

#: Config fields that count layers.
LAYER_COUNTS = ("n_layer", "num_hidden_layers", "num_layers", "n_layers", "num_decoder_layers")
#: Config fields that size a dimension of some tensor.
WIDTHS = (
    "vocab_size", "hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "n_positions",
    "max_position_embeddings", "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "d_ff",
)  # fmt: skip
#: Config fields that name an attention or experts implementation.
ATTENTION_FIELDS = ("attn_implementation", "experts_implementation")
#: Config fields that name an activation (``hidden_activation`` may be null).
ACTIVATION_FIELDS = ("hidden_act", "activation_function", "hidden_activation")
#: Config fields that hold RoPE parameters.
ROPE_FIELDS = ("rope_scaling", "rope_parameters")
#: Config fields that count attention heads, and the hidden sizes they divide.
HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads")
HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model")
#: Fields that give a head's width themselves (the hidden size then need not divide by the heads).
_HEAD_WIDTHS = ("head_dim", "d_kv")
#: A config object's own names for fields ``config.json`` spells otherwise.
_OBJECT_NAMES = {
    "_attn_implementation_internal": "attn_implementation",
    "_experts_implementation_internal": "experts_implementation",
}

_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 80, 80, 6, 6, 3


def _refuse(field: str, value: object, rule: str) -> ValueError:
    return ValueError(shorten(f"config.json: {shorten(field, 200)} = {_short.repr(value)} is invalid: {rule}"))


def listed(keys: Iterable[object], limit: int = MAX_LISTED_KEYS) -> str:
    """At most ``limit`` of ``keys`` (each shortened), then how many more there are."""
    shown, more = [], 0
    for key in keys:
        if len(shown) < limit:
            shown.append(shorten(key, 200) if isinstance(key, str) else key)
        else:
            more += 1
    return f"{shown}" + (f" and {more:,} more" if more else "")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def config_fields(config: Any) -> dict[str, Any]:
    """The fields of a config as ``config.json`` names them: a mapping's items, or a config object's attributes."""
    if isinstance(config, Mapping):
        return dict(config)
    fields = {_OBJECT_NAMES.get(name, name): value for name, value in vars(config).items()}
    return {name: value for name, value in fields.items() if not name.startswith("_")}


# ----------------------------------------------------------------------------- the config alone
def check_config_fields(config: Any, *, default_rope_type: str = "default") -> None:
    """Check every field of a config that needs no weights (see the module's docstring).

    Parameters
    ----------
    config : Mapping or PretrainedConfig
        The parsed ``config.json``, or the config object transformers made from it.
    default_rope_type : str, optional
        The RoPE type the model's config class uses by default (allowed besides transformers' own).

    Raises
    ------
    ValueError
        Naming the first field that breaks its rule.
    """
    fields = config_fields(config)
    _check_labels(fields)  # first: on the stock path transformers has made a label map of num_labels entries
    _check_entries(fields)
    for name in ("dtype", "torch_dtype"):
        value = fields.get(name)
        if type(value).__name__ == "dtype" and type(value).__module__ == "torch":  # a config object's own
            value = str(value).removeprefix("torch.")
        if value is not None and not (isinstance(value, str) and value in DTYPES):
            raise _refuse(name, value, f"a converted checkpoint's dtype is null or one of {list(DTYPES)}")
    for name in (*LAYER_COUNTS, *WIDTHS):
        value = fields.get(name)
        if value is not None and (not _is_count(value) or value < 0):
            raise _refuse(name, value, "a layer count or size is a non-negative int")
    _check_names_and_heads(fields, "", default_rope_type)


def _check_entries(fields: Mapping[str, Any]) -> None:
    if len(fields) > MAX_CONFIG_FIELDS:
        raise _refuse("<fields>", f"<{len(fields):,} fields>", f"a config has at most {MAX_CONFIG_FIELDS:,} fields")
    count = 0
    pending = [value for name, value in fields.items() if name != RECORD_KEY]
    while pending:  # no recursion: a deep value cannot exhaust the stack
        value = pending.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise _refuse(
                "<values>", f"<more than {MAX_CONFIG_VALUES:,} values>",
                f"a config's fields hold at most {MAX_CONFIG_VALUES:,} values together (the conversion record apart)",
            )  # fmt: skip
        if isinstance(value, Mapping):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif callable(getattr(value, "to_json_string", None)):  # a sub-config object
            pending.extend(vars(value).values())


def _check_labels(fields: Mapping[str, Any]) -> None:
    count = fields.get("num_labels")
    if count is not None and (not _is_count(count) or not 0 <= count <= MAX_LABELS):
        raise _refuse("num_labels", count, f"it must be an int of at least 0 and at most {MAX_LABELS:,}")
    id2label, label2id = fields.get("id2label"), fields.get("label2id")
    for name, value in (("id2label", id2label), ("label2id", label2id)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise _refuse(name, value, "it must be a mapping")
        if len(value) > MAX_LABELS:
            raise _refuse(name, f"<{len(value):,} entries>", f"a label map has at most {MAX_LABELS:,} entries")
    if id2label is not None:
        if count is not None and len(id2label) != count:
            raise _refuse("id2label", f"<{len(id2label):,} entries>", f"num_labels = {count} gives as many labels")
        ids = {_label_id(key) for key in id2label}
        if ids != set(range(len(id2label))):
            raise _refuse("id2label", id2label, f"its keys are the ids 0 to {len(id2label) - 1}, each once")
        for key, label in id2label.items():
            if not isinstance(label, str) or len(label) > MAX_LABEL_CHARS:
                raise _refuse(f"id2label[{key!r}]", label, f"a label is a string of at most {MAX_LABEL_CHARS} chars")
    if label2id is not None:
        size = len(id2label) if id2label is not None else count if count is not None else len(label2id)
        if len(label2id) != size:
            raise _refuse("label2id", f"<{len(label2id):,} entries>", f"it must have {size} entries, one per label")
        for label, key in label2id.items():
            if not isinstance(label, str) or len(label) > MAX_LABEL_CHARS or not _is_count(key) or not 0 <= key < size:
                raise _refuse(f"label2id[{label!r}]", key, f"it maps a label name to an id from 0 to {size - 1}")


def _label_id(key: object) -> int:
    """An ``id2label`` key as an int (``config.json`` keys are strings), or -1."""
    if _is_count(key):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= MAX_LABEL_ID_DIGITS:
        return int(key)
    return -1


def _check_names_and_heads(fields: Mapping[str, Any], where: str, default_rope_type: str) -> None:
    for name in ATTENTION_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        choices = _implementations(name)
        values = value.values() if isinstance(value, Mapping) else (value,)  # per sub-config, or one for all
        for one in values:
            if one is not None and not (isinstance(one, str) and one in choices):
                raise _refuse(
                    where + name, value,
                    f"it must be null or one of transformers' built-in implementations {sorted(choices)} (a converted "
                    "checkpoint names no kernel repository of the Hub)",
                )  # fmt: skip
    for name in ACTIVATION_FIELDS:
        if name in fields:
            value = fields[name]
            if not (value is None and name == "hidden_activation") and not _known_activation(value):
                raise _refuse(where + name, value, "it must name an activation of transformers' ACT2FN")
    for name in ROPE_FIELDS:
        _check_rope(where + name, fields.get(name), default_rope_type)
    _check_heads(fields, where)
    for name, value in fields.items():  # the sub-configs of a composite model (text_config, vision_config, …)
        if name.endswith("_config") and name != "quantization_config" and value is not None:
            sub = config_fields(value) if isinstance(value, Mapping) or hasattr(value, "__dict__") else {}
            if sub and where.count(".") < 4:
                _check_names_and_heads(sub, f"{where}{name}.", default_rope_type)


def _implementations(name: str) -> frozenset[str]:
    """The built-in attention (or experts) implementations of transformers: never a Hub repository ``org/name``."""
    if name == "attn_implementation":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry
    else:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as registry
    built_in = {"eager", *registry.valid_keys()}
    return frozenset(key for key in built_in if isinstance(key, str) and not set("/:@") & set(key))


def _known_activation(value: object) -> bool:
    from transformers.activations import ACT2FN

    return isinstance(value, str) and value in ACT2FN


def _check_rope(field: str, value: object, default_rope_type: str) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise _refuse(field, value, "RoPE parameters are a mapping, or null")
    nested = bool(value) and all(isinstance(one, Mapping) or one is None for one in value.values())
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    types = {"default", default_rope_type, *ROPE_INIT_FUNCTIONS}
    for key, parameters in value.items() if nested else [("", value)]:
        where = f"{field}[{key!r}]" if nested else field
        if parameters is None:
            continue
        for name in ("rope_type", "type"):
            if name in parameters and parameters[name] not in types:
                raise _refuse(f"{where}[{name!r}]", parameters[name], f"a RoPE type is one of {sorted(types)}")
        for name, one in parameters.items():
            plain = one is None or isinstance(one, (int, float)) or name in ("rope_type", "type")
            numbers = isinstance(one, list) and all(isinstance(x, (int, float)) for x in one)
            if not (plain or numbers):
                raise _refuse(f"{where}[{name!r}]", one, "a RoPE parameter is a number, a list of numbers or null")


def _check_heads(fields: Mapping[str, Any], where: str) -> None:
    heads_field = next((name for name in HEAD_FIELDS if fields.get(name) is not None), None)
    if heads_field is None:
        return
    heads = fields[heads_field]
    if not _is_count(heads) or heads <= 0:
        raise _refuse(where + heads_field, heads, "a head count is a positive int")
    kv_heads = fields.get("num_key_value_heads")
    if kv_heads is not None and (not _is_count(kv_heads) or kv_heads <= 0 or heads % kv_heads):
        raise _refuse(
            where + "num_key_value_heads", kv_heads, f"it must be a positive int dividing {heads_field} = {heads}"
        )
    for name in _HEAD_WIDTHS:
        width = fields.get(name)
        if width is not None:
            if not _is_count(width) or width <= 0:
                raise _refuse(where + name, width, "a head width is a positive int")
            return  # a head's width is given: the hidden size need not divide by the heads
    hidden_field = next((name for name in HIDDEN_FIELDS if fields.get(name) is not None), None)
    if hidden_field is not None:
        hidden = fields[hidden_field]
        if not _is_count(hidden) or hidden <= 0 or hidden % heads:
            raise _refuse(where + hidden_field, hidden, f"it must be a positive multiple of {heads_field} = {heads}")


# ----------------------------------------------------------------------------- the config against the weights
Shapes = Mapping[str, tuple[int, ...]]


def check_config_widths(config: Any, shapes: Shapes) -> None:
    """No width of the config above the largest dimension of a stored tensor that holds elements.

    A cheap bound before [`check_config_layout`][mumoe_tn.conversion.persistence.config_checks.check_config_layout]
    builds anything: a zero-element tensor (shape ``(0, 2**31)``) declares no width.
    ``max_position_embeddings`` may also be up to
    [`MAX_UNSTORED_POSITIONS`][mumoe_tn.conversion.persistence.bounds.MAX_UNSTORED_POSITIONS].
    """
    fields = config_fields(config)
    widest = max((max(shape, default=1) for shape in shapes.values() if 0 not in shape), default=0)
    for name in WIDTHS:
        value = fields.get(name)
        if not _is_count(value):
            continue
        bound = max(widest, MAX_UNSTORED_POSITIONS) if name == "max_position_embeddings" else widest
        if value > bound:
            raise _refuse(
                name, value, f"no stored tensor has a dimension above {widest:,}: the config does not fit the weights"
            )


@dataclass(frozen=True)
class ModelLayout:
    """What a model class builds from a config, found on the meta device without building its layers.

    ``shapes``: every tensor of the model built with one layer per layer list, by key.
    ``layers``: each layer list's key prefix (``"transformer.h"``), with the config field that
    counts its layers and the count.
    """

    shapes: dict[str, tuple[int, ...]]
    layers: dict[str, tuple[str, int]]


def model_layout(model_class: type, config: Any) -> ModelLayout:
    """Build ``model_class`` on the meta device from ``config`` with one layer (and two, per layer count).

    The config is copied without its conversion record and quantization config; list fields as
    long as a layer count (``layer_types``) are cut to the layers built.

    Raises
    ------
    ValueError
        If the class cannot be built from the config.
    """
    stored = {name: value for name, value in vars(config).items() if name in LAYER_COUNTS and _is_count(value)}
    one = _meta_shapes(model_class, config, dict.fromkeys(stored, 1), stored)
    layers: dict[str, tuple[str, int]] = {}
    for name, count in stored.items():
        two = _meta_shapes(model_class, config, {**dict.fromkeys(stored, 1), name: 2}, stored)
        for key in two.keys() - one.keys():
            parts = key.split(".")
            for position, part in enumerate(parts):
                if part == "1" and ".".join([*parts[:position], "0", *parts[position + 1 :]]) in one:
                    layers.setdefault(".".join(parts[:position]), (name, count))
                    break
    return ModelLayout(one, layers)


def _meta_shapes(
    model_class: type, config: Any, counts: Mapping[str, int], stored: Mapping[str, int]
) -> dict[str, tuple[int, ...]]:
    import torch

    probe = copy.copy(config)
    for name in (RECORD_KEY, "quantization_config"):
        vars(probe).pop(name, None)
    probe = copy.deepcopy(probe)
    lengths = set(stored.values())
    for name, value in list(vars(probe).items()):
        if isinstance(value, list) and len(value) in lengths and len(value) > 2:
            setattr(probe, name, value[: max(counts.values())])
    for name, count in counts.items():
        setattr(probe, name, count)
    try:
        with torch.device("meta"):
            model = model_class(probe)
    except Exception as error:  # a model's constructor raises many kinds for a config it cannot build
        raise ValueError(
            shorten(
                f"config.json describes a {getattr(model_class, '__name__', model_class)} that cannot be built "
                f"({type(error).__name__}: {shorten(str(error), 300)})"
            )
        ) from None
    return {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}


def check_config_layout(config: Any, layout: ModelLayout, shapes: Shapes, skip: Collection[str] = ()) -> None:
    """Every tensor the config's model would receive has the checkpoint's shape, and the layers fit.

    Parameters
    ----------
    config : Mapping or PretrainedConfig
        The config (its int fields name a width that does not fit).
    layout : ModelLayout
        From [`model_layout`][mumoe_tn.conversion.persistence.config_checks.model_layout].
    shapes : Mapping
        The checkpoint's tensor shapes, by key.
    skip : collection of str
        Module paths whose tensors are not compared (the modules a conversion record replaces).

    Raises
    ------
    ValueError
        If a tensor the model would receive has another shape in the checkpoint, a layer the
        config's count implies holds no weight, or a weight of a layer list has an index at or
        beyond the count.
    """
    prefixes = tuple(path + "." for path in skip)
    for key, expected in layout.shapes.items():
        held = shapes.get(key)
        if held is None or tuple(held) == expected or key.startswith(prefixes):
            continue
        fields = config_fields(config)
        named = [name for name, value in fields.items() if _is_count(value) and value in expected and value not in held]
        field = named[0] if named else "<sizes>"
        raise _refuse(
            field, fields.get(field, expected),
            f"the model it describes has {key!r} of shape {expected}, the checkpoint holds {tuple(held)}",
        )  # fmt: skip
    for prefix, (field, count) in layout.layers.items():
        indices = _layer_indices(prefix, shapes)
        beyond = sorted(index for index in indices if index >= count)
        if beyond:
            raise _refuse(
                field, count,
                f"the weights hold layer(s) {listed(beyond)} of {prefix!r}, so the config gives too few layers",
            )  # fmt: skip
        if len(indices) < count:
            raise _refuse(
                field, count,
                f"the weights hold {len(indices):,} layer(s) of {prefix!r}: layer(s) {_missing(indices, count)} of "
                f"the {count:,} the config gives have no weights",
            )  # fmt: skip


def _layer_indices(prefix: str, shapes: Shapes) -> set[int]:
    start = prefix + "."
    indices = set()
    for key in shapes:
        if key.startswith(start):
            index = key[len(start) :].split(".", 1)[0]
            if index.isascii() and index.isdigit():
                indices.add(int(index) if len(index) <= MAX_LAYER_INDEX_DIGITS else 1 << 62)
    return indices


def _missing(indices: set[int], count: int) -> str:
    """The first layers below ``count`` that ``indices`` (all below ``count``) lacks, and how many more."""
    first, index = [], 0
    while index < count and len(first) < MAX_LISTED_KEYS:  # at most len(indices) + MAX_LISTED_KEYS steps
        if index not in indices:
            first.append(index)
        index += 1
    more = count - len(indices) - len(first)
    return f"{first}" + (f" and {more:,} more" if more else "")
