"""The command-line entry point: parse, call the library, print. Bad input → one line, exit status 2."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import re
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from trainledger import __version__
from trainledger.commands.common import stdout_for_json_only
from trainledger.errors import InputError
from trainledger.signals import (
    Terminated,
    exit_status,
    interrupts_wait_for_imports,
    stop_children,
    terminating_signals_raise,
)

COMMANDS = ("demo", "state", "trace", "shard", "plan", "pareto", "estimate", "fit", "report")
"""The subcommands, in the order ``--help`` lists them; each is a module of :mod:`trainledger.commands`, imported
when the command line names it (``estimate`` and ``fit`` then never import torch) or asks for help."""
TRACING = frozenset({"demo", "trace", "plan", "pareto"})
"""The commands that always trace a step: the tracer's compiled path is built before they run, where it is not yet."""


def _command(name: str) -> ModuleType:
    return importlib.import_module(f"trainledger.commands.{name}")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if not _SAYS_WHAT_WOULD_DO.search(message):  # argparse's own: unrecognized, missing, ambiguous
            message += f"; see '{self.prog} --help' for what is accepted"
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


_SAYS_WHAT_WOULD_DO = re.compile(r"accepted|choose from|must|give|e\.g\.|at (least|most)|use ")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every subcommand, or with ``only`` (one of :data:`COMMANDS`) that one alone."""
    parser = _Parser(
        prog="trainledger",
        description="What occupies memory at the peak instant of a PyTorch training step, and why.",
    )
    parser.add_argument("--version", action="version", version=f"trainledger {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in (only,) if only in COMMANDS else COMMANDS:
        _command(name).add_parser(sub)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


_CONFIG_ONLY = ("estimate", "fit")  # commands that read a Hugging Face config, never a model

_LOOKS_NUMERIC = re.compile(r"-[\d.]")


def _dash_values_joined(parser: argparse.ArgumentParser, given: list[str]) -> list[str]:
    """``--budget -5%`` as ``--budget=-5%``: argparse takes a value that starts with a dash for an option unless
    it is a plain negative number, and says the option "expected one argument", not what is wrong with the
    value. Joined, the option's own check says that (a budget must be positive)."""
    command = _subparsers(parser).get(given[0]) if given else None
    if command is None:
        return given
    takes_value = {o for a in command._actions if a.nargs is None and a.option_strings for o in a.option_strings}
    joined: list[str] = []
    i = 0
    while i < len(given):
        arg = given[i]
        if arg in takes_value and i + 1 < len(given) and _LOOKS_NUMERIC.match(given[i + 1]):
            joined.append(f"{arg}={given[i + 1]}")
            i += 2
            continue
        joined.append(arg)
        i += 1
    return joined


@contextlib.contextmanager
def _warnings_on_one_line(command: str) -> Iterator[None]:
    """A warning is one line on stderr, as an error is (``trainledger trace: warning: ...``), not Python's two with
    a source path and line."""
    before = warnings.formatwarning

    def one_line(message: Any, category: Any, filename: str, lineno: int, line: str | None = None) -> str:
        return f"trainledger {command}: warning: {' '.join(str(message).split())}\n"

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = before


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(given[0] if given else None)
    if given and given[0] in _CONFIG_ONLY and any(a == "--model" or a.startswith("--model=") for a in given):
        _subparsers(parser)[given[0]].error(  # argparse would only say that --hf-config is missing
            f"{given[0]} works from a Hugging Face config (--hf-config PATH), not from a model; for your own "
            "model use trace, plan or shard with --model"
        )
    args, extra = parser.parse_known_args(_dash_values_joined(parser, given))
    if extra:  # said by the subcommand's parser, so the message names the command
        command = _subparsers(parser).get(getattr(args, "command", None) or "", parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        with (
            _warnings_on_one_line(args.command),
            terminating_signals_raise(),  # SIGTERM and SIGHUP unwind like Ctrl-C: every cleanup runs
            stdout_for_json_only() if getattr(args, "json", False) else contextlib.nullcontext(),
        ):
            if args.command in TRACING:
                _build_compiled_tracer()
            return int(args.run(args))
    except InputError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        sys.stderr.write(f"trainledger {args.command}: error: {message}\n")
        return 2
    except KeyboardInterrupt:
        stop_children()
        sys.stderr.write("trainledger: interrupted\n")
        return exit_status(signal.SIGINT)
    except Terminated as exc:
        stop_children()
        sys.stderr.write(f"trainledger: terminated by {signal.Signals(exc.signum).name}\n")
        return exit_status(exc.signum)


def _build_compiled_tracer() -> None:
    """Build the tracer's compiled path (once for each torch and Python, about 20 s) before the first trace, with a
    status line saying so on a terminal; where it cannot be built, traces take the Python hook, as fast as before."""
    from trainledger.trace import compiled_tracer, compiled_tracer_ready

    if compiled_tracer_ready():
        return
    from rich.console import Console

    err = Console(stderr=True)
    if not err.is_terminal:
        compiled_tracer()
        return
    with err.status("building the tracer's compiled path for this torch (once, about 20 s)…"):
        compiled_tracer()


def entry() -> int:
    """The ``trainledger`` program: :func:`main`, then the process ends without the collector's walks over
    every object torch and transformers made (a full collection as the interpreter shuts down: 2 s of CPU
    after a trace of a Hugging Face model on this machine, a sixth of the command). Called in a process
    that goes on (a test, a notebook), use :func:`main`: frozen objects are never collected."""
    try:
        with interrupts_wait_for_imports():  # an import interrupted halfway can abort the process
            status = main()
    except KeyboardInterrupt:  # before the command's own handler: while torch or transformers loaded
        sys.stderr.write("trainledger: interrupted\n")
        return exit_status(signal.SIGINT)
    gc.freeze()
    return status


if __name__ == "__main__":
    raise SystemExit(entry())
