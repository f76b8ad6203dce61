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

The hook checks ``config.json`` field by field when transformers asks for a quantizer, and against
the weights' headers when transformers has found the weight files (see
[`check_stock_layout`][mumoe_tn.conversion.persistence.quantizer.check_stock_layout]), both before the model
is built; then it replays the record with
[`apply_conversion`][mumoe_tn.conversion.persistence.replay.apply_conversion] on the skeleton, checking
every tensor the record implies against the checkpoint's own headers first (nothing is built
that the checkpoint does not hold), and afterwards clears transformers' "quantized" marks: the
model casts, trains and saves like any other. Nothing is quantized.

With mumoe_tn imported, a config that carries a conversion record is never loaded as a dense model:
a config without ``quantization_config`` (saved before the record selected the hook itself, or
edited) is rebuilt from its record as if it had the method's config, and a ``quantization_config``
of another method or malformed, or another method asked for at load, is refused with a
``ValueError`` (see [`check_stock_config`][mumoe_tn.conversion.persistence.quantizer.check_stock_config]).

Without mumoe_tn imported, transformers does not know the method: it logs
``Unknown quantization type, got mumoe_tn … we will skip the quantization`` and its load report
lists the μMoE tensors as unexpected and the dense blocks' weights as newly initialised — the
dense model it returns is *not* the converted one. transformers offers no louder refusal for an
unknown method; import mumoe_tn (or use
[`load_converted`][mumoe_tn.conversion.persistence.checkpoints.load_converted], which always checks).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers.quantizers.auto as quantizers_auto
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from mumoe_tn.conversion.persistence.bounds import STOCK_WEIGHT_FILES
from mumoe_tn.conversion.persistence.config_checks import (
    check_config_fields,
    check_config_layout,
    check_config_widths,
    model_layout,
)
from mumoe_tn.conversion.persistence.files import (
    FileBytes,
    check_json_files,
    check_unchanged,
    file_identity,
    header_shapes,
    member_file,
    read_all_headers,
    regular_file,
)
from mumoe_tn.conversion.persistence.record import QUANT_METHOD, RECORD_KEY, ConversionRecord
from mumoe_tn.conversion.persistence.replay import commit_conversion, replay_conversion

__all__ = [
    "METHOD",
    "CheckedWeights",
    "MuMoEConfig",
    "MuMoEQuantizer",
    "check_stock_config",
    "check_stock_files",
    "check_stock_layout",
    "convert_skeleton",
    "register_with_transformers",
]

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
                f"config.json: quantization_config[{key!r:.80}] = {unknown[key]!r:.80} is invalid: the mumoe_tn method "
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
        handed = vars(self.quantization_config)  # by load_converted, which checked the config and read the files
        shapes, record = handed.pop("checkpoint_shapes", None), handed.pop("checkpoint_record", None)
        early: CheckedWeights | None = vars(self).pop("checked_weights", None)
        if early is not None and type(model) is early.model_class and _same_files(checkpoint_files, early.files):
            # the stock path checked the config against these files' headers when transformers found them
            check_json_files(early.root)
            convert_skeleton(model, checkpoint_files, shapes=early.shapes, record=early.record)
            self.checked_files = early.identities
            return model
        self.checked_files = convert_skeleton(model, checkpoint_files, shapes=shapes, record=record)
        return model

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        # The weights transformers loaded are those whose headers were checked, or the load fails.
        check_unchanged(getattr(self, "checked_files", ()), "from_pretrained")
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
    """Register the ``"mumoe_tn"`` method with transformers (done for you by ``import mumoe_tn``); idempotent.

    Besides the method, transformers' choice of a quantizer is guarded by
    [`check_stock_config`][mumoe_tn.conversion.persistence.quantizer.check_stock_config], so a config carrying a
    conversion record never loads as a dense model.
    """
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is not MuMoEConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(METHOD, None)
        register_quantization_config(METHOD)(MuMoEConfig)
    if AUTO_QUANTIZER_MAPPING.get(METHOD) is not MuMoEQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(METHOD, None)
        register_quantizer(METHOD)(MuMoEQuantizer)
    # modeling_utils binds the function when it loads, which is right after this module's registration runs
    # (or earlier, if transformers was loaded before mumoe_tn): guard both names.
    for module in (quantizers_auto, sys.modules.get("transformers.modeling_utils")):
        original = getattr(module, "get_hf_quantizer", None)
        if original is not None and not getattr(original, "checks_conversion_records", False):
            module.get_hf_quantizer = _guarded(original)


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_hf_quantizer(config: Any, quantization_config: Any, *args: Any, **kwargs: Any) -> Any:
        check_stock_config(config, quantization_config)
        # from_pretrained looks for the weight files next: a converted checkpoint's are checked first
        stock = getattr(config, RECORD_KEY, None) is not None and not hasattr(quantization_config, "checkpoint_shapes")
        _stock_load.pending = None
        loading = sys.modules.get("transformers.modeling_utils")
        finder = getattr(loading, "_get_resolved_checkpoint_files", None)
        if stock and finder is not None and not getattr(finder, "checks_conversion_records", False):
            loading._get_resolved_checkpoint_files = _checking_files(finder)
        chosen = original(config, quantization_config, *args, **kwargs)
        if stock:
            quantizer, chosen_config = chosen[:2] if isinstance(chosen, tuple) and len(chosen) > 1 else (None, None)
            if getattr(chosen_config, RECORD_KEY, None) is not None:
                config = chosen_config  # the quantizer may replace the config from_pretrained goes on with
            _stock_load.pending = (config, quantizer if isinstance(quantizer, MuMoEQuantizer) else None)
        return chosen

    get_hf_quantizer.checks_conversion_records = True
    return get_hf_quantizer


