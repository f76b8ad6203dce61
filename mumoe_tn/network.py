"""The labelled expert network: the one abstraction every decomposition is built from.

An [`ExpertNetwork`][mumoe_tn.network.ExpertNetwork] describes the expert weight tensor
``W ∈ R^{N_1 × … × N_E × I × O}`` of a μMoE layer as a tensor network. Each core is a
tuple of labels; a label is either a *physical leg* (an expert mode ``n1``…``nE``, the input
leg ``i`` or the output leg ``o``) or a *bond* joining two or more cores (three or more make a
hyperedge, which is how CP shares its rank label). Everything else — the forward equation,
the dense equation, parameter counts, plans, costs and rank bounds — is derived from it.

This module is pure Python: it never imports torch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import networkx as nx

from mumoe_tn.validation import check_size

if TYPE_CHECKING:
    from mumoe_tn.decompositions.format import Format

__all__ = [
    "BATCH_LABEL",
    "INPUT_LEG",
    "OUTPUT_LEG",
    "ExpertNetwork",
    "expert_leg",
    "is_expert_leg",
    "normalise_expert_dims",
    "physical_sizes",
]

INPUT_LEG = "i"
OUTPUT_LEG = "o"
#: The label of the (flattened) batch dimension in forward equations; reserved.
BATCH_LABEL = "__batch__"
_EXPERT_LEG = re.compile(r"n([1-9][0-9]*)\Z", re.ASCII)
_EXPERT_LIKE = re.compile(r"n\d+\Z")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+\-]*\Z")


def expert_leg(mode: int) -> str:
    """Return the label of expert mode ``mode`` (1-based), e.g. ``expert_leg(2) == "n2"``."""
    return f"n{mode}"


def is_expert_leg(label: str) -> bool:
    """Return whether ``label`` names an expert mode (``n1``, ``n2``, …)."""
    return _EXPERT_LEG.match(label) is not None


def _is_physical(label: str) -> bool:
    return label in (INPUT_LEG, OUTPUT_LEG) or is_expert_leg(label)


def _parse_labels(core: str, labels: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(labels, str):
        labels = labels.split()
    labels = tuple(labels)
    if not labels:
        raise ValueError(f"core {core!r} has no labels; every core needs at least one leg")
    for label in labels:
        if not isinstance(label, str) or not label.isidentifier():
            raise ValueError(
                f"core {core!r}: label {label!r} is not a valid name; labels are identifiers "
                "such as 'n1', 'i', 'o', 'r', 'a1'"
            )
        if _EXPERT_LIKE.match(label) and not _EXPERT_LEG.match(label):
            raise ValueError(
                f"core {core!r}: label {label!r} looks like an expert leg but is not one; expert legs are "
                "'n1', 'n2', … (ASCII digits, no leading zero, no 'n0')"
            )
        if label.startswith("__") and label.endswith("__"):
            raise ValueError(f"core {core!r}: label {label!r} is reserved (dunder labels such as {BATCH_LABEL!r})")
    seen: set[str] = set()
    for label in labels:
        if label in seen:
            raise ValueError(
                f"core {core!r} has label {label!r} twice in {labels}; a label may appear at "
                "most once per core (traces are not supported)"
            )
        seen.add(label)
    return labels


def _core_groups(cores: Mapping[str, Any], owners: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """The groups of cores joined by shared labels, in time linear in cores and label ends.

    Each label shared by several cores is one node joined to its cores (a hyperedge as one node),
    not an edge per pair of its cores, which grows with the square of the cores a label joins.
    """
    graph = nx.Graph()
    graph.add_nodes_from(cores)
    for label, where in owners.items():
        if len(where) > 1:
            graph.add_edges_from((("label", label), core) for core in where)
    return [sorted(node for node in part if isinstance(node, str)) for part in nx.connected_components(graph)]


@dataclass(frozen=True, eq=False)
class ExpertNetwork:
    """A tensor network for the expert weight tensor ``W ∈ R^{N_1×…×N_E×I×O}``.

    Parameters
    ----------
    cores : Mapping[str, str | Sequence[str]]
        Ordered mapping of core name to its labels, either as a sequence of labels or as a
        whitespace-separated string (``"n1 r"``). Core names must be Python identifiers; they
        become parameter names in
        [`mumoe_tn.layers.experts.FactorizedExperts`][mumoe_tn.layers.experts.FactorizedExperts].
    sizes : Mapping[str, int]
        Size of every label: the physical legs ``n1``…``nE`` (``N_e``), ``i`` (``I``, or ``I+1``
        when a bias is folded in), ``o`` (``O``) and every bond.
    name : str, optional
        A display name (letters, digits, ``_ . + -``); the format's name by default, else
        ``"custom"``. It is only a label: no tool reads meaning into it.
    format : Format, optional
        The registered decomposition format this network follows (set by the format's
        builder, see `mumoe_tn.decompositions`); ``None`` for a custom network, which
        takes the generic path of every tool. A network given a format must have exactly the
        cores the format's builder makes.

    Raises
    ------
    ValueError
        If a rule is broken: a label twice in a core, a physical leg missing or in more than
        one core, expert modes not numbered ``n1``…``nE`` without gaps, a bond in only one core
        (dangling), a label without a size or a size for an unknown label, or a disconnected
        network.
    TypeError
        If a size is not an int.

    Examples
    --------
    A tensor-ring-like network with three cores and one expert mode:

    >>> net = ExpertNetwork.from_spec(
    ...     "A: n1 a b, B: a i c, C: b c o", expert_dims=8, in_features=16,
    ...     out_features=32, ranks={"a": 4, "b": 4, "c": 8})
    >>> net.n_params
    1664
    """

    cores: Mapping[str, tuple[str, ...]]
    sizes: Mapping[str, int]
    name: str | None = None
    format: Format | None = None
    _bonds: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _owners: Mapping[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name = self.name
        if name is None:
            name = "custom" if self.format is None else self.format.name
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"network name must be a non-empty string of letters, digits and '_.+-', got {name!r}")
        object.__setattr__(self, "name", name)
        if not isinstance(self.cores, Mapping) or not self.cores:
            raise ValueError(f"cores must be a non-empty mapping of name -> labels, got {self.cores!r}")
        cores: dict[str, tuple[str, ...]] = {}
        for core, labels in self.cores.items():
            if not isinstance(core, str) or not core.isidentifier():
                raise ValueError(f"core name {core!r} is not a Python identifier")
            cores[core] = _parse_labels(core, labels)
        if not isinstance(self.sizes, Mapping):
            raise TypeError(f"sizes must be a mapping of label -> int, got {type(self.sizes).__name__}")
        sizes = {label: check_size(f"size of label {label!r}", size) for label, size in self.sizes.items()}

        owners: dict[str, list[str]] = {}
        for core, labels in cores.items():
            for label in labels:
                owners.setdefault(label, []).append(core)
        for label in (INPUT_LEG, OUTPUT_LEG):
            if label not in owners:
                raise ValueError(
                    f"the network has no {'input' if label == INPUT_LEG else 'output'} leg "
                    f"{label!r}; cores are {dict(cores)}"
                )
        modes = sorted(int(_EXPERT_LEG.match(lbl).group(1)) for lbl in owners if is_expert_leg(lbl))
        if not modes:
            raise ValueError(f"the network has no expert leg 'n1'; cores are {dict(cores)}")
        expected = list(range(1, len(modes) + 1))
        if modes != expected:
            unknown = sorted(set(modes) - set(expected))
            raise ValueError(
                f"unknown expert leg(s) {[expert_leg(m) for m in unknown]}: expert legs must be "
                f"numbered n1..nE without gaps, found {[expert_leg(m) for m in modes]}"
            )
        bonds = []
        for label, where in owners.items():
            if not _is_physical(label):
                if len(where) < 2:
                    raise ValueError(
                        f"bond {label!r} appears only in core {where[0]!r} (dangling); a bond must "
                        "join two or more cores, and physical legs are named 'i', 'o', 'n1'..'nE'"
                    )
                bonds.append(label)
        missing = [label for label in owners if label not in sizes]
        if missing:
            raise ValueError(f"no size given for label(s) {missing}; sizes has {sorted(sizes)}")
        extra = [label for label in sizes if label not in owners]
        if extra:
            raise ValueError(f"size given for unknown label(s) {extra}; the cores use {sorted(owners)}")

        object.__setattr__(self, "cores", MappingProxyType(cores))
        object.__setattr__(self, "sizes", MappingProxyType({lbl: sizes[lbl] for lbl in owners}))
        object.__setattr__(self, "_bonds", tuple(bonds))
        object.__setattr__(self, "_owners", MappingProxyType({lbl: tuple(where) for lbl, where in owners.items()}))
        parts = _core_groups(cores, owners)
        if len(parts) > 1:
            raise ValueError(f"the network is disconnected: its cores fall into separate groups {parts}")
        if self.format is not None:
            self.format.check(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # MappingProxyType does not pickle; rebuild (and re-validate) from plain dicts.
        return (ExpertNetwork, (dict(self.cores), dict(self.sizes), self.name, self.format))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_spec(
        cls,
        spec: str,
        *,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        ranks: Mapping[str, int] | int,
        name: str | None = None,
    ) -> ExpertNetwork:
        """Build a network from an einsum-like spec string.

        Parameters
        ----------
        spec : str
            Cores separated by commas, each a whitespace-separated list of labels, optionally
            prefixed with ``name:``; unnamed cores are called ``core0``, ``core1``, … . Example:
            ``"n1 a b, a i c, b c o"`` or ``"A: n1 a b, B: a i c, C: b c o"``.
        expert_dims : int or Sequence[int]
            Sizes ``N_1…N_E`` of the expert legs ``n1…nE``.
        in_features, out_features : int
            Sizes of the legs ``i`` and ``o``.
        ranks : Mapping[str, int] or int
            Size of every bond, or one int used for all bonds.
        name : str, optional
            Display name of the network (``"custom"`` by default).

        Returns
        -------
        ExpertNetwork
        """
        if not isinstance(spec, str):
            raise TypeError(f"spec must be a string such as 'n1 a b, a i c, b c o', got {type(spec).__name__}")
        cores: dict[str, tuple[str, ...]] = {}
        for position, part in enumerate(spec.split(",")):
            part = part.strip()
            if not part:
                raise ValueError(f"spec {spec!r} has an empty core at position {position}")
            if ":" in part:
                core, _, labels = part.partition(":")
                core = core.strip()
            else:
                core, labels = f"core{position}", part
            if core in cores:
                raise ValueError(f"spec {spec!r} names core {core!r} twice")
            cores[core] = tuple(labels.split())
        labels = {label for core_labels in cores.values() for label in core_labels}
        sizes = physical_sizes(expert_dims, in_features, out_features)
        n_modes = len(sizes) - 2
        bonds = sorted(label for label in labels if not _is_physical(label))
        if isinstance(ranks, Mapping):
            unknown = sorted(set(ranks) - set(bonds))
            if unknown:
                raise ValueError(f"ranks given for label(s) {unknown} that are not bonds of {spec!r}; bonds: {bonds}")
            sizes.update(ranks)
        else:
            sizes.update({bond: ranks for bond in bonds})
        unused = [expert_leg(m) for m in range(1, n_modes + 1) if expert_leg(m) not in labels]
        if unused:
            raise ValueError(f"expert_dims has {n_modes} mode(s) but the spec {spec!r} has no leg {unused}")
        return cls(cores, sizes, name=name)

    @classmethod
    def from_shapes(
        cls,
        cores: Mapping[str, str | Sequence[str]],
        shapes: Mapping[str, Sequence[int]],
        *,
        name: str | None = None,
    ) -> ExpertNetwork:
        """Build a network from core labels and the shapes of existing core tensors.

        Sizes are inferred from the shapes; a label whose size differs between cores is a
        bond size mismatch.

        Parameters
        ----------
        cores : Mapping[str, str | Sequence[str]]
            Core name -> labels.
        shapes : Mapping[str, Sequence[int]]
            Core name -> the shape of that core's tensor.
        name : str, optional
            Display name of the network (``"custom"`` by default).

        Returns
        -------
        ExpertNetwork
        """
        if not isinstance(cores, Mapping) or not isinstance(shapes, Mapping):
            raise TypeError("cores and shapes must be mappings of core name -> labels / shape")
        sizes: dict[str, int] = {}
        where: dict[str, str] = {}
        if set(shapes) != set(cores):
            raise ValueError(f"shapes are given for cores {sorted(shapes)} but the cores are {sorted(cores)}")
        for core, labels in cores.items():
            labels = _parse_labels(core, labels)
            shape = tuple(shapes[core])
            if len(shape) != len(labels):
                raise ValueError(
                    f"core {core!r} has labels {labels} ({len(labels)} legs) but a tensor of shape "
                    f"{shape} ({len(shape)} dims)"
                )
            for label, size in zip(labels, shape, strict=True):
                if label in sizes and sizes[label] != size:
                    raise ValueError(
                        f"bond size mismatch: label {label!r} has size {sizes[label]} in core "
                        f"{where[label]!r} but {size} in core {core!r}"
                    )
                sizes[label] = size
                where.setdefault(label, core)
        return cls(dict(cores), sizes, name=name)

    # ------------------------------------------------------------------ derived facts
    @functools.cached_property
    def n_expert_modes(self) -> int:
        """Number of expert modes ``E``."""
        return sum(1 for label in self.sizes if is_expert_leg(label))

    @functools.cached_property
    def expert_legs(self) -> tuple[str, ...]:
        """Labels of the expert modes, ``("n1", …, "nE")``."""
        return tuple(expert_leg(m) for m in range(1, self.n_expert_modes + 1))

    @property
    def expert_dims(self) -> tuple[int, ...]:
        """Sizes ``(N_1, …, N_E)`` of the expert modes."""
        return tuple(self.sizes[leg] for leg in self.expert_legs)

    @property
    def n_experts(self) -> int:
        """Total number of experts ``N_1·…·N_E``."""
        total = 1
        for size in self.expert_dims:
            total *= size
        return total

    @property
    def in_features(self) -> int:
        """Size of the input leg ``i``."""
        return self.sizes[INPUT_LEG]

    @property
    def out_features(self) -> int:
        """Size of the output leg ``o``."""
        return self.sizes[OUTPUT_LEG]

    @property
    def bonds(self) -> tuple[str, ...]:
        """Internal labels (ranks), in order of first appearance."""
        return self._bonds

    @property
    def hyperedges(self) -> tuple[str, ...]:
        """Bonds shared by three or more cores."""
        return tuple(bond for bond in self._bonds if len(self.cores_with(bond)) > 2)

    def cores_with(self, label: str) -> tuple[str, ...]:
        """Names of the cores carrying ``label``."""
        if label not in self._owners:
            raise ValueError(f"unknown label {label!r}; the network has labels {sorted(self.sizes)}")
        return self._owners[label]

    def core_of(self, leg: str) -> str:
        """Name of the one core carrying physical leg ``leg``.

        Raises
        ------
        ValueError
            If ``leg`` is not a physical leg, or is shared by several cores (a Hadamard
            factorisation): [`cores_with`][mumoe_tn.network.ExpertNetwork.cores_with] names them all.
        """
        if not _is_physical(leg):
            raise ValueError(f"{leg!r} is not a physical leg; physical legs are 'i', 'o', 'n1'..'nE'")
        owners = self.cores_with(leg)
        if len(owners) > 1:
            raise ValueError(
                f"physical leg {leg!r} is shared by cores {list(owners)} (a Hadamard factorisation); "
                "use cores_with(leg) for all of them"
            )
        return owners[0]

    @property
    def shared_legs(self) -> tuple[str, ...]:
        """Physical legs held by two or more cores (Hadamard, or Khatri–Rao, factorisations)."""
        return tuple(label for label, owners in self._owners.items() if _is_physical(label) and len(owners) > 1)

    def core_shape(self, core: str) -> tuple[int, ...]:
        """Shape of core ``core``, in the order of its labels."""
        if core not in self.cores:
            raise ValueError(f"unknown core {core!r}; the cores are {list(self.cores)}")
        return tuple(self.sizes[label] for label in self.cores[core])

    @property
    def core_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every core, by name."""
        return {core: self.core_shape(core) for core in self.cores}

    @property
    def core_params(self) -> dict[str, int]:
        """Number of parameters of every core (product of its label sizes)."""
        return {core: _prod(shape) for core, shape in self.core_shapes.items()}

    @property
    def n_params(self) -> int:
        """Total number of parameters of the expert tensor's cores."""
        return sum(self.core_params.values())

    @property
    def dense_shape(self) -> tuple[int, ...]:
        """Shape ``(N_1, …, N_E, I, O)`` of the dense expert tensor ``W``."""
        return (*self.expert_dims, self.in_features, self.out_features)

    # ------------------------------------------------------------------ equations
    def forward_equation(self) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
        """Operand labels and output labels of the factorized forward pass.

        Operands are the cores (in order), then one coefficient tensor ``(b, n_e)`` per expert
        mode, then the input ``(b, i)``; the output is ``(b, o)``. The batch label ``b`` stands
        for all leading dimensions flattened into one.

        Returns
        -------
        inputs : list of tuple of str
        output : tuple of str
        """
        inputs = list(self.cores.values())
        inputs += [(BATCH_LABEL, leg) for leg in self.expert_legs]
        inputs.append((BATCH_LABEL, INPUT_LEG))
        return inputs, (BATCH_LABEL, OUTPUT_LEG)

    def dense_equation(self) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
        """Operand labels (the cores) and output labels ``(n1, …, nE, i, o)`` of ``W``."""
        return list(self.cores.values()), (*self.expert_legs, INPUT_LEG, OUTPUT_LEG)

    def to_spec(self) -> str:
        """The spec string of this network, as accepted by [`from_spec`][mumoe_tn.network.ExpertNetwork.from_spec]."""
        return ", ".join(f"{core}: {' '.join(labels)}" for core, labels in self.cores.items())

    def with_sizes(self, **sizes: int) -> ExpertNetwork:
        """Return a copy with some label sizes changed (e.g. ``net.with_sizes(r=16)``)."""
        unknown = sorted(set(sizes) - set(self.sizes))
        if unknown:
            raise ValueError(f"unknown label(s) {unknown}; the network has labels {sorted(self.sizes)}")
        return ExpertNetwork(dict(self.cores), {**self.sizes, **sizes}, name=self.name, format=self.format)

    def with_format(self, format: Format | None, *, name: str | None = None) -> ExpertNetwork:
        """Return a copy that follows ``format`` (checked against the format's builder), or none.

        Parameters
        ----------
        format : Format or None
            A registered format; ``None`` makes the copy a custom network.
        name : str, optional
            Display name of the copy (default: the format's name, or ``"custom"``).

        Returns
        -------
        ExpertNetwork
        """
        return ExpertNetwork(dict(self.cores), dict(self.sizes), name=name, format=format)

    def graph(self) -> nx.MultiGraph:
        """The network as a networkx multigraph: one node per core, one edge per pair of cores sharing a label.

        Bonds and shared physical legs (a Hadamard factorisation's ``o`` in two cores) both join
        cores; a physical leg in one core adds no edge.
        """
        graph = nx.MultiGraph()
        graph.add_nodes_from(self.cores)
        for bond, owners in self._owners.items():
            for k, first in enumerate(owners):
                for second in owners[k + 1 :]:
                    graph.add_edge(first, second, label=bond, size=self.sizes[bond])
        return graph

    def _key(self) -> tuple:
        fmt = None if self.format is None else self.format.name
        return (tuple(self.cores.items()), tuple(self.sizes.items()), self.name, fmt)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpertNetwork) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        dims = "×".join(map(str, self.expert_dims))
        bonds = ", ".join(f"{bond}={self.sizes[bond]}" for bond in self._bonds)
        tag = f"{self.name!r}" if self.format is not None or self.name == "custom" else f"{self.name!r} (no format)"
        return (
            f"ExpertNetwork({tag}, '{self.to_spec()}', experts={dims}, "
            f"i={self.in_features}, o={self.out_features}, bonds=({bonds}), params={self.n_params})"
        )


