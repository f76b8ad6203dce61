"""Distillation methods as registered objects: a name, and a factory built from a structured spec.

A method of the frontier — a TopK transcoder, a skip transcoder, a μMoE block of a registered
format, flat or with two expert modes — is a
[`DistillationMethod`][mumoe_tn.distillation.methods.DistillationMethod] in
[`METHODS`][mumoe_tn.distillation.methods.METHODS]. Its text form (``"transcoder"``,
``"skip-transcoder"``, ``"cp"``, ``"cp-hier"``, …, what ``--methods`` takes) is parsed once, by
[`parse_method`][mumoe_tn.distillation.methods.parse_method], into a
[`MethodSpec`][mumoe_tn.distillation.methods.MethodSpec]: the method's family, the format of a
μMoE block, flat or hierarchical expert modes, ``k`` (the L0), the budget and a default recipe.
Every tool (the frontier, the command line, saved runs, the benchmarks) asks the spec and the
registry, never the text. Three methods are registered:

- ``"transcoder"`` and ``"skip-transcoder"``: a (skip) TopK transcoder, the references the
  paired comparisons are made against;
- ``"mumoe"``: named by a registered format's name (``"cp"``), or the name with ``"-hier"`` for
  the same number of experts in two modes (``256`` → ``16×16``), top-k per mode.

A method of your own is one call; it reaches ``run_frontier``, ``mumoe-tn distill --methods`` and
the benchmarks by its name:

```python
from mumoe_tn.distillation.methods import available_methods, register_method, unregister_method
from mumoe_tn.distillation.replacements import transcoder_factory


def wide_transcoder(spec, settings):
    return transcoder_factory(spec.k, 2 * (spec.budget or 1.0))


register_method("wide-transcoder", wide_transcoder)
assert "wide-transcoder" in available_methods()
unregister_method("wide-transcoder")
```

A saved run records each replacement by the
[`ReplacementSpec`][mumoe_tn.distillation.replacement_specs.ReplacementSpec] its factory attached;
a method that gives ``read`` and ``rebuild`` is saved and rebuilt by
[`spec_from_data`][mumoe_tn.distillation.methods.spec_from_data] and
[`factory_from_spec`][mumoe_tn.distillation.methods.factory_from_spec], the spec's ``kind`` being
the method's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mumoe_tn.decompositions.registry import available
from mumoe_tn.distillation.replacement_specs import (
    MUMOE_KIND,
    TRANSCODER_KIND,
    ReplacementSpec,
    check_spec_fields,
    mumoe_spec_from_data,
    transcoder_spec_from_data,
)
from mumoe_tn.distillation.replacements import TRANSCODER_RECIPES, mode_split, mumoe_factory, transcoder_factory
from mumoe_tn.distillation.training import RECIPES, Factory
from mumoe_tn.registry import Registry

__all__ = [
    "BEST_RECIPES",
    "DEFAULT_METHODS",
    "HIERARCHICAL_SUFFIX",
    "METHODS",
    "DistillationMethod",
    "MethodSettings",
    "MethodSpec",
    "available_methods",
    "check_methods",
    "factory_from_spec",
    "method_factory",
    "parse_method",
    "parse_methods",
    "reference_methods",
    "register_method",
    "spec_from_data",
    "unregister_method",
]

#: What a format's name ends with to name a μMoE block of two expert modes (``"cp-hier"``).
HIERARCHICAL_SUFFIX = "-hier"

#: The methods of the default frontier, in their text form.
DEFAULT_METHODS = ("transcoder", "skip-transcoder", "mxd", "mxd-hier", "cp", "cp-hier", "tr", "tr-hier")


@dataclass(frozen=True)
class MethodSpec:
    """One method of a frontier, as structured data: what its text form says, and its sparsity and budget.

    Attributes
    ----------
    family : str
        The registered method (``"transcoder"``, ``"skip-transcoder"``, ``"mumoe"``, one of yours).
    format : str or None
        The μMoE block's format, for a method named by formats (None otherwise).
    hierarchical : bool
        Two expert modes (the text form's ``"-hier"``); False: one (flat).
    k : int or None
        The sparsity L0: TopK latents, or experts active per token (None until a frontier sets it).
    budget : int, float or None
        Parameters per replacement, or a multiple of the block's (None: the paper's budget).
    recipe : str or None
        The method's default recipe name (see [`RECIPES`][mumoe_tn.distillation.trainer.RECIPES]);
        None: the run's.
    """

    family: str
    format: str | None = None
    hierarchical: bool = False
    k: int | None = None
    budget: int | float | None = None
    recipe: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"MethodSpec.family must be a registered method's name, got {self.family!r:.80}")
        if self.format is not None and (not isinstance(self.format, str) or not self.format):
            raise ValueError(f"MethodSpec.format must be None or a format's name, got {self.format!r:.80}")
        if not isinstance(self.hierarchical, bool):
            raise TypeError(f"MethodSpec.hierarchical must be a bool, got {self.hierarchical!r:.80}")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"MethodSpec.k must be None or a positive int, got {self.k!r:.80}")
        budget = self.budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
            raise ValueError(f"MethodSpec.budget must be None or a positive number, got {budget!r:.80}")
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"MethodSpec.recipe must be None or one of {sorted(RECIPES)}, got {self.recipe!r:.80}")

    @property
    def text(self) -> str:
        """The text form: the method's name, or the format's name (with ``"-hier"`` for two modes)."""
        if self.format is None:
            return self.family
        return self.format + (HIERARCHICAL_SUFFIX if self.hierarchical else "")


@dataclass(frozen=True)
class MethodSettings:
    """What a frontier sets for all its methods (each factory takes what applies to it).

    Attributes
    ----------
    experts : int
        Experts of every μMoE block (split into two modes for a hierarchical one).
    top_k : str
        The μMoE blocks' top-k gate (``"auto"``: by format).
    recipe : str
        The run's recipe; a method whose spec names none follows it.
    aux_k : bool or None
        The auxiliary-k term on the μMoE blocks (None: the factory's default).
    balance : float or None
        The weight of the load-balancing term on the μMoE blocks (None: the factory's default).
    """

    experts: int = 256
    top_k: str = "auto"
    recipe: str = "mxd-paper"
    aux_k: bool | None = None
    balance: float | None = None


@dataclass(frozen=True)
class DistillationMethod:
    """A registered distillation method.

    Attributes
    ----------
    name : str
        Its name: its text form, or for a method named by formats the family the specs carry.
    factory : Callable
        ``factory(spec, settings)`` returns the replacement's factory (``BlockInfo -> nn.Module``)
        for a [`MethodSpec`][mumoe_tn.distillation.methods.MethodSpec] whose ``k`` is set and the
        frontier's [`MethodSettings`][mumoe_tn.distillation.methods.MethodSettings].
    by_format : bool
        Named by a registered format's name (``"cp"``, ``"cp-hier"``) instead of its own.
    takes_top_k : bool
        Built with the frontier's top-k gate: a ``top_k`` other than ``"auto"`` is part of the
        replacement's name (``"cp:relu@8"``).
    reference : bool
        A reference the command's paired comparisons are made against.
    check : Callable or None
        ``check(spec, settings)`` refuses a spec the method cannot build (an L0 out of reach)
        with a ``ValueError``, before any work.
    read : Callable or None
        ``read(data, field)`` reads a saved [`ReplacementSpec`][mumoe_tn.distillation.replacement_specs.ReplacementSpec]
        whose ``kind`` is this method's name, checking every field.
    rebuild : Callable or None
        ``rebuild(spec)`` gives the factory a saved ``ReplacementSpec`` describes.
    """

    name: str
    factory: Callable[[MethodSpec, MethodSettings], Factory]
    by_format: bool = False
    takes_top_k: bool = False
    reference: bool = False
    check: Callable[[MethodSpec, MethodSettings], None] | None = None
    read: Callable[[Mapping[str, Any], str], ReplacementSpec] | None = None
    rebuild: Callable[[ReplacementSpec], Factory] | None = None


def _transcoder_recipe(spec: MethodSpec, settings: MethodSettings) -> str | None:
    """The recipe a transcoder is initialised for: the spec's or the run's, where it is a transcoder's own."""
    recipe = spec.recipe or settings.recipe
    return recipe if recipe in TRANSCODER_RECIPES else None


def _transcoder(spec: MethodSpec, settings: MethodSettings) -> Factory:
    return transcoder_factory(spec.k, spec.budget, recipe=_transcoder_recipe(spec, settings))


def _skip_transcoder(spec: MethodSpec, settings: MethodSettings) -> Factory:
    return transcoder_factory(spec.k, spec.budget, skip=True, recipe=_transcoder_recipe(spec, settings))


def _rebuild_transcoder(spec: ReplacementSpec) -> Factory:
    return transcoder_factory(spec.k, spec.budget, skip=spec.skip)  # type: ignore[arg-type]


def _expert_dims(spec: MethodSpec, experts: int) -> int | tuple[int, ...]:
    return mode_split(experts, 2) if spec.hierarchical else experts


def _mumoe(spec: MethodSpec, settings: MethodSettings) -> Factory:
    recipe = spec.recipe or settings.recipe
    initial = "plain" if recipe == "plain" else None  # None: the authors' init for a Mixture of Decoders
    return mumoe_factory(
        spec.format, _expert_dims(spec, settings.experts), spec.k, spec.budget, top_k=settings.top_k,  # type: ignore[arg-type]
        recipe=initial, aux_k=settings.aux_k, balance=settings.balance,
    )  # fmt: skip


def _mumoe_reach(spec: MethodSpec, settings: MethodSettings) -> None:
    """Refuse an L0 that a μMoE block of ``settings.experts`` experts cannot have active (naming ``--experts``)."""
    l0, experts = spec.k, settings.experts
    if l0 is None:
        return
    if spec.hierarchical:
        ks, dims = mode_split(l0, 2), mode_split(experts, 2)
        if any(k > n for k, n in zip(ks, dims, strict=True)):
            raise ValueError(
                f"L0 {l0} is out of reach of {spec.text!r} with {experts} experts: it keeps {ks[0]}×{ks[1]} of "
                f"{dims[0]}×{dims[1]} experts per mode; raise --experts (experts=; --quick uses 16)"
            )
    elif l0 > experts:
        raise ValueError(
            f"L0 {l0} is more than the {experts} experts of {spec.text!r}: raise --experts (experts=; --quick "
            f"uses 16) to at least {l0}"
        )


def _rebuild_mumoe(spec: ReplacementSpec) -> Factory:
    return mumoe_factory(spec.format, spec.experts, spec.k, spec.budget, top_k=spec.top_k, recipe=spec.recipe,
                         aux_k=spec.aux_k, balance=spec.balance)  # type: ignore[arg-type]  # fmt: skip


def _check_entry(name: str, method: DistillationMethod) -> None:
    if not isinstance(method, DistillationMethod):
        raise TypeError(f"a distillation method is registered as a DistillationMethod, got {method!r:.80}")
    if method.name != name:
        raise ValueError(f"the distillation method {method.name!r} cannot be registered as {name!r}")


METHODS: Registry[str, DistillationMethod] = Registry(
    "distillation method",
    check=_check_entry,
    entries={
        method.name: method
        for method in (
            DistillationMethod(TRANSCODER_KIND, _transcoder, reference=True, read=transcoder_spec_from_data,
                               rebuild=_rebuild_transcoder),
            DistillationMethod("skip-transcoder", _skip_transcoder, reference=True),
            DistillationMethod(MUMOE_KIND, _mumoe, by_format=True, takes_top_k=True, check=_mumoe_reach,
                               read=mumoe_spec_from_data, rebuild=_rebuild_mumoe),
        )
    },
)  # fmt: skip
"""The registered distillation methods, by name (written through ``register_method``)."""


def register_method(
    name: str,
    factory: Callable[[MethodSpec, MethodSettings], Factory],
    *,
    by_format: bool = False,
    takes_top_k: bool = False,
    reference: bool = False,
    check: Callable[[MethodSpec, MethodSettings], None] | None = None,
    read: Callable[[Mapping[str, Any], str], ReplacementSpec] | None = None,
    rebuild: Callable[[ReplacementSpec], Factory] | None = None,
    replace: bool = False,
) -> DistillationMethod:
    """Register a distillation method (see [`DistillationMethod`][mumoe_tn.distillation.methods.DistillationMethod]).

    Parameters
    ----------
    name : str
        Its name, what ``--methods`` takes: printable, without ``"@"``, ``":"``, ``"/"`` or blanks
        (the replacements are named ``"<method>@<L0>"``).
    factory, by_format, takes_top_k, reference, check, read, rebuild
        As the attributes of ``DistillationMethod``.
    replace : bool, optional
        Replace the method registered under ``name`` (default: raise).

    Returns
    -------
    DistillationMethod

    Raises
    ------
    ValueError
        A name that is empty or holds a reserved character, or one taken while ``replace`` is False.
    TypeError
        A factory, check, read or rebuild that is not callable.
    """
    if not isinstance(name, str) or not name or not name.isprintable() or any(c in name for c in "@:/ \t"):
        raise ValueError(f"a distillation method needs a printable name without '@', ':', '/' or blanks, got {name!r}")
    for field, value in (("factory", factory), ("check", check), ("read", read), ("rebuild", rebuild)):
        if (value is not None or field == "factory") and not callable(value):
            raise TypeError(f"{field} must be callable, got {value!r:.80}")
    if (read is None) != (rebuild is None):
        raise ValueError("give read and rebuild together: a saved replacement is read and then rebuilt")
    method = DistillationMethod(name, factory, bool(by_format), bool(takes_top_k), bool(reference), check, read,
                                rebuild)  # fmt: skip
    return METHODS.register(name, method, replace=replace)


def unregister_method(name: str) -> None:
    """Remove the method registered under ``name`` (e.g. at the end of a test)."""
    METHODS.unregister(name)


def available_methods() -> list[str]:
    """The registered methods' names (a method named by formats is listed by its family)."""
    return METHODS.names()


def reference_methods() -> tuple[str, ...]:
    """The text forms of the references the paired comparisons are made against (the transcoders)."""
    return tuple(name for name, method in METHODS.items() if method.reference and not method.by_format)


def _unknown(text: str) -> ValueError:
    named = [name for name, method in METHODS.items() if not method.by_format]
    by_format = [name for name, method in METHODS.items() if method.by_format]
    formats = f", or a format name of {sorted(available())} (with {HIERARCHICAL_SUFFIX!r} for two expert modes)"
    return ValueError(
        f"unknown method {text!r:.80}: the registered distillation methods are {sorted(named)}"
        + (formats if by_format else "")
    )


def parse_method(method: str | MethodSpec) -> MethodSpec:
    """The [`MethodSpec`][mumoe_tn.distillation.methods.MethodSpec] a method's text form names.

    Parameters
    ----------
    method : str or MethodSpec
        ``"transcoder"``, ``"skip-transcoder"``, a registered format's name, that name with
        ``"-hier"``, or the name of a method you registered; a spec is checked and returned.

    Returns
    -------
    MethodSpec
        With ``k`` and ``budget`` unset (a frontier sets them per L0).

    Raises
    ------
    ValueError
        An unknown name, naming it and the registered methods; a spec of an unregistered family.
    """
    if isinstance(method, MethodSpec):
        entry = METHODS.lookup(method.family)
        if entry.by_format and (method.format is None or method.format.lower() not in available()):
            raise ValueError(f"{method.family!r} needs a registered format of {sorted(available())}, "
                             f"got {method.format!r}")  # fmt: skip
        if not entry.by_format and (method.format is not None or method.hierarchical):
            raise ValueError(f"the method {method.family!r} is named by itself: it takes no format and no expert "
                             f"modes, got format={method.format!r}, hierarchical={method.hierarchical}")  # fmt: skip
        return method
    if not isinstance(method, str):
        raise TypeError(f"a distillation method is named by a str or given as a MethodSpec, got {method!r:.80}")
    entry = METHODS.get(method)
    if entry is not None and not entry.by_format:
        return MethodSpec(entry.name)
    hierarchical = method.endswith(HIERARCHICAL_SUFFIX)
    base = method[: -len(HIERARCHICAL_SUFFIX)] if hierarchical else method
    if base.lower() in available():
        for entry in METHODS.values():
            if entry.by_format:
                return MethodSpec(entry.name, base, hierarchical)
    raise _unknown(method)


def parse_methods(methods: Sequence[str | MethodSpec]) -> tuple[MethodSpec, ...]:
    """Every method of ``methods`` parsed once (see [`parse_method`][mumoe_tn.distillation.methods.parse_method])."""
    if isinstance(methods, (str, MethodSpec)) or not isinstance(methods, Sequence) or not methods:
        raise ValueError(f"methods must be a non-empty sequence of method names, got {methods!r:.80}")
    return tuple(parse_method(method) for method in methods)


BEST_RECIPES: tuple[tuple[str, str], ...] = (
    ("transcoder", "topk-transcoder"),
    ("skip-transcoder", "topk-transcoder"),
    ("mxd", "adam-warmup"),
    ("mxd-hier", "plain"),
    ("cp", "plain"),
    ("cp-hier", "plain"),
    ("tr", "plain"),
    ("tr-hier", "plain"),
)
"""Each method's best recipe in the recipe sweep, as (method name, recipe name) pairs.

Chosen by ``python -m benchmarks.recipe_sweep`` (see
[`mumoe_tn.distillation.method_recipes`][mumoe_tn.distillation.method_recipes]);
``FrontierConfig(method_recipes=BEST_RECIPES)`` and ``mumoe-tn distill --per-method-recipes``
train each method with its own.
"""


def method_factory(spec: MethodSpec, settings: MethodSettings | None = None) -> tuple[str, Factory]:
    """The replacement's name in a frontier and its factory, for a spec whose ``k`` is set.

    Parameters
    ----------
    spec : MethodSpec
    settings : MethodSettings, optional
        The frontier's settings (default ``MethodSettings()``).

    Returns
    -------
    tuple
        ``("<method>@<L0>", factory)`` (with the top-k gate as ``"<method>:<top_k>@<L0>"`` where
        the method takes it and it is not ``"auto"``).

    Raises
    ------
    ValueError
        A spec without ``k``, or one the method's ``check`` refuses.
    """
    spec = parse_method(spec)
    settings = MethodSettings() if settings is None else settings
    if spec.k is None:
        raise ValueError(f"the method {spec.text!r} needs its sparsity: give the spec a k (the L0)")
    entry = METHODS.lookup(spec.family)
    if entry.check is not None:
        entry.check(spec, settings)
    gate = f":{settings.top_k}" if entry.takes_top_k and settings.top_k != "auto" else ""
    return f"{spec.text}{gate}@{spec.k}", entry.factory(spec, settings)


def check_methods(specs: Sequence[MethodSpec], l0s: Sequence[int], settings: MethodSettings) -> None:
    """Ask every method's ``check`` about every L0, before any work."""
    for spec in specs:
        entry = METHODS.lookup(spec.family)
        if entry.check is not None:
            for l0 in l0s:
                entry.check(dataclasses.replace(spec, k=l0), settings)


def spec_from_data(data: object, field: str = "spec") -> ReplacementSpec:
    """The saved [`ReplacementSpec`][mumoe_tn.distillation.replacement_specs.ReplacementSpec] ``data`` holds, checked.

    Parameters
    ----------
    data : object
        Parsed JSON, as [`ReplacementSpec.to_data`][mumoe_tn.distillation.replacement_specs.ReplacementSpec.to_data]
        wrote it.
    field : str, optional
        Where ``data`` sits (quoted in errors).

    Raises
    ------
    ValueError
        A field that is missing, unknown, of the wrong type or out of range, named; a ``kind``
        that names no registered method that can be rebuilt.
    """
    fields = check_spec_fields(data, field)
    kind = fields["kind"]
    method = METHODS.get(kind) if isinstance(kind, str) else None
    if method is None or method.read is None:
        kinds = sorted(name for name, entry in METHODS.items() if entry.read is not None)
        raise ValueError(f"{field}.kind = {kind!r:.120} is invalid: it must be one of {kinds}")
    return method.read(fields, field)


def factory_from_spec(spec: ReplacementSpec) -> Factory:
    """The factory a saved [`ReplacementSpec`][mumoe_tn.distillation.replacement_specs.ReplacementSpec] describes.

    Parameters
    ----------
    spec : ReplacementSpec
        As a factory attached it to what it built (``module.replacement_spec``), or as read by
        [`spec_from_data`][mumoe_tn.distillation.methods.spec_from_data].

    Returns
    -------
    Factory
        A factory that builds the same module again (its weights freshly initialised).
    """
    if not isinstance(spec, ReplacementSpec):
        raise TypeError(f"spec must be a ReplacementSpec, got {type(spec).__name__}")
    method = METHODS.lookup(spec.kind)
    if method.rebuild is None:
        raise ValueError(f"the distillation method {spec.kind!r} registered no rebuild: its replacements are not saved")
    return method.rebuild(spec)
