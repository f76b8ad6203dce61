"""μMoE layers written as the fewest eager PyTorch calls their arithmetic needs: the host-time floors.

Each floor holds a library layer built from the same options (``MuMoE(..., decomposition)``,
entmax15 + BatchNorm gate, seeded alike by the benchmarks) and runs that layer's own parameters
with nothing else: no checks, caches beyond one folding of the eval weights, records or plan
look-ups. The host section divides each format's eager host time per call by its floor's.

- Train: the gate's product, its batch norm (running statistics updated as the layer's are),
  the sparse map, the input factor's product with its bias row, then the format's products;
  autograd for the backward.
- Eval: the gate (its running statistics folded in) and the input factor in one ``addmm``, the
  map, then the format's products. The folding happens once, at the first eval call: the
  parameters of a benchmark do not change between calls.

The cores' layouts (``benchmarks.floors.FewestCallsTR`` permutes its three-way cores into
matrices) are rearranged in every training call, as the gradients must reach the parameters
themselves; at eval they are rearranged once with the folding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import entmax
import torch
from torch import nn

from mumoe_tn import MuMoE
from mumoe_tn.gates import entmax15

#: The sparse maps a floor can run on its gate's logits: the library's 1.5-entmax (the layer's
#: own), a softmax (the cheapest map: what the sparse one costs above it), and 1.5-entmax from the
#: ``entmax`` package (the reference implementation of the same map).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "entmax15": entmax15,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "entmax.entmax15": lambda logits: entmax.entmax15(logits, dim=-1),
}


class FewestCalls(nn.Module):
    """The gate and the input factor of a one-mode μMoE layer as the fewest eager calls.

    Subclasses name their format (``decomposition``), the input core's matrix (``input_matrix``:
    ``I + 1`` rows, the last the bias row) and the products after the map (``combine``).

    Parameters
    ----------
    activation : str, optional
        Key of :data:`ACTIVATIONS`: the map run on the gate's logits (default ``"entmax15"``,
        the layer's own; another map makes a decomposition row, not the layer's output).
    **layer_options
        Keyword arguments of :class:`~mumoe_tn.MuMoE` (its ``decomposition`` is the subclass's).
    """

    decomposition = ""

    def __init__(self, *, activation: str = "entmax15", **layer_options: Any) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.layer = MuMoE(**{**layer_options, "decomposition": self.decomposition})
        if len(self.layer.expert_dims) != 1:
            raise ValueError(f"a fewest-calls floor has one expert mode, got expert_dims={self.layer.expert_dims}")
        self.activation = ACTIVATIONS[activation]
        self._eval_weights: tuple[torch.Tensor, ...] | None = None

    def input_matrix(self) -> torch.Tensor:
        """The input core as an ``(I + 1, k)`` matrix whose product with ``[x, 1]`` the format combines."""
        raise NotImplementedError

    def expert_matrices(self) -> tuple[torch.Tensor, ...]:
        """The cores after the input factor, as :meth:`combine` takes them."""
        raise NotImplementedError

    def combine(self, coefficients: torch.Tensor, hidden: torch.Tensor, *matrices: torch.Tensor) -> torch.Tensor:
        """The output from the map's coefficients and the input factor's product ``hidden``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        gate = self.layer.gate
        (projection,) = gate.projections.values()
        (norm,) = gate.norms.values()
        if self.training:
            logits = nn.functional.batch_norm(x @ projection.weight.T, norm.running_mean, norm.running_var,
                                              training=True, momentum=norm.momentum, eps=norm.eps)  # fmt: skip
            inputs = self.input_matrix()
            hidden = torch.addmm(inputs[-1], x, inputs[:-1])
            return self.combine(self.activation(logits), hidden, *self.expert_matrices())
        if self._eval_weights is None:
            with torch.no_grad():
                scale = torch.rsqrt(norm.running_var + norm.eps)
                inputs = self.input_matrix()
                weight = torch.cat([projection.weight.T * scale, inputs[:-1]], dim=1).contiguous()
                bias = torch.cat([-norm.running_mean * scale, inputs[-1]])
                matrices = tuple(matrix.contiguous() for matrix in self.expert_matrices())
            self._eval_weights = (weight, bias, *matrices)
        weight, bias, *matrices = self._eval_weights
        n = projection.weight.shape[0]
        out = torch.addmm(bias, x, weight)
        return self.combine(self.activation(out[:, :n]), out[:, n:], *matrices)


class FewestCallsCP(FewestCalls):
    """A CP μMoE layer as the fewest eager calls: ``((a U_n1) ⊙ ([x, 1] U_i)) U_oᵀ``.

    The parameters of ``MuMoE(..., "cp")`` built from the same options (cores ``U_n1``, ``U_i``
    with the bias row, ``U_o``): one product for the gate and one for the input factor (one
    ``addmm`` for both at eval), the map, then two products.
    """

    decomposition = "cp"

    def input_matrix(self) -> torch.Tensor:
        return self.layer.experts.U_i

    def expert_matrices(self) -> tuple[torch.Tensor, ...]:
        cores = self.layer.experts
        return cores.U_n1, cores.U_o.T

    def combine(self, coefficients: torch.Tensor, hidden: torch.Tensor, *matrices: torch.Tensor) -> torch.Tensor:
        expert_factor, output_factor = matrices
        return torch.mm((coefficients @ expert_factor) * hidden, output_factor)


class FewestCallsTR(FewestCalls):
    """A TR μMoE layer as the fewest eager calls: a batched product of the ring's two token-dependent links.

    The parameters of ``MuMoE(..., "tr")`` (cores ``G_n1: r1 n1 r2``, ``G_i: r2 i r3``,
    ``G_o: r3 o r1``): ``A = a G_n1`` as ``(B, r1, r2)`` and ``Z = [x, 1] G_i`` as
    ``(B, r2, r3)``, one ``bmm`` closes them into ``(B, r1, r3)``, one product with ``G_o``
    (as an ``(r1 r3, O)`` matrix) gives the output.
    """

    decomposition = "tr"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        r1, _, r2 = self.layer.experts.G_n1.shape
        self.ranks = r1, r2, self.layer.experts.G_i.shape[2]

    def input_matrix(self) -> torch.Tensor:
        core = self.layer.experts.G_i  # (r2, I + 1, r3)
        return core.transpose(0, 1).reshape(core.shape[1], -1)

    def expert_matrices(self) -> tuple[torch.Tensor, ...]:
        cores = self.layer.experts
        expert, output = cores.G_n1, cores.G_o  # (r1, N, r2), (r3, O, r1)
        return expert.transpose(0, 1).reshape(expert.shape[1], -1), output.permute(2, 0, 1).reshape(-1, output.shape[1])

    def combine(self, coefficients: torch.Tensor, hidden: torch.Tensor, *matrices: torch.Tensor) -> torch.Tensor:
        expert_factor, output_factor = matrices
        r1, r2, r3 = self.ranks
        tokens = hidden.shape[0]
        links = torch.bmm((coefficients @ expert_factor).view(tokens, r1, r2), hidden.view(tokens, r2, r3))
        return torch.mm(links.view(tokens, r1 * r3), output_factor)


class FewestCallsMxD(FewestCalls):
    """A Mixture-of-Decoders μMoE layer as the fewest eager calls: ``([x, 1] D) ⊙ (a C_n1)``.

    The parameters of ``MuMoE(..., "mxd")`` (the decoder ``D`` with its bias row and the experts'
    output scalings ``C_n1``): one product for the gate and one for the decoder (one ``addmm``
    for both at eval), the map, one product and one multiplication.
    """

    decomposition = "mxd"

    def input_matrix(self) -> torch.Tensor:
        return self.layer.experts.D

    def expert_matrices(self) -> tuple[torch.Tensor, ...]:
        return (self.layer.experts.C_n1,)

    def combine(self, coefficients: torch.Tensor, hidden: torch.Tensor, *matrices: torch.Tensor) -> torch.Tensor:
        (scalings,) = matrices
        return (coefficients @ scalings) * hidden


#: The floors by format, as the host section names them.
FLOORS: dict[str, type[FewestCalls]] = {"cp": FewestCallsCP, "tr": FewestCallsTR, "mxd": FewestCallsMxD}


def fewest_calls(*, decomposition: str, **options: Any) -> FewestCalls:
    """The floor of the layer ``MuMoE(..., decomposition, **options)`` (a builder of the benchmarks' cases)."""
    if decomposition not in FLOORS:
        raise ValueError(f"no fewest-calls floor for decomposition={decomposition!r}; choose one of {sorted(FLOORS)}")
    return FLOORS[decomposition](**options)
