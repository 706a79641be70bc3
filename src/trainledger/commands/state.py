"""``trainledger state``: persistent training state from a model, or declared from a stated format."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.text import Text

from trainledger.commands.common import add_json_flag, add_model_flag, count_arg, emit
from trainledger.declared import OPTIMIZER_ARRAYS, StateSpec
from trainledger.errors import InputError
from trainledger.report.terminal import (
    UNITS_NOTE,
    both_units,
    category_table,
    notes_text,
    payload_text,
    peak_text,
    print_renderables,
)
from trainledger.state import StateResult, spec_state, workload_state
from trainledger.units import parse_dtype
from trainledger.workload import load_workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "state",
        help="weights, gradients, optimizer state and master copies, each with its real precision",
        description="Persistent training state of a model (--model) or of a stated format (--params ...).",
    )
    add_model_flag(p)
    p.add_argument("--no-step", action="store_true", help="inventory the model as built, without one step")
    add_spec_flags(p.add_argument_group("a declared format instead of a model"))
    add_json_flag(p)
    p.set_defaults(run=run)


def add_spec_flags(group: argparse._ActionsContainer) -> None:
    """The flags of a declared format (``--params`` and each array's precision); ``shard`` uses them too."""
    group.add_argument("--params", type=count_arg("--params"), help="trainable parameters: 1e9, 7B, 125M")
    group.add_argument("--weights", default="bf16", help="weight precision (default bf16)")
    group.add_argument("--grads", default=None, help="gradient precision (default: as weights; 'none' to omit)")
    group.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZER_ARRAYS)} (default adamw)")
    group.add_argument("--moments", default="fp32", help="optimizer state precision (default fp32)")
    group.add_argument("--master", default=None, help="precision of a master copy of the weights (e.g. fp32)")
    group.add_argument("--frozen-params", type=count_arg("--frozen-params"), default=0, help="frozen weights")


def spec_from_args(args: argparse.Namespace) -> StateSpec:
    """The :class:`StateSpec` the flags of :func:`add_spec_flags` describe."""
    grads = args.grads if args.grads in (None, "none") else parse_dtype(args.grads)
    return StateSpec(
        num_params=args.params,
        weights=args.weights,
        grads=grads,
        optimizer=args.optimizer,
        moments=args.moments,
        master=args.master,
        frozen_params=args.frozen_params,
    )


def compute(args: argparse.Namespace) -> StateResult:
    if args.model and args.params:
        raise InputError("give either --model or --params, not both")
    if args.model:
        return workload_state(load_workload(args.model), take_step=not args.no_step)
    if not args.params:
        raise InputError("give --model NAME|file.py:factory, or --params N with the formats (see --help)")
    return spec_state(spec_from_args(args))


def run(args: argparse.Namespace) -> int:
    result = compute(args)
    return emit(result, render, as_json=args.json)


def render(result: StateResult, console: Console) -> None:
    led = result.ledger
    rc = result.recovery
    lines = [
        f"recovery checkpoint (durable state for a restart; not activation checkpointing): "
        f"{rc.bytes:,} bytes ({both_units(rc.bytes)})"
        + (
            f"; frozen weights {rc.frozen_bytes:,} bytes reloadable from their source, not included"
            if rc.frozen_bytes
            else ""
        )
    ]
    if result.num_graph_nodes is not None:
        lines.append(
            f"autograd graph nodes one step creates: {result.num_graph_nodes} (a node count: not FLOPs, not bytes)"
        )
    print_renderables(
        category_table(led, title=f"persistent state — {result.source}"),
        payload_text(result.payload),
        peak_text(led.peak(), evidence=str(led.evidence), maxima=led.category_maxima(), single_instant=True),
        Text("\n".join(lines)),
        notes_text([*led.notes, UNITS_NOTE]),
        console=console,
    )
