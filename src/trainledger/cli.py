"""The command-line entry point: parse, call the library, print. Bad input → one line, exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from trainledger import __version__
from trainledger.commands import demo, estimate, fit, pareto, plan, report, shard, state, trace
from trainledger.errors import InputError

COMMANDS = (demo, state, trace, shard, plan, pareto, estimate, fit, report)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainledger",
        description="What occupies memory at the peak instant of a PyTorch training step, and why.",
    )
    parser.add_argument("--version", action="version", version=f"trainledger {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args))
    except InputError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        sys.stderr.write(f"trainledger {args.command}: error: {message}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("trainledger: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
