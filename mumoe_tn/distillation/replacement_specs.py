"""What builds a replacement, as plain data: a saved run is rebuilt from it, never from code.

[`mumoe_factory`][mumoe_tn.distillation.replacements.mumoe_factory] and
[`transcoder_factory`][mumoe_tn.distillation.replacements.transcoder_factory] describe what they
build with a [`ReplacementSpec`][mumoe_tn.distillation.replacement_specs.ReplacementSpec] when
their arguments are plain values (a registered format's name, expert counts, ``k``, a budget, a
top-k gate's name, a recipe, ``aux_k`` as a bool, ``balance`` as a number); every module they
build then carries it as ``replacement_spec``.
[`save_frontier`][mumoe_tn.distillation.run_files.save_frontier] writes
those specs as JSON and [`load_frontier`][mumoe_tn.distillation.run_files.load_frontier] reads
them back with [`spec_from_data`][mumoe_tn.distillation.methods.spec_from_data], which hands each
to the reader its kind's registered method names (``transcoder_spec_from_data``,
``mumoe_spec_from_data`` here): every field is checked by type and range before anything is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mumoe_tn.decompositions.registry import available
from mumoe_tn.gates.registry import top_k_gates

__all__ = [
    "MAX_EXPERTS",
    "MAX_EXPERT_MODES",
    "MAX_SPEC_BALANCE",
    "MAX_SPEC_BUDGET",
    "MAX_SPEC_FRACTION",
    "MUMOE_KIND",
    "TRANSCODER_KIND",
    "ReplacementSpec",
    "check_spec_fields",
    "mumoe_spec_from_data",
    "transcoder_spec_from_data",
]

#: The kind of a (skip) transcoder's spec: the registered method that rebuilds it.
TRANSCODER_KIND = "transcoder"

#: The kind of a μMoE block's spec: the registered method, named by formats, that rebuilds it.
MUMOE_KIND = "mumoe"

#: Most expert modes of a described μMoE block.
MAX_EXPERT_MODES = 4

#: Most experts of a described μMoE block (all modes together), and most TopK latents.
MAX_EXPERTS = 1 << 24

#: Largest budget, in parameters, a spec may name.
MAX_SPEC_BUDGET = 1 << 40

#: Largest budget a spec may name as a multiple of the replaced block's parameters.
MAX_SPEC_FRACTION = 1024.0

_FIELDS = ("kind", "k", "budget", "skip", "format", "experts", "top_k", "recipe", "aux_k", "balance")

#: Fields that data written before they existed may lack (read as None, the factory's default).
_OPTIONAL_FIELDS = ("balance",)

#: Largest weight of the load-balancing term a spec may name.
MAX_SPEC_BALANCE = 1e3


@dataclass(frozen=True)
class ReplacementSpec:
    """The arguments of a factory that built a replacement, as plain values.

    Attributes
    ----------
    kind : str
        The registered distillation method that rebuilds it (see
        [`METHODS`][mumoe_tn.distillation.methods.METHODS]): ``"transcoder"`` for a (skip)
        transcoder, ``"mumoe"`` for a μMoE block of a registered format.
    k : int, tuple of int or None
        TopK latents (None: a ReLU transcoder), or experts kept per token, per expert mode.
    budget : int, float or None
        Parameters, a multiple of the replaced block's parameters, or None for the paper's budget.
    skip : bool
        A skip transcoder.
    format : str or None
        The μMoE block's format name.
    experts : tuple of int or None
        Experts per mode (None: a Mixture of Decoders whose expert count is solved for the budget).
    top_k : str
        The top-k gate's short name, or ``"auto"``.
    recipe : {"mxd-paper", "plain"} or None
        The μMoE block's initialisation (None: by format).
    aux_k : bool or None
        The auxiliary-k term (None: the factory's default).
    balance : float or None
        The weight of the load-balancing term (None: the factory's default).
    """

    kind: str
    k: int | tuple[int, ...] | None
    budget: int | float | None = None
    skip: bool = False
    format: str | None = None
    experts: tuple[int, ...] | None = None
    top_k: str = "auto"
    recipe: str | None = None
    aux_k: bool | None = None
    balance: float | None = None

    def to_data(self) -> dict[str, Any]:
        """The spec as JSON-able data (tuples as lists)."""
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name in _FIELDS
            for value in (getattr(self, name),)
        }


def _refuse(field: str, value: object, rule: str) -> ValueError:
    return ValueError(f"{field} = {value!r:.120} is invalid: {rule}")


def _size(field: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise _refuse(field, value, f"it must be an int from 1 to {limit:,}")
    return value


def _sizes(field: str, value: object, limit: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_EXPERT_MODES:
        raise _refuse(field, value, f"it must be a list of 1 to {MAX_EXPERT_MODES} ints")
    return tuple(_size(f"{field}[{i}]", entry, limit) for i, entry in enumerate(value))


def _budget(field: str, value: object) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or not 0 < value <= MAX_SPEC_FRACTION:
            raise _refuse(field, value, f"a fractional budget must be in (0, {MAX_SPEC_FRACTION:g}]")
        return value
    return _size(field, value, MAX_SPEC_BUDGET)


def _balance(field: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SPEC_BALANCE:
        raise _refuse(field, value, f"it must be null or a number from 0 to {MAX_SPEC_BALANCE:g}")
    return float(value)


def _choice(field: str, value: object, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices`` by type and value (``1`` is not ``True``)."""
    if not any(value is choice or (type(value) is type(choice) and value == choice) for choice in choices):
        raise _refuse(field, value, f"it must be one of {list(choices)}")
    return value


def check_spec_fields(data: object, field: str = "spec") -> Mapping[str, Any]:
    """``data`` if it is a JSON object of exactly a spec's fields (those written before they existed may lack).

    Raises
    ------
    ValueError
        Data that is no object, or a field missing or unknown (named).
    """
    if not isinstance(data, Mapping):
        raise _refuse(field, data, "it must be a JSON object")
    unknown = sorted(str(key)[:80] for key in data if key not in _FIELDS)
    missing = [name for name in _FIELDS if name not in data and name not in _OPTIONAL_FIELDS]
    if unknown or missing:
        raise ValueError(f"{field} is invalid: it must have exactly the fields {list(_FIELDS)} (missing {missing}, "
                         f"unknown {unknown[:5]})")  # fmt: skip
    return data


def _common(data: Mapping[str, Any], field: str) -> tuple[int | float | None, str, bool | None, float | None, bool]:
    """The fields every kind checks alike: budget, top_k, aux_k, balance, skip."""
    budget = _budget(f"{field}.budget", data["budget"])
    top_k = _choice(f"{field}.top_k", data["top_k"], ("auto", *top_k_gates()))
    aux_k = _choice(f"{field}.aux_k", data["aux_k"], (None, True, False))
    balance = _balance(f"{field}.balance", data.get("balance"))
    skip = _choice(f"{field}.skip", data["skip"], (True, False))
    return budget, top_k, aux_k, balance, skip


def transcoder_spec_from_data(data: Mapping[str, Any], field: str = "spec") -> ReplacementSpec:
    """A saved (skip) transcoder's spec, every field checked (``data`` as ``check_spec_fields`` passed it).

    Raises
    ------
    ValueError
        A field of the wrong type, out of range or set where a transcoder has none, named.
    """
    data = check_spec_fields(data, field)
    budget, _, _, _, skip = _common(data, field)
    k = None if data["k"] is None else _size(f"{field}.k", data["k"], MAX_EXPERTS)
    for name, default in (("format", None), ("experts", None), ("top_k", "auto"), ("recipe", None),
                          ("aux_k", None), ("balance", None)):  # fmt: skip
        if data.get(name) is not default and not (isinstance(default, str) and data[name] == default):
            raise _refuse(f"{field}.{name}", data[name], f"a transcoder's must be {default!r}")
    return ReplacementSpec(data["kind"], k, budget, skip)


def mumoe_spec_from_data(data: Mapping[str, Any], field: str = "spec") -> ReplacementSpec:
    """A saved μMoE block's spec, every field checked (``data`` as ``check_spec_fields`` passed it).

    Raises
    ------
    ValueError
        A field of the wrong type or out of range, an unregistered format, or ``k`` keeping more
        experts than there are, named.
    """
    data = check_spec_fields(data, field)
    budget, top_k, aux_k, balance, skip = _common(data, field)
    if skip:
        raise _refuse(f"{field}.skip", skip, "a μMoE block has no skip")
    formats = available()
    fmt = data["format"]
    if not isinstance(fmt, str) or fmt.lower() not in formats:
        raise _refuse(f"{field}.format", fmt, f"it must name a registered format of {sorted(formats)}")
    experts = None if data["experts"] is None else _sizes(f"{field}.experts", data["experts"], MAX_EXPERTS)
    if experts is not None and math.prod(experts) > MAX_EXPERTS:
        raise _refuse(f"{field}.experts", data["experts"], f"at most {MAX_EXPERTS:,} experts in all")
    k_data = data["k"]
    k = (
        _sizes(f"{field}.k", k_data, MAX_EXPERTS)
        if isinstance(k_data, list)
        else _size(f"{field}.k", k_data, MAX_EXPERTS)
    )
    if experts is not None:
        ks = (k,) * len(experts) if isinstance(k, int) and len(experts) == 1 else k
        if not isinstance(ks, tuple) or len(ks) != len(experts):
            raise _refuse(f"{field}.k", k_data, f"it must have one entry per expert mode ({len(experts)})")
        if any(kept > there for kept, there in zip(ks, experts, strict=True)):
            raise _refuse(f"{field}.k", k_data, f"it keeps more experts than the {list(experts)} there are")
    recipe = _choice(f"{field}.recipe", data["recipe"], (None, "mxd-paper", "plain"))
    return ReplacementSpec(data["kind"], k, budget, False, fmt, experts, top_k, recipe, aux_k, balance)
