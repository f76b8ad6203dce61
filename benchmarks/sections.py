"""The benchmark sections: which cases each one times, its reference row and its targets."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.baselines import Case


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of a run (full or ``--quick``)."""

    width: int  # d, the model width (MLP block d → 4d → d; layer d → 4d)
    batch: int  # sequences
    seq: int  # tokens per sequence
    experts: int  # N of the single-mode μMoE layers and of PEER at matched parameters
    hierarchy: tuple[int, ...]  # a hierarchical μMoE with prod(hierarchy) experts
    few: int  # the expert count every peer can run at its authors' default width
    paper_seq: int  # tokens per sequence of the hand-written einsum comparison (GPT-2: 8×128)
    small_width: int  # the char-GPT example's width
    small_experts: int
    small_batch: int
    small_seq: int
    peer_heads: int = 8
    peer_topk: int = 16
    rank_multiple: int = 1  # matched μMoE ranks are multiples of this (the small blocks always match exactly)
    decode_tokens: tuple[int, ...] = (1, 8, 64)  # tokens per call of the inference section (decoding batches)
    sweep_tokens: int = 4096  # the latency sweep runs 1, 2, 4, … up to this many tokens
    gpt2: tuple[int, int, int, int] = (4, 12, 2048, 256)  # generation model: layers, heads, vocabulary, positions
    prompt: int = 16  # prompt tokens of the generation benchmark
    new_tokens: int = 32  # tokens generated
    generate_batches: tuple[int, ...] = (1, 8)
    decode_reps: int = 30  # samples per case and round of the inference section
    mxd_hierarchy: tuple[int, int] = (1024, 1024)  # the hierarchical MxD block: 2^20 experts
    host_width: int = 64  # I = O of the host section's layers (blocks I → 4I → I): arithmetic is nothing
    host_experts: int = 16
    host_hierarchy: tuple[int, int] = (4, 4)
    host_train_tokens: int = 64  # tokens of its fwd+bwd
    host_eval_tokens: int = 1  # tokens of its eval call
    host_reps: int = 40  # samples per case and round (calls of tens of microseconds)


FULL = Sizes(768, 8, 512, 256, (32, 32, 32, 32), 16, 128, 64, 64, 32, 64, rank_multiple=16)
QUICK = Sizes(
    32, 2, 16, 16, (4, 4, 4), 4, 16, 16, 8, 2, 16, peer_heads=2, peer_topk=4,
    decode_tokens=(1, 8), sweep_tokens=16, gpt2=(2, 2, 64, 64), prompt=4, new_tokens=4,
    generate_batches=(1, 2), decode_reps=10, mxd_hierarchy=(8, 8), host_reps=4,
)  # fmt: skip


@dataclass(frozen=True)
class Target:
    """``numerator ÷ denominator`` of ``metric`` must be ≤ ``limit``; without a denominator, ``numerator``'s own."""

    name: str
    numerator: str
    denominator: str | None  # None: a count of the numerator row (e.g. kernels per call), not a ratio
    metric: str  # "train_s", "infer_s", "peak_bytes", or a count ("eval_kernels", "train_kernels")
    limit: float


@dataclass(frozen=True)
class Section:
    """One table of the report."""

    name: str
    title: str
    description: str
    reference: str  # label of the row every ratio divides by (unless `pairs` says otherwise)
    cases: tuple[Case, ...]
    memory: bool = True
    reps: int = 1
    targets: tuple[Target, ...] = ()
    not_run: tuple[Case, ...] = ()  # listed with their parameter count, never built
    pairs: tuple[tuple[str, str], ...] = ()  # (row, its own reference row)
    borrowed: tuple[tuple[str, str], ...] = ()  # (row label, section measuring the same configuration)
    order: tuple[str, ...] = ()  # row order of the table when not cases, not_run, borrowed
    reference_text: str = ""  # what the × column divides by, when not the reference row alone
    train: bool = True  # time fwd+bwd too; False: only the forward (eval, no grad, inputs without grad)
    eval_tokens: int | None = None  # host cost: eval at this many tokens, kernels and host reads counted

    def labels(self) -> list[str]:
        """Row labels in table order."""
        default = [case.label for case in (*self.cases, *self.not_run)] + [label for label, _ in self.borrowed]
        return list(self.order) or default

    def __post_init__(self) -> None:
        labels = [case.label for case in (*self.cases, *self.not_run)] + [label for label, _ in self.borrowed]
        if len(set(labels)) != len(labels):
            raise ValueError(f"section {self.name!r} repeats a row label: {labels}")
        if self.order and sorted(self.order) != sorted(labels):
            raise ValueError(f"section {self.name!r}: order {self.order} does not list its rows {labels}")

    def reference_of(self, label: str) -> str:
        """The row that ``label``'s ratios divide by."""
        return dict(self.pairs).get(label, self.reference)


