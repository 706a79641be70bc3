"""Snapshots that make interface changes show in review: every command's flags, and the seed's JSON.

Regenerate after an intended change with ``TRAINLEDGER_UPDATE_GOLDEN=1 python -m pytest tests/test_cli_snapshot.py``
and commit the files under ``tests/golden/``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from trainledger.cli import build_parser

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TRAINLEDGER_UPDATE_GOLDEN") == "1"


def flags() -> dict[str, list[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: sorted(opt for action in p._actions for opt in action.option_strings)
        for name, p in sorted(sub.choices.items())
    }


def check(name: str, value: object) -> None:
    path = GOLDEN / name
    text = json.dumps(value, indent=2, sort_keys=True) + "\n"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with TRAINLEDGER_UPDATE_GOLDEN=1"
    assert json.loads(path.read_text()) == json.loads(text), f"{name} changed; review, then regenerate"


def test_cli_flags_snapshot():
    check("cli_flags.json", flags())


@pytest.mark.parametrize("argv", [["state", "--model", "seed-423"], ["state", "--params", "1e9", "--master", "fp32"]])
def test_state_json_snapshot(cli_json, argv):
    d = cli_json(*argv)
    d.pop("meta", None)  # producer facts (model name, optimizer class) are not part of the schema
    check("state_" + "_".join(a.strip("-").replace(".", "") for a in argv[1:]) + ".json", d)
