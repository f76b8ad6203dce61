"""Tensor-ring μMoE: a ring of three-leg cores over n1 … nE, i, o."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mumoe_tn.decompositions._ring import chain, chain_ranks, pass_through_expert_cores
from mumoe_tn.decompositions.format import Format
from mumoe_tn.network import ExpertNetwork, normalise_expert_dims

__all__ = ["PAPER_EXPERT_RANK", "TRFormat", "tr"]

#: The paper's ``R1 = R2 = 4``: rank of the bonds touching expert cores when one int is given.
PAPER_EXPERT_RANK = 4


def _ranks(network: ExpertNetwork) -> list[int]:
    return [network.sizes[f"r{k}"] for k in range(1, network.n_expert_modes + 3)]


class TRFormat(Format, name="tr"):
    """TRμMoE (paper the fast TR forward and its hierarchical form).

    Cores ``G_n1 (R_1, N_1, R_2) … G_nE (R_E, N_E, R_{E+1})``, ``G_i (R_{E+1}, I, R_{E+2})`` and
    ``G_o (R_{E+2}, O, R_1)``, in tensorly's ``(r_k, n_k, r_{k+1})`` layout; bonds
    ``r1 … r{E+2}``. Rank: ``E + 2`` ints, or one int ``R`` for ``R_{E+2}`` (the bond between the
    input and output cores) with the others ``expert_rank`` (default 4, the paper's).
    """

    init_rule = "paper"

    def network(
        self,
        expert_dims: int | Sequence[int],
        in_features: int,
        out_features: int,
        rank: int | Sequence[int],
        *,
        expert_rank: int = PAPER_EXPERT_RANK,
    ) -> ExpertNetwork:
        """The ring; see the class docstring."""
        n_bonds = len(normalise_expert_dims(expert_dims)) + 2
        ranks = chain_ranks("tr", rank, n_bonds, expert_rank)
        return chain(expert_dims, in_features, out_features, ranks, closed=True)

    def closed_form_fma(self, network: ExpertNetwork) -> int:
        """``Σ_e R_e N_e R_{e+1} + R_{E+1} I R_{E+2} + Σ_{e=2}^{E+1} R_1 R_e R_{e+1} + R_{E+2} O R_1``.

        For ``E = 1`` this is the paper's ``R1NR2 + R2IR3 + R1R2R3 + R1OR3`` (Table
        decomp-tradeoff); for ``E > 1`` the mode-2 products and the left-to-right chain of
        ``R_1 × R_{e+1}`` matrix products of the paper's hierarchical TR forward. Nothing is omitted.
        """
        r = _ranks(network)
        n_modes = network.n_expert_modes
        total = sum(r[e] * n * r[e + 1] for e, n in enumerate(network.expert_dims))
        total += r[n_modes] * network.in_features * r[n_modes + 1]
        total += sum(r[0] * r[e] * r[e + 1] for e in range(1, n_modes + 1))
        return total + r[n_modes + 1] * network.out_features * r[0]

    def closed_form_rank_bound(self, network: ExpertNetwork) -> int:
        """``min{R_{E+2}·min{R_1, …, R_{E+1}}, I, O}`` (paper ``min{R3·min{R1, R2}, I, O}`` for E = 1)."""
        r = _ranks(network)
        return min(r[-1] * min(r[:-1]), network.in_features, network.out_features)

    def search_structures(
        self, expert_dims: tuple[int, ...], expert_ranks: Sequence[int]
    ) -> list[tuple[str, int | tuple[int, ...] | None]]:
        """Every ``(R1, R2)`` of ``expert_ranks`` with a ratio of at most 4; ``R3`` is scaled."""
        pairs = [(r1, r2) for r1 in expert_ranks for r2 in expert_ranks if max(r1, r2) <= 4 * min(r1, r2)]
        # r1 closes the ring at the output core; the last bond is the one matching scales
        return [(f"tr R1={r1} R2={r2}", (r1, *([r2] * len(expert_dims)), 1)) for r1, r2 in pairs]

    def matched_bonds(self, network: ExpertNetwork) -> tuple[str, ...]:
        """``R_{E+2}``, the input–output bond; the expert ranks stay (the paper's R1 = R2 = 4)."""
        return (f"r{network.n_expert_modes + 2}",)

    def upcycle_capacity(self, network: ExpertNetwork) -> int:
        """``R_{E+2}`` components."""
        return network.sizes[f"r{network.n_expert_modes + 2}"]

    def upcycle(self, network: ExpertNetwork, cores: Mapping[str, Any], left: Any, right: Any) -> None:
        """Identity expert slices; ``G_i[0] = left``, ``G_o[:, :, 0] = rightᵀ`` (zero-padded)."""
        k = left.shape[1]
        pass_through_expert_cores(network, cores)
        cores["G_i"].zero_()
        cores["G_o"].zero_()
        cores["G_i"][0, :, :k] = left
        cores["G_o"][:k, :, 0] = right.T

    def decompose(self, tensor: Any, network: ExpertNetwork, **options: Any) -> list[Any]:
        """Tensorly's TR-SVD (``method="svd"``, default) or TR-ALS (``method="als"``)."""
        import tensorly as tl

        method = options.get("method", "svd")
        ranks = _ranks(network)
        if method not in ("svd", "als"):
            raise ValueError(f"tr method must be 'svd' or 'als', got {method!r}")
        if method == "svd" and ranks[0] * ranks[1] > tensor.shape[0]:
            raise ValueError(
                f"TR-SVD needs R1·R2 <= N1, got {ranks[0]}·{ranks[1]} > {tensor.shape[0]}; lower the expert ranks "
                "or use method='als'"
            )
        with tl.backend_context("pytorch"):
            if method == "als":
                return list(
                    tl.decomposition.tensor_ring_als(
                        tensor,
                        rank=[*ranks, ranks[0]],
                        n_iter_max=options.get("n_iter_max", 100),
                        random_state=options.get("random_state", 0),
                    )
                )
            return list(tl.decomposition.tensor_ring(tensor, rank=[*ranks, ranks[0]]))


def tr(
    expert_dims: int | Sequence[int],
    in_features: int,
    out_features: int,
    rank: int | Sequence[int],
    *,
    expert_rank: int = PAPER_EXPERT_RANK,
) -> ExpertNetwork:
    """TRμMoE network (see [`TRFormat`][mumoe_tn.decompositions.tr.TRFormat]).

    Parameters
    ----------
    expert_dims : int or Sequence[int]
        Expert mode sizes ``N_1…N_E``.
    in_features, out_features : int
        Sizes of the legs ``i`` and ``o``.
    rank : int or Sequence[int]
        ``E + 2`` ranks ``(R_1, …, R_{E+2})``, or one int ``R`` meaning ``R_{E+2} = R`` and every
        other rank ``expert_rank``.
    expert_rank : int, optional
        Rank of the bonds touching expert cores when ``rank`` is an int (default 4).

    Returns
    -------
    ExpertNetwork
    """
    return TRFormat.get().build(expert_dims, in_features, out_features, rank, expert_rank=expert_rank)
