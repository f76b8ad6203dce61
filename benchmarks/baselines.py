"""What the benchmarks measure: the μMoE, nn.Linear / MLP, the paper's einsums and peer MoEs.

Every case is a JSON-serialisable :class:`Case` (so that a fresh process can rebuild it to
measure its peak memory). μMoE layers are built only through the public constructors
(``MuMoE(...)``, ``MuMoEMLP(...)``); nothing here looks at a network's name. The peers come
from the package registry (``pip install -e ".[bench]"``) and are configured as their
authors' READMEs show; a peer that is not installed is reported, not faked.

- ``soft-moe-pytorch``: ``SoftMoE(dim, seq_len=…, num_experts=…, expert_mult=…)``.
- ``PEER-pytorch``: ``PEER(dim, heads=8, num_experts=<square>, num_experts_per_head=16)``.
- ``st-moe-pytorch``: ``MoE(dim, num_experts=…, gating_top_n=2, expert_hidden_mult=…)``, a
  top-2 router with capacity factors (ST-MoE); its auxiliary losses are not back-propagated.
- The paper's appendix "Fast μMoE implementations" (CP and TR, one and two expert modes),
  transcribed with ``torch.einsum`` (the paper's ``einops.einsum`` calls it) over the very
  cores of a :class:`~mumoe_tn.layers.experts.FactorizedExperts`.
- :class:`DenseMoE`: a soft mixture whose every expert (a narrow MLP) runs on every token, the
  outputs weighted by a softmax gate: the dense-MoE baseline of the latency sweep.
- :class:`Generation`: greedy ``generate`` of a small local GPT-2 (``transformers``), dense or
  converted to μMoE blocks with ``mumoe_tn.convert``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks.floors import fewest_calls
from mumoe_tn import MuMoE
from mumoe_tn.layers import FactorizedExperts, MixtureOfDecoders, MuMoEMLP

#: Registry package that provides each peer model, for the "not installed" message.
PEER_PACKAGES = {"peer": "PEER-pytorch", "soft_moe": "soft-moe-pytorch", "st_moe": "st-moe-pytorch"}
PEER_MODULES = {"peer": "PEER_pytorch", "soft_moe": "soft_moe_pytorch", "st_moe": "st_moe_pytorch"}


@dataclass(frozen=True)
class Case:
    """One configuration to time.

    Attributes
    ----------
    label : str
        Row label in the tables.
    model : str
        Key of :data:`BUILDERS`.
    options : dict
        Keyword arguments of the builder.
    batch, seq : int
        Inputs are ``(batch, seq, width)`` tokens (``batch·seq`` tokens in all).
    inputs : str
        ``"tokens"`` (one input of ``in_features``), ``"contraction"`` (an input with the
        bias column and one coefficient tensor per expert mode) or ``"prompt"`` (token ids of
        ``vocab_size``).
    threads : int, optional
        CPU threads this case is timed with (default: the run's ``--threads``).
    """

    label: str
    model: str
    options: dict = field(default_factory=dict)
    batch: int = 8
    seq: int = 512
    inputs: str = "tokens"
    threads: int | None = None

    def to_json(self) -> dict:
        """The case as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Case:
        """Rebuild a case from :meth:`to_json`."""
        return cls(**data)


#: Optional packages of the library's own cases: model → (module, registry package).
OPTIONAL = {"generation": ("transformers", "transformers")}


def missing_package(case: Case) -> str | None:
    """The registry package a case needs and that is not installed, else None."""
    module, package = PEER_MODULES.get(case.model), PEER_PACKAGES.get(case.model)
    if case.model in OPTIONAL:
        module, package = OPTIONAL[case.model]
    if module is not None and importlib.util.find_spec(module) is None:
        return package
    return None


# ----------------------------------------------------------------------------- builders
def _linear(in_features: int, out_features: int) -> nn.Module:
    return nn.Linear(in_features, out_features)


def _mlp(in_features: int, hidden_features: int) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, hidden_features), nn.GELU(), nn.Linear(hidden_features, in_features))


def _router(topk: int | None, relu_topk: int | None) -> dict[str, Any]:
    """``gate=``: a softmax top-k router (``topk``) or the MxD gate (``relu_topk``); none: the default gate."""
    from mumoe_tn.gates import ReLUTopKGate, TopKGate

    if topk is not None:
        return {"gate": TopKGate(k=topk)}
    return {} if relu_topk is None else {"gate": ReLUTopKGate(k=relu_topk)}


def _mumoe(
    *, precontract: bool = True, topk: int | None = None, relu_topk: int | None = None, **options: Any
) -> nn.Module:
    layer = MuMoE(**options, **_router(topk, relu_topk))
    layer.experts.precontract = precontract
    return layer