#: The config (and the quantizer chosen for it) of the converted checkpoint that the ``from_pretrained`` running in
#: this thread loads through the stock path, until its weight files are found.
_stock_load = threading.local()


def _checking_files(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def find_checkpoint_files(pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        pending = getattr(_stock_load, "pending", None)
        _stock_load.pending = None
        if pending is None or pretrained_model_name_or_path is None:
            return original(pretrained_model_name_or_path, *args, **kwargs)
        config, quantizer = pending
        subfolder = (kwargs.get("download_kwargs") or {}).get("subfolder") or ""
        root = Path(str(pretrained_model_name_or_path)) / subfolder
        check_stock_files(root)
        found = original(pretrained_model_name_or_path, *args, **kwargs)
        caller = inspect.currentframe()
        model_class = _loading_class(caller.f_back.f_locals.get("cls") if caller and caller.f_back else None)
        del caller
        files = found[0] if isinstance(found, tuple) and found else None
        if model_class is not None and files:
            checked = check_stock_layout(config, model_class, files, root)
            if quantizer is not None:
                quantizer.checked_weights = checked
        return found

    find_checkpoint_files.checks_conversion_records = True
    return find_checkpoint_files


def _loading_class(candidate: object) -> type | None:
    """The model class ``from_pretrained`` is building, as its frame names it (``cls``), or None."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if isinstance(candidate, type) and base is not None and issubclass(candidate, base):
        return candidate
    return None


def _same_files(found: Sequence[str | os.PathLike] | None, checked: Sequence[Path]) -> bool:
    return [Path(file) for file in found or ()] == list(checked)


def check_stock_config(config: Any, quantization_config: Any = None) -> None:
    """What stock ``from_pretrained`` does with a config that carries a conversion record.

    Nothing for a config without a record. With one: its fields are checked (see
    [`check_config_fields`][mumoe_tn.conversion.persistence.config_checks.check_config_fields]); a config with
    no ``quantization_config`` is given the method's (``{"quant_method": "mumoe_tn"}``), so the
    record is replayed and the converted model loads; a ``quantization_config`` that is not the
    method's, or another method's config asked for at load, is refused.

    Parameters
    ----------
    config : PretrainedConfig
        The config transformers read.
    quantization_config : optional
        The ``quantization_config=`` given to ``from_pretrained``.

    Raises
    ------
    ValueError
        If a field of the config breaks its rule, or the record's model would otherwise load as a
        dense model or be quantized by another method.
    """
    if getattr(config, RECORD_KEY, None) is None:
        return
    check_config_fields(config, default_rope_type=getattr(config, "default_rope_type", "default"))
    if quantization_config is not None and not isinstance(quantization_config, MuMoEConfig):
        raise ValueError(
            f"from_pretrained(quantization_config={quantization_config!r:.120}): this checkpoint carries a mumoe_tn "
            "conversion record, so it loads only through the mumoe_tn method; load it without quantization_config"
        )
    found = getattr(config, "quantization_config", None)
    if found is None:
        if quantization_config is None:  # a MuMoEConfig given at load (load_converted hands one over) is used
            config.quantization_config = {"quant_method": METHOD}
    else:
        method = found.get("quant_method") if isinstance(found, Mapping) else getattr(found, "quant_method", None)
        if method != METHOD:
            raise ValueError(
                f"config.json: quantization_config = {found!r:.120} is invalid: the config carries a mumoe_tn "
                f"conversion record, whose checkpoint has {{'quant_method': {METHOD!r}}} (a dense load would leave its "
                "MLP weights random)"
            )


def check_stock_files(root: Path) -> None:
    """The files of a converted checkpoint's directory, checked before stock ``from_pretrained`` looks for them.

    transformers looks for the weight files by name after it chose a quantizer: each file it may
    read that is present (even a dangling link) must be a regular file of one hard link inside
    ``root``, a JSON file of at most [`MAX_JSON_BYTES`][mumoe_tn.conversion.persistence.bounds.MAX_JSON_BYTES] (see
    [`member_file`][mumoe_tn.conversion.persistence.files.member_file]). Nothing is checked when ``root`` is
    not a directory (a hub name).

    Raises
    ------
    ValueError
        Naming the first file that breaks its rule.
    """
    if not root.is_dir():
        return
    check_json_files(root)
    for name in STOCK_WEIGHT_FILES:
        if os.path.lexists(root / name):
            member_file(root, name, name)


def convert_skeleton(
    model: Any,
    checkpoint_files: Sequence[str | os.PathLike] | None,
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    record: ConversionRecord | None = None,
) -> list[FileBytes]:
    """Replay a checkpoint's record on the model transformers built for it, checked against its weight files.

    Called by the ``from_pretrained`` hook (see
    [`mumoe_tn.conversion.persistence.quantizer`][mumoe_tn.conversion.persistence.quantizer])
    on the meta-device skeleton: every weight file must be a regular file inside the checkpoint
    directory, and every tensor the record implies must be in their headers with its shape. The
    JSON files transformers reads on its own (``config.json``, ``generation_config.json``, a shard
    index) must be regular files inside the directory of at most
    [`MAX_JSON_BYTES`][mumoe_tn.conversion.persistence.bounds.MAX_JSON_BYTES] (``generation_config.json`` is checked
    before transformers reads it; ``config.json`` and the index have been read, and the load is refused).

    Parameters
    ----------
    model : PreTrainedModel
        The skeleton, with the checkpoint's config.
    checkpoint_files : sequence of path-like, optional
        The weight files transformers found.
    shapes : Mapping, optional
        The checkpoint's tensor shapes, when the caller read the files itself and checked the
        config against them ([`load_converted`][mumoe_tn.conversion.persistence.checkpoints.load_converted]
        does): no file is read. Otherwise the config is checked against the files' headers (see
        [`check_config_layout`][mumoe_tn.conversion.persistence.config_checks.check_config_layout]).
    record : ConversionRecord, optional
        The config's record, already validated by the caller (it is not validated again).

    Returns
    -------
    list of FileBytes
        The identities of the weight files checked (empty with ``shapes``), for
        [`check_unchanged`][mumoe_tn.conversion.persistence.files.check_unchanged] once the weights are loaded.

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
        root = Path(str(getattr(config, "name_or_path", "") or ""))
        weights = check_stock_layout(config, type(model), checkpoint_files, root)
        checked, shapes, record = weights.identities, weights.shapes, weights.record
    delattr(config, RECORD_KEY)  # the replay writes it back
    try:
        rebuilt, record = replay_conversion(model, data if record is None else record, shapes=shapes)
        commit_conversion(model, rebuilt, record)
    except BaseException:
        setattr(config, RECORD_KEY, data)
        raise
    return checked


@dataclass(frozen=True)
class CheckedWeights:
    """A converted checkpoint's weight files, checked with its config against their headers.

    ``files`` as found (inside ``root`` where it is a directory), their ``identities`` when the
    headers were read, the headers' ``shapes`` by key, the validated ``record``, and the
    ``model_class`` the config was checked with.
    """

    root: Path
    files: tuple[Path, ...]
    identities: list[FileBytes]
    shapes: dict[str, tuple[int, ...]]
    record: ConversionRecord
    model_class: type


def check_stock_layout(
    config: Any, model_class: type, checkpoint_files: Sequence[str | os.PathLike] | None, root: Path
) -> CheckedWeights:
    """Check a converted checkpoint's config against its weight files' headers, building no model of its size.

    The weight files must be regular files of one link inside ``root`` (where it is a directory,
    whose JSON files are checked too); their headers are read (never their data), the record is
    validated, and the config is checked with
    [`check_config_widths`][mumoe_tn.conversion.persistence.config_checks.check_config_widths] and
    [`check_config_layout`][mumoe_tn.conversion.persistence.config_checks.check_config_layout] (``model_class``
    built on the meta device with one and two layers). The stock hook runs this when transformers
    has found the weight files, before it builds the model: a config declaring 20,000 layers is
    refused without them being built.

    Parameters
    ----------
    config : PretrainedConfig
        The config transformers made, with its conversion record.
    model_class : type
        The model class ``from_pretrained`` builds.
    checkpoint_files : sequence of path-like, optional
        The weight files transformers found.
    root : Path
        The checkpoint directory (or a hub name, which is not a directory).

    Returns
    -------
    CheckedWeights

    Raises
    ------
    ValueError
        If there is no weight file, a file is outside the directory or malformed, or the config
        does not fit the weights.
    """
    files = tuple(Path(file) for file in checkpoint_files or ())
    if not files:
        raise ValueError("a converted checkpoint needs its weight files; transformers found none")
    if root.is_dir():
        check_json_files(root)
        members = [member_file(root, os.path.relpath(file.resolve(), root.resolve()), "weight file") for file in files]
    else:
        members = [regular_file(file, "weight file") for file in files]
    identities = [file_identity(file) for file in members]
    shapes = header_shapes(read_all_headers(members))
    check_unchanged(identities, "from_pretrained")  # the headers read are those of the files checked
    record = ConversionRecord.from_dict(getattr(config, RECORD_KEY))
    check_config_widths(config, shapes)  # cheap bounds first: the layout check builds the class on the meta device
    skip = [path for module in record.modules for path in module.paths]
    check_config_layout(config, model_layout(model_class, config), shapes, skip)
    return CheckedWeights(root, files, identities, shapes, record, model_class)
