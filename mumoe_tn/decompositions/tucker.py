"""Tucker μMoE: a core tensor with one factor matrix per leg."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mumoe_tn.decompositions.format import Format
from mumoe_tn.decompositions.registry import normalise_ranks
from mumoe_tn.decompositions.tensor_support import zero_pad
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork, physical_sizes

__all__ = ["TuckerFormat", "tucker"]


def _legs(network: ExpertNetwork) -> list[str]:
    return [*network.expert_legs, INPUT_LEG, OUTPUT_LEG]


class TuckerFormat(Format, name="tucker"):
    """TuckerμMoE: ``W = Z ×_1 U_n1 … ×_E U_nE ×_{E+1} U_i ×_{E+2} U_o``.

    The core ``core`` has labels ``(s_n1, …, s_nE, s_i, s_o)`` and each factor ``U_<leg>`` has
    labels ``(leg, s_<leg>)`` (tensorly's layout). Rank: ``E + 2`` ints
    ``(R_n1, …, R_nE, R_I, R_O)`` or one int for all. Parameter matching scales every bond.
    """

    tltorch_class = "TuckerTensor"

    def network(
        self,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        rank: int | Sequence[int],
        **options: Any,
    ) -> ExpertNetwork:
        """Core and factors; see the class docstring."""
        if options:
            raise TypeError(f"tucker takes no options, got {sorted(options)}")
        sizes = physical_sizes(expert_dims, in_features, out_features)
        legs = list(sizes)
        ranks = normalise_ranks("tucker", rank, len(legs))
        core_labels = tuple(f"s_{leg}" for leg in legs)
        cores = {"core": core_labels, **{f"U_{leg}": (leg, f"s_{leg}") for leg in legs}}
        sizes.update(zip(core_labels, ranks, strict=True))
        return ExpertNetwork(cores, sizes)

    def closed_form_fma(self, network: ExpertNetwork) -> int:
        """FMAs per token, derived here (the paper gives none).

        ``Σ_e N_e R_e + I R_I + Σ_{k=0}^{E} P / Π_{j<k} R_j + R_O O`` with ``P = Π R`` over all
        ``E + 2`` core modes: the factor products, then the core contracted with the vectors of
        modes ``n1 … nE, i`` in that order, then the output factor.
        """
        ranks = [network.sizes[f"s_{leg}"] for leg in _legs(network)]
        total = sum(n * r for n, r in zip(network.expert_dims, ranks, strict=False))
        total += network.in_features * ranks[-2] + ranks[-1] * network.out_features
        remaining = 1
        for r in ranks:
            remaining *= r
        for r in ranks[:-1]:
            total += remaining
            remaining //= r
        return total

    def closed_form_rank_bound(self, network: ExpertNetwork) -> int:
        """``min{I, R_I, R_O, O}``, to which the paper's "Tucker μMoEs: rank analysis" bound reduces."""
        return min(network.in_features, network.sizes["s_i"], network.sizes["s_o"], network.out_features)

    def upcycle_capacity(self, network: ExpertNetwork) -> int:
        """``min(R_I, R_O)`` components."""
        return min(network.sizes["s_i"], network.sizes["s_o"])

    def upcycle(self, network: ExpertNetwork, cores: Mapping[str, Any], left: Any, right: Any) -> None:
        """Expert factors select component 0, whose core slice is an identity; ``U_i``, ``U_o`` hold the factors."""
        k = left.shape[1]
        for core in cores.values():
            core.zero_()
        for leg in network.expert_legs:
            cores[f"U_{leg}"][:, 0] = 1.0
        head = cores["core"][(0,) * network.n_expert_modes]
        for j in range(min(head.shape)):
            head[j, j] = 1.0
        cores["U_i"][:, :k] = left
        cores["U_o"][:, :k] = right

    def decompose(self, tensor: Any, network: ExpertNetwork, **options: Any) -> list[Any]:
        """Tensorly's ``tucker`` (HOOI, random init), padded where tensorly clips ranks."""
        import tensorly as tl

        ranks = [min(network.sizes[f"s_{leg}"], size) for leg, size in zip(_legs(network), tensor.shape, strict=True)]
        with tl.backend_context("pytorch"):
            core, factors = tl.decomposition.tucker(
                tensor,
                rank=ranks,
                n_iter_max=options.get("n_iter_max", 100),
                init="random",
                random_state=options.get("random_state", 0),
            )
        shapes = [network.core_shape(name) for name in network.cores]
        return [zero_pad(value, shape) for value, shape in zip([core, *factors], shapes, strict=True)]

    def to_tltorch(self, network: ExpertNetwork, cores: Mapping[str, Any]) -> Any:
        """A ``tltorch.TuckerTensor``."""
        from mumoe_tn.decompositions.tensor_support import load_tltorch, parameter_copy

        tltorch = load_tltorch()
        factors = [parameter_copy(cores[f"U_{leg}"]) for leg in _legs(network)]
        return tltorch.TuckerTensor(parameter_copy(cores["core"]), factors)

    def from_tltorch(self, tensor: Any) -> tuple[ExpertNetwork, list[Any]]:
        """The Tucker core and factors."""
        *dims, in_features, out_features = tuple(tensor.shape)
        network = self.build(dims, in_features, out_features, list(tensor.core.shape))
        return network, [tensor.core.detach(), *(f.detach() for f in tensor.factors)]


def tucker(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
) -> ExpertNetwork:
    """TuckerμMoE network (see [`TuckerFormat`][mumoe_tn.decompositions.tucker.TuckerFormat]).

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        ``E + 2`` ranks ``(R_n1, …, R_nE, R_I, R_O)`` or one int for all.

    Returns
    -------
    ExpertNetwork
    """
    return TuckerFormat.get().build(expert_dims, in_features, out_features, rank)