def _mumoe_mlp(*, topk: int | None = None, relu_topk: int | None = None, **options: Any) -> nn.Module:
    return MuMoEMLP(**options, **_router(topk, relu_topk))


class PlannedContraction(nn.Module):
    """The expert contraction alone, as the library plans and runs it."""

    def __init__(self, **layer_options: Any) -> None:
        super().__init__()
        self.experts = MuMoE(**layer_options).experts

    def forward(self, z: torch.Tensor, coefficients: list[torch.Tensor]) -> torch.Tensor:
        return self.experts(z, coefficients)


def _core(experts: FactorizedExperts, leg: str, order: tuple[str, ...]) -> torch.Tensor:
    """The core holding ``leg``, its dimensions permuted to ``order`` (its own labels)."""
    net = experts.network
    name = net.core_of(leg)
    labels = net.cores[name]
    if sorted(order) != sorted(labels):
        raise ValueError(f"core {name!r} has labels {labels}, expected a permutation of {order}")
    return experts.cores[name].permute(*(labels.index(label) for label in order))


def _bond(experts: FactorizedExperts, first: str, second: str) -> str:
    """The one bond shared by the cores of legs ``first`` and ``second``."""
    net = experts.network
    a, b = net.cores[net.core_of(first)], net.cores[net.core_of(second)]
    shared = [label for label in a if label in b and label in net.bonds]
    if len(shared) != 1:
        raise ValueError(f"the paper's einsums need one bond between the cores of {first!r} and {second!r}")
    return shared[0]


def handwritten_cp(experts: FactorizedExperts, z: torch.Tensor, coefficients: list[torch.Tensor]) -> torch.Tensor:
    """Paper appendix, CPμMoE: ``einsum(G_o, a[0]@G1.T, …, z@G_i.T, 'r o, b t r, …, b t r -> b t o')``."""
    net = experts.network
    (rank,) = net.bonds
    if any(len(labels) != 2 for labels in net.cores.values()):
        raise ValueError("the paper's CP einsum needs one factor matrix per leg and one shared rank")
    terms = [a @ _core(experts, leg, (leg, rank)) for a, leg in zip(coefficients, net.expert_legs, strict=True)]
    terms.append(z @ _core(experts, "i", ("i", rank)))
    equation = "ro," + ",".join("btr" for _ in terms) + "->bto"
    return torch.einsum(equation, _core(experts, "o", (rank, "o")), *terms)


def handwritten_tr(experts: FactorizedExperts, z: torch.Tensor, coefficients: list[torch.Tensor]) -> torch.Tensor:
    """Paper appendix, TRμMoE with one or two expert modes (batched tensor-vector products)."""
    net = experts.network
    legs = net.expert_legs
    if len(legs) not in (1, 2):
        raise ValueError("the paper gives TR einsums for one and two expert modes")
    ring = [*legs, "i", "o"]
    bonds = [_bond(experts, ring[k - 1], ring[k]) for k in range(len(ring))]  # bonds[k] joins ring[k-1], ring[k]
    cores = [_core(experts, leg, (bonds[k], leg, bonds[(k + 1) % len(ring)])) for k, leg in enumerate(ring)]
    factors = [torch.einsum("btn,pnq->btpq", a, core) for a, core in zip(coefficients, cores, strict=False)]
    factors.append(torch.einsum("bti,piq->btpq", z, cores[len(legs)]))
    chain = factors[0]
    for factor in factors[1:]:
        chain = torch.einsum("btpq,btqs->btps", chain, factor)
    return torch.einsum("sop,btps->bto", cores[-1], chain)


class HandwrittenContraction(nn.Module):
    """The paper's einsums over the cores of the same (seeded) layer as :class:`PlannedContraction`."""

    def __init__(self, formula: str, **layer_options: Any) -> None:
        super().__init__()
        self.experts = MuMoE(**layer_options).experts
        self.formula = {"cp": handwritten_cp, "tr": handwritten_tr}[formula]

    def forward(self, z: torch.Tensor, coefficients: list[torch.Tensor]) -> torch.Tensor:
        return self.formula(self.experts, z, coefficients)


class HandwrittenLayer(nn.Module):
    """A whole μMoE layer whose contraction is the paper's einsum.

    The layer's own gate, a column of ones for the bias, then :func:`handwritten_cp` or
    :func:`handwritten_tr`.
    """

    def __init__(self, formula: str, **layer_options: Any) -> None:
        super().__init__()
        self.layer = MuMoE(**layer_options)
        self.formula = {"cp": handwritten_cp, "tr": handwritten_tr}[formula]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.layer.input_norm(x)
        coefficients = self.layer.gate(z)
        z = torch.cat([z, z.new_ones(*z.shape[:-1], 1)], dim=-1)
        return self.formula(self.layer.experts, z, list(coefficients))


