"""The ``mumoe-tn`` entry point: the registry of commands, the parser it builds, and one-line errors.

Every command is one module of this package, ``mumoe_tn.cli.<command>_command``, with the same
four names: ``HELP`` (its line in ``mumoe-tn --help``), ``DESCRIPTION`` (its ``--help`` text),
``configure(parser)`` (adds its arguments) and ``run(args) -> int`` (does the work, returns the exit
status). [`COMMANDS`][mumoe_tn.cli.main.COMMANDS] lists them in ``--help`` order.

Every error — a bad argument, an output that cannot be written, a missing optional package, or
an error from the library — is printed as one line naming the problem, with exit status 2. Every
warning is one line on stderr, ``mumoe-tn COMMAND: warning: ...``, without Python's file and source
line.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

from mumoe_tn.cli.arguments import UsageError, closest

__all__ = ["COMMANDS", "FORMATS_ENTRY_POINTS", "build_parser", "command_module", "main"]

COMMANDS = ("compare", "plan", "demo", "specialisation", "design", "explore", "distill")
"""The commands, in ``--help`` order; command ``NAME`` is the module ``mumoe_tn.cli.NAME_command``."""

#: The entry-point group under which a package declares the module that registers its formats.
FORMATS_ENTRY_POINTS = "mumoe_tn.formats"


def command_module(name: str) -> ModuleType:
    """The module of command ``name`` (one of [`COMMANDS`][mumoe_tn.cli.main.COMMANDS])."""
    if name not in COMMANDS:
        raise ValueError(f"unknown command {name!r}; the commands are {', '.join(COMMANDS)}")
    return importlib.import_module(f"mumoe_tn.cli.{name}_command")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is one ``--help`` away).

    An invalid choice (a command, ``--dtype``, ``--gates``) also names the closest valid one.
    """

    def error(self, message: str) -> None:  # type: ignore[override]
        choice = re.match(r"argument .*: invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if choice:
            message += closest(
                choice.group(1), re.findall(r"'([^']*)'", choice.group(2)) or choice.group(2).split(", ")
            )
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _LineRefused(Exception):
    """The line check found an error: the real parse reports it, and nothing is imported."""


class _HelpAsked(Exception):
    """The line asks for help: the modules ``--import`` named before it are imported, then the help printed."""


class _LineCheck(_Parser):
    """The full parser, checking a line before any module it names is imported: it prints nothing, exits never.

    An option's choices are not held to (a module ``--import`` names may register more formats,
    which the real parse then accepts); everything else is the real parse's.
    """

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if isinstance(action, argparse._SubParsersAction):  # the command itself: no module adds one
            super()._check_value(action, value)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _LineRefused(message)

    def print_help(self, file: object = None) -> None:
        """Nothing: the real parser prints the help, once the modules are imported."""

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise _HelpAsked


def _modules_on_line(argv: Sequence[str]) -> list[str]:
    """The modules the line's ``--import`` options name, as the full parser reads the whole line.

    Empty if the line is refused: a value that is another option (``--title --import=MODULE``), an
    unknown option, a missing argument (an abbreviation such as ``--imp`` counts only where the
    full parser reads it as ``--import``). With ``--help``, those named before it.
    """
    named: list[str] = []

    def record(module: str) -> str:
        named.append(module)
        return module

    try:
        args = build_parser(parser_class=_LineCheck, record=record).parse_args(list(argv))
    except _HelpAsked:
        return named
    except _LineRefused:
        return []
    return list(args.modules)


def _load_user_formats(argv: Sequence[str]) -> None:
    """Import the modules that register user formats: the entry points, then every ``--import MODULE``.

    Runs before the full parser is built, so registered formats appear in ``--help`` and are
    accepted by ``--decompositions``. A module is imported only once the full parser has read the
    whole line (choices aside) and found it the value of an ``--import`` option. A module that
    cannot be imported ends the command with one line naming it.
    """
    from importlib.metadata import entry_points

    for point in entry_points(group=FORMATS_ENTRY_POINTS):
        try:
            point.load()
        except Exception as error:
            raise UsageError(
                f"the {FORMATS_ENTRY_POINTS} entry point {point.name!r} ({point.value}) failed: {error}"
            ) from None
    for module in _modules_on_line(argv):
        try:
            importlib.import_module(module)
        except Exception as error:
            raise UsageError(f"--import {module}: cannot import it ({type(error).__name__}: {error})") from None


def build_parser(
    *, parser_class: type[argparse.ArgumentParser] = _Parser, record: Callable[[str], str] | None = None
) -> argparse.ArgumentParser:
    """The ``mumoe-tn`` parser: the global options and one sub-parser per command module.

    Parameters
    ----------
    parser_class : type, optional
        The class of the parser and of its sub-parsers.
    record : callable, optional
        Called with each ``--import`` value as the parser reads it (it returns the value).
    """
    parser = parser_class(prog="mumoe-tn", description="Multilinear mixture-of-experts tools.")
    module_name = record or str
    parser.add_argument(
        "--import",
        dest="modules",
        action="append",
        default=[],
        type=module_name,
        metavar="MODULE",
        help=(
            "import MODULE first, e.g. the module that registers your own formats (repeatable); packages "
            f"can declare such modules under the {FORMATS_ENTRY_POINTS!r} entry-point group instead"
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = command_module(name)
        command = commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.configure(command)
        command.add_argument(
            "--import", dest="modules", action="append", default=argparse.SUPPRESS, type=module_name,
            metavar="MODULE", help="import MODULE first (as before the command)",
        )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mumoe-tn`` command; returns the exit status (2 for any error, printed as one line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _load_user_formats(argv)
    except UsageError as error:
        _Parser(prog="mumoe-tn").exit(2, f"mumoe-tn: error: {error}\n")
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = tuple(argv)  # what a command that can be resumed prints for doing so
    with warnings.catch_warnings(record=True) as caught:  # the filters in force decide what is shown
        try:
            return command_module(args.command).run(args)
        except Exception as error:  # the command line prints every failure as one line, never a traceback
            kind = "" if isinstance(error, (UsageError, ValueError, TypeError)) else f"{type(error).__name__}: "
            message = " ".join(str(error).split())
            parser.exit(2, f"mumoe-tn {args.command}: error: {kind}{message}\n")
        finally:
            _report(args.command, caught)
    return 2  # pragma: no cover - parser.exit raises


def _report(command: str, caught: Sequence[warnings.WarningMessage]) -> None:
    """Every distinct warning as one line on stderr, in the program's words (no file, no source line)."""
    seen = set()
    for warning in caught:
        message = " ".join(str(warning.message).split())
        if message not in seen:
            seen.add(message)
            print(f"mumoe-tn {command}: warning: {message}", file=sys.stderr)
