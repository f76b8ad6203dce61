"""CP (canonical polyadic) μMoE: one factor matrix per leg, all sharing one rank label."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mumoe_tn.decompositions.format import Format
from mumoe_tn.decompositions.registry import normalise_ranks
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork, physical_sizes

__all__ = ["CPFormat", "cp"]


def _legs(network: ExpertNetwork) -> list[str]:
    return [*network.expert_legs, INPUT_LEG, OUTPUT_LEG]


class CPFormat(Format, name="cp"):
    """CPμMoE (paper the fast CP forward and its hierarchical form).

    ``W = Σ_r u^(1)_r ∘ … ∘ u^(E)_r ∘ u^(E+1)_r ∘ u^(E+2)_r`` with factor matrices
    ``U_n1 … U_nE, U_i, U_o`` of shape ``(leg, R)`` (tensorly's layout); the rank label ``r`` is
    a hyperedge shared by all ``E + 2`` cores. Rank: one int ``R``.
    """

    init_rule = "paper"
    tltorch_class = "CPTensor"

    def network(
        self,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        rank: int | Sequence[int],
        **options: Any,
    ) -> ExpertNetwork:
        """Factor matrices ``U_<leg> (leg, r)`` for every leg; see the class docstring."""
        if options:
            raise TypeError(f"cp takes no options, got {sorted(options)}")
        (r,) = normalise_ranks("cp", rank, 1)
        sizes = physical_sizes(expert_dims, in_features, out_features)
        legs = [leg for leg in sizes if leg not in (INPUT_LEG, OUTPUT_LEG)] + [INPUT_LEG, OUTPUT_LEG]
        return ExpertNetwork({f"U_{leg}": (leg, "r") for leg in legs}, {**sizes, "r": r})

    def closed_form_fma(self, network: ExpertNetwork) -> int:
        """``R(ΣN_e + I + O)`` (paper decomposition trade-off table, the fast CP forward)."""
        return network.sizes["r"] * (sum(network.expert_dims) + network.in_features + network.out_features)

    def hand_fma(self, network: ExpertNetwork) -> int:
        """The paper's order with its omitted ``E·R`` elementwise products counted."""
        return self.closed_form_fma(network) + network.n_expert_modes * network.sizes["r"]

    def closed_form_rank_bound(self, network: ExpertNetwork) -> int:
        """``min{I, O, R}`` (paper, "CPμMoEs: rank analysis")."""
        return min(network.in_features, network.out_features, network.sizes["r"])

    def matched_bonds(self, network: ExpertNetwork) -> tuple[str, ...]:
        """The rank ``r``."""
        return ("r",)

    def upcycle_capacity(self, network: ExpertNetwork) -> int:
        """``R`` components."""
        return network.sizes["r"]

    def upcycle(self, network: ExpertNetwork, cores: Mapping[str, Any], left: Any, right: Any) -> None:
        """Expert factors all ones; ``U_i``, ``U_o`` hold ``left``, ``right`` (zero-padded)."""
        k = left.shape[1]
        for core in cores.values():
            core.zero_()
        for leg in network.expert_legs:
            cores[f"U_{leg}"].fill_(1.0)
        cores["U_i"][:, :k] = left
        cores["U_o"][:, :k] = right

    def decompose(self, tensor: Any, network: ExpertNetwork, **options: Any) -> list[Any]:
        """Tensorly's ``parafac`` (random init); the weights are folded into the first factor."""
        import tensorly as tl

        with tl.backend_context("pytorch"):
            weights, factors = tl.decomposition.parafac(
                tensor,
                network.sizes["r"],
                n_iter_max=options.get("n_iter_max", 100),
                init="random",
                random_state=options.get("random_state", 0),
            )
        return [factors[0] * weights[None], *factors[1:]]

    def to_tltorch(self, network: ExpertNetwork, cores: Mapping[str, Any]) -> Any:
        """A ``tltorch.CPTensor`` with unit weights."""
        from mumoe_tn.decompositions.tensor_support import load_tltorch, parameter_copy

        tltorch = load_tltorch()
        first = cores["U_i"]
        weights = first.new_ones(network.sizes["r"])
        return tltorch.CPTensor(parameter_copy(weights), [parameter_copy(cores[f"U_{leg}"]) for leg in _legs(network)])

    def from_tltorch(self, tensor: Any) -> tuple[ExpertNetwork, list[Any]]:
        """The CP factors, the tensor's weights folded into the first factor."""
        *dims, in_features, out_features = tuple(tensor.shape)
        factors = [f.detach() for f in tensor.factors]
        network = self.build(dims, in_features, out_features, factors[0].shape[1])
        return network, [factors[0] * tensor.weights.detach()[None], *factors[1:]]


def cp(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
) -> ExpertNetwork:
    """CPμMoE network: factor matrices ``U_<leg> (leg, R)`` sharing the rank hyperedge ``r``.

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        The CP rank ``R`` (a one-element sequence is accepted too).

    Returns
    -------
    ExpertNetwork
        ``R·(ΣN_e + I + O)`` parameters, carrying [`CPFormat`][mumoe_tn.decompositions.cp.CPFormat].
    """
    return CPFormat.get().build(expert_dims, in_features, out_features, rank)
