"""Save a converted model and load it back as itself: Hugging Face directories and safetensors files.

A converted model carries its [`ConversionRecord`][mumoe_tn.conversion.persistence.record.ConversionRecord]. Saving
writes the record next to the weights — in ``config.json`` for a Hugging Face model (``save_pretrained``
does it: the record lives in ``model.config``), in the file's metadata for a safetensors file —
and loading builds the original model, replays the record with
[`apply_conversion`][mumoe_tn.conversion.persistence.replay.apply_conversion] and loads the weights, checking every key
and shape first:

```python
model.save_pretrained("converted")                          # or save_converted(model, "converted")
model = load_converted(GPT2LMHeadModel, "converted")        # logits and generate() as saved

save_converted(model, "converted.safetensors")              # any nn.Module
model = load_converted(build_model(), "converted.safetensors")
```

With mumoe_tn imported, stock ``GPT2LMHeadModel.from_pretrained("converted")`` (or
``AutoModelForCausalLM``) rebuilds the converted model too, through the hook of
[`mumoe_tn.conversion.persistence.quantizer`][mumoe_tn.conversion.persistence.quantizer].

A checkpoint is data (see the threat model in ``docs/reliability.md``). Loading one reads only
regular files inside its directory (``config.json``, ``generation_config.json``, index entries:
relative, inside after resolving links), each once through one descriptor, and builds the model
from those bytes alone (transformers reads no file of it again); it checks the record field by
field, the model class against the config's ``model_type``, ``config.json`` field by field against
the weights' headers (see
[`mumoe_tn.conversion.persistence.config_checks`][mumoe_tn.conversion.persistence.config_checks])
and every tensor the record implies against the checkpoint's tensors before any module is made,
fails if a file read was replaced before the load ended, and changes a given model only when
everything fits: a failed load leaves it as it was. Every refusal is a ``ValueError`` naming the
field or file and quoting the value.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.persistence.bounds import MAX_CONFIG_BYTES
from mumoe_tn.conversion.persistence.config_checks import (
    check_config_fields,
    check_config_layout,
    check_config_widths,
    listed,
    model_layout,
)
from mumoe_tn.conversion.persistence.files import (
    FileBytes,
    Headers,
    check_unchanged,
    gather_weights,
    header_shapes,
    member_file,
    read_json,
    read_once,
    read_weights,
    weight_files,
)
from mumoe_tn.conversion.persistence.record import RECORD_KEY, ConversionRecord, record_in_config, shorten
from mumoe_tn.conversion.persistence.replay import commit_conversion, conversion_record, replay_conversion

__all__ = ["load_converted", "save_converted"]

#: The generation settings ``save_pretrained`` writes next to ``config.json``.
GENERATION_CONFIG = "generation_config.json"


def _is_hf_class(model: object) -> bool:
    return isinstance(model, type) and issubclass(model, nn.Module) and hasattr(model, "config_class")


def _is_auto_class(model: object) -> bool:
    """A transformers auto class (``AutoModelForCausalLM``, ...): it maps config classes to model classes."""
    loads = callable(getattr(model, "from_pretrained", None))
    return isinstance(model, type) and hasattr(model, "_model_mapping") and loads


def _model_class(cls: type, config: Mapping[str, Any]) -> type:
    """The model class that loads ``config``: ``cls`` itself, or what the auto class ``cls`` maps its type to."""
    model_type = config.get("model_type")
    if _is_auto_class(cls):
        from transformers import CONFIG_MAPPING

        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ValueError(
                f"config.json: model_type = {model_type!r:.80} is invalid: it names no model type transformers knows"
            )
        try:
            return cls._model_mapping[CONFIG_MAPPING[model_type]]
        except KeyError:
            raise ValueError(
                f"config.json: model_type = {model_type!r:.80} is invalid for {cls.__name__}, which has no model "
                f"class for it: load it with the class of its own model type"
            ) from None
    expected = getattr(cls.config_class, "model_type", "") or None
    if expected is not None and model_type != expected:
        raise ValueError(
            f"config.json: model_type = {model_type!r:.80} is invalid for {cls.__name__}, which loads "
            f"{expected!r} checkpoints: load it with the class of its own model type (or AutoModelForCausalLM)"
        )
    return cls


def save_converted(model: nn.Module, path: str | os.PathLike, **save_options: Any) -> None:
    """Save a converted model with its conversion record.

    Parameters
    ----------
    model : nn.Module
        A model changed by [`convert`][mumoe_tn.conversion.convert.convert].
    path : str or PathLike
        For a Hugging Face model (one with ``save_pretrained``): a directory, written by
        ``model.save_pretrained(path, **save_options)`` (the record is in its config). For any
        other model: a ``.safetensors`` file holding the state dict (tensors shared between
        modules stored once) and the record in its metadata.
    **save_options
        Passed to ``save_pretrained``.

    Raises
    ------
    ValueError
        If the model carries no conversion record.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    record = conversion_record(model)
    if record is None:
        raise ValueError(
            f"this {type(model).__name__} was not converted by mumoe_tn (it has no conversion record): save it "
            "the usual way"
        )
    if callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained(path, **save_options)
        return
    if save_options:
        raise TypeError(f"options {sorted(save_options)} apply to save_pretrained; {type(model).__name__} has none")
    from safetensors.torch import save_model

    save_model(model, str(path), metadata={RECORD_KEY: record.to_json()})


