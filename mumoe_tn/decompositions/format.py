"""The [`Format`][mumoe_tn.decompositions.format.Format] base class: what is specific to a named decomposition.

A format is registered once (by subclassing with a ``name=`` keyword) and carried by every
network its builder makes (``ExpertNetwork.format``). Tools never test a network's name; they
ask its format, and a network without one (a custom network) takes the generic path of every
tool:

| tool | the format may provide | generic path (no format) |
|---|---|---|
| forward, dense, costs | nothing: derived from the labelled network | the same |
| closed-form FMAs | ``closed_form_fma``, ``hand_fma`` | none shown |
| rank bound | ``closed_form_rank_bound`` (checked in the tests) | min cut of the network |
| parameter matching | ``matched_bonds`` | every bond (or the ones named) |
| initialisation | ``init_rule`` | ``"linear"`` (variance-targeted) |
| upcycling a Linear | ``upcycle_capacity``, ``upcycle`` | alternating least squares |
| dense decomposition | ``decompose`` (tensorly) | alternating least squares |
| tensorly-torch | ``to_tltorch``, ``from_tltorch`` | not available |
| the block an MLP becomes | ``mlp_block`` (a registered block kind) | ``"mumoe"`` (every layer factorized) |
| design search | ``search_structures``, ``in_search`` | one structure, every matched bond scaled |
| distillation's top-k gate | ``top_k_gate`` | ``"softmax"`` |

This module is torch-free: methods that handle tensors receive them from the caller and import
torch or tensorly lazily.

Examples
--------
A two-level hierarchical Tucker format for two expert modes, registered in a few lines:

>>> from mumoe_tn.decompositions import Format, normalise_ranks, unregister
>>> from mumoe_tn.network import ExpertNetwork, physical_sizes
>>> class HTucker(Format, name="htucker_doc"):
...     def network(self, expert_dims, in_features, out_features, rank, **options):
...         a, b, c, d, e = normalise_ranks(self.name, rank, 5)
...         sizes = physical_sizes(expert_dims, in_features, out_features)
...         cores = {"U1": "n1 a", "U2": "n2 b", "Ui": "i c", "Uo": "o d", "L": "a b e", "R": "c d e"}
...         return ExpertNetwork(cores, {**sizes, "a": a, "b": b, "c": c, "d": d, "e": e})
>>> HTucker.get().build((8, 8), 17, 16, 4).n_params
324
>>> unregister("htucker_doc")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from mumoe_tn.network import ExpertNetwork

__all__ = ["Format"]


class Format:
    """Base class of a named decomposition format.

    Subclass it with ``class MyFormat(Format, name="mine")`` and implement
    [`network`][mumoe_tn.decompositions.format.Format.network]; the subclass is instantiated and registered under that
    (lower-cased) name, so ``MuMoE(…, decomposition="mine")``, [`mumoe_tn.costs.compare`][mumoe_tn.costs.table.compare]
    and ``mumoe-tn compare`` know it at once; a name already registered raises ``ValueError`` unless the class also
    says ``replace=True``. Every other method is optional and has a documented default; overriding
    one replaces the generic path of that tool for networks of this format.

    Attributes
    ----------
    name : str
        The registered name.
    init_rule : str
        Initialisation rule used by ``init="auto"`` (see [`mumoe_tn.layers.init`][mumoe_tn.layers.init]): ``"linear"``
        (default, any network) or ``"paper"`` (the paper's CP/TR rule).
    tltorch_class : str or None
        Name of the tensorly-torch ``FactorizedTensor`` class this format converts to, if any.
    mlp_block : str
        The kind of block an MLP becomes with this format: the key of a builder registered in
        [`mumoe_tn.layers.mlp_blocks`][mumoe_tn.layers.mlp_blocks], which every tool that builds a
        block ([`convert`][mumoe_tn.conversion.convert.convert], replaying a checkpoint, distillation)
        asks through [`mlp_block_for`][mumoe_tn.layers.mlp_blocks.mlp_block_for]. ``"mumoe"`` (default:
        every layer of the block factorized, [`MuMoEMLP`][mumoe_tn.layers.mlp.MuMoEMLP] /
        [`MuMoEGatedMLP`][mumoe_tn.layers.mlp.MuMoEGatedMLP]) or ``"decoders"`` (the encoder kept dense
        and the decoder factorized, [`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders]); a
        format with a block of its own registers its builder under a key of its own. The format names
        the block by key, not by class, so this torch-free package never refers to a torch module.
    in_search : bool
        Whether the design search ([`mumoe_tn.design`][mumoe_tn.design]) draws networks of this
        format (default True), as [`search_structures`][mumoe_tn.decompositions.format.Format.search_structures]
        describes them.
    top_k_gate : str
        The top-k gate a distilled block of this format gets by default: the short name of a
        registered top-k gate class (see [`top_k_gates`][mumoe_tn.gates.registry.top_k_gates]);
        ``"softmax"`` unless the format says otherwise.
    """

    name: ClassVar[str] = ""
    init_rule: ClassVar[str] = "linear"
    tltorch_class: ClassVar[str | None] = None
    mlp_block: ClassVar[str] = "mumoe"
    in_search: ClassVar[bool] = True
    top_k_gate: ClassVar[str] = "softmax"

    def __init_subclass__(cls, *, name: str | None = None, replace: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:
            return
        from mumoe_tn.decompositions.registry import register

        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a format needs a non-empty name, got {name!r}")
        cls.name = name.lower()
        register(cls(), replace=replace)

    @classmethod
    def get(cls) -> Format:
        """The registered instance of this format class."""
        from mumoe_tn.decompositions.registry import get_format

        return get_format(cls.name)

    # ------------------------------------------------------------------ structure
    def network(
        self,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        rank: int | Sequence[int],
        **options: Any,
    ) -> ExpertNetwork:
        """The network's cores and sizes, as a plain `ExpertNetwork` (no format attached).

        Must be implemented by every format. [`build`][mumoe_tn.decompositions.registry.build] attaches the format.

        Parameters
        ----------
        expert_dims : int or Sequence[int]
            ``N_1 … N_E``.
        in_features, out_features : int
            Sizes of the legs ``i`` and ``o``.
        rank : int or Sequence[int]
            One int, or one rank per bond in the order of [`ranks_of`][mumoe_tn.decompositions.format.Format.ranks_of].
        **options
            Format-specific options.

        Returns
        -------
        ExpertNetwork
        """
        raise NotImplementedError(f"format {self.name!r} must implement network()")

    def build(
        self,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        rank: int | Sequence[int],
        **options: Any,
    ) -> ExpertNetwork:
        """Build this format's network for the given sizes and ranks, carrying the format.

        Parameters
        ----------
        expert_dims : int or Sequence[int]
            ``N_1 … N_E``.
        in_features, out_features : int
            Sizes of the legs ``i`` and ``o``.
        rank : int or Sequence[int]
            Ranks, see [`network`][mumoe_tn.decompositions.format.Format.network].
        **options
            Format-specific options.

        Returns
        -------
        ExpertNetwork
        """
        plain = self.network(expert_dims, in_features, out_features, rank, **options)
        if not isinstance(plain, ExpertNetwork):
            raise TypeError(f"format {self.name!r}: network() returned {type(plain).__name__}, not an ExpertNetwork")
        return ExpertNetwork(dict(plain.cores), dict(plain.sizes), format=self)

    def ranks_of(self, network: ExpertNetwork) -> tuple[int, ...]:
        """The ``rank`` argument that rebuilds ``network``: its bond sizes in order of appearance."""
        return tuple(network.sizes[bond] for bond in network.bonds)

    def check(self, network: ExpertNetwork) -> None:
        """Raise ``ValueError`` unless ``network`` has exactly the cores this format builds."""
        try:
            expected = self.network(
                network.expert_dims, network.in_features, network.out_features, self.ranks_of(network)
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"the network does not follow format {self.name!r}: {error}") from None
        if dict(expected.cores) != dict(network.cores):
            raise ValueError(
                f"the network does not follow format {self.name!r}: it has cores '{network.to_spec()}' but "
                f"{self.name!r} builds '{expected.to_spec()}'; leave format=None for a custom network"
            )

    # ------------------------------------------------------------------ closed forms
    def closed_form_fma(self, network: ExpertNetwork) -> int | None:
        """FMAs per token as the paper states them (gating excluded), or None if not known."""
        return None

    def hand_fma(self, network: ExpertNetwork) -> int | None:
        """Exact FMAs per token of the hand-derived order (lower-order terms included), or None."""
        return self.closed_form_fma(network)

    def closed_form_rank_bound(self, network: ExpertNetwork) -> int | None:
        """The paper's expert-rank bound, or None; tests hold it against the min cut."""
        return None

    # ------------------------------------------------------------------ design search
    def search_structures(
        self, expert_dims: tuple[int, ...], expert_ranks: Sequence[int]
    ) -> list[tuple[str, int | tuple[int, ...] | None]]:
        """The structures of this format the design search tries, as ``(description, rank)`` pairs.

        Each ``rank`` builds a network of this format (``build(expert_dims, I, O, rank)``) in which
        the bonds [`matched_bonds`][mumoe_tn.decompositions.format.Format.matched_bonds] names are at
        size 1: the search scales them to the budget and keeps every other bond as given. The
        default is one structure, every bond at 1 (``rank=1``). Set the class attribute
        ``in_search = False`` to keep a format out of the search.

        Parameters
        ----------
        expert_dims : tuple of int
            ``N_1 … N_E`` of the structure.
        expert_ranks : Sequence[int]
            Sizes the search tries for bonds a format keeps fixed (e.g. a ring's expert bonds).

        Returns
        -------
        list of (str, rank)
        """
        return [(self.name, 1)]

    # ------------------------------------------------------------------ matching
    def matched_bonds(self, network: ExpertNetwork) -> tuple[str, ...]:
        """Bonds that parameter matching scales by default: every bond unless overridden."""
        return network.bonds

    # ------------------------------------------------------------------ weights from data
    def upcycle_capacity(self, network: ExpertNetwork) -> int | None:
        """How many singular components of a Linear `upcycle` can hold, or None (no closed form)."""
        return None

    def upcycle(self, network: ExpertNetwork, cores: Mapping[str, Any], left: Any, right: Any) -> None:
        """Set ``cores`` in place so that every expert equals ``left @ rightᵀ``.

        Called only when [`upcycle_capacity`][mumoe_tn.decompositions.format.Format.upcycle_capacity] is not None, with
        ``left (I, k)`` and ``right (O, k)``, ``k ≤ upcycle_capacity``, on the cores' device and dtype.
        """
        raise NotImplementedError(f"format {self.name!r} has no closed-form upcycling")

    def decompose(self, tensor: Any, network: ExpertNetwork, **options: Any) -> list[Any] | None:
        """Cores (in network order) fitted to a dense ``W``, or None to use the generic solver.

        Parameters
        ----------
        tensor : torch.Tensor
            Dense ``W`` of shape ``network.dense_shape`` (float32 or wider).
        network : ExpertNetwork
            The target network (this format).
        **options
            ``n_iter_max``, ``random_state`` and format-specific options.
        """
        return None

    # ------------------------------------------------------------------ tensorly-torch
    def to_tltorch(self, network: ExpertNetwork, cores: Mapping[str, Any]) -> Any:
        """The cores as a tensorly-torch factorized tensor (called only if `tltorch_class` is set)."""
        raise NotImplementedError(f"format {self.name!r} has no tensorly-torch counterpart")

    def from_tltorch(self, tensor: Any) -> tuple[ExpertNetwork, list[Any]]:
        """A network of this format and its core values from a tensorly-torch tensor."""
        raise NotImplementedError(f"format {self.name!r} has no tensorly-torch counterpart")

    # ------------------------------------------------------------------ identity
    def __reduce__(self) -> tuple[Any, ...]:
        from mumoe_tn.decompositions.registry import get_format

        return (get_format, (self.name,))

    def __repr__(self) -> str:
        return f"<format {self.name!r}>"
