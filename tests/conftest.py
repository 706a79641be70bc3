"""Shared helpers for the tests."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys

import pytest

from trainledger.ledger import Ledger


@pytest.fixture
def signals_not_ignored():
    """SIGINT and SIGHUP as a terminal's shell leaves them, for the tests of what a signal does. A test run started in
    the background (``nohup``, or ``cmd &`` in a script) ignores both, its children inherit that, and trainledger
    rightly keeps ignored a signal its process began ignoring: those tests would see the command finish untouched."""
    ignored = [s for s in (signal.SIGINT, signal.SIGHUP) if signal.getsignal(s) is signal.SIG_IGN]
    for s in ignored:
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    yield
    for s in ignored:
        signal.signal(s, signal.SIG_IGN)


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process: returns (exit status, stdout, stderr)."""
    from trainledger.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own exits (usage errors, --help)
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def cli_json(cli):
    def run(*argv: str) -> dict:
        code, out, err = cli(*argv, "--json")
        assert code == 0, err
        return json.loads(out)

    return run


def run_subprocess(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real console entry point in a fresh process (as a user runs it)."""
    return subprocess.run(
        [sys.executable, "-m", "trainledger.cli", *argv], capture_output=True, text=True, timeout=timeout
    )


@functools.cache
def traced_example(name: str) -> Ledger:
    """``trace(examples.build(name))``, traced once per run: a ledger is frozen, so the tests that read the plain
    real trace of the same built-in example share it (each of them still traces its own variants)."""
    from trainledger.examples import build
    from trainledger.trace import trace

    return trace(build(name))
