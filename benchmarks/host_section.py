"""The host section: what a call costs the host where the arithmetic is nothing.

Kernels and host reads per call, host time per call against ``nn.Linear`` (layers) and the dense
MLP (blocks), each format's layer against its fewest-eager-calls floor (``benchmarks.floors``),
and the layers under ``torch.compile`` against ``nn.Linear`` under it (``benchmarks.compiled_host``).
"""

from __future__ import annotations

from typing import Any

from benchmarks.baselines import Case
from benchmarks.compiled_host import compiled_case
from benchmarks.sections import Section, Sizes, Target, dims_text

#: Limits of the host section: kernels of the CP layer per call, every other layer's (format or
#: gate) counts ÷ CP's, and host time ÷ nn.Linear's (eval, fwd+bwd).
HOST_KERNELS = {"eval_kernels": 8, "train_kernels": 30}
HOST_KERNELS_VS_CP = 1.5
HOST_TIME = {"infer_s": 3.0, "train_s": 4.0}
#: A layer's host time ÷ its floor's (the same parameters as the fewest eager calls), eval and fwd+bwd.
HOST_FLOOR = 1.1
#: A compiled layer's time per call ÷ the compiled nn.Linear's, eval and fwd+bwd.
HOST_COMPILED = 2.0
#: Graphs compiled after the warm-up (recompiles) while a compiled case is timed.
HOST_RECOMPILES = 0
#: Experts the top-k gates of the host section keep per token.
HOST_TOP_K = 2
#: The formats whose layer has a fewest-calls floor (``benchmarks.floors.FLOORS``).
FLOOR_FORMATS = ("CP", "TR", "MxD")
#: The formats whose layer is timed under ``torch.compile``.
COMPILED_FORMATS = ("CP", "TR", "TT", "Tucker", "MxD")


def _call(metric: str, s: Sizes) -> str:
    return f"eval B = {s.host_eval_tokens}" if metric == "infer_s" else f"fwd+bwd B = {s.host_train_tokens}"


def host_section(s: Sizes, extra: dict, *, compile_rows: bool = True) -> Section:
    """What a call costs the host at sizes where the arithmetic is nothing: kernels, host reads, time.

    ``compile_rows=False`` leaves out the layers under ``torch.compile`` (each compiles its graphs first).
    """
    i, n, tokens = s.host_width, s.host_experts, (s.host_train_tokens, 1)
    hier = list(s.host_hierarchy)
    layer = {"in_features": i, "out_features": i, **extra}
    block = {"in_features": i, "hidden_features": 4 * i, "out_features": i, **extra}
    linear = Case("nn.Linear", "linear", {"in_features": i, "out_features": i}, *tokens)
    mlp = Case("dense MLP", "mlp", {"in_features": i, "hidden_features": 4 * i}, *tokens)

    def options(dims: int | list[int], name: str, **more: Any) -> dict:
        matched = {"match": "linear"} if name != "mxd" else {}  # MxD's decoder alone holds nn.Linear's matrix
        return {**layer, "expert_dims": dims, "decomposition": name, **matched, **more}

    layers = {  # entmax15 + BatchNorm gate, the default
        "CP": Case(f"CP layer, {n} experts", "mumoe", options(n, "cp"), *tokens),
        "TR": Case(f"TR layer, {n} experts", "mumoe", options(n, "tr"), *tokens),
        "TT": Case(f"TT layer, {n} experts", "mumoe", options(n, "tt"), *tokens),
        "Tucker": Case(f"Tucker layer, {n} experts", "mumoe", options(n, "tucker"), *tokens),
        "MxD": Case(f"MxD layer, {n} experts", "mumoe", options(n, "mxd"), *tokens),
        "hierarchical CP": Case(f"CP layer, {dims_text(tuple(hier))} experts", "mumoe", options(hier, "cp"), *tokens),
    }
    floors = {
        name: Case(f"{layers[name].label}, fewest eager calls", "fewest_calls", layers[name].options, *tokens)
        for name in FLOOR_FORMATS
    }
    gates = [
        Case(f"CP layer, {n} experts, sparsemax gate", "mumoe", options(n, "cp", activation="sparsemax"), *tokens),
        Case(f"CP layer, {n} experts, top-{HOST_TOP_K} softmax gate", "mumoe", options(n, "cp", topk=HOST_TOP_K),
             *tokens),
        Case(f"MxD layer, {n} experts, ReLU top-{HOST_TOP_K} gate", "mumoe",
             options(n, "mxd", relu_topk=HOST_TOP_K), *tokens),
    ]  # fmt: skip
    compiled = {}
    if compile_rows:
        compiled["nn.Linear"] = compiled_case(linear, "nn.Linear, torch.compile")
        for name in COMPILED_FORMATS:
            compiled[name] = compiled_case(layers[name], f"{layers[name].label}, torch.compile")
    blocks = [
        Case(f"{name} block, {label} experts", "mumoe_mlp", {**block, "expert_dims": dims, "decomposition": fmt,
             "match": "mlp"}, *tokens)
        for name, fmt, dims, label in (
            ("CP", "cp", n, n), ("TR", "tr", n, n), ("TT", "tt", n, n), ("Tucker", "tucker", n, n),
            ("CP", "cp", hier, dims_text(tuple(hier))),
        )
    ]  # fmt: skip
    blocks.append(
        Case(f"MxD block, {n} experts, ReLU top-{HOST_TOP_K} gate", "mxd_block",
             {"in_features": i, "hidden_features": 4 * i, "expert_dims": n, "gate_k": HOST_TOP_K, "match": "mlp",
              **extra}, *tokens)
    )  # fmt: skip
    cases = (linear, *layers.values(), *floors.values(), *gates, *compiled.values(), mlp, *blocks)
    pairs = [(case.label, mlp.label) for case in (mlp, *blocks)]
    pairs += [(case.label, compiled["nn.Linear"].label) for case in compiled.values()]
    return Section(
        "host",
        f"Host overhead: kernels, host reads and time per call at I = O = {i}, {n} experts",
        _description(s, compile_rows),
        linear.label,
        cases,
        memory=False,
        reps=s.host_reps,
        targets=_targets(s, layers, floors, gates, compiled, linear),
        pairs=tuple(pairs),
        reference_text="nn.Linear (layers, floors), the compiled nn.Linear (compiled layers) or the dense MLP (blocks)",
        eval_tokens=s.host_eval_tokens,
    )