def _mlp(s: Sizes, batch: int, seq: int) -> Case:
    return Case("dense MLP", "mlp", {"in_features": s.width, "hidden_features": 4 * s.width}, batch, seq)


def _aligned(s: Sizes) -> dict:
    """The ``rank_multiple=`` option of matched μMoE cases (none when matching is exact)."""
    return {"rank_multiple": s.rank_multiple} if s.rank_multiple > 1 else {}


def _block(label: str, s: Sizes, dims: int | tuple[int, ...], name: str, batch: int, seq: int, **extra) -> Case:
    options = {"in_features": s.width, "hidden_features": 4 * s.width, "expert_dims": dims, "decomposition": name}
    return Case(label, "mumoe_mlp", {**options, "match": "mlp", **_aligned(s), **extra}, batch, seq)


def _peer(s: Sizes, experts: int, per_head: int, batch: int, seq: int) -> Case:
    options = {"dim": s.width, "heads": s.peer_heads, "num_experts": experts, "num_experts_per_head": per_head}
    return Case(f"PEER {experts:,} experts", "peer", options, batch, seq)


def dims_text(dims: tuple[int, ...]) -> str:
    """``32×32`` for several expert modes, ``256`` for one."""
    return "×".join(map(str, dims)) if len(dims) > 1 else str(dims[0])


def layer_section(s: Sizes, extra: dict) -> Section:
    """Param-matched μMoE layers (entmax15 + BatchNorm gate) against ``nn.Linear``."""
    i, o, tokens = s.width, 4 * s.width, (s.batch, s.seq)
    linear = Case("nn.Linear", "linear", {"in_features": i, "out_features": o}, *tokens)
    aligned = f", ranks ×{s.rank_multiple}" if s.rank_multiple > 1 else ""
    layers, exact = [], []
    for name in ("cp", "tr"):
        options = {"in_features": i, "out_features": o, "expert_dims": s.experts, "decomposition": name}
        options |= {"match": "linear"}
        label = f"{name.upper()} μMoE, {s.experts} experts"
        layers.append(Case(label + aligned, "mumoe", options | _aligned(s) | extra, *tokens))
        if aligned:
            exact.append(Case(label + ", exact match", "mumoe", options | extra, *tokens))
    targets = []
    for case in layers:
        targets.append(Target(f"{case.label} ÷ nn.Linear, fwd+bwd time", case.label, linear.label, "train_s", 1.15))
        targets.append(Target(f"{case.label} ÷ nn.Linear, peak memory", case.label, linear.label, "peak_bytes", 1.3))
    return Section(
        "layer",
        f"μMoE layer vs nn.Linear({i}, {o})",
        f"{s.batch * s.seq:,} tokens, inputs requiring grad; μMoE layers parameter-matched to nn.Linear "
        '(`match="linear"`, gate counted), entmax15 + BatchNorm gate. '
        + (
            f"`rank_multiple={s.rank_multiple}` keeps the matched rank a multiple of {s.rank_multiple} "
            "(CP R = 528 instead of 529, TR R3 = 144 instead of 141; parameters within 0.2 %): "
            "BLAS kernels run an odd inner size up to 1.5× slower. The exact matches are shown too."
            if aligned
            else ""
        ),
        linear.label,
        (linear, *layers, *exact),
        targets=tuple(targets),
    )


