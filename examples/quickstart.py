"""Build CP, TR, TT and Tucker μMoE layers with two expert modes and check them against W.

Run: ``python examples/quickstart.py``. For each decomposition it prints the output shape,
the parameter counts and the largest difference between the factorized forward pass and the
naive forward pass over the materialised expert tensor (paper Eq. hierarchy-sum).
"""

import torch

from mumoe_tn import ExpertNetwork, MuMoE, dense_forward

IN, OUT, EXPERTS = 64, 128, (16, 8)  # 16 × 8 = 128 experts in two expert modes
RANKS = {"cp": 32, "tr": 16, "tt": 16, "tucker": 8}


def check(name: str, layer: MuMoE, x: torch.Tensor) -> None:
    layer.eval()  # use BatchNorm running statistics so both passes see identical gates
    with torch.no_grad():
        y = layer(x)
        z = torch.cat([x, torch.ones(*x.shape[:-1], 1)], dim=-1).reshape(-1, IN + 1)
        coefficients = [a.reshape(-1, a.shape[-1]) for a in layer.last_coefficients]
        reference = dense_forward(layer.experts.to_dense(), coefficients, z).reshape(y.shape)
    experts = layer.network.n_params
    gate = sum(p.numel() for p in layer.gate.parameters())
    print(
        f"{name:<34} out {tuple(y.shape)}  expert params {experts:>7,}  gate params {gate:>5,}  "
        f"max |factorized - dense| {(y - reference).abs().max().item():.2e}"
    )


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 32, IN)  # (batch, tokens, features)
    print(
        f"μMoE layers {IN} -> {OUT}, experts {EXPERTS[0]}×{EXPERTS[1]} = {EXPERTS[0] * EXPERTS[1]}, "
        f"input {tuple(x.shape)}"
    )
    print(f"nn.Linear({IN}, {OUT}) has {IN * OUT + OUT:,} parameters; a dense MoE has {128 * (IN + 1) * OUT:,}")
    for name, rank in RANKS.items():
        check(f"{name} (rank {rank})", MuMoE(IN, OUT, EXPERTS, name, rank), x)
    # A custom decomposition: a tensor ring whose input core also holds the second expert leg.
    custom = ExpertNetwork.from_spec(
        "A: n1 a b, B: a n2 i c, C: b c o",
        expert_dims=EXPERTS,
        in_features=IN + 1,
        out_features=OUT,
        ranks={"a": 4, "b": 4, "c": 16},
    )
    check("custom 'n1 a b, a n2 i c, b c o'", MuMoE(IN, OUT, decomposition=custom), x)


if __name__ == "__main__":
    main()
