"""The inference section: eval mode at decoding batches, the CP layer's cost decomposed, and pre-contraction."""

from __future__ import annotations

from benchmarks.baselines import Case
from benchmarks.sections import Section, Sizes, Target, dims_text, threads_text
from mumoe_tn import MuMoE
from mumoe_tn.contractions import per_call_fma, plan_forward, plan_inference


def _per_call_fma(options: dict, tokens: int) -> tuple[int, int]:
    """FMAs of one inference call of a MuMoE layer: planned as in training, and with pre-contraction."""
    network = MuMoE(**options, device="meta").experts.network
    plan, constant = plan_inference(network, tokens)
    return plan_forward(network, tokens, "auto").fma, per_call_fma(plan, constant)


#: The decomposition rows of the CP layer at B = 1: its GEMMs as the fewest eager calls
#: (``benchmarks.floors.FewestCallsCP``) with each map of ``benchmarks.floors.ACTIVATIONS``.
DECOMPOSITION = {
    "CP layer's GEMMs and entmax15 as the fewest eager calls": "entmax15",
    "the same GEMMs with a softmax map": "softmax",
    "the same GEMMs with entmax15 from the `entmax` package": "entmax.entmax15",
}


def inference_section(s: Sizes, extra: dict, threads: int = 2) -> Section:
    """Eval-mode forward at decoding batches, 1 thread and the run's threads, and Tucker pre-contraction."""
    i, o, d = s.width, 4 * s.width, s.width
    n = 1
    for size in s.hierarchy:
        n *= size
    layer = {"in_features": i, "out_features": o, "expert_dims": s.experts, "decomposition": "cp"}
    layer |= {"match": "linear", **extra}
    cases, pairs, targets = [], [], []
    for count in sorted({1, threads}):  # all cases of one thread count together: one switch per round
        at = threads_text(count)
        for tokens in s.decode_tokens:
            tag = f"B={tokens}, {at}"
            linear = Case(
                f"nn.Linear, {tag}", "linear", {"in_features": i, "out_features": o}, tokens, 1, threads=count
            )
            cp_layer = Case(f"CP layer, {tag}", "mumoe", layer, tokens, 1, threads=count)
            mlp = Case(
                f"dense MLP, {tag}", "mlp", {"in_features": d, "hidden_features": 4 * d}, tokens, 1, threads=count
            )
            blocks = {}
            for name in ("cp", "tr", "tt"):
                options = {"in_features": d, "hidden_features": 4 * d, "out_features": d, "expert_dims": s.experts}
                options |= {"decomposition": name, "match": "mlp", **extra}
                blocks[name] = Case(f"{name.upper()} block, {tag}", "mumoe_mlp", options, tokens, 1, threads=count)
            group = [linear, cp_layer, mlp, *blocks.values()]
            if tokens == 1:
                options = {"in_features": d, "hidden_features": 4 * d, "out_features": d}
                options |= {"expert_dims": list(s.hierarchy), "decomposition": "cp", "match": "mlp", **extra}
                label = f"CP block {dims_text(s.hierarchy)} = {n:,} experts, {tag}"
                group.append(Case(label, "mumoe_mlp", options, tokens, 1, threads=count))
                targets.append(Target(f"{label} ÷ dense MLP", label, mlp.label, "infer_s", 1.5))
            cases += group
            pairs += [(linear.label, linear.label), (cp_layer.label, linear.label), (mlp.label, mlp.label)]
            pairs += [(case.label, mlp.label) for case in group[3:]]
            if tokens == 1:  # the CP layer's gap to nn.Linear decomposed: its GEMMs alone, with three maps
                floors = [Case(f"{label}, {tag}", "fewest_calls", {**layer, "activation": activation}, tokens, 1,
                               threads=count) for label, activation in DECOMPOSITION.items()]  # fmt: skip
                cases += floors
                pairs += [(case.label, linear.label) for case in floors]
            targets.append(
                Target(
                    f"CP layer ÷ nn.Linear, {tag}",
                    cp_layer.label,
                    linear.label,
                    "infer_s",
                    1.3 if tokens == 1 else 1.15,
                )
            )
            if tokens in (1, max(s.decode_tokens)):
                limit = 1.3 if tokens == 1 else 1.15
                for name, block in blocks.items():
                    targets.append(
                        Target(f"{name.upper()} block ÷ dense MLP, {tag}", block.label, mlp.label, "infer_s", limit)
                    )
                for name in ("tr", "tt"):
                    name_ = f"{name.upper()} block's ratio ÷ CP block's ratio, {tag} (= {name.upper()} ÷ CP)"
                    targets.append(Target(name_, blocks[name].label, blocks["cp"].label, "infer_s", 1.2))
    # Pre-contraction of a Tucker layer's parameter-only sub-network, on and off (the run's threads).
    root = round(s.experts**0.5)
    tucker = {"in_features": i, "out_features": o, "expert_dims": [root, root], "decomposition": "tucker"}
    tucker |= {"match": "linear", **extra}
    counts = []
    for batch, seq in ((s.batch, 1), (s.batch, s.seq // 8)):
        tokens = f"{batch * seq:,} tokens"
        linear = Case(
            f"nn.Linear, {tokens}", "linear", {"in_features": i, "out_features": o}, batch, seq, threads=threads
        )
        label = f"Tucker μMoE {root}×{root}, {tokens}"
        plain = Case(
            f"{label}, contracted every call", "mumoe", {**tucker, "precontract": False}, batch, seq, threads=threads
        )
        cached = Case(f"{label}, pre-contracted", "mumoe", tucker, batch, seq, threads=threads)
        cases += [linear, plain, cached]
        pairs += [(linear.label, linear.label), (plain.label, linear.label), (cached.label, plain.label)]
        every, once = _per_call_fma(tucker, batch * seq)
        counts.append(f"{tokens}: {every:,} → {once:,} FMAs per call")
    return Section(
        "inference",
        "Inference: eval mode at decoding batches, and pre-contraction",
        f"Eval mode, `torch.no_grad()`, inputs without grad, B tokens per call (B = "
        f"{', '.join(map(str, s.decode_tokens))}), timed with 1 thread and with {threads_text(threads)} (the run's "
        f'`--threads`), all cases alternating in one run. CP layer: `MuMoE({i}, {o}, {s.experts}, "cp", '
        f'match="linear")` ÷ `nn.Linear({i}, {o})`. Blocks: `MuMoEMLP({d}, {4 * d}, {d}, {s.experts}, fmt, '
        f'match="mlp")` (CP, TR, TT) and the {dims_text(s.hierarchy)} = {n:,}-expert CP block ÷ the dense MLP '
        f"{d} → {4 * d} → {d} (GELU). Constructed as users write them: no `rank_multiple` (the library "
        'lays out odd ranks itself). "TR/TT ÷ CP" targets divide the TR or TT block\'s ratio by the CP '
        "block's: the dense MLP cancels, so they are the two blocks' times divided. Last rows: a Tucker "
        f"μMoE {root}×{root} layer whose core-only sub-network `plan_inference` contracts once and keeps "
        f"until the parameters change ({'; '.join(counts)}), ÷ the same layer contracted every call. "
        "At B = 1 the CP layer's time is decomposed: the same layer's parameters run as the fewest eager calls "
        "its arithmetic needs (`benchmarks.floors.FewestCallsCP`: one `addmm` for the gate with its folded "
        "batch norm and the input factor, the map, two products) with its own 1.5-entmax, with a softmax (the "
        "cheapest map: the GEMMs' own time) and with 1.5-entmax from the `entmax` package; layer − first row "
        "is the library's per-call work, first row − softmax row the sparse map's cost above a softmax.",
        cases[0].label,
        tuple(cases),
        memory=False,
        reps=s.decode_reps,  # calls of a fraction of a millisecond: many samples per round
        targets=tuple(targets),
        pairs=tuple(pairs),
        reference_text="nn.Linear (layers), the dense MLP (blocks) at the same tokens and threads, or the "
        "Tucker layer contracted every call (pre-contracted)",
        train=False,
    )
