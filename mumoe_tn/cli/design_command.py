"""``mumoe-tn design``: its arguments and what it prints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mumoe_tn.cli.arguments import add_layer_shape, add_output_formats, budget, check_plot, positive
from mumoe_tn.costs.display import DTYPE_BYTES
from mumoe_tn.design.space import DEFAULT_EXPERT_RANKS, HADAMARD_LEGS, families
from mumoe_tn.design.structure_search import design

__all__ = ["DESCRIPTION", "HELP", "configure", "run"]

HELP = "which network for a budget? the Pareto front of a structure and rank search"
DESCRIPTION = (
    "Searches CP, TR, TT, Tucker, every factorization of the experts into modes and generated "
    "topologies (chains, rings, stars, trees), matches each to the budget, and prints the Pareto front of "
    "parameters, FMAs per token, peak memory and the expert-rank bound. Defaults: the paper's GPT-2 layer, "
    "768 -> 3072 with 256 experts, the nn.Linear's parameters."
)


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's arguments to ``parser``; returns it."""
    add_layer_shape(
        parser,
        experts_help="the number of experts, factored into 1 … --max-modes modes (default 256), or fixed dims such as "
        "16 16",
    )
    parser.add_argument(
        "--budget",
        type=budget,
        default="linear",
        help="parameters: linear (the nn.Linear's, default), mlp (an in->out->in block), a number, or a fraction "
        "of the nn.Linear's such as 0.5",
    )
    parser.add_argument("--max-fma", type=float, help="at most this many FMAs per token")
    parser.add_argument("--max-peak", type=float, help="at most this many elements in the peak intermediate")
    parser.add_argument(
        "--batch", type=positive, default=1, help="tokens per forward for FMAs and the peak (default 1)"
    )
    parser.add_argument("--min-rank", type=positive, default=1, help="the smallest expert-matrix rank bound kept")
    parser.add_argument("--rank-multiple", type=positive, default=1, help="matched ranks are multiples of this")
    parser.add_argument(
        "--max-modes", type=positive, default=3, help="most expert modes of a factorization (default 3)"
    )
    parser.add_argument(
        "--families",
        nargs="+",
        choices=families(),
        default=None,
        help="what to search: registered formats and generated topologies (default: all)",
    )
    parser.add_argument(
        "--expert-ranks",
        type=positive,
        nargs="+",
        default=list(DEFAULT_EXPERT_RANKS),
        help="sizes tried for fixed bonds: TR's R1/R2, TT's and the topologies' expert bonds (default 2 4 8 16)",
    )
    parser.add_argument(
        "--hadamard",
        nargs="*",
        choices=("o", "i", "io"),
        default=list(HADAMARD_LEGS),
        help="Hadamard variants of the generated topologies: the physical legs their expert cores also hold "
        "(default: o i; none: --hadamard with no value)",
    )
    parser.add_argument("--no-bias", dest="bias", action="store_false", help="no folded bias")
    parser.add_argument("--no-gating", dest="gate", action="store_false", help="do not count gating parameters/FMAs")
    parser.add_argument(
        "--weight",
        metavar="FILE.pt",
        help="a pretrained layer saved with torch.save: an nn.Linear state dict (weight, bias) or an (out, in) "
        "weight; the upcycle error becomes an objective",
    )
    parser.add_argument("--measure", action="store_true", help="time the forward pass of every point of the front")
    parser.add_argument("--all", dest="every", action="store_true", help="list every matched network, not the front")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="float32", help="dtype of the memory column (default float32)"
    )
    add_output_formats(parser)
    parser.add_argument("--plot", metavar="FILE.png", help="also save FMAs per token against the rank bound")
    return parser


def _load_weight(path: str) -> object:
    """The tensor or ``nn.Linear`` a ``--weight`` file holds, read as data: checked before anything is allocated.

    The file is read once; a pickle is refused unless it is torch's zip format of uncompressed
    entries, and its tensors are unpickled onto the meta device and checked (dense, every element
    stored, no more than the file holds, shapes of a layer) before they are read.
    """
    import io

    import torch
    from torch import nn

    from mumoe_tn.conversion.persistence.files import read_once
    from mumoe_tn.conversion.persistence.storage import check_file_holds, check_pickled_archive

    if not Path(path).is_file():
        raise ValueError(f"--weight {path!r}: no such file")
    source = f"--weight {path!r}"
    data = read_once(Path(path), "--weight").data
    check_pickled_archive(data, source)
    for location in ("meta", "cpu"):  # sizes checked on the meta device, then the bytes read
        try:
            loaded = torch.load(io.BytesIO(data), map_location=location, weights_only=True)
        except Exception as error:  # torch raises many kinds for a malformed pickle
            raise ValueError(f"{source} is not a file torch.save wrote ({type(error).__name__})") from None
        state = _weight_state(loaded, source)
        check_file_holds(state, len(data), source)
    weight = state["weight"]
    if set(state) == {"weight"} and isinstance(loaded, torch.Tensor):
        return weight
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias="bias" in state, device="meta", dtype=weight.dtype)
    layer.weight = nn.Parameter(weight)
    if "bias" in state:
        layer.bias = nn.Parameter(state["bias"])
    return layer


def _weight_state(loaded: object, source: str) -> dict[str, object]:
    """``{"weight": ..., "bias": ...}`` of a ``--weight`` file: a floating tensor, or nn.Linear's state dict."""
    import torch

    rule = "holds neither a floating tensor nor an nn.Linear state dict (a 2-D weight and, optionally, its bias)"
    if isinstance(loaded, torch.Tensor):
        state = {"weight": loaded}
    elif isinstance(loaded, dict) and set(loaded) in ({"weight"}, {"weight", "bias"}):
        state = dict(loaded)
        weight, bias = state["weight"], state.get("bias")
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError(f"{source} {rule}: its weight is not a 2-D tensor")
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != weight.shape[:1]):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"{source} {rule}: its bias is {shape}, not of shape ({weight.shape[0]},)")
    else:
        raise ValueError(f"{source} {rule}")
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{source} {rule}: its {key} has dtype {tensor.dtype}")
    return state


def run(args: argparse.Namespace) -> int:
    """Search, then print the front (and save the plot)."""
    check_plot(args.plot, "plot")
    weight = None if args.weight is None else _load_weight(args.weight)
    experts = args.experts[0] if len(args.experts) == 1 else tuple(args.experts)
    result = design(
        args.in_features,
        args.out_features,
        experts,
        budget=args.budget,
        max_fma=args.max_fma,
        max_peak=None if args.max_peak is None else int(args.max_peak),
        batch=args.batch,
        min_rank=args.min_rank,
        rank_multiple=args.rank_multiple,
        max_modes=args.max_modes,
        families=args.families,
        expert_ranks=args.expert_ranks,
        hadamard=args.hadamard,
        bias=args.bias,
        gate=args.gate,
        weight=weight,
        measure=args.measure,
    )
    if args.json:
        print(result.to_json(every=args.every))
    elif args.markdown:
        print(result.title() + "\n\n" + result.to_markdown(every=args.every, dtype=args.dtype))
        print(f"\nbest: {result.best_point.structure} ({result.best_point.experts} experts): {result.best.to_spec()}")
    elif args.csv:
        print(result.to_csv(every=args.every), end="")
    else:
        from rich.console import Console

        console = Console()  # sized by the terminal (or $COLUMNS)
        console.print(result.to_rich(every=args.every, dtype=args.dtype, width=console.width))
    if args.plot:
        path = result.plot(args.plot)
        print(f"saved {path}", file=sys.stderr)
    return 0
