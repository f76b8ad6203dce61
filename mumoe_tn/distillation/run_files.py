"""A frontier run saved to a directory that describes itself, and loaded back as data.

[`save_frontier`][mumoe_tn.distillation.run_files.save_frontier] writes ``frontier.json`` (the
table, and under ``config.saved_run`` what rebuilds the replacements: every block by its name and
shapes, every method by the [`ReplacementSpec`][mumoe_tn.distillation.replacement_specs.ReplacementSpec]
of the factory that built it — its ``kind`` the registered method
([`METHODS`][mumoe_tn.distillation.methods.METHODS]) that reads and rebuilds it — and the model's
directory relative to the run),
``replacements.safetensors`` (the weights, with the same record in its metadata) and ``model/``
(``save_pretrained``). It works from any entry point — ``mumoe-tn distill --save``,
[`run_frontier`][mumoe_tn.distillation.study.run_frontier] or
[`distill`][mumoe_tn.distillation.training.distill] with the library's factories — because every
module those factories build carries its spec.

[`load_frontier`][mumoe_tn.distillation.run_files.load_frontier] treats the directory as data:
it reads only regular files inside it (``st_nlink == 1``, links leading out refused before
anything is opened), each once, JSON up to
[`MAX_RUN_JSON_BYTES`][mumoe_tn.distillation.run_files.MAX_RUN_JSON_BYTES] and
[`MAX_JSON_DEPTH`][mumoe_tn.distillation.run_files.MAX_JSON_DEPTH] deep; it checks every field of
the record by type and range, the record against the one in the weights file, the stored
tensors against every recorded block and method and each budget against the parameters stored
for it before any module is built, then every module on the meta device against the stored
shapes; only then are the replacements built and filled, all or nothing. Blocks are selected by
their recorded names; nothing from the files is compiled or imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn

from mumoe_tn.conversion.persistence.config_checks import (
    check_config_fields,
    check_config_layout,
    check_config_widths,
    model_layout,
)
from mumoe_tn.conversion.persistence.files import (
    FileBytes,
    Headers,
    check_unchanged,
    gather_weights,
    member_file,
    read_once,
    weight_files,
)
from mumoe_tn.conversion.surgery.block_kinds import BLOCK_KINDS, block_kind
from mumoe_tn.costs.baselines import transcoder_parameters
from mumoe_tn.costs.matching import resolve_target
from mumoe_tn.distillation.frontier import FrontierTable
from mumoe_tn.distillation.methods import factory_from_spec, spec_from_data
from mumoe_tn.distillation.replacement_files import fill_replacements, read_replacements, save_replacements
from mumoe_tn.distillation.replacement_specs import ReplacementSpec
from mumoe_tn.distillation.replacements import PAPER_EXPANSION
from mumoe_tn.distillation.streaming import BlockInfo, select_blocks

__all__ = [
    "BUDGET_RATIO",
    "MAX_JSON_DEPTH",
    "MAX_RUN_BLOCKS",
    "MAX_RUN_JSON_BYTES",
    "MAX_RUN_METHODS",
    "MAX_RUN_NAME",
    "MODEL_DIRECTORY",
    "REPLACEMENTS_FILE",
    "RUN_FORMAT",
    "TABLE_FILE",
    "SavedRun",
    "load_frontier",
    "read_record",
    "run_record",
    "save_frontier",
]

TABLE_FILE, REPLACEMENTS_FILE, MODEL_DIRECTORY = "frontier.json", "replacements.safetensors", "model"
"""The files of a saved frontier run, in its directory."""

RUN_FORMAT = "mumoe_tn.frontier-run/1"
"""The ``format`` of a saved run's record."""