def handwritten_section(s: Sizes, extra: dict) -> Section:
    """The planned contraction against the paper's appendix einsums, same weights."""
    i, o, tokens = s.width, 4 * s.width, (s.batch, s.paper_seq)
    root = round(s.experts**0.5)
    cases, targets, pairs = [], [], []
    for name in ("cp", "tr"):
        for dims in ((s.experts,), (root, root)):
            layer = {"in_features": i, "out_features": o, "expert_dims": list(dims), "decomposition": name}
            layer |= {"match": "linear"}
            tag = f"{name.upper()} E={len(dims)} ({dims_text(dims)})"
            planned = Case(f"{tag} contraction, planned", "planned", layer | extra, *tokens, inputs="contraction")
            hand_options = {"formula": name, **layer}
            hand = Case(f"{tag} contraction, paper einsum", "handwritten", hand_options, *tokens, inputs="contraction")
            whole = Case(f"{tag} layer, planned", "mumoe", layer | extra, *tokens)
            whole_hand = Case(f"{tag} layer, paper einsum", "handwritten_layer", {"formula": name, **layer}, *tokens)
            cases += [hand, planned, whole_hand, whole]  # each reference first: its row prints first
            pairs += [(planned.label, hand.label), (whole.label, whole_hand.label)]
            pairs += [(hand.label, hand.label), (whole_hand.label, whole_hand.label)]
            name_ = f"{tag} contraction: planned ÷ paper einsum, fwd+bwd"
            targets.append(Target(name_, planned.label, hand.label, "train_s", 0.95))
    return Section(
        "handwritten",
        "Planned contraction vs the paper's hand-written einsums",
        f"GPT-2 setting: {i} → {o}, {s.batch}×{s.paper_seq} tokens, ranks matched to nn.Linear; the paper's "
        "appendix einsums (torch.einsum) over the very same cores. Contraction alone: the input (with its bias "
        "column) and the coefficients require grad. Layer: the same gate, then either contraction. Ratios: "
        "each planned row ÷ its paper-einsum row.",
        cases[0].label,
        tuple(cases),
        memory=False,
        reps=3,  # its targets sit within 5 % of 1: more samples per case
        targets=tuple(targets),
        pairs=tuple(pairs),
        reference_text="each row's paper-einsum counterpart",
    )


def params_section(s: Sizes, extra: dict) -> Section:
    """MLP blocks at (about) the dense MLP's parameter count."""
    d, tokens = s.width, (s.batch, s.seq)
    mlp = _mlp(s, *tokens)
    cp = _block(f"μMoE CP, {s.experts} experts", s, s.experts, "cp", *tokens, **extra)
    tr = _block(f"μMoE TR, {s.experts} experts", s, s.experts, "tr", *tokens, **extra)
    n = 1
    for size in s.hierarchy:
        n *= size
    hier = _block(f"μMoE CP, {dims_text(s.hierarchy)} = {n:,} experts", s, s.hierarchy, "cp", *tokens, **extra)
    # PEER's query projection alone (d → 2·heads·d/2) holds d·d·heads parameters: with the authors'
    # 8 heads that is the whole MLP budget, so the fewest experts its 16-per-head product keys allow
    # (16² = 256) is the nearest configuration.
    peer = _peer(s, s.peer_topk**2, s.peer_topk, *tokens)
    # The MLP's 8·d² parameters split over `few` experts: soft-MoE's d → d·mult → d experts hold
    # 2·d²·mult each, st-moe's GEGLU experts 3·d·h with h = d·mult·2/3, so mult = 4 / few for both.
    few, mult = s.few, 4 / s.few
    soft = Case(
        f"soft-MoE, {few} experts of width {int(d * mult)}",
        "soft_moe",
        {"dim": d, "seq_len": s.seq, "num_experts": few, "expert_mult": mult},
        *tokens,
    )
    st = Case(
        f"st-moe top-2, {few} experts of width {int(d * mult * 2 / 3)}",
        "st_moe",
        {"dim": d, "num_experts": few, "expert_hidden_mult": mult},
        *tokens,
    )
    targets = (
        Target(f"{cp.label} block ÷ dense MLP, fwd+bwd", cp.label, mlp.label, "train_s", 1.05),
        Target(f"{tr.label} block ÷ dense MLP, fwd+bwd", tr.label, mlp.label, "train_s", 1.05),
        Target(f"{hier.label} block ÷ dense MLP, fwd+bwd", hier.label, mlp.label, "train_s", 1.2),
    )
    return Section(
        "params",
        f"Matched parameters: MLP block {d} → {4 * d} → {d}",
        f'{s.batch}×{s.seq} tokens (inputs requiring grad). μMoE blocks `MuMoEMLP(..., match="mlp"'
        + (f", rank_multiple={s.rank_multiple}" if s.rank_multiple > 1 else "")
        + ")`; peers at "
        "the dense MLP's parameter count where their configuration allows (soft-MoE and st-moe by narrower "
        "experts), else the nearest (PEER: its 8-head query projection alone is the MLP's budget). At equal "
        "parameters soft-MoE and st-moe do far less arithmetic per token (each slot or token passes one or two "
        f"experts 1/{s.few} of the MLP's width), the μMoE the MLP's full amount.",
        mlp.label,
        (mlp, cp, tr, hier, peer, soft, st),
        targets=targets,
    )


