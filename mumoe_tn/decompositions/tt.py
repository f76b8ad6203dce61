"""Tensor-train μMoE: an open chain of cores over n1 … nE, i, o (a TR with R_1 = 1)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mumoe_tn.decompositions._ring import chain, chain_ranks, pass_through_expert_cores
from mumoe_tn.decompositions.format import Format
from mumoe_tn.decompositions.tensor_support import zero_pad
from mumoe_tn.decompositions.tr import PAPER_EXPERT_RANK
from mumoe_tn.network import INPUT_LEG, OUTPUT_LEG, ExpertNetwork, normalise_expert_dims

__all__ = ["TTFormat", "tt"]


class TTFormat(Format, name="tt"):
    """TTμMoE: cores ``G_n1 (N_1, R_1) … G_i (R_E, I, R_{E+1}), G_o (R_{E+1}, O)``.

    Rank: ``E + 1`` ints, or one int ``R`` for ``R_{E+1}`` (the bond between the input and output
    cores) with the others ``expert_rank`` (default 4).
    """

    tltorch_class = "TTTensor"

    def network(
        self,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        rank: int | Sequence[int],
        *,
        expert_rank: int = PAPER_EXPERT_RANK,
    ) -> ExpertNetwork:
        """The train; see the class docstring."""
        n_bonds = len(normalise_expert_dims(expert_dims)) + 1
        ranks = chain_ranks("tt", rank, n_bonds, expert_rank)
        return chain(expert_dims, in_features, out_features, ranks, closed=False)

    def closed_form_fma(self, network: ExpertNetwork) -> int:
        """FMAs per token, derived here (the paper gives none).

        With ranks ``R_1 … R_{E+1}``:
        ``N_1R_1 + Σ_{e≥2} (R_{e-1}N_eR_e + R_{e-1}R_e) + R_E I R_{E+1} + R_E R_{E+1} + R_{E+1} O``,
        i.e. the mode-2 products, the vector-matrix chain along the experts, ``z`` into the input
        core, the expert vector into that result, and the output core. Nothing is omitted.
        """
        n_modes = network.n_expert_modes
        r = [network.sizes[f"r{k}"] for k in range(1, n_modes + 2)]
        dims = network.expert_dims
        total = dims[0] * r[0]
        total += sum(r[e - 1] * dims[e] * r[e] + r[e - 1] * r[e] for e in range(1, n_modes))
        total += r[n_modes - 1] * network.in_features * r[n_modes] + r[n_modes - 1] * r[n_modes]
        return total + r[n_modes] * network.out_features

    def closed_form_rank_bound(self, network: ExpertNetwork) -> int:
        """``min{R_{E+1}, I, O}``: only the bond between input and output cores joins them."""
        return min(network.sizes[f"r{network.n_expert_modes + 1}"], network.in_features, network.out_features)

    def search_structures(
        self, expert_dims: tuple[int, ...], expert_ranks: Sequence[int]
    ) -> list[tuple[str, int | tuple[int, ...] | None]]:
        """The expert bonds at each size of ``expert_ranks``; the last bond is scaled."""
        return [(f"tt R={r}", (*([r] * len(expert_dims)), 1)) for r in expert_ranks]

    def matched_bonds(self, network: ExpertNetwork) -> tuple[str, ...]:
        """``R_{E+1}``, the input–output bond."""
        return (f"r{network.n_expert_modes + 1}",)

    def upcycle_capacity(self, network: ExpertNetwork) -> int:
        """``R_{E+1}`` components."""
        return network.sizes[f"r{network.n_expert_modes + 1}"]

    def upcycle(self, network: ExpertNetwork, cores: Mapping[str, Any], left: Any, right: Any) -> None:
        """Pass-through expert cores; ``G_i[0] = left``, ``G_o = rightᵀ`` (zero-padded)."""
        k = left.shape[1]
        pass_through_expert_cores(network, cores)
        cores["G_i"].zero_()
        cores["G_o"].zero_()
        cores["G_i"][0, :, :k] = left
        cores["G_o"][:k] = right.T

    def decompose(self, tensor: Any, network: ExpertNetwork, **options: Any) -> list[Any]:
        """Tensorly's TT-SVD, with ranks clipped to what the tensor's unfoldings allow."""
        import tensorly as tl

        ranks = [network.sizes[bond] for bond in network.bonds]
        with tl.backend_context("pytorch"):
            factors = list(tl.decomposition.tensor_train(tensor, rank=[1, *ranks, 1]))
        # tensorly clips ranks to the unfoldings' sizes: pad every core back to the network's shape.
        shapes = [network.core_shape(name) for name in network.cores]
        factors[0], factors[-1] = factors[0][0], factors[-1][..., 0]
        return [zero_pad(factor, shape) for factor, shape in zip(factors, shapes, strict=True)]

    def to_tltorch(self, network: ExpertNetwork, cores: Mapping[str, Any]) -> Any:
        """A ``tltorch.TTTensor`` (boundary ranks of 1 added)."""
        from mumoe_tn.decompositions.tensor_support import load_tltorch, parameter_copy

        tltorch = load_tltorch()
        factors = [cores[f"G_{leg}"] for leg in [*network.expert_legs, INPUT_LEG, OUTPUT_LEG]]
        factors[0], factors[-1] = factors[0][None], factors[-1][..., None]
        return tltorch.TTTensor([parameter_copy(f) for f in factors])

    def from_tltorch(self, tensor: Any) -> tuple[ExpertNetwork, list[Any]]:
        """The TT cores without their boundary ranks of 1."""
        *dims, in_features, out_features = tuple(tensor.shape)
        factors = [f.detach() for f in tensor.factors]
        network = self.build(dims, in_features, out_features, [f.shape[-1] for f in factors[:-1]])
        return network, [factors[0][0], *factors[1:-1], factors[-1][..., 0]]


def tt(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
    *,
    expert_rank: int = PAPER_EXPERT_RANK,
) -> ExpertNetwork:
    """TTμMoE network (see [`TTFormat`][mumoe_tn.decompositions.tt.TTFormat]).

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        ``E + 1`` ranks ``(R_1, …, R_{E+1})``, or one int ``R`` meaning ``R_{E+1} = R`` and every
        other rank ``expert_rank``.
    expert_rank : int, optional
        Rank of the bonds between expert cores when ``rank`` is an int (default 4).

    Returns
    -------
    ExpertNetwork
    """
    return TTFormat.get().build(expert_dims, in_features, out_features, rank, expert_rank=expert_rank)
