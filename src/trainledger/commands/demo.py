"""``trainledger demo``: the main job on built-in examples, no arguments needed."""

from __future__ import annotations

import argparse

from rich.rule import Rule
from rich.text import Text

from trainledger.commands import state as state_cmd
from trainledger.commands import trace as trace_cmd
from trainledger.examples import gpt_tiny, seed_423
from trainledger.report.terminal import make_console
from trainledger.state import workload_state

NEXT_STEPS = """\
next:
  trainledger trace --model gpt-tiny --plot step.png      the same trace as a picture
  trainledger trace --model gpt-tiny --measure            beside the allocator's own counters
  trainledger state --params 7e9 --weights bf16 --master fp32 --optimizer adamw
  trainledger state --model path/to/your_file.py:factory  your own model (factory() returns trainledger.Workload)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run trainledger on its built-in examples")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from trainledger.trace import TraceReport, trace

    console = make_console()
    console.print(Rule("1. persistent state: the seed's 423 float64 parameters, Adam, a frozen reference copy"))
    state_cmd.render(workload_state(seed_423()), console)
    console.print(Rule("2. one traced training step of a small GPT: what is live at the peak instant"))
    trace_cmd.render(TraceReport.of(trace(gpt_tiny())), console)
    console.print(Text(NEXT_STEPS))
    return 0