def experts_section(s: Sizes, extra: dict, memory_limit: int) -> Section:
    """Every model at the same expert counts, at its authors' default expert width."""
    d, tokens = s.width, (s.batch, s.seq)
    n_hier = 1
    for size in s.hierarchy:
        n_hier *= size
    mlp = _mlp(s, *tokens)
    few = f"{s.few:,}"
    cases: list[Case] = [mlp]
    cases += [_block(f"μMoE {name.upper()}, {few} experts", s, s.few, name, *tokens, **extra) for name in ("cp", "tr")]
    cases.append(_peer(s, s.few, min(s.peer_topk, round(s.few**0.5)), *tokens))
    soft = {"dim": d, "seq_len": s.seq, "num_experts": s.few}
    cases.append(Case(f"soft-MoE, {few} experts", "soft_moe", soft, *tokens))
    cases.append(Case(f"st-moe top-2, {few} experts", "st_moe", {"dim": d, "num_experts": s.few}, *tokens))
    # The same configurations as in the matched-parameter table are not timed twice.
    params = params_section(s, extra)
    borrowed = tuple((case.label, "params") for case in params.cases[1:5])
    order = [case.label for case in cases]
    not_run = []
    for k, n in enumerate((s.experts, n_hier)):
        group = [Case(f"soft-MoE, {n:,} experts", "soft_moe", {"dim": d, "seq_len": s.seq, "num_experts": n})]
        group.append(Case(f"st-moe top-2, {n:,} experts", "st_moe", {"dim": d, "num_experts": n}))
        if k == 1:
            group.append(_peer(s, n_hier, s.peer_topk, *tokens))
        mine = [label for label, _ in borrowed if f" {n:,} experts" in label or f"= {n:,} experts" in label]
        order += mine + [case.label for case in group]
        not_run += group
    return Section(
        "experts",
        "Matched expert counts",
        f"MLP block {d} → {4 * d} → {d}, {s.batch}×{s.seq} tokens; peers at their authors' default expert "
        f"width, μMoE blocks parameter-matched to the dense MLP at every count. PEER's experts are single "
        f"neurons; at {few} experts it retrieves {min(s.peer_topk, round(s.few**0.5))} per head (its product "
        f"keys cannot return more than √N). Rows at {s.experts:,} and {n_hier:,} experts that also appear in "
        "the matched-parameter table are taken from it (same configuration, timed there, ratios to its dense "
        f"MLP). Configurations whose fp32 weights and gradients exceed {memory_limit / 2**30:.0f} GiB are "
        "listed with their parameter count, not run.",
        mlp.label,
        tuple(cases),
        not_run=tuple(not_run),
        borrowed=borrowed,
        order=tuple(order),
    )