MAX_RUN_JSON_BYTES = 16 << 20
"""Largest ``frontier.json`` or ``model/config.json`` read (a table of thousands of rows is a few MB)."""

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and lists in those files (a run's is at most 5)."""

MAX_RUN_BLOCKS, MAX_RUN_METHODS, MAX_RUN_NAME = 4096, 1024, 256
"""Most blocks and most methods a run's record may name, and the longest name."""

BUDGET_RATIO = 4
"""A recorded budget and the parameters stored for it may be at most this factor apart."""

_BLOCK_FIELDS = ("kind", "in_features", "hidden_features", "out_features", "bias", "parameters", "methods")
_RECORD_FIELDS = ("format", "model", "blocks", "methods")


# ----------------------------------------------------------------------------- saving
def save_frontier(
    directory: str | Path,
    table: FrontierTable,
    replacements: Mapping[str, Mapping[str, nn.Module]],
    model: nn.Module,
    *,
    save_model: bool = True,
) -> Path:
    """Write a frontier run to ``directory``: its table, its replacements, what rebuilds them, and the model.

    Parameters
    ----------
    directory : str or Path
        A new or empty directory.
    table : FrontierTable
        The run's table (its ``config`` is kept, with the record under ``"saved_run"``).
    replacements : Mapping
        ``block name -> method -> module``, each built by
        [`mumoe_factory`][mumoe_tn.distillation.replacements.mumoe_factory] or
        [`transcoder_factory`][mumoe_tn.distillation.replacements.transcoder_factory] with plain
        arguments (the module carries its ``replacement_spec``).
    model : nn.Module
        The model the replacements were distilled from: its blocks' shapes are recorded.
    save_model : bool, optional
        Write the model into ``model/`` (``save_pretrained``); without it,
        [`load_frontier`][mumoe_tn.distillation.run_files.load_frontier] needs ``model=``.

    Returns
    -------
    Path
        The directory.

    Raises
    ------
    ValueError
        A directory that is not new or empty, a replacement without a spec (named), a method
        name used for two different specs, or a block the model does not have.
    """
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(f"save= must be a new or empty directory, got {str(directory)!r}")
    if not isinstance(table, FrontierTable):
        raise TypeError(f"table must be a FrontierTable, got {type(table).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the nn.Module the replacements were distilled from, got {type(model).__name__}")
    record = run_record(replacements, model, MODEL_DIRECTORY if save_model else None)
    text = json.dumps(record, sort_keys=True)
    directory.mkdir(parents=True, exist_ok=True)
    saved = dataclasses.replace(table, config={**table.config, "saved_run": record})
    (directory / TABLE_FILE).write_text(saved.to_json() + "\n")
    save_replacements(replacements, directory / REPLACEMENTS_FILE, metadata={"saved_run": text})
    if save_model:
        model.save_pretrained(directory / MODEL_DIRECTORY)
    return directory


def run_record(
    replacements: Mapping[str, Mapping[str, nn.Module]], model: nn.Module, model_path: str | None
) -> dict[str, Any]:
    """The record that rebuilds ``replacements`` for ``model``: blocks by name and shape, methods by spec."""
    if not isinstance(replacements, Mapping) or not replacements:
        raise ValueError("replacements must be a non-empty mapping block -> method -> module")
    specs: dict[str, dict[str, Any]] = {}
    for block, methods in replacements.items():
        _check_name(f"replacements[{block!r:.80}]", block)
        if not isinstance(methods, Mapping) or not methods:
            raise ValueError(f"replacements[{block!r:.80}] must be a non-empty mapping method -> module")
        for method, module in methods.items():
            where = f"replacements[{block!r:.80}][{method!r:.80}]"
            _check_name(where, method)
            spec = getattr(module, "replacement_spec", None)
            if not isinstance(spec, ReplacementSpec):
                raise ValueError(
                    f"{where} carries no replacement_spec: only modules built by mumoe_factory (a registered format's "
                    "name, no layer= or block options) or transcoder_factory can be saved as a run that rebuilds "
                    "itself; save others with save_replacements"
                )
            data = spec.to_data()
            if specs.setdefault(method, data) != data:
                raise ValueError(f"{where}: the method {method!r:.80} names two different replacements in this run")
    found = {block.name: block for block in select_blocks(model, lambda name, _: name in replacements)}
    absent = [name for name in replacements if name not in found]
    if absent:
        raise ValueError(f"the model has no MLP block {absent[0]!r:.120}: save the model the replacements came from")
    blocks = {
        name: {
            "kind": info.kind,
            "in_features": info.in_features,
            "hidden_features": info.hidden_features,
            "out_features": info.out_features,
            "bias": info.bias,
            "parameters": info.parameters,
            "methods": list(replacements[name]),
        }
        for name, info in found.items()
    }
    return {"format": RUN_FORMAT, "model": model_path, "blocks": blocks, "methods": specs}


def _check_name(field: str, name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_RUN_NAME or "/" in name or not name.isprintable():
        raise ValueError(
            f"{field} = {name!r:.120} is invalid: a block or method name is 1 to {MAX_RUN_NAME} printable characters "
            "without '/'"
        )
    return name


# ----------------------------------------------------------------------------- reading the record
def _depth(data: object, limit: int, field: str) -> None:
    """Refuse data nested more than ``limit`` deep (iteratively: no recursion on crafted input)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                raise ValueError(f"{field} nests objects and lists more than {limit} deep")
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))


def _parse(data: bytes, field: str) -> Any:
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{field} is not valid JSON ({type(error).__name__}: {str(error)[:120]})") from None
    _depth(parsed, MAX_JSON_DEPTH, field)
    return parsed


def _int(field: str, value: object, limit: int = 1 << 40) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"{field} = {value!r:.80} is invalid: it must be an int from 1 to {limit:,}")
    return value


def _object(field: str, value: object, names: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{field} = {value!r:.80} is invalid: it must be a JSON object")
    missing = [name for name in names if name not in value]
    unknown = sorted(str(key)[:80] for key in value if key not in names)
    if missing or unknown:
        raise ValueError(f"{field} is invalid: it must have the fields {list(names)} (missing {missing}, unknown "
                         f"{unknown[:5]})")  # fmt: skip
    return value


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """A run's checked record: what rebuilds its replacements.

    Attributes
    ----------
    model : str or None
        The model's directory, relative to the run (None: the run saved no model).
    blocks : dict
        Block name -> its recorded ``kind``, sizes, ``bias``, ``parameters`` and ``methods``.
    methods : dict of str to ReplacementSpec
        Method name -> the spec that builds it.
    """

    model: str | None
    blocks: dict[str, dict[str, Any]]
    methods: dict[str, ReplacementSpec]


def _model_path(field: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_RUN_NAME or "\\" in value or "\0" in value:
        raise ValueError(f"{field} = {value!r:.120} is invalid: it must be null or a relative path inside the run")
    path = PurePosixPath(value)
    if path.is_absolute() or any(part in ("..", "") for part in value.split("/")) or os.path.isabs(value):
        raise ValueError(
            f"{field} = {value!r:.120} is invalid: the model must lie inside the run directory (a relative path "
            "without '..'); pass another model with load_frontier(..., model=)"
        )
    return value


def read_record(data: object, field: str = "saved_run") -> SavedRun:
    """The checked record of a run (see the module's notes); every refusal names its field."""
    if data is None:
        raise ValueError(
            f"{field} is missing: the run was saved by a mumoe_tn that did not record how to rebuild its replacements; "
            "run it again with save="
        )
    record = _object(field, data, _RECORD_FIELDS)
    if record["format"] != RUN_FORMAT:
        raise ValueError(f"{field}.format = {record['format']!r:.80} is invalid: expected {RUN_FORMAT!r}")
    model = _model_path(f"{field}.model", record["model"])
    methods_data, blocks_data = record["methods"], record["blocks"]
    if not isinstance(methods_data, dict) or not 0 < len(methods_data) <= MAX_RUN_METHODS:
        raise ValueError(f"{field}.methods is invalid: it must be an object of 1 to {MAX_RUN_METHODS} methods")
    if not isinstance(blocks_data, dict) or not 0 < len(blocks_data) <= MAX_RUN_BLOCKS:
        raise ValueError(f"{field}.blocks is invalid: it must be an object of 1 to {MAX_RUN_BLOCKS} blocks")
    methods = {
        _check_name(f"{field}.methods", name): spec_from_data(spec, f"{field}.methods[{name!r}]")
        for name, spec in methods_data.items()
    }
    blocks = {}
    for name, entry in blocks_data.items():
        where = f"{field}.blocks[{_check_name(f'{field}.blocks', name)!r}]"
        entry = _object(where, entry, _BLOCK_FIELDS)
        distilled = [name for name in BLOCK_KINDS.names() if block_kind(name).mlp and not block_kind(name).split]
        if not isinstance(entry["kind"], str) or entry["kind"] not in distilled:
            raise ValueError(f"{where}.kind = {entry['kind']!r:.80} is invalid: it must be one of {distilled}")
        if not isinstance(entry["bias"], bool):
            raise ValueError(f"{where}.bias = {entry['bias']!r:.80} is invalid: it must be true or false")
        for size in ("in_features", "hidden_features", "out_features"):
            _int(f"{where}.{size}", entry[size], 1 << 24)
        _int(f"{where}.parameters", entry["parameters"])
        listed = entry["methods"]
        if not isinstance(listed, list) or not listed or len(set(map(str, listed))) != len(listed):
            raise ValueError(f"{where}.methods = {listed!r:.80} is invalid: it must be a list of distinct method names")
        unknown = [method for method in listed if method not in methods]
        if unknown:
            raise ValueError(f"{where}.methods names {unknown[0]!r:.80}, which {field}.methods does not describe")
        blocks[name] = dict(entry)
    return SavedRun(model, blocks, methods)


def _difference(a: object, b: object, field: str) -> str | None:
    """The first field where two parsed JSON values differ, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{field}.{key}"
            found = _difference(a[key], b[key], f"{field}.{key}")
            if found:
                return found
        return None
    if type(a) is not type(b) or a != b:
        return field
    return None


# ----------------------------------------------------------------------------- the files
def _read_member(root: Path, name: str, reads: list[FileBytes], *, limit: int | None = None) -> FileBytes:
    """A file of the run: inside it once links are resolved, a regular file with one link, read once."""
    file = member_file(root, name, name)
    try:
        links = os.stat(file).st_nlink
    except OSError as error:
        raise ValueError(f"{name} cannot be read ({error.strerror})") from None
    if links != 1:
        raise ValueError(f"{name} has {links} hard links: a run's file must have one (a hard link may lead out)")
    read = read_once(file, name, limit=limit, follow=False)
    reads.append(dataclasses.replace(read, data=b""))
    return read


def _stored(run: SavedRun, headers: Headers) -> dict[tuple[str, str], int]:
    """Elements stored per ``(block, method)``: every key must belong to a recorded pair, every pair hold some."""
    pairs = {(block, method): 0 for block, entry in run.blocks.items() for method in entry["methods"]}
    for key, (shape, _) in headers.items():
        block, _, rest = key.partition("/")
        method, _, tensor = rest.partition("/")
        if (block, method) not in pairs or not tensor:
            raise ValueError(
                f"{REPLACEMENTS_FILE} holds the tensor {key!r:.120}, which belongs to no block and method of the run's "
                "record (saved_run.blocks)"
            )
        count = 1
        for size in shape:
            count *= size
        pairs[block, method] += count
    empty = [pair for pair, count in pairs.items() if count == 0]
    if empty:
        raise ValueError(f"{REPLACEMENTS_FILE} holds no tensor of {'/'.join(empty[0])!r}, which saved_run records")
    return pairs


def _check_budgets(run: SavedRun, stored: Mapping[tuple[str, str], int]) -> None:
    """Each method's budget against the parameters stored for it, before anything is built."""
    for (block, method), count in stored.items():
        spec, entry = run.methods[method], run.blocks[block]
        if spec.budget is None:
            target = transcoder_parameters(
                entry["in_features"], PAPER_EXPANSION * entry["in_features"], entry["out_features"]
            )
        else:
            target = resolve_target(spec.budget, entry["parameters"])
        if target > BUDGET_RATIO * count or count > BUDGET_RATIO * target:
            raise ValueError(
                f"saved_run.methods[{method!r}].budget = {spec.budget!r} is invalid: a replacement of {block!r} built "
                f"for {target:,} parameters, but {REPLACEMENTS_FILE} stores {count:,} for it (more than "
                f"{BUDGET_RATIO}× apart)"
            )


def _read_model(root: Path, relative: str, reads: list[FileBytes]) -> nn.Module:
    """The model saved in the run (``save_pretrained``), read as data: transformers opens none of its files."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    base = root / relative
    resolved = base.resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"saved_run.model = {relative!r} is invalid: it leads outside the run directory {str(root)!r}")
    if not resolved.is_dir():
        raise ValueError(f"saved_run.model = {relative!r} is invalid: it must name a directory of the run")
    config = _parse(_read_member(root, f"{relative}/config.json", reads, limit=MAX_RUN_JSON_BYTES).data,
                    f"{relative}/config.json")  # fmt: skip
    if not isinstance(config, dict):
        raise ValueError(f"{relative}/config.json is invalid: it must be a JSON object")

    def weight_reads() -> Iterator[tuple[str, FileBytes]]:
        for file in weight_files(resolved, reads):  # one file, or the shards a checked index names
            name = file.relative_to(root).as_posix()
            if file.suffix != ".safetensors":
                raise ValueError(f"{name} is not a safetensors file: a run's model is saved with save_pretrained")
            yield name, _read_member(root, name, reads)

    state, shapes = gather_weights(weight_reads(), "the model")
    check_config_fields(config)
    check_config_widths(config, shapes)  # cheap bounds first: the layout check builds the class on the meta device
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{relative}/config.json: model_type = {model_type!r:.80} names no model type transformers knows"
        )
    config_class = CONFIG_MAPPING[model_type]
    if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{relative}/config.json: model_type = {model_type!r:.80} is not a causal language model")
    transformers.logging.set_verbosity_error()
    settings = {key: value for key, value in config.items() if key not in ("auto_map", "quantization_config")}
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    try:  # transformers raises many kinds for a malformed config: its own validation errors, KeyError, RuntimeError
        model_config = config_class.from_dict(settings)
    except Exception as error:
        raise ValueError(
            f"{relative}/config.json does not describe a model ({type(error).__name__}: {str(error)[:200]})"
        ) from None
    check_config_layout(config, model_layout(cls, model_config), shapes)
    try:
        model, info = cls.from_pretrained(None, config=model_config, state_dict=state, output_loading_info=True)
    except Exception as error:
        raise ValueError(
            f"{relative}/config.json does not describe the model its weights hold ({type(error).__name__}: "
            f"{str(error)[:200]})"
        ) from None
    problems = {name: sorted(map(str, info.get(name) or ())) for name in ("missing_keys", "unexpected_keys",
                                                                          "mismatched_keys")}  # fmt: skip
    problems = {name: keys[:5] for name, keys in problems.items() if keys}
    if problems:
        raise ValueError(f"the weights of {relative}/ do not fit its config.json: {problems}")
    return model.eval()


def _blocks(run: SavedRun, model: nn.Module) -> list[BlockInfo]:
    """The model's blocks of the recorded names, checked against the recorded shapes."""
    found = {block.name: block for block in select_blocks(model, lambda name, _: name in run.blocks)}
    for name, entry in run.blocks.items():
        if name not in found:
            raise ValueError(f"saved_run.blocks[{name!r}] is invalid: the model has no MLP block of that name")
        info = found[name]
        for key in _BLOCK_FIELDS[:-1]:
            if getattr(info, key) != entry[key]:
                raise ValueError(
                    f"saved_run.blocks[{name!r}].{key} = {entry[key]!r} differs from the model's {getattr(info, key)!r}"
                )
    return [found[name] for name in run.blocks]


def _check_shapes(run: SavedRun, blocks: list[BlockInfo], headers: Headers) -> None:
    """Every replacement built on the meta device (no memory) against the stored shapes."""
    meta = torch.device("meta")
    for block in blocks:
        for method in run.blocks[block.name]["methods"]:
            skeleton = factory_from_spec(run.methods[method])(dataclasses.replace(block, device=meta))
            built = {f"{block.name}/{method}/{key}": tuple(t.shape) for key, t in skeleton.state_dict().items()}
            stored = {key: shape for key, (shape, _) in headers.items() if key.startswith(f"{block.name}/{method}/")}
            if built != stored:
                differ = sorted(key for key in set(built) | set(stored) if built.get(key) != stored.get(key))
                raise ValueError(
                    f"saved_run.methods[{method!r}] builds a replacement of {block.name!r} that {REPLACEMENTS_FILE} "
                    f"does not hold: {differ[0]!r} is {built.get(differ[0])} built, {stored.get(differ[0])} stored"
                )


def load_frontier(
    directory: str | Path, *, model: nn.Module | None = None
) -> tuple[nn.Module, dict[str, dict[str, nn.Module]], FrontierTable]:
    """The model, the trained replacements (``block -> method -> module``) and the table of a saved run.

    The replacements are rebuilt from the run's record (see the module's notes) and filled from
    ``replacements.safetensors``; splice one in with
    [`splice`][mumoe_tn.distillation.splicing.splice].

    Parameters
    ----------
    directory : str or Path
        What [`save_frontier`][mumoe_tn.distillation.run_files.save_frontier] wrote.
    model : nn.Module, optional
        The model to load the replacements for (default: the run's ``model/``; needed when the run
        saved none). Its blocks must have the recorded names and shapes.

    Returns
    -------
    tuple
        ``(model, replacements, table)``.

    Raises
    ------
    ValueError
        A directory without a saved run; a file outside it, linked, not regular, too large or
        changed while read; a field of the record missing, malformed or out of range, or
        differing from the weights file, the stored tensors or the model (the field is named).
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
    given = Path(directory)
    if not given.is_dir() or not os.path.lexists(given / TABLE_FILE):
        raise ValueError(f"{str(given)!r} holds no saved frontier run (no {TABLE_FILE})")
    root = given.resolve()  # once: the run's files are checked against this directory
    reads: list[FileBytes] = []
    data = _parse(_read_member(root, TABLE_FILE, reads, limit=MAX_RUN_JSON_BYTES).data, TABLE_FILE)
    table = FrontierTable.from_data(data, TABLE_FILE)
    run = read_record(table.config.get("saved_run"), f"{TABLE_FILE}: config.saved_run")
    unknown = [row for row in table.rows if row.method not in run.blocks.get(row.block, {}).get("methods", ())]
    if unknown:
        raise ValueError(
            f"{TABLE_FILE}: a row of {unknown[0].block!r}/{unknown[0].method!r} names no saved replacement"
        )
    tensors, headers, metadata = read_replacements(_read_member(root, REPLACEMENTS_FILE, reads))
    if "saved_run" not in metadata:
        raise ValueError(f"{REPLACEMENTS_FILE}: saved_run is missing from its metadata")
    differs = _difference(table.config["saved_run"], _parse(metadata["saved_run"].encode(), REPLACEMENTS_FILE),
                          "saved_run")  # fmt: skip
    if differs:
        raise ValueError(f"{differs} differs between {TABLE_FILE} and {REPLACEMENTS_FILE}: they are not of one run")
    _check_budgets(run, _stored(run, headers))
    if model is None:
        if run.model is None:
            source = table.config.get("model_dir")
            named = f" (the table names {str(source)[:200]!r})" if isinstance(source, str) else ""
            raise ValueError(
                f"saved_run.model is null: the run saved no model{named}; load the model it distilled "
                "and pass it as model="
            )
        model = _read_model(root, run.model, reads)
    blocks = _blocks(run, model)
    _check_shapes(run, blocks, headers)
    with torch.random.fork_rng(devices=[]):
        built = {
            block.name: {
                method: factory_from_spec(run.methods[method])(block) for method in run.blocks[block.name]["methods"]
            }
            for block in blocks
        }
    check_unchanged(reads, str(given))
    return model, fill_replacements(built, tensors, str(root / REPLACEMENTS_FILE)), table
