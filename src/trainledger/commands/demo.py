"""``trainledger demo``: the main job on built-in examples, no arguments needed."""

from __future__ import annotations

import argparse

from rich.rule import Rule

from trainledger.commands import state as state_cmd
from trainledger.examples import seed_423
from trainledger.report.terminal import make_console
from trainledger.state import workload_state


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run trainledger on its built-in examples")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    console = make_console()
    console.print(Rule("the seed's fixture: 423 float64 parameters, Adam, a frozen reference copy"))
    state_cmd.render(workload_state(seed_423()), console)
    return 0