def small_section(s: Sizes, extra: dict) -> Section:
    """The char-GPT example's MLP blocks (d = 64): per-call overhead against small matrices."""
    d, tokens = s.small_width, (s.small_batch, s.small_seq)
    small = Sizes(d, *tokens, s.small_experts, s.hierarchy, s.few, s.paper_seq, d, s.small_experts, *tokens)
    mlp = _mlp(small, *tokens)
    cp = _block(f"μMoE CP, {s.small_experts} experts", small, s.small_experts, "cp", *tokens, **extra)
    tr = _block(f"μMoE TR, {s.small_experts} experts", small, s.small_experts, "tr", *tokens, **extra)
    hier = _block(f"μMoE CP, {dims_text(s.hierarchy)} experts", small, s.hierarchy, "cp", *tokens, **extra)
    targets = tuple(
        Target(f"{case.label} block ÷ dense MLP (d={d}), fwd+bwd", case.label, mlp.label, "train_s", 1.3)
        for case in (cp, tr)
    )
    return Section(
        "small",
        f"Small blocks: the char-GPT example's MLP {d} → {4 * d} → {d}",
        f"{s.small_batch}×{s.small_seq} tokens, as in `examples/char_gpt.py`: the matrices are small, so "
        "per-call overhead (gate, plan look-up, many small einsums) shows.",
        mlp.label,
        (mlp, cp, tr, hier),
        memory=False,
        reps=10,
        targets=targets,
    )


def autotune_section(s: Sizes, extra: dict) -> Section:
    """What ``optimize="autotune"`` changes: each case planned by default and autotuned."""
    i, o = s.width, 4 * s.width
    layer_options = {"in_features": i, "out_features": o, "expert_dims": s.experts, "match": "linear", **_aligned(s)}
    root = round(s.experts**0.5)
    contraction = {"in_features": i, "out_features": o, "expert_dims": [root, root], "match": "linear"}
    cases, pairs = [], []
    for name in ("cp", "tr"):
        variants = [
            (f"{name.upper()} μMoE layer, {s.experts} experts", "mumoe", layer_options, (s.batch, s.seq), "tokens"),
            (f"{name.upper()} E=2 ({root}×{root}) contraction", "planned", contraction, (s.batch, s.paper_seq),
             "contraction"),
            (f"μMoE {name.upper()} block d={s.small_width}, {s.small_experts} experts", "mumoe_mlp",
             {"in_features": s.small_width, "hidden_features": 4 * s.small_width, "expert_dims": s.small_experts,
              "match": "mlp"}, (s.small_batch, s.small_seq), "tokens"),
        ]  # fmt: skip
        for label, model, options, tokens, inputs in variants:
            options = {**options, "decomposition": name, **extra}  # the run's planner (--optimize)
            plain = Case(f"{label}, default plan", model, options, *tokens, inputs=inputs)
            tuned = Case(f"{label}, autotuned", model, {**options, "optimize": "autotune"}, *tokens, inputs=inputs)
            cases += [plain, tuned]
            pairs += [(plain.label, plain.label), (tuned.label, plain.label)]
    return Section(
        "autotune",
        'Autotuning: `optimize="autotune"` against the default planner',
        "The first training call of each batch bucket times the cheapest few paths (within "
        "`AUTOTUNE_FMA_SLACK` of the fewest FMAs), each in two step layouts, forward and backward on the "
        "call's own operands, and keeps the fastest; later calls reuse it. Same cases as the layer, "
        "hand-written and small sections. Ratios: each autotuned row ÷ its default-plan row.",
        cases[0].label,
        tuple(cases),
        memory=False,
        pairs=tuple(pairs),
        reference_text="each row's default-plan counterpart",
    )


def threads_text(count: int) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{count} thread" + ("s" if count > 1 else "")


#: Experts the MxD gate keeps per token (per mode) in the MxD sections.
MXD_TOP_K = 32


