"""Stock ``from_pretrained`` rebuilds a converted model: mumoe_tn's hook in transformers' quantizer registry.

transformers lets a package register a quantization method: a ``quantization_config`` in
``config.json`` whose ``quant_method`` names it selects the registered ``HfQuantizer``, whose
``_process_model_before_weight_loading`` may replace modules of the meta-device skeleton before
the weights load. mumoe_tn registers the method ``"mumoe_tn"``: a converted Hugging Face model
carries ``"quantization_config": {"quant_method": "mumoe_tn"}`` next to its conversion record, so

```python
import mumoe_tn  # registers the hook (when transformers' quantizer registry loads)
model = AutoModelForCausalLM.from_pretrained("converted")  # the converted model, its weights loaded
```

The hook replays the record with
[`apply_conversion`][mumoe_tn.conversion.record.apply_conversion] on the skeleton, checking
every tensor the record implies against the checkpoint's own headers first (nothing is built
that the checkpoint does not hold), and afterwards clears transformers' "quantized" marks: the
model casts, trains and saves like any other. Nothing is quantized.

Without mumoe_tn imported, transformers does not know the method: it logs
``Unknown quantization type, got mumoe_tn … we will skip the quantization`` and its load report
lists the μMoE tensors as unexpected and the dense blocks' weights as newly initialised — the
dense model it returns is *not* the converted one. transformers offers no louder refusal for an
unknown method; import mumoe_tn (or use
[`load_converted`][mumoe_tn.conversion.checkpoints.load_converted], which always checks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from mumoe_tn.conversion.files import (
    FileBytes,
    check_json_files,
    check_unchanged,
    file_identity,
    header_shapes,
    member_file,
    read_all_headers,
    regular_file,
)
from mumoe_tn.conversion.record import QUANT_METHOD, RECORD_KEY, commit_conversion, replay_conversion

__all__ = ["METHOD", "MuMoEConfig", "MuMoEQuantizer", "convert_skeleton", "register_with_transformers"]

#: The ``quant_method`` that selects the hook.
METHOD = QUANT_METHOD


class MuMoEConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a converted model: only selects the hook (the record is the config's own).

    Parameters
    ----------
    quant_method : str, optional
        Must be ``"mumoe_tn"``.
    **unknown
        Refused: a checkpoint's config may carry no other option.
    """

    def __init__(self, quant_method: str = METHOD, **unknown: Any) -> None:
        if quant_method != METHOD:
            raise ValueError(f"config.json: quantization_config.quant_method = {quant_method!r}, expected {METHOD!r}")
        if unknown:
            key = sorted(unknown)[0]
            raise ValueError(
                f"config.json: quantization_config[{key!r}] = {unknown[key]!r:.80} is invalid: the mumoe_tn method "
                "takes only 'quant_method'"
            )
        self.quant_method = METHOD

    def to_dict(self) -> dict[str, Any]:
        """``{"quant_method": "mumoe_tn"}``."""
        return {"quant_method": METHOD}


class MuMoEQuantizer(HfQuantizer):
    """Replays a checkpoint's conversion record on transformers' meta-device skeleton before weights load."""

    requires_calibration = False

    def __init__(self, quantization_config: MuMoEConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)

    def _process_model_before_weight_loading(self, model: Any, checkpoint_files: Any = None, **kwargs: Any) -> Any:
        shapes = getattr(self.quantization_config, "checkpoint_shapes", None)  # handed over by load_converted
        self.checked_files = convert_skeleton(model, checkpoint_files, shapes=shapes)
        return model

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        # The weights transformers loaded are those whose headers were checked, or the load fails.
        check_unchanged(getattr(self, "checked_files", ()), "from_pretrained")
        vars(self.quantization_config).pop("checkpoint_shapes", None)
        # Nothing is quantized: drop transformers' marks so the model casts (.half(), .to(dtype)) and trains as usual.
        model.hf_quantizer = None
        model.is_quantized = False
        model.__dict__.pop("quantization_method", None)
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and "_is_quantized" in vars(config):
                config._is_quantized = False
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        """A converted model saves with ``save_pretrained`` as it loaded."""
        return True

    @property
    def is_trainable(self) -> bool:
        """Every parameter of a converted model trains."""
        return True


def register_with_transformers() -> None:
    """Register the ``"mumoe_tn"`` method with transformers (done for you by ``import mumoe_tn``); idempotent."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is not MuMoEConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(METHOD, None)
        register_quantization_config(METHOD)(MuMoEConfig)
    if AUTO_QUANTIZER_MAPPING.get(METHOD) is not MuMoEQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(METHOD, None)
        register_quantizer(METHOD)(MuMoEQuantizer)


def convert_skeleton(
    model: Any,
    checkpoint_files: Sequence[str | os.PathLike] | None,
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> list[FileBytes]:
    """Replay a checkpoint's record on the model transformers built for it, checked against its weight files.

    Called by the ``from_pretrained`` hook (see [`mumoe_tn.conversion.quantizer`][mumoe_tn.conversion.quantizer])
    on the meta-device skeleton: every weight file must be a regular file inside the checkpoint
    directory, and every tensor the record implies must be in their headers with its shape. The
    JSON files transformers reads on its own (``config.json``, ``generation_config.json``, a shard
    index) must be regular files inside the directory of at most
    [`MAX_JSON_BYTES`][mumoe_tn.conversion.files] (``generation_config.json`` is checked before
    transformers reads it; ``config.json`` and the index have been read, and the load is refused).

    Parameters
    ----------
    model : PreTrainedModel
        The skeleton, with the checkpoint's config.
    checkpoint_files : sequence of path-like, optional
        The weight files transformers found.
    shapes : Mapping, optional
        The checkpoint's tensor shapes, when the caller read the files itself
        ([`load_converted`][mumoe_tn.conversion.checkpoints.load_converted] does): no file is read.

    Returns
    -------
    list of FileBytes
        The identities of the weight files checked (empty with ``shapes``), for
        [`check_unchanged`][mumoe_tn.conversion.files.check_unchanged] once the weights are loaded.

    Raises
    ------
    ValueError
        If the config has no record, a file is outside the directory or malformed, or the record
        does not fit the model or the weights.
    """
    config = getattr(model, "config", None)
    data = getattr(config, RECORD_KEY, None)
    if data is None:
        raise ValueError(
            f"config.json: quantization_config selects mumoe_tn, but the config has no {RECORD_KEY!r} record to "
            "replay: the checkpoint is incomplete"
        )
    checked: list[FileBytes] = []
    if shapes is None:
        files = [Path(file) for file in checkpoint_files or ()]
        if not files:
            raise ValueError("a converted checkpoint needs its weight files; transformers found none")
        root = Path(str(getattr(config, "name_or_path", "") or ""))
        if root.is_dir():
            check_json_files(root)
            files = [
                member_file(root, os.path.relpath(file.resolve(), root.resolve()), "weight file") for file in files
            ]
        else:
            files = [regular_file(file, "weight file") for file in files]
        checked = [file_identity(file) for file in files]
        shapes = header_shapes(read_all_headers(files))
        check_unchanged(checked, "from_pretrained")  # the headers read are those of the files checked
    delattr(config, RECORD_KEY)  # the replay writes it back
    try:
        rebuilt, record = replay_conversion(model, data, shapes=shapes)
        commit_conversion(model, rebuilt, record)
    except BaseException:
        setattr(config, RECORD_KEY, data)
        raise
    return checked
