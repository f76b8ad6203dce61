"""``mumoe-tn distill``: the sparsity–accuracy frontier of a model's MLP blocks, μMoE against transcoders.

The command line of [`run_frontier`][mumoe_tn.distillation.study.run_frontier]; its methods, budget
and model are described in [`mumoe_tn.distillation.study`][mumoe_tn.distillation.study].

SIGINT (Ctrl-C) or SIGTERM ends the current step, writes the ``--checkpoint`` file, prints the
command that resumes the run and exits with status 130 (SIGINT) or 143 (SIGTERM); a second
signal stops at once with the same status, keeping the checkpoint written last.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
import shlex
import signal
import sys
from pathlib import Path

import torch

from mumoe_tn.cli.arguments import UsageError, add_output_formats, check_plot
from mumoe_tn.distillation.interruption import DistillationStopped, StopOnSignals
from mumoe_tn.distillation.methods import BEST_RECIPES, HIERARCHICAL_SUFFIX, METHODS, parse_methods
from mumoe_tn.distillation.paired import paired_against
from mumoe_tn.distillation.process_shares import joined_process_group, process_checkpoint, process_world
from mumoe_tn.distillation.replacements import top_k_gate_names
from mumoe_tn.distillation.study import FrontierConfig, run_frontier
from mumoe_tn.distillation.trainer import RECIPES

__all__ = ["DESCRIPTION", "HELP", "checkpoint_steps", "config_from", "configure", "resume_command", "run"]

HELP = "distil a model's MLP blocks into μMoE blocks and transcoders: the sparsity-accuracy frontier"
DESCRIPTION = (
    "Distils each MLP block of a causal language model into sparse replacements (μMoE blocks of "
    "any format, flat or hierarchical, TopK transcoders and skip transcoders) at one parameter budget and "
    "several sparsities L0, on streamed activations, then measures L0, normalised MSE, explained variance, "
    "next-token cross-entropy clean / spliced / zero-ablated and the CE-loss score on held-out text (the last 10 % "
    "of --text, by default Python's pydoc_data). Without --model a GPT-2-shaped model is built and trained on the "
    "text first (needs the hf extra). Ctrl-C (SIGINT) or SIGTERM writes the --checkpoint after the current step, "
    "prints the command that resumes the run and exits with status 130 or 143."
)


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the command's arguments to ``parser``; returns it."""
    d = FrontierConfig()
    parser.add_argument("--quick", action="store_true", help="a tiny run of well under a minute")
    parser.add_argument("--model", dest="model_dir", metavar="DIR", help="a local Hugging Face causal LM (default: "
                        "build a GPT-2-shaped model and train it on pydoc_data)")  # fmt: skip
    parser.add_argument("--text", nargs="+", metavar="PATH", help="UTF-8 text files, or directories of .txt/.md "
                        "files (read sorted, subdirectories too), to train, distil and evaluate on (default "
                        "Python's pydoc_data); tokenised by the tokenizer beside --model, else bytes")  # fmt: skip
    parser.add_argument("--mlps", help=f"regex of the MLP blocks to distil (default {d.mlps!r})")
    parser.add_argument("--methods", nargs="+", help=f"methods: {', '.join(_named_methods())}, a format name, or a "
                        f"format name with {HIERARCHICAL_SUFFIX!r} for two expert modes (default "
                        f"{' '.join(d.methods)})")  # fmt: skip
    parser.add_argument("--l0", dest="l0s", type=int, nargs="+", help=f"sparsities (default {list(d.l0s)})")
    parser.add_argument("--experts", type=int, help=f"experts of every μMoE block (default {d.experts})")
    parser.add_argument(
        "--expansion", type=int, help=f"budget: a transcoder of expansion×I latents (default {d.expansion})"
    )
    parser.add_argument("--budget", type=int, help="budget: parameters per replacement (instead of --expansion)")
    parser.add_argument("--tokens", type=int, help=f"distillation tokens (default {d.tokens:,})")
    parser.add_argument("--eval-tokens", type=int, help=f"held-out evaluation tokens (default {d.eval_tokens:,})")
    parser.add_argument("--batch-size", type=int, help=f"tokens per optimiser step (default {d.batch_size})")
    parser.add_argument("--buffer-tokens", type=int, help=f"activation buffer capacity (default {d.buffer_tokens:,})")
    parser.add_argument("--recipe", choices=sorted(RECIPES), help="training recipe of every method: 'mxd-paper' "
                        "(default: the MxD authors' init, unit-norm expert vectors, AdamW 4e-4 with warm-up), "
                        "'plain' (Adam 1e-3), or another")  # fmt: skip
    parser.add_argument("--per-method-recipes", action="store_true", help="train each method with its own best "
                        "recipe from the recipe sweep (BEST_RECIPES; --recipe for the others)")  # fmt: skip
    parser.add_argument("--lr", type=float, help="learning rate (default the recipe's)")
    parser.add_argument(
        "--pretrain-steps", type=int, help=f"training steps of the built model (default {d.pretrain_steps})"
    )
    parser.add_argument("--width", type=int, help=f"width of the built model (default {d.width})")
    parser.add_argument("--depth", type=int, help=f"layers of the built model (default {d.depth})")
    parser.add_argument("--seed", type=int, help=f"seed (default {d.seed})")
    parser.add_argument("--top-k", choices=top_k_gate_names(), help="the μMoE blocks' top-k gate: 'auto' (default: "
                        "the format's, ReLU for MxD as its authors gate; softmax for the others) or any registered "
                        "top-k gate")  # fmt: skip
    parser.add_argument("--checkpoint", metavar="FILE", help="save the distillation's state here (and resume from it "
                        "with --resume)")  # fmt: skip
    parser.add_argument("--checkpoint-every", metavar="N", help="write --checkpoint every N optimiser steps (default "
                        "100), or every N tokens with a 'tok' suffix (e.g. 50000tok)")  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="resume the distillation from --checkpoint (which must "
                        "exist)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_output_formats(
        parser, json="print the table as JSON", csv="print the table as CSV",
        markdown="print the table as Markdown (the default when stdout is not a terminal; a rich table when it is)",
    )  # fmt: skip
    parser.add_argument("--save", metavar="DIR", help="write the run into this new or empty directory: the table "
                        "(frontier.json), the trained replacements (replacements.safetensors) and the built model "
                        "(model/), reloadable with mumoe_tn.distillation.study.load_frontier")  # fmt: skip
    parser.add_argument("--plot", metavar="FILE.png", help="save the frontier plot (CE-loss score against L0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return parser


def _named_methods() -> list[str]:
    """The registered methods named by their own name (the others by a format's)."""
    return [name for name, method in METHODS.items() if not method.by_format]


def config_from(args: argparse.Namespace) -> FrontierConfig:
    """The configuration the parsed arguments ask for."""
    config = FrontierConfig.quick() if args.quick else FrontierConfig()
    names = ("model_dir", "text", "mlps", "methods", "l0s", "experts", "expansion", "budget", "tokens", "eval_tokens",
             "batch_size", "buffer_tokens", "recipe", "lr", "pretrain_steps", "width", "depth", "seed",
             "top_k")  # fmt: skip
    changes = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    for name in ("methods", "l0s", "text"):
        if name in changes:
            changes[name] = tuple(changes[name])
    for name in ("experts", "expansion", "budget", "tokens", "eval_tokens", "batch_size", "buffer_tokens",
                 "pretrain_steps", "width", "depth"):  # fmt: skip
        if name in changes and changes[name] <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {changes[name]}")
    if getattr(args, "per_method_recipes", False):
        changes["method_recipes"] = BEST_RECIPES
    if "methods" in changes:  # parsed once here: an unknown method is named before any model is built
        changes["methods"] = tuple(spec.text for spec in parse_methods(changes["methods"]))
    if any(l0 <= 0 for l0 in changes.get("l0s", ())):
        raise ValueError(f"--l0 values must be positive ints, got {list(changes['l0s'])}")
    return dataclasses.replace(config, **changes)


def checkpoint_steps(every: str | None, batch_size: int) -> int:
    """The optimiser steps between checkpoints that ``--checkpoint-every`` asks for (100 without it).

    ``"N"`` is N steps; ``"Ntok"`` is N tokens, rounded up to whole steps of ``batch_size`` tokens.
    """
    if every is None:
        return 100
    match = re.fullmatch(r"\s*(\d+)\s*(tok|tokens)?\s*", every)
    if match is None or int(match.group(1)) <= 0:
        raise UsageError(f"--checkpoint-every takes a positive number of steps (N) or of tokens (Ntok), got {every!r}")
    count = int(match.group(1))
    return math.ceil(count / batch_size) if match.group(2) else count


def resume_command(args: argparse.Namespace) -> str:
    """The command line that resumes this run: the one given, with ``--resume`` (under torchrun, its own)."""
    words = list(getattr(args, "command_line", None) or sys.argv[1:])
    if "--resume" not in words:
        words.append("--resume")
    if process_world() is not None:  # torchrun's own options are not this process's to know
        return "torchrun <the same options> -m mumoe_tn.cli " + shlex.join(words)
    return shlex.join(["mumoe-tn", *words])


def _stopped(args: argparse.Namespace, stop: StopOnSignals, reason: str) -> int:
    """Say where the stopped run is kept and how to resume it; the exit status of the signal."""
    name = signal.Signals(stop.signal or signal.SIGINT).name
    print(f"mumoe-tn distill: stopped by {name}: {reason}", file=sys.stderr)
    if args.checkpoint and process_checkpoint(args.checkpoint).is_file():
        print(f"mumoe-tn distill: resume with: {resume_command(args)}", file=sys.stderr)
    else:
        print("mumoe-tn distill: no checkpoint to resume from (give --checkpoint FILE to keep one)", file=sys.stderr)
    return stop.exit_status if stop.signal is not None else 128 + signal.SIGINT


def run(args: argparse.Namespace) -> int:
    """Run the frontier for the parsed arguments, print the table (and save it and the plot).

    Under ``torchrun`` (``WORLD_SIZE`` above 1) the processes join a gloo group and share the
    distillation (see [`mumoe_tn.distillation.process_shares`][mumoe_tn.distillation.process_shares]);
    rank 0 evaluates, prints and saves.
    """
    with joined_process_group():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    check_plot(args.plot, "plot")
    if importlib.util.find_spec("transformers") is None:
        raise UsageError("distill needs transformers: pip install 'mumoe_tn[hf]'")
    config = config_from(args)
    if args.save and Path(args.save).exists() and (not Path(args.save).is_dir() or any(Path(args.save).iterdir())):
        raise UsageError(f"--save must name a new or empty directory, got {args.save!r}")
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint FILE")
    if args.checkpoint_every is not None and not args.checkpoint:
        raise ValueError("--checkpoint-every needs --checkpoint FILE")
    if args.resume and not process_checkpoint(args.checkpoint).is_file():
        raise ValueError(f"--resume: there is no checkpoint file at {str(process_checkpoint(args.checkpoint))!r}")
    every = checkpoint_steps(args.checkpoint_every, config.batch_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    stop = StopOnSignals("mumoe-tn distill: stopping after the current step (send the signal again to stop at once)")
    try:
        with stop:
            table = run_frontier(config, progress=args.progress, checkpoint=args.checkpoint, resume=args.resume,
                                 save=args.save, checkpoint_every=every, stop=stop)  # fmt: skip
    except DistillationStopped as stopped:
        return _stopped(args, stop, f"{stopped.trained:,} of {stopped.tokens:,} tokens distilled")
    except KeyboardInterrupt:
        return _stopped(args, stop, "at once, on the second signal; the checkpoint is the last one written")
    finally:
        torch.set_num_threads(threads)
    if table is None:  # a process of rank above 0: rank 0 reports
        return 0
    if args.plot:
        table.plot(args.plot)
    paired = paired_against(table)
    if args.json:
        data = json.loads(table.to_json())
        differences = [
            {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in dataclasses.asdict(d).items()}
            for d in paired
        ]
        print(json.dumps({**data, "paired": differences}, indent=2))
    elif args.csv:
        sys.stdout.write(table.to_csv())
    else:
        if args.markdown:
            print(table.title() + "\n\n" + table.to_markdown())
        else:
            table.show()
        if paired:
            print("\nAgainst the transcoders, paired over the held-out sequences (method − transcoder, 95 % interval):")
            for difference in paired:
                print(f"  {difference}{'  *' if difference.decided else ''}")
            print("  * the CE difference's interval excludes 0")
    return 0