def load_converted(
    model: nn.Module | type, path: str | os.PathLike, *, dtype: torch.dtype | None = None, strict: bool = True
) -> nn.Module:
    """Load a converted model saved by ``save_pretrained`` or ``save_converted``, with its conversion.

    Parameters
    ----------
    model : type or nn.Module
        A Hugging Face model class (``GPT2LMHeadModel``, ``LlamaForCausalLM``, …) or auto class
        (``AutoModelForCausalLM``, which picks the class of the config's ``model_type``) with a
        checkpoint directory, or a freshly built, unconverted instance of the original model with
        a ``.safetensors`` file.
    path : str or PathLike
        The checkpoint directory or file.
    dtype : torch.dtype, optional
        Cast the loaded model to this dtype (default: a Hugging Face model takes the dtype its
        config names; an instance keeps its own).
    strict : bool, optional
        Require every key of the model (except tied weights) and of the checkpoint to match.

    Returns
    -------
    nn.Module
        The converted model with the saved weights, in eval mode.

    Raises
    ------
    ValueError
        If the checkpoint has no conversion record (it was not saved from a converted model), a
        file, field or tensor of it is malformed, the record does not fit the model, or keys or
        shapes do not match. A given model is then left exactly as it was.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    path = Path(path)
    if _is_hf_class(model) or _is_auto_class(model):
        return _load_hf(model, path, dtype=dtype, strict=strict)
    if not isinstance(model, nn.Module):
        raise TypeError(
            "model must be a Hugging Face model class (or auto class) or a freshly built nn.Module, got "
            f"{getattr(model, '__name__', type(model).__name__)}"
        )
    read = read_once(path, "the checkpoint file")  # checked and parsed from the same bytes
    state, headers, metadata = read_weights(read)
    del read
    if RECORD_KEY not in metadata:
        raise ValueError(
            f"{str(path)!r} holds no mumoe_tn conversion record: it was not saved by save_converted from a converted "
            "model (load a plain state dict with model.load_state_dict)"
        )
    rebuilt, record = replay_conversion(model, metadata[RECORD_KEY], shapes=header_shapes(headers))

    def check_and_load(converted: nn.Module) -> None:
        _check_state(converted, headers, str(path), strict=strict)  # everything checked, then copied in
        own = converted.state_dict(keep_vars=True)
        converted.load_state_dict({key: value for key, value in state.items() if key in own}, strict=False)

    commit_conversion(model, rebuilt, record, check=check_and_load)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _check_state(model: nn.Module, headers: Headers, source: str, *, strict: bool) -> None:
    """Keys, shapes and dtype kinds of a checkpoint against ``model`` (shared tensors may be stored once)."""
    own = model.state_dict(keep_vars=True)
    present = {id(own[key]) for key in headers if key in own}
    missing = [key for key in own if key not in headers and id(own[key]) not in present]
    unexpected = [key for key in headers if key not in own]
    mismatched = [
        f"{key}: checkpoint {shape}, model {tuple(own[key].shape)}"
        for key, (shape, _) in headers.items()
        if key in own and shape != tuple(own[key].shape)
    ]
    kinds = [
        f"{key}: checkpoint {dtype}, model {own[key].dtype}"
        for key, (_, dtype) in headers.items()
        if key in own and dtype.is_floating_point != own[key].dtype.is_floating_point
    ]
    problems = []
    if mismatched:
        problems.append(f"shapes differ for {listed(mismatched, 5)}")
    if kinds:
        problems.append(f"dtypes of another kind for {listed(kinds, 5)}")
    if strict and missing:
        problems.append(f"the checkpoint lacks {len(missing)} key(s) of the model, e.g. {listed(missing, 5)}")
    if strict and unexpected:
        problems.append(f"the checkpoint has {len(unexpected)} key(s) the model lacks, e.g. {listed(unexpected, 5)}")
    if problems:
        raise ValueError(shorten(f"the weights in {source!r} do not fit the converted model: " + "; ".join(problems)))


# ----------------------------------------------------------------------------- Hugging Face directories
def _load_hf(cls: type, path: Path, *, dtype: torch.dtype | None, strict: bool) -> nn.Module:
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory: give the directory save_pretrained wrote")
    root = path.resolve()  # once: a link to the directory swapped during the load is not followed again
    reads: list[FileBytes] = []
    config_file = member_file(root, "config.json", "config.json")
    config = read_json(config_file, "config.json", reads, limit=MAX_CONFIG_BYTES)
    if not isinstance(config, Mapping):
        raise ValueError(f"config.json = {config!r:.120} is invalid: it must be a JSON object")
    cls = _model_class(cls, config)
    check_config_fields(config, default_rope_type=getattr(cls.config_class, "default_rope_type", "default"))
    record = record_in_config(config)  # every field checked before transformers reads anything else
    if record is None:
        raise ValueError(
            f"the checkpoint {str(path)!r} holds no mumoe_tn conversion record in its config.json: it was not saved "
            f"from a converted model; load it with {cls.__name__}.from_pretrained"
        )
    generation = None
    if os.path.lexists(root / GENERATION_CONFIG):
        generation = read_json(member_file(root, GENERATION_CONFIG, GENERATION_CONFIG), GENERATION_CONFIG, reads)

    def weight_reads() -> Iterator[tuple[str, FileBytes]]:
        for file in weight_files(root, reads):
            read = read_once(file, "weight file", follow=False)
            reads.append(dataclasses.replace(read, data=b""))
            yield repr(str(file)), read
            del read

    state, shapes = gather_weights(weight_reads(), "the checkpoint")
    check_unchanged(reads, str(path))  # every file read was, at one instant, the version read
    check_config_widths(config, shapes)  # cheap bounds first: the layout check builds the class on the meta device
    model_config = _config_object(cls, path, config)
    skip = [module_path for module in record.modules for module_path in module.paths]
    check_config_layout(config, model_layout(cls, model_config), shapes, skip)
    return _build_hf(cls, path, model_config, record, generation, state, shapes, dtype=dtype, strict=strict)


#: What transformers raises for a config or generation config it cannot read.
_MALFORMED = (TypeError, ValueError, KeyError, AttributeError)


def _config_object(cls: type, path: Path, config: Mapping[str, Any]) -> Any:
    """The config object transformers makes of ``config.json`` (its ``quantization_config`` left out)."""
    settings = {key: value for key, value in config.items() if key != "quantization_config"}
    try:
        return cls.config_class.from_dict(settings)
    except _MALFORMED as error:
        raise ValueError(f"config.json of {str(path)!r} is invalid ({type(error).__name__}: {error!s:.200})") from None


def _build_hf(
    cls: type,
    path: Path,
    model_config: Any,
    record: ConversionRecord,
    generation: Any,
    state: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    *,
    dtype: torch.dtype | None,
    strict: bool,
) -> nn.Module:
    """The converted model from the checkpoint's contents as read: transformers reads no file of it again."""
    from transformers import GenerationConfig

    from mumoe_tn.conversion.persistence.quantizer import MuMoEConfig, register_with_transformers

    register_with_transformers()
    handover = MuMoEConfig()
    handover.checkpoint_shapes = shapes  # the hook checks the record against these
    handover.checkpoint_record = record  # validated once, here: the hook replays it as it is
    if generation is not None and not isinstance(generation, Mapping):
        raise ValueError(f"{GENERATION_CONFIG} = {generation!r:.120} is invalid: it must be a JSON object")
    try:
        generation_config = None if generation is None else GenerationConfig.from_dict(generation)
    except _MALFORMED as error:
        raise ValueError(f"{GENERATION_CONFIG} is invalid ({type(error).__name__}: {error!s:.200})") from None
    model, info = cls.from_pretrained(
        None,
        config=model_config,
        state_dict=state,
        generation_config=generation_config,
        quantization_config=handover,
        dtype="auto",
        output_loading_info=True,
    )
    model.config.name_or_path = str(path)
    problems = {name: info.get(name) for name in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {name: keys for name, keys in problems.items() if keys}
    if strict and problems:
        found = "; ".join(f"{name} {len(keys):,}: {listed(sorted(map(str, keys)))}" for name, keys in problems.items())
        raise ValueError(shorten(f"the weights in {str(path)!r} do not fit the converted model: {found}"))
    if dtype is not None:
        model.to(dtype)
    return model.eval()
