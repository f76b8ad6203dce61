"""``mumoe-tn explore``: write the expert explorer's page for a model a Python function builds.

``MODEL`` names a function, ``path/to/file.py:function`` or ``package.module:function``,
that returns the keyword arguments of [`explore`][mumoe_tn.analysis.explorer.explore] as a
dict (at least ``model`` and ``data``) or a ``(model, data)`` pair. The project's examples
have one each: ``examples/char_gpt.py:explorer``, ``examples/gpt2_upcycle.py:explorer`` and
``examples/mixer_digits.py:explorer``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from mumoe_tn.analysis.explorer.explore_options import OPTION_NAMES, ExploreOptions
from mumoe_tn.cli.arguments import positive

__all__ = ["DESCRIPTION", "HELP", "configure", "load_target", "options_from", "run"]

HELP = "write a self-contained HTML page showing what each expert of a model does"
DESCRIPTION = (
    "Runs the model a Python function builds over its data and writes one HTML page (no network "
    "needed to open it): per layer the experts' usage, sparsity, dead experts and specialisation; per expert "
    "(or slice of a hierarchical mode) its top-activating examples in context, a histogram of its "
    "coefficient and the effect of ablating it on the loss and outputs."
)


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's arguments to ``parser``; returns it."""
    parser.add_argument(
        "target",
        metavar="MODEL",
        help="FILE.py:FUNCTION or MODULE:FUNCTION returning explore()'s arguments (a dict with model and data, "
        "or a (model, data) pair), e.g. examples/char_gpt.py:explorer",
    )
    parser.add_argument("-o", "--output", default="experts.html", help="the HTML page to write (default experts.html)")
    parser.add_argument("--samples", type=positive, help="explore only the first SAMPLES samples of the data")
    parser.add_argument("--layers", nargs="+", metavar="NAME", help="qualified names of the layers (default: all)")
    parser.add_argument("--top-k", type=positive, default=12, help="top-activating examples per expert (default 12)")
    parser.add_argument("--context", type=int, default=12, help="tokens of context on each side (default 12)")
    parser.add_argument("--batch-size", type=positive, default=32, help="samples per forward pass (default 32)")
    parser.add_argument(
        "--ablation-samples", type=positive, default=64, help="samples for the ablation effects (default 64)"
    )
    parser.add_argument("--no-ablation", dest="ablation", action="store_false", help="skip the ablation passes")
    parser.add_argument("--title", help="the page's title")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def load_target(target: str) -> Callable[[], object]:
    """The function ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION`` names (ValueError if it cannot be loaded)."""
    location, colon, name = target.rpartition(":")
    if not colon or not location or not name.isidentifier():
        raise ValueError(f"MODEL must be FILE.py:FUNCTION or MODULE:FUNCTION, got {target!r}")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise ValueError(f"MODEL {target!r}: no file {location!r}")
        spec = importlib.util.spec_from_file_location(f"mumoe_explore_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))  # the file's own imports of its neighbours
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise ValueError(f"MODEL {target!r}: cannot import {location!r} ({error})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"MODEL {target!r}: {location!r} has no function {name!r}")
    return function


def options_from(args: argparse.Namespace, options: ExploreOptions | None = None) -> ExploreOptions:
    """``options`` (default ``ExploreOptions()``) with what the parsed arguments set."""
    changes: dict[str, object] = {
        "top_k": args.top_k, "context": args.context, "batch_size": args.batch_size, "ablation": args.ablation,
        "ablation_samples": args.ablation_samples, "progress": False if args.quiet else None,
    }  # fmt: skip
    if args.layers:
        changes["layers"] = args.layers
    if args.title:
        changes["title"] = args.title
    return dataclasses.replace(ExploreOptions() if options is None else options, **changes)


def run(args: argparse.Namespace) -> int:
    """Build the model, explore it, write the page; prints where it went."""
    from mumoe_tn.analysis.explorer.explore import explore

    output = Path(args.output)
    if not output.parent.is_dir():
        raise ValueError(f"cannot write {args.output!r}: its folder does not exist")
    if args.context < 0:
        raise ValueError(f"--context must be at least 0, got {args.context}")
    built = load_target(args.target)()
    if isinstance(built, Mapping):
        given = dict(built)
    elif isinstance(built, tuple) and len(built) == 2:
        given = {"model": built[0], "data": built[1]}
    else:
        raise TypeError(
            f"{args.target} must return a dict of explore() arguments or a (model, data) pair, "
            f"got {type(built).__name__}"
        )
    missing = [key for key in ("model", "data") if key not in given]
    if missing:
        raise ValueError(f"{args.target} returned no {' or '.join(missing)} (explore() needs model and data)")
    model, data = given.pop("model"), given.pop("data")
    unknown = sorted(str(key) for key in given if key not in OPTION_NAMES)
    if unknown:
        raise ValueError(f"{args.target} returned {unknown}, which explore() does not take; its options are "
                         f"{list(OPTION_NAMES)}")  # fmt: skip
    if args.samples is not None:
        data = data[: args.samples]
        for key in ("labels", "images"):
            if given.get(key) is not None:
                given[key] = given[key][: args.samples]
    options = options_from(args, ExploreOptions(**given))
    report = explore(model, data, output, options=options)
    units = sum(len(layer["units"]) for layer in report.data["layers"])
    print(f"wrote {output} ({len(report.data['layers'])} layers, {units} experts and slices)")
    return 0