def _targets(
    s: Sizes, layers: dict[str, Case], floors: dict[str, Case], gates: list[Case], compiled: dict[str, Case],
    linear: Case,
) -> tuple[Target, ...]:  # fmt: skip
    """Kernel counts, host time against nn.Linear and against each floor, compiled time and recompiles."""
    cp = layers["CP"].label
    targets = [
        Target(f"{cp}: kernels per eval call (B = {s.host_eval_tokens})", cp, None, "eval_kernels",
               HOST_KERNELS["eval_kernels"]),
        Target(f"{cp}: kernels per fwd+bwd (B = {s.host_train_tokens})", cp, None, "train_kernels",
               HOST_KERNELS["train_kernels"]),
    ]  # fmt: skip
    others = [case for name, case in layers.items() if name != "CP"] + gates
    for case in others:
        for metric, call in (("eval_kernels", "eval call"), ("train_kernels", "fwd+bwd")):
            targets.append(Target(f"{case.label} ÷ CP layer: kernels per {call}", case.label, cp, metric,
                                  HOST_KERNELS_VS_CP))  # fmt: skip
    for case in layers.values():
        for metric, limit in HOST_TIME.items():
            name = f"{case.label} ÷ nn.Linear: host time, {_call(metric, s)}"
            targets.append(Target(name, case.label, linear.label, metric, limit))
    for name, floor in floors.items():
        for metric in HOST_TIME:
            label = layers[name].label
            targets.append(Target(f"{label} ÷ its fewest eager calls: host time, {_call(metric, s)}", label,
                                  floor.label, metric, HOST_FLOOR))  # fmt: skip
    reference = compiled.get("nn.Linear")
    for name, case in compiled.items():
        if name != "nn.Linear":
            for metric in HOST_TIME:
                targets.append(Target(f"{case.label} ÷ nn.Linear, torch.compile: time, {_call(metric, s)}",
                                      case.label, reference.label, metric, HOST_COMPILED))  # fmt: skip
    for case in compiled.values():
        targets.append(Target(f"{case.label}: recompiles while timed", case.label, None, "recompiles",
                              HOST_RECOMPILES))  # fmt: skip
    return tuple(targets)


def _description(s: Sizes, compile_rows: bool) -> str:
    i, n = s.host_width, s.host_experts
    text = (
        f"Sizes at which the arithmetic is nothing, so a call costs what the host does: layers {i} → {i} "
        f'(`MuMoE({i}, {i}, {n}, fmt, match="linear")`, entmax15 + BatchNorm gate unless named; the MxD layer '
        f"has {n} experts unmatched, since its decoder alone holds nn.Linear's matrix) against `nn.Linear({i}, "
        f'{i})`, and blocks {i} → {4 * i} → {i} (`MuMoEMLP(..., match="mlp")`, `MixtureOfDecoders(..., '
        f'match="mlp")`) against the dense MLP (GELU). *fwd*: one eval call on {s.host_eval_tokens} token(s) '
        f"under `torch.no_grad()`; *fwd+bwd*: one train-mode step on {s.host_train_tokens} tokens that require "
        "grad, all cases alternating in one run. Times are the host's: from a synchronised device until the call "
        "returns (on the CPU, the call's time). *kernels*: ATen operators that compute, forward and backward, on "
        "the code path of the run's device (views, allocations and metadata left out; "
        "`benchmarks.launches.AtenCalls`); *host reads*: values the call reads back to the host (`item`, "
        "`nonzero`, `tolist`, `numpy`, copies to the CPU), each a wait for the device on an accelerator. On the "
        "CPU, work handed to NumPy shows as one host read and no kernels. *fewest eager calls*: the layer's own "
        f"parameters ({', '.join(FLOOR_FORMATS)}) run as the fewest PyTorch calls its arithmetic needs, with the "
        "same gate map and nothing else (`benchmarks.floors`): the floor of what an eager layer with this gate "
        f"can cost; each layer's host time ÷ its floor's is held to ≤ {HOST_FLOOR}×."
    )
    if not compile_rows:
        return text + " The `torch.compile` rows were left out of this run (`--no-compile`)."
    return text + (
        f" *torch.compile*: the {', '.join(COMPILED_FORMATS)} layers and nn.Linear each under "
        "`torch.compile(module, fullgraph=True)` (inductor, its default mode; on the CPU it compiles C++), timed "
        "like the other rows and divided by the compiled nn.Linear; the graphs of the warm-up (one per mode and "
        "grad mode), the time they took to compile and the graphs compiled later (recompiles) are in the note "
        "column. Their kernels are not counted: inductor's fused kernels are not ATen operators."
    )
