"""``mumoe-tn plan``: the planned contraction of a registered decomposition or a spec string."""

from __future__ import annotations

import argparse
import shutil
import textwrap
from collections.abc import Sequence

from mumoe_tn.cli.arguments import UsageError, add_layer_shape, by_bond, check_names, memory_limit, positive, ranks
from mumoe_tn.decompositions.registry import available

__all__ = ["DEFAULT_RANK", "DESCRIPTION", "HELP", "configure", "run"]

HELP = "show the planned contraction of a decomposition or a spec string"
DESCRIPTION = "The input leg i counts the folded bias (i = in + 1), as in compare; --no-bias for i = in."

#: The rank of every bond when ``--rank`` is left out.
DEFAULT_RANK = 64


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's arguments to ``parser``; returns it."""
    parser.add_argument("network", help=f"a registered name {available()} or a spec such as 'n1 a b, a i c, b c o'")
    add_layer_shape(parser, experts_help="experts per mode, e.g. 256 or 32 32 (default 256)")
    parser.add_argument(
        "--rank",
        type=_rank_word_type,
        nargs="+",
        default=None,
        help="one rank for every bond (64), one per bond in order (4,4,64 or 4 4 64) or by bond name "
        "(a=4,b=4,c=64); default 64 for every bond. A network without bonds takes none",
    )
    parser.add_argument("--batch", type=positive, default=1, help="tokens per forward (default 1)")
    parser.add_argument("--no-bias", dest="bias", action="store_false", help="no folded bias: i = in")
    parser.add_argument(
        "--optimize", default="auto", help="path optimizer: auto (default), dp, optimal, greedy, cotengra, …"
    )
    parser.add_argument(
        "--memory-limit",
        type=memory_limit,
        default=None,
        help="most elements any intermediate may hold (an int, or max_input: the largest operand); "
        "default: 4x the largest operand or result, or 1.5x the smallest peak any path reaches",
    )
    return parser


def _rank_word_type(text: str) -> tuple[int, ...] | dict[str, int]:
    """One word of ``--rank``: ``64``, ``4,4,64`` (per bond, in order) or ``a=4,b=4,c=64`` (by bond)."""
    if "=" not in text:
        return ranks(text)
    usage = f"--rank takes R, R1,R2,… (per bond, in order) or BOND=R,BOND=R,… (by bond), got {text!r}"
    return by_bond(text, usage)


def _merged_ranks(words: Sequence[tuple[int, ...] | dict[str, int]]) -> int | tuple[int, ...] | dict[str, int]:
    """The words of ``--rank`` as one rank, ranks in bond order, or ``{bond: size}``."""
    if all(isinstance(word, tuple) for word in words):
        merged_order = tuple(rank for word in words for rank in word)  # type: ignore[union-attr]
        return merged_order[0] if len(merged_order) == 1 else merged_order
    if not all(isinstance(word, dict) for word in words):
        raise UsageError(
            "--rank takes ranks in bond order (4,4,32) or bond=size pairs (a=4,b=4,c=32), not both, got "
            + " ".join(_rank_word(word) for word in words)
        )
    merged: dict[str, int] = {}
    for word in words:
        for bond, size in word.items():  # type: ignore[union-attr]
            if bond in merged:
                raise UsageError(f"--rank gives bond {bond!r} twice ({merged[bond]} and {size})")
            merged[bond] = size
    return merged


def _rank_word(word: tuple[int, ...] | dict[str, int]) -> str:
    if isinstance(word, dict):
        return ",".join(f"{bond}={size}" for bond, size in word.items())
    return ",".join(map(str, word))


def run(args: argparse.Namespace) -> int:
    """Resolve the network, plan its forward contraction and print the plan and its rank bound."""
    from mumoe_tn.contractions.plan import plan_forward
    from mumoe_tn.costs.rank import min_cut
    from mumoe_tn.decompositions.resolve import resolve_network, spec_ranks

    rank = None if args.rank is None else _merged_ranks(args.rank)
    width = args.in_features + int(args.bias)
    dims = tuple(args.experts)
    check_names([args.network], "network name")
    named = args.network.lower() in available()
    decomposition = args.network.lower() if named else args.network
    if named and not isinstance(rank, dict):
        network = resolve_network(decomposition, dims, width, args.out_features, DEFAULT_RANK if rank is None else rank)
    else:  # a spec string, or bonds by name: the shape first (every bond 1), then the sizes
        shape = resolve_network(decomposition, dims, width, args.out_features, 1)
        if not shape.bonds and rank is not None:
            given = " ".join(map(_rank_word, args.rank))
            raise UsageError(f"{args.network!r} has no bonds, so --rank {given} has nothing to size: leave it out")
        network = shape.with_sizes(**spec_ranks(shape.bonds, DEFAULT_RANK if rank is None else rank, shape.name))
    plan = plan_forward(network, args.batch, args.optimize, memory_limit=args.memory_limit)
    labels, bound = min_cut(network)
    bias = f"{args.in_features} inputs + 1 folded bias, as in compare" if args.bias else "no bias"
    per_token = plan.fma / args.batch
    limit = (
        "auto (4x the largest operand or result, or 1.5x the smallest peak found)"
        if args.memory_limit is None
        else f"{args.memory_limit:,}"
    )
    if args.memory_limit == "max_input":
        limit = "max_input (the largest operand)"
    _print_fitted(
        f"i = {width} ({bias}); batch {args.batch:,}",
        str(network),
        str(plan),
        f"largest intermediate per batch: {plan.largest_intermediate:,} elements; FMA per token: {per_token:,.0f}",
        f"memory limit: {limit}",
        f"expert rank <= {bound} (cut {labels})",
    )
    return 0


def _print_fitted(*texts: str) -> None:
    """Print lines wrapped at spaces to the terminal's width (or $COLUMNS); a word is never split."""
    columns = shutil.get_terminal_size().columns
    for line in "\n".join(texts).splitlines():
        if len(line) <= columns:
            print(line)
        else:
            indent = " " * (len(line) - len(line.lstrip()) + 4)
            print(
                textwrap.fill(line, columns, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
            )