class DenseMoE(nn.Module):
    """A soft mixture of narrow MLP experts, all evaluated on every token.

    ``num_experts`` experts ``in_features → hidden_features / num_experts → in_features`` hold
    the dense MLP's parameters (plus a ``in_features × num_experts`` gate), and every token
    passes all of them: the MLP's multiply-adds, each expert's hidden units scaled by its
    softmax gate weight before the down projection.
    """

    def __init__(self, in_features: int, hidden_features: int, num_experts: int) -> None:
        super().__init__()
        if hidden_features % num_experts:
            raise ValueError(f"hidden_features={hidden_features} must divide into num_experts={num_experts}")
        self.num_experts = num_experts
        self.gate = nn.Linear(in_features, num_experts)
        self.up = nn.Linear(in_features, hidden_features)  # the experts' up projections side by side
        self.down = nn.Linear(hidden_features, in_features)  # and their down projections, summed
        self.activation = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=-1)  # (..., experts)
        hidden = self.activation(self.up(x)).unflatten(-1, (self.num_experts, -1))
        return self.down((hidden * weights.unsqueeze(-1)).flatten(-2))


class Generation(nn.Module):
    """Greedy, KV-cached ``generate`` of a small local GPT-2, dense or converted to μMoE blocks.

    The model is built from a ``GPT2Config`` (nothing is downloaded), dropout off, in eval mode.
    With ``convert`` (keyword arguments of :func:`mumoe_tn.convert`) its MLP blocks are replaced
    first. ``forward(prompt)`` generates exactly ``new_tokens`` tokens (no end-of-sequence token).
    """

    def __init__(
        self,
        *,
        layers: int,
        width: int,
        heads: int,
        vocab_size: int,
        positions: int,
        new_tokens: int,
        convert: dict | None = None,
    ) -> None:
        super().__init__()
        import transformers

        import mumoe_tn

        config = transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab_size, n_positions=positions,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config).eval()
        if convert is not None:
            mumoe_tn.convert(self.model, **convert)
        self.vocab_size, self.new_tokens = vocab_size, new_tokens
        self.settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
        self.settings |= {"use_cache": True, "pad_token_id": 0}

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        return self.model.generate(prompt, attention_mask=torch.ones_like(prompt), **self.settings)


def _peer(**options: Any) -> nn.Module:
    from PEER_pytorch import PEER

    return PEER(**options)


def _soft_moe(**options: Any) -> nn.Module:
    from soft_moe_pytorch import SoftMoE

    return SoftMoE(**options)


class TopKMoE(nn.Module):
    """st-moe-pytorch's ``MoE`` returning only its output (its auxiliary losses are dropped)."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        from st_moe_pytorch import MoE

        self.moe = MoE(**options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def _mxd_gate(k: int | None) -> dict[str, Any]:
    """The authors' gate (top-k of ReLU(Gx + b), not renormalised) when ``k`` is given, else the default."""
    if k is None:
        return {}
    from mumoe_tn.gates import ReLUTopKGate

    return {"gate": ReLUTopKGate(k=k)}


def _mxd_block(*, gate_k: int | None = None, **options: Any) -> nn.Module:
    return MixtureOfDecoders(**options, **_mxd_gate(gate_k))


class AuthorsMxD(nn.Module):
    """The Mixture of Decoders layer written from the paper's equations, at a library block's sizes.

    ``h = GELU(E x + b)``, ``a = TopK_k(ReLU(G x + b_G))`` (not renormalised),
    ``y = (Dᵀh) ⊙ (Cᵀa) + b_out``: plain ``nn.Linear`` / parameter matmuls and ``torch.topk``,
    the hidden width and expert count taken from the matched
    [`MixtureOfDecoders`][mumoe_tn.layers.decoders.MixtureOfDecoders] of the same options.
    """

    def __init__(self, *, gate_k: int, **options: Any) -> None:
        super().__init__()
        like = MixtureOfDecoders(**options)
        (n,) = like.network.expert_dims
        hidden, out_features = like.hidden_features, like.out_features
        self.k = gate_k
        self.encoder = nn.Linear(like.in_features, hidden)
        self.gate = nn.Linear(like.in_features, n)
        self.decoder = nn.Parameter(torch.randn(hidden, out_features) / hidden**0.5)
        self.experts = nn.Parameter(torch.ones(n, out_features) + 0.01 * torch.randn(n, out_features))
        self.output_bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.encoder(x))
        values, index = torch.relu(self.gate(x)).topk(self.k, dim=-1)
        a = torch.zeros(*x.shape[:-1], self.experts.shape[0], dtype=x.dtype, device=x.device).scatter(-1, index, values)
        return (hidden @ self.decoder) * (a @ self.experts) + self.output_bias


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "mxd_block": _mxd_block,
    "mxd_authors": AuthorsMxD,
    "linear": _linear,
    "mlp": _mlp,
    "mumoe": _mumoe,
    "mumoe_mlp": _mumoe_mlp,
    "planned": PlannedContraction,
    "handwritten": HandwrittenContraction,
    "handwritten_layer": HandwrittenLayer,
    "fewest_calls": fewest_calls,
    "compiled": lambda **options: Compiled(**options),
    "peer": _peer,
    "soft_moe": _soft_moe,
    "st_moe": TopKMoE,
    "dense_moe": DenseMoE,
    "generation": Generation,
}


