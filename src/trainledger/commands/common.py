"""Flags and printing shared by several subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console

from trainledger.errors import InputError
from trainledger.report.terminal import make_console
from trainledger.units import parse_count, parse_size


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_model_flag(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument(
        "--model",
        metavar="NAME|FILE.py:FACTORY",
        required=required,
        help="a built-in example (seed-423, gpt-tiny, mlp, cnn, lstm, moe, dpo, lora, autocast-bf16, "
        "bf16-master, unet-small) or your file.py:factory returning a trainledger.Workload",
    )


def print_json(obj: dict[str, Any]) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def count_arg(flag: str):
    def parse(text: str) -> int:
        try:
            return parse_count(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: {exc}") from None

    return parse


def size_arg(flag: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: {exc}") from None

    return parse


def positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a whole number") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} {value} must be at least 1")
        return value

    return parse


def require(condition: bool, message: str) -> None:
    if not condition:
        raise InputError(message)


def emit(result: Any, render: Callable[[Any, Console], None], *, as_json: bool) -> int:
    """Print a command's result: ``result.to_dict()`` as one JSON object, or ``render`` on the console."""
    if as_json:
        print_json(result.to_dict())
    else:
        render(result, make_console())
    return 0