def _prod(values: Iterable[int]) -> int:
    total = 1
    for value in values:
        total *= value
    return total


def physical_sizes(expert_dims: int | Sequence[int], in_features: int, out_features: int) -> dict[str, int]:
    """Sizes of the physical legs ``n1 … nE``, ``i`` and ``o``, checked.

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        ``N_1 … N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.

    Returns
    -------
    dict of str to int
    """
    dims = normalise_expert_dims(expert_dims)
    sizes = {expert_leg(m): size for m, size in enumerate(dims, start=1)}
    sizes[INPUT_LEG] = check_size("in_features", in_features)
    sizes[OUTPUT_LEG] = check_size("out_features", out_features)
    return sizes


def normalise_expert_dims(expert_dims: int | Sequence[int]) -> tuple[int, ...]:
    """Return ``expert_dims`` as a non-empty tuple of positive ints.

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        One int (a single expert mode) or the sizes ``N_1…N_E``.

    Returns
    -------
    tuple of int
    """
    if isinstance(expert_dims, int) and not isinstance(expert_dims, bool):
        expert_dims = (expert_dims,)
    if isinstance(expert_dims, str) or not isinstance(expert_dims, Sequence) or not expert_dims:
        raise TypeError(f"expert_dims must be an int or a non-empty sequence of ints, got {expert_dims!r}")
    return tuple(check_size(f"expert_dims[{m}]", size) for m, size in enumerate(expert_dims))