def _mxd_cases(s: Sizes, batch: int, seq: int, extra: dict, threads: int | None = None, tag: str = "") -> dict:
    """The MxD rows at the MLP's parameters: flat, hierarchical, and the paper's equations written out."""
    d, hier = s.width, s.mxd_hierarchy
    block = {"in_features": d, "hidden_features": 4 * d, "match": "mlp", **extra}
    flat = {**block, "expert_dims": s.experts, "gate_k": min(MXD_TOP_K, s.experts)}
    deep = {**block, "expert_dims": list(hier), "gate_k": min(MXD_TOP_K, hier[0])}
    authors = {"in_features": d, "hidden_features": 4 * d, "match": "mlp", "expert_dims": s.experts}
    n = hier[0] * hier[1]
    dense = {"in_features": d, "hidden_features": 4 * d}
    return {
        "mlp": Case(f"dense MLP{tag}", "mlp", dense, batch, seq, threads=threads),
        "flat": Case(f"MxD block, {s.experts:,} experts{tag}", "mxd_block", flat, batch, seq, threads=threads),
        "hier": Case(
            f"hierarchical MxD, {dims_text(hier)} = {n:,} experts{tag}", "mxd_block", deep, batch, seq, threads=threads
        ),
        "authors": Case(
            f"MxD from the paper's equations, {s.experts:,} experts{tag}",
            "mxd_authors",
            {**authors, "gate_k": min(MXD_TOP_K, s.experts)},
            batch,
            seq,
            threads=threads,
        ),
    }


def mxd_section(s: Sizes, extra: dict) -> Section:
    """MxD blocks (flat and hierarchical) against the MLP they replace and the paper's equations, training."""
    rows = _mxd_cases(s, s.batch, s.seq, extra)
    mlp, flat, hier, authors = rows["mlp"], rows["flat"], rows["hier"], rows["authors"]
    targets = (
        Target(f"{flat.label} ÷ dense MLP, fwd+bwd", flat.label, mlp.label, "train_s", 1.3),
        Target(f"{hier.label} ÷ dense MLP, fwd+bwd", hier.label, mlp.label, "train_s", 1.5),
        Target(f"{flat.label} ÷ {authors.label}, fwd+bwd", flat.label, authors.label, "train_s", 1.15),
    )
    d = s.width
    return Section(
        "mxd",
        f"Mixture of Decoders: MLP block {d} → {4 * d} → {d}",
        f'{s.batch}×{s.seq} tokens, inputs requiring grad. `MixtureOfDecoders(..., match="mlp")` with the '
        f"authors' gate (top-{MXD_TOP_K} of ReLU(Gx + b)): at the MLP's parameter count its hidden layer is "
        "narrower (its experts and gate take the rest). The paper's equations row is the same layer at the same "
        "sizes written as plain matmuls and `torch.topk` (the MxD paper's formulation).",
        mlp.label,
        (mlp, flat, hier, authors),
        targets=targets,
        pairs=((authors.label, mlp.label),),
    )


def mxd_inference_section(s: Sizes, extra: dict, threads: int = 2) -> Section:
    """MxD blocks in eval mode at decoding batches, against the MLP."""
    cases, pairs, targets = [], [], []
    for tokens in (1, max(s.decode_tokens)):
        rows = _mxd_cases(s, tokens, 1, extra, threads=threads, tag=f", B={tokens}")
        cases += list(rows.values())
        pairs += [(case.label, rows["mlp"].label) for case in rows.values()]
        for key in ("flat", "hier"):
            limit = 2.0 if tokens == 1 else 1.3
            label = rows[key].label
            targets.append(Target(f"{label} ÷ dense MLP", label, rows["mlp"].label, "infer_s", limit))
    return Section(
        "mxd-inference",
        "Mixture of Decoders at decoding batches (eval, no_grad)",
        f"Eval mode under `no_grad`, {threads} thread(s); the same blocks as the training table.",
        cases[0].label,
        tuple(cases),
        memory=False,
        reps=s.decode_reps,
        targets=tuple(targets),
        pairs=tuple(pairs),
        reference_text="the dense MLP at the same tokens",
        train=False,
    )


