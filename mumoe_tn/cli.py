"""The ``mumoe-tn`` command line: ``compare`` cost tables, ``plan`` a network's contraction."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mumoe_tn.costs.table import compare
from mumoe_tn.decompositions.registry import available

__all__ = ["main"]


def _rank(text: str) -> tuple[str, int | tuple[int, ...]]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--rank takes NAME=R or NAME=R1,R2,…, got {text!r}")
    try:
        ranks = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rank {text!r}: ranks must be integers") from None
    return name.strip().lower(), ranks[0] if len(ranks) == 1 else ranks


def _match(text: str) -> str | int:
    if text in ("linear", "mlp"):
        return text
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--match takes 'linear', 'mlp' or a number of parameters, got {text!r}"
        ) from None
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mumoe-tn", description="Multilinear mixture-of-experts tools.")
    commands = parser.add_subparsers(dest="command", required=True)

    cmp = commands.add_parser(
        "compare",
        help="cost table of μMoE decompositions against nn.Linear, MLP blocks and MoEs",
        description=(
            "Parameters, FMAs (1 FMA = 1 FLOP), peak intermediate and expert-rank bounds. Defaults: the paper's "
            "GPT-2 MLP layer, 768 -> 3072 with 256 experts, CP and TR parameter-matched to nn.Linear."
        ),
    )
    cmp.add_argument("--in", dest="in_features", type=int, default=768, help="input features (default 768)")
    cmp.add_argument("--out", dest="out_features", type=int, default=3072, help="output features (default 3072)")
    cmp.add_argument("--experts", type=int, nargs="+", default=[256], help="experts per mode, e.g. 256 or 32 32 32 32")
    cmp.add_argument("--decompositions", nargs="+", default=["cp", "tr"], help=f"any of {available()} (default cp tr)")
    cmp.add_argument(
        "--rank", type=_rank, action="append", default=[], help="explicit ranks, e.g. cp=512 or tr=4,4,128"
    )
    cmp.add_argument(
        "--match",
        type=_match,
        default="linear",
        help="parameter target for decompositions without --rank: linear (default), mlp (compare in->out->in blocks), "
        "or a number. TR/TT scale the input-output bond, Tucker all its bonds.",
    )
    cmp.add_argument("--no-bias", dest="bias", action="store_false", help="no folded bias (and no baseline bias)")
    cmp.add_argument("--no-gating", dest="gate", action="store_false", help="do not count gating parameters/FMAs")
    cmp.add_argument("--batch", type=int, default=1, help="tokens per forward for planned FMAs and peak memory")
    cmp.add_argument("--top-k", type=int, default=2, help="K of the sparse MoE baseline (default 2)")
    output = cmp.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON")
    output.add_argument("--markdown", action="store_true", help="print a Markdown table")
    output.add_argument("--csv", action="store_true", help="print CSV")
    cmp.add_argument("--plot", metavar="FILE.png", help="also save parameters vs number of experts (2 to 16,384)")

    plan = commands.add_parser("plan", help="show the planned contraction of a decomposition or a spec string")
    plan.add_argument("network", help=f"a registered name {available()} or a spec such as 'n1 a b, a i c, b c o'")
    plan.add_argument("--in", dest="in_features", type=int, default=768)
    plan.add_argument("--out", dest="out_features", type=int, default=3072)
    plan.add_argument("--experts", type=int, nargs="+", default=[256])
    plan.add_argument("--rank", type=int, nargs="+", default=[64], help="rank(s) of the named builder, or every bond")
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument("--optimize", default="dp", help="path optimizer (dp, optimal, greedy, auto, cotengra, …)")

    demo = commands.add_parser(
        "demo",
        help="mean expert polysemanticity vs number of experts on scikit-learn's digits",
        description="Trains a CP μMoE classification head per expert count on 8×8 digits, ablates every expert, "
        "and prints test accuracy and mean class-level polysemanticity (paper Eq. polysemanticity).",
    )
    demo.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    demo.add_argument("--epochs", type=int, default=40)
    demo.add_argument("--rank", type=int, default=32)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--plot", metavar="FILE.png", default="polysemanticity.png", help="plot file ('' for none)")

    from mumoe_tn.specialisation import configure_parser

    configure_parser(
        commands.add_parser(
            "specialisation",
            help="does expert class-polysemanticity fall with more experts? (paper Fig. polysemanticity)",
            description="Trains CP μMoE final layers (N = 16 … 1,024; entmax15/softmax; BatchNorm/none; several "
            "seeds) on 100 generated classes, ablates every expert and reports mean class-level polysemanticity.",
        )
    )
    return parser


def _compare(args: argparse.Namespace) -> int:
    ranks = dict(args.rank)
    table = compare(
        args.in_features,
        args.out_features,
        tuple(args.experts),
        tuple(name.lower() for name in args.decompositions),
        ranks=ranks,
        match=args.match,
        bias=args.bias,
        gate=args.gate,
        batch=args.batch,
        top_k=args.top_k,
    )
    if args.json:
        print(table.to_json())
    elif args.markdown:
        print(table.title() + "\n\n" + table.to_markdown())
    elif args.csv:
        print(table.to_csv(), end="")
    else:
        from rich.console import Console

        Console(width=200).print(table.to_rich())
    if args.plot:
        from mumoe_tn.plots import plot_parameters_vs_experts

        path = plot_parameters_vs_experts(table, args.plot)
        print(f"saved {path}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from mumoe_tn.contractions.plan import plan_forward
    from mumoe_tn.costs.rank import min_cut
    from mumoe_tn.decompositions.registry import build
    from mumoe_tn.network import ExpertNetwork

    if args.network.lower() in available():
        rank = args.rank[0] if len(args.rank) == 1 else tuple(args.rank)
        network = build(args.network, tuple(args.experts), args.in_features, args.out_features, rank)
    else:
        if len(args.rank) != 1:
            raise ValueError("a spec string takes one --rank for all of its bonds")
        network = ExpertNetwork.from_spec(
            args.network,
            expert_dims=tuple(args.experts),
            in_features=args.in_features,
            out_features=args.out_features,
            ranks=args.rank[0],
        )
    plan = plan_forward(network, args.batch, args.optimize)
    labels, bound = min_cut(network)
    print(network)
    print(plan)
    print(f"largest intermediate: {plan.largest_intermediate:,} elements; expert rank <= {bound} (cut {labels})")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from mumoe_tn.demo import format_rows, run_demo

    rows = run_demo(args.experts, epochs=args.epochs, rank=args.rank, seed=args.seed, plot=args.plot or None)
    print(format_rows(rows))
    if args.plot:
        print(f"saved {args.plot}", file=sys.stderr)
    return 0


def _specialisation(args: argparse.Namespace) -> int:
    from mumoe_tn.specialisation import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mumoe-tn`` command; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    commands = {"compare": _compare, "plan": _plan, "demo": _demo, "specialisation": _specialisation}
    try:
        return commands[args.command](args)
    except (ValueError, TypeError) as error:
        parser.exit(2, f"mumoe-tn {args.command}: error: {error}\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