#: Graphs dynamo may keep for one code object (the forward of every compiled layer of one class).
COMPILED_GRAPHS_PER_CLASS = 64


class Compiled(nn.Module):
    """The module of ``case`` and its ``torch.compile`` (``fullgraph=True``); calls run the compiled one.

    Parameters
    ----------
    case : dict
        The wrapped case, as :meth:`benchmarks.baselines.Case.to_json` writes it.
    backend : str, optional
        ``torch.compile`` backend (default ``"inductor"``; ``"eager"`` traces without generating code).
    mode : str, optional
        ``torch.compile`` mode of the inductor backend (default: its default mode).

    Notes
    -----
    Constructing one raises dynamo's ``recompile_limit`` (process-wide) to at least
    :data:`COMPILED_GRAPHS_PER_CLASS`: the compiled layers of one class share one cache.
    """

    def __init__(self, *, case: dict, backend: str = "inductor", mode: str | None = None) -> None:
        super().__init__()
        inner = Case.from_json(case)
        if inner.model == "compiled":
            raise ValueError(f"case {inner.label!r} is compiled already")
        self.eager = BUILDERS[inner.model](**inner.options)
        # Every compiled layer of one class shares its forward's code object, whose cache holds
        # `recompile_limit` graphs in all (8 by default): room for those of many compiled layers.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, COMPILED_GRAPHS_PER_CLASS)
        self.compiled = torch.compile(self.eager, backend=backend, mode=mode, fullgraph=True)

    def forward(self, *args: Any) -> torch.Tensor:
        return self.compiled(*args)


def build_module(case: Case, device: torch.device | str = "cpu") -> nn.Module:
    """The module of a case, seeded, on ``device``."""
    if case.model not in BUILDERS:
        raise ValueError(f"unknown model {case.model!r}; choose one of {list(BUILDERS)}")
    torch.manual_seed(0)
    return BUILDERS[case.model](**case.options).to(device)


def count_params(case: Case) -> int:
    """Parameters of a case's module, counted on the meta device (nothing is allocated)."""
    try:
        with torch.device("meta"):
            module = BUILDERS[case.model](**case.options)
    except (NotImplementedError, RuntimeError):  # an init that needs real data
        module = BUILDERS[case.model](**case.options)
    return sum(p.numel() for p in module.parameters())


def make_inputs(case: Case, module: nn.Module, device: torch.device | str = "cpu") -> tuple[list[torch.Tensor], tuple]:
    """Inputs that require grad (as inside a network), and the forward's positional arguments."""
    generator = torch.Generator().manual_seed(1)
    lead = (case.batch, case.seq)
    if case.inputs == "tokens":
        x = torch.randn(*lead, input_width(case), generator=generator).to(device).requires_grad_()
        return [x], (x,)
    if case.inputs == "contraction":
        net = module.experts.network
        z = torch.randn(*lead, net.in_features, generator=generator).to(device).requires_grad_()
        coefficients = [
            torch.softmax(torch.randn(*lead, n, generator=generator), -1).to(device).requires_grad_()
            for n in net.expert_dims
        ]
        return [z, *coefficients], (z, coefficients)
    if case.inputs == "prompt":
        prompt = torch.randint(1, module.vocab_size, lead, generator=generator).to(device)
        return [], (prompt,)
    raise ValueError(f"unknown inputs {case.inputs!r}")


def input_width(case: Case) -> int:
    """Feature width of a ``"tokens"`` case's input."""
    options = case.options
    if case.model == "compiled":  # the width of the case it compiles
        return input_width(Case.from_json(options["case"]))
    for key in ("in_features", "dim"):
        if key in options:
            return int(options[key])
    raise ValueError(f"case {case.label!r} names no input width (in_features or dim)")


def fp32_bytes(params: int) -> int:
    """Bytes of float32 weights plus their gradients."""
    return 2 * 4 * params


def human(count: float) -> str:
    """``4.72 M``-style count."""
    for scale, suffix in ((1e9, " B"), (1e6, " M"), (1e3, " k")):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:g}"
