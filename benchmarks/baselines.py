"""Layers the μMoE is measured against.

- The paper's appendix "Fast μMoE implementations", transcribed with ``torch.einsum`` (the
  paper uses ``einops.einsum``, which calls it) over the same cores as a
  :class:`~mumoe_tn.layers.FactorizedExperts`: the hand-written baseline.
- A dense MoE that materialises ``W`` and evaluates every expert (paper Eq. 1).
- A sparse top-K MoE that routes each token to its K best experts (a loop over experts).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mumoe_tn import FactorizedExperts, MuMoE
from mumoe_tn.gating import ExpertGate


class HandwrittenCP(nn.Module):
    """``einsum(G_o, a@G_n.T, …, z@G_i.T, 'r o, b r, …, b r -> b o')`` over shared CP cores."""

    def __init__(self, experts: FactorizedExperts) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, z: torch.Tensor, coefficients: list[torch.Tensor]) -> torch.Tensor:
        net, cores = self.experts.network, self.experts.cores
        terms = [a @ cores[f"U_{leg}"] for a, leg in zip(coefficients, net.expert_legs, strict=True)]
        terms.append(z @ cores["U_i"])
        equation = "ro," + ",".join("br" for _ in terms) + "->bo"
        return torch.einsum(equation, cores["U_o"].T, *terms)


class HandwrittenTR(nn.Module):
    """The paper's TR pseudocode for one or two expert modes over shared TR cores."""

    def __init__(self, experts: FactorizedExperts) -> None:
        super().__init__()
        if experts.network.n_expert_modes not in (1, 2):
            raise ValueError("the paper gives TR pseudocode for one and two expert modes")
        self.experts = experts

    def forward(self, z: torch.Tensor, coefficients: list[torch.Tensor]) -> torch.Tensor:
        cores = self.experts.cores
        f1 = torch.einsum("bn,anc->bac", coefficients[0], cores["G_n1"])
        if len(coefficients) == 1:
            f2 = torch.einsum("bi,cid->bcd", z, cores["G_i"])
            fout = torch.einsum("bac,bcd->bad", f1, f2)
            return torch.einsum("doa,bad->bo", cores["G_o"], fout)
        f2 = torch.einsum("bn,cnd->bcd", coefficients[1], cores["G_n2"])
        f3 = torch.einsum("bi,die->bde", z, cores["G_i"])
        fout = torch.einsum("bac,bcd->bad", f1, f2)
        fout = torch.einsum("bad,bde->bae", fout, f3)
        return torch.einsum("eoa,bae->bo", cores["G_o"], fout)


class DenseMoE(nn.Module):
    """Every expert evaluated on every token over a materialised ``W (N, I+1, O)`` (Eq. 1)."""

    def __init__(self, in_features: int, out_features: int, n_experts: int) -> None:
        super().__init__()
        self.gate = ExpertGate(in_features, n_experts)
        bound = in_features**-0.5
        self.weight = nn.Parameter(torch.empty(n_experts, in_features + 1, out_features).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (a,) = self.gate(x)
        z = torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)
        outputs = torch.einsum("bi,nio->bno", z, self.weight)  # every expert's output
        return torch.einsum("bn,bno->bo", a, outputs)


class SparseMoE(nn.Module):
    """Top-K routing: softmax over each token's K best router logits, one Linear per expert.

    Experts are separate ``nn.Linear`` modules (as in common MoE code), so each expert's
    gradient is its own tensor; only experts that receive tokens run.
    """

    def __init__(self, in_features: int, out_features: int, n_experts: int, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(in_features, n_experts, bias=False)
        self.top_k = top_k
        self.out_features = out_features
        self.experts = nn.ModuleList(nn.Linear(in_features, out_features) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, chosen = self.router(x).topk(self.top_k, dim=-1)
        weights = F.softmax(values, dim=-1)
        y = x.new_zeros(x.shape[0], self.out_features)
        for expert in torch.unique(chosen).tolist():
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            out = self.experts[expert](x[token])
            y = y.index_add(0, token, out * weights[token, slot, None])
        return y


def matched_layer(name: str, in_features: int, out_features: int, expert_dims: tuple[int, ...]) -> MuMoE:
    """A μMoE layer parameter-matched (gating counted) to ``nn.Linear(in, out)``."""
    from mumoe_tn.costs import linear, match_layer
    from mumoe_tn.decompositions import build

    network = build(name, expert_dims, in_features + 1, out_features, 1)
    bonds = network.bonds if name == "tucker" else None
    matched = match_layer(network, linear(in_features, out_features).params, bonds=bonds)
    return MuMoE(in_features, out_features, decomposition=matched.networks[0], input_norm=True)