def latency_section(s: Sizes, extra: dict, threads: int = 2) -> Section:
    """Eval-mode latency against tokens per call: μMoE layer and block against dense ones."""
    i, o, d = s.width, 4 * s.width, s.width
    layer = {"in_features": i, "out_features": o, "expert_dims": s.experts, "decomposition": "cp"}
    layer |= {"match": "linear", **extra}
    block = {"in_features": d, "hidden_features": 4 * d, "out_features": d, "expert_dims": s.experts}
    block |= {"decomposition": "cp", "match": "mlp", **extra}
    moe = {"in_features": d, "hidden_features": 4 * d, "num_experts": s.few}
    cases, pairs = [], []
    tokens = 1
    while tokens <= s.sweep_tokens:
        at = f"{tokens:,} token" + ("s" if tokens > 1 else "")
        linear = Case(f"nn.Linear, {at}", "linear", {"in_features": i, "out_features": o}, tokens, 1, threads=threads)
        mlp = Case(f"dense MLP, {at}", "mlp", {"in_features": d, "hidden_features": 4 * d}, tokens, 1, threads=threads)
        group = [
            linear,
            Case(f"μMoE CP layer, {at}", "mumoe", layer, tokens, 1, threads=threads),
            mlp,
            Case(f"μMoE CP block, {at}", "mumoe_mlp", block, tokens, 1, threads=threads),
            Case(f"dense MoE, {s.few} experts, {at}", "dense_moe", moe, tokens, 1, threads=threads),
        ]
        cases += group
        pairs += [(linear.label, linear.label), (group[1].label, linear.label), (mlp.label, mlp.label)]
        pairs += [(group[3].label, mlp.label), (group[4].label, mlp.label)]
        tokens *= 2
    return Section(
        "latency",
        "Inference latency against tokens per call",
        f"Eval mode, `torch.no_grad()`, {threads_text(threads)}, 1 to {s.sweep_tokens:,} tokens per call: the CP "
        f'layer (`MuMoE({i}, {o}, {s.experts}, "cp", match="linear")`) against nn.Linear, the CP block '
        f'(`MuMoEMLP({d}, {4 * d}, {d}, {s.experts}, "cp", match="mlp")`) and a dense MoE against the dense '
        f"MLP. The dense MoE evaluates every expert on every token and weights their outputs by a softmax "
        f"gate; a dense MoE of {s.experts} full-width experts would hold {s.experts}× the MLP's weights "
        f"({s.experts * 8 * d * d * 4 / 2**30:.1f} GiB), so it has {s.few} experts of width {4 * d // s.few} at "
        "the MLP's parameter count (plus its gate) and the MLP's multiply-adds.",
        cases[0].label,
        tuple(cases),
        memory=False,
        reps=3,
        pairs=tuple(pairs),
        reference_text="nn.Linear (layer) or the dense MLP (blocks) at the same tokens",
        train=False,
    )


