"""Flags and printing shared by several subcommands."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

from trainledger.errors import InputError
from trainledger.report.terminal import make_console
from trainledger.units import parse_count, parse_size


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_model_flag(p: argparse.ArgumentParser, *, unless: str | None = None) -> None:
    """``--model``: required, or required unless ``unless`` (another source of the step) is given. argparse
    cannot say "one of these two", so the command checks it and the help says it."""
    need = f"required unless {unless} is given" if unless else "required"
    p.add_argument(
        "--model",
        metavar="NAME|FILE.py:FACTORY",
        help=f"({need}) a built-in example (seed-423, gpt-tiny, mlp, cnn, lstm, moe, dpo, lora, autocast-bf16, "
        "bf16-master, unet-small) or your file.py:factory returning a trainledger.Workload",
    )


def input_paths(args: argparse.Namespace) -> list[str]:
    """The files the user gave as inputs (a model file, a config): outputs must never overwrite them. A
    config given as a folder is read from its ``config.json``: that file is the input."""
    spec = getattr(args, "model", None) or ""
    given = [spec.rpartition(":")[0]] if ":" in spec else []
    for config in (getattr(args, "hf_config", None), getattr(args, "diffusers_config", None)):
        if config:
            given.append(str(Path(config) / "config.json") if Path(config).is_dir() else config)
    if getattr(args, "plan", None):  # trace --plan FILE
        given.append(args.plan)
    return given


def flags_verb(flags: list[str], singular: str, plural: str) -> str:
    """``--a applies`` or ``--a, --b apply``: the flags a message names, with its verb agreeing."""
    return f"{', '.join(flags)} {singular if len(flags) == 1 else plural}"


@contextlib.contextmanager
def private_tmpdir(prefix: str = "trainledger-") -> Iterator[Path]:
    """A temporary folder of the command's own, named by ``TMPDIR`` (and ``tempfile``) for the duration
    and removed afterwards with whatever was left in it: libraries that write scratch files and delete
    them only on success (a MILP solver's ``.mps``/``.sol`` files) leave nothing behind when the
    command is interrupted."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    keys = ("TMPDIR", "TMP", "TEMP")
    saved_env = {k: os.environ.get(k) for k in keys}
    saved_tempdir = tempfile.tempdir
    try:
        os.environ.update(dict.fromkeys(keys, str(folder)))
        tempfile.tempdir = str(folder)
        yield folder
    finally:
        tempfile.tempdir = saved_tempdir
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(folder, ignore_errors=True)


_JSON_STDOUT: list[TextIO] = []  # while a --json command runs: where its one JSON object goes


@contextlib.contextmanager
def stdout_for_json_only() -> Iterator[None]:
    """While a ``--json`` command runs, what else is printed to stdout (a factory, model or loss that
    prints) goes to stderr, so that stdout holds the one JSON object :func:`print_json` writes."""
    _JSON_STDOUT.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _JSON_STDOUT.pop()


def print_json(obj: dict[str, Any]) -> None:
    out = _JSON_STDOUT[-1] if _JSON_STDOUT else sys.stdout
    json.dump(obj, out, indent=2)
    out.write("\n")


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=`` from a parser raising :class:`InputError`: its message becomes argparse's one line."""

    def parse_arg(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_arg.__name__ = parse.__name__
    return parse_arg


def parse_torch_device(text: str) -> str:
    """A device PyTorch names (``cpu``, ``cuda``, ``cuda:1``), as typed."""
    import torch

    try:
        torch.device(text)
    except (RuntimeError, TypeError):
        raise InputError(f"{text!r} is no device PyTorch knows; give e.g. cpu or cuda") from None
    return text


count_arg = argparse_type(parse_count)
"""A positive count (``1e9``, ``7B``), parsed exactly."""


def parse_count_or_zero(text: str) -> int:
    return parse_count(text, zero=True)


count_or_zero_arg = argparse_type(parse_count_or_zero)
"""A count that may be 0 (``--frozen-params``, whose default is 0)."""
size_arg = argparse_type(parse_size)
"""A size (``12GB``, ``11.2GiB``, bytes)."""


def parse_device_memory(text: str) -> int:
    """A device's memory: a size, where a bare number too small to hold any step (``80``) is refused as a size that
    lost its unit, not taken as bytes."""
    nbytes = parse_size(text)
    if _NUMBER.match(text) and nbytes < 1 << 20:
        number = text.strip()
        raise InputError(f"{number!r} would be {nbytes:,} bytes; give a size with its unit ({number}GiB or {number}GB)")
    return nbytes


device_memory_arg = argparse_type(parse_device_memory)
"""A device's memory (``80GiB``); a bare number under 1 MiB is refused."""

_NUMBER = re.compile(r"^\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*$")


def positive_int(*, minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum`` (``4096``, and ``1e6`` too); the limits of
    each quantity are the library's to check (they hold for Python callers too)."""

    def whole(text: str) -> int:
        value = Decimal(text) if _NUMBER.match(text) else None
        if value is None or value != value.to_integral_value():
            raise InputError(f"{text!r} is not a whole number; give e.g. {max(minimum, 1) * 8}")
        shown = text.strip()  # as typed
        if value < minimum:
            raise InputError(f"{shown} must be at least {minimum:,}")
        if value.adjusted() > 30:
            raise InputError(f"{shown} is far too large for a count here; give a whole number such as 8")
        return int(value)

    return argparse_type(whole)


def positive_float(text: str) -> float:
    """An argparse type: a finite number above zero (bandwidths, rates, seconds)."""
    value = float(text) if _NUMBER.match(text) else None
    if value is not None and math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is too large to be a number here; give e.g. 400 or 2.5")
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0; give e.g. 400 or 2.5")
    return value


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
