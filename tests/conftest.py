"""Shared helpers for the tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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