def generation_section(s: Sizes, extra: dict, threads: int = 2) -> Section:
    """Greedy KV-cached generation: a small GPT-2 converted to μMoE blocks against the dense one."""
    layers, heads, vocab, positions = s.gpt2
    model = {"layers": layers, "width": s.width, "heads": heads, "vocab_size": vocab, "positions": positions}
    model |= {"new_tokens": s.new_tokens}
    convert = {"expert_dims": s.experts, "mlps": r"mlp$", **extra}
    cases, pairs, targets = [], [], []
    for batch in s.generate_batches:
        at = f"batch {batch}"
        dense = Case(f"dense GPT-2, {at}", "generation", model, batch, s.prompt, inputs="prompt", threads=threads)
        mumoe = Case(f"μMoE GPT-2, {at}", "generation", {**model, "convert": convert}, batch, s.prompt,
                     inputs="prompt", threads=threads)  # fmt: skip
        cases += [dense, mumoe]
        pairs += [(dense.label, dense.label), (mumoe.label, dense.label)]
        name = f"μMoE GPT-2 ÷ dense GPT-2 generation time, {at} (tokens/s ≥ 0.8×)"
        targets.append(Target(name, mumoe.label, dense.label, "infer_s", 1.25))
    return Section(
        "generation",
        "Generation: a GPT-2 converted to μMoE blocks against the dense model",
        f"`GPT2LMHeadModel` from a local `GPT2Config(n_embd={s.width}, n_layer={layers}, n_head={heads}, "
        f"vocab_size={vocab}, n_positions={positions})` (random weights, nothing downloaded), eval mode; the "
        f'μMoE model is the same after `mumoe_tn.convert(model, expert_dims={s.experts}, mlps=r"mlp$")` '
        "(CP blocks parameter-matched to each MLP, token-wise gates as for every causal model). Each call "
        f"is `generate` from a {s.prompt}-token prompt: greedy, KV cache on, exactly {s.new_tokens} new "
        f"tokens, {threads_text(threads)}. Tokens per second is the inverse of the time, so the target "
        '"tokens/s ≥ 0.8× the dense model\'s" reads time ≤ 1.25×.',
        cases[0].label,
        tuple(cases),
        memory=False,
        reps=2,
        targets=tuple(targets),
        pairs=tuple(pairs),
        reference_text="the dense GPT-2 at the same batch",
        train=False,
    )


#: (log2 experts, modes) of the scale section's timed subset: E = 1 … 6 modes of 16 experts (each
#: with a target), and one mode of 256 and three of 256 (its planning grid covers 2^4 … 2^24, E = 1 … 6).
SCALE_TIMED = ((4, 1), (8, 2), (12, 3), (16, 4), (20, 5), (24, 6), (8, 1), (24, 3))
#: fwd+bwd time ÷ nn.Linear's the timed layers with modes of 16 experts keep within.
SCALE_LIMIT = 1.5


def scale_section(s: Sizes, extra: dict) -> Section:
    """Every format and a user's tree network, matched to nn.Linear, 2^4 to 2^24 experts: fwd+bwd time, peak memory."""
    from benchmarks.scale import TREE, decomposition, expert_dims  # the grid's own layers

    i, o, tokens = s.width, 4 * s.width, (s.batch, s.seq // 4)
    linear = Case("nn.Linear", "linear", {"in_features": i, "out_features": o}, *tokens)
    cases, targets = [linear], []
    names = {"cp": "CP", "tr": "TR", "tt": "TT", "tucker": "Tucker", TREE: "tree"}
    for name, shown in names.items():
        for exponent, modes in SCALE_TIMED if name != TREE else SCALE_TIMED[:6]:
            dims = expert_dims(exponent, modes)
            options = {"in_features": i, "out_features": o, "expert_dims": list(dims)}
            options["decomposition"] = decomposition(name, modes)
            label = f"{shown} 2^{exponent} = {dims_text(dims)}"
            cases.append(Case(label, "mumoe", {**options, "match": "linear", **extra}, *tokens))
            if set(dims) == {16}:
                target = f"{shown}, E = {modes} modes of 16 ÷ nn.Linear, fwd+bwd time"
                targets.append(Target(target, label, linear.label, "train_s", SCALE_LIMIT))
    return Section(
        "scale",
        f"Scale: every format from 2^4 to 2^24 experts, against nn.Linear({i}, {o})",
        f"{tokens[0] * tokens[1]:,} tokens, inputs requiring grad; every layer `MuMoE({i}, {o}, dims, fmt, "
        'match="linear")` (entmax15 + BatchNorm gate), the experts split into E modes of powers of two as '
        "equal as can be; *tree* is a user's network with no registered format (a hierarchical Tucker tree: "
        "`benchmarks.scale.tree_spec`), matched by scaling every bond. The planning grid below covers every "
        "format and the tree, 2^4 … 2^24 experts and E = 1 … 6.",
        linear.label,
        tuple(cases),
        reps=3,
        targets=tuple(targets),
    )
