"""Save a converted model and load it back as itself: Hugging Face directories and safetensors files.

A converted model carries its [`ConversionRecord`][mumoe_tn.conversion.record.ConversionRecord]. Saving writes
the record next to the weights — in ``config.json`` for a Hugging Face model (``save_pretrained``
does it: the record lives in ``model.config``), in the file's metadata for a safetensors file —
and loading builds the original model, replays the record with
[`apply_conversion`][mumoe_tn.conversion.convert.apply_conversion] and loads the weights, checking every key
and shape first:

```python
model.save_pretrained("converted")                          # or save_converted(model, "converted")
model = load_converted(GPT2LMHeadModel, "converted")        # logits and generate() as saved

save_converted(model, "converted.safetensors")              # any nn.Module
model = load_converted(build_model(), "converted.safetensors")
```

``GPT2LMHeadModel.from_pretrained("converted")`` alone cannot know about the conversion: it builds
the dense model and transformers reports the μMoE weights as unused. Load converted checkpoints
with [`load_converted`][mumoe_tn.conversion.checkpoints.load_converted].
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.convert import apply_conversion, conversion_record
from mumoe_tn.conversion.record import RECORD_KEY, ConversionRecord

__all__ = ["load_converted", "save_converted"]

_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _is_hf_class(model: object) -> bool:
    return isinstance(model, type) and issubclass(model, nn.Module) and hasattr(model, "config_class")


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
        A Hugging Face model class (``GPT2LMHeadModel``, ``LlamaForCausalLM``, …) with a checkpoint
        directory, or a freshly built, unconverted instance of the original model with a
        ``.safetensors`` file.
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
        If the checkpoint has no conversion record (it was not saved from a converted model), the
        record does not fit the model, or keys or shapes do not match.
    """
    path = Path(path)
    if _is_hf_class(model):
        return _load_hf(model, path, dtype=dtype, strict=strict)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a Hugging Face model class or a freshly built nn.Module, got {type(model).__name__}"
        )
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a file: give the .safetensors file save_converted wrote")
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if RECORD_KEY not in metadata:
        raise ValueError(
            f"{str(path)!r} holds no mumoe_tn conversion record: it was not saved by save_converted from a converted "
            "model (load a plain state dict with model.load_state_dict)"
        )
    apply_conversion(model, ConversionRecord.from_dict(metadata[RECORD_KEY]))
    _load_state(model, load_file(str(path)), str(path), strict=strict)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _load_hf(cls: type, path: Path, *, dtype: torch.dtype | None, strict: bool) -> nn.Module:
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory: give the directory save_pretrained wrote")
    config = cls.config_class.from_pretrained(path)
    data = getattr(config, RECORD_KEY, None)
    if data is None:
        raise ValueError(
            f"the checkpoint {str(path)!r} holds no mumoe_tn conversion record in its config.json: it was not saved "
            f"from a converted model; load it with {cls.__name__}.from_pretrained"
        )
    record = ConversionRecord.from_dict(data)
    delattr(config, RECORD_KEY)  # apply_conversion writes it back as it replays
    model = cls(config)
    apply_conversion(model, record)
    _load_state(model, _read_hf_weights(path), str(path), strict=strict)
    saved_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None and isinstance(saved_dtype, str):
        saved_dtype = getattr(torch, saved_dtype, None)
    target = dtype if dtype is not None else saved_dtype
    if isinstance(target, torch.dtype):
        model.to(target)
    if (path / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory (safetensors or pickled, sharded or not)."""
    for single, index in (_SAFETENSORS, _PICKLED):
        files = [path / single] if (path / single).is_file() else []
        if not files and (path / index).is_file():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        if files:
            state: dict[str, torch.Tensor] = {}
            for file in files:
                if file.suffix == ".safetensors":
                    from safetensors.torch import load_file

                    state.update(load_file(str(file)))
                else:
                    state.update(torch.load(file, map_location="cpu", weights_only=True))
            return state
    raise ValueError(f"no weights in {str(path)!r}: expected one of {[*_SAFETENSORS, *_PICKLED]}")


def _load_state(model: nn.Module, state: Mapping[str, torch.Tensor], source: str, *, strict: bool) -> None:
    """Check keys and shapes of ``state`` against ``model`` (tied weights may be absent), then load it."""
    own = model.state_dict(keep_vars=True)
    loaded = {id(own[key]) for key in state if key in own}
    missing = [key for key in own if key not in state and id(own[key]) not in loaded]
    unexpected = [key for key in state if key not in own]
    mismatched = [
        f"{key}: checkpoint {tuple(value.shape)}, model {tuple(own[key].shape)}"
        for key, value in state.items()
        if key in own and tuple(value.shape) != tuple(own[key].shape)
    ]
    problems = []
    if mismatched:
        problems.append(f"shapes differ for {mismatched[:5]}")
    if strict and missing:
        problems.append(f"the checkpoint lacks {len(missing)} key(s) of the model, e.g. {missing[:5]}")
    if strict and unexpected:
        problems.append(f"the checkpoint has {len(unexpected)} key(s) the model lacks, e.g. {unexpected[:5]}")
    if problems:
        raise ValueError(f"the weights in {source!r} do not fit the converted model: " + "; ".join(problems))
    model.load_state_dict({key: value for key, value in state.items() if key in own}, strict=False)
