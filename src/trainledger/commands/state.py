"""``trainledger state``: persistent training state from a model, or declared from a stated format."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.text import Text

from trainledger.commands.common import add_json_flag, add_model_flag, count_arg, count_or_zero_arg, emit, flags_verb
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
from trainledger.sources import load_workload
from trainledger.state import StateResult, spec_state, workload_state


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "state",
        help="weights, gradients, optimizer state and master copies, each with its real precision",
        description="Persistent training state of a model (--model) or of a stated format (--params ...).",
    )
    add_model_flag(p, unless="--params")
    p.add_argument(
        "--no-step", action="store_true", help="with --model: inventory the model as built, without one step"
    )
    add_spec_flags(p.add_argument_group("a declared format instead of a model"))
    add_json_flag(p)
    p.set_defaults(run=run)


DTYPES_HELP = "fp32, bf16, fp16, fp64, fp8 (e4m3, e5m2), int8"
SPEC_FLAGS = ("weights", "grads", "optimizer", "moments", "master", "frozen_params")
"""The precision flags of a declared format: defaults ``None`` so that a flag given beside ``--model``
(which would ignore it) is refused; :class:`StateSpec` supplies the defaults."""


def add_spec_flags(group: argparse._ActionsContainer) -> None:
    """The flags of a declared format (``--params`` and each array's precision); ``shard`` uses them too."""
    group.add_argument("--params", type=count_arg, help="trainable parameters: 1e9, 7B, 125M")
    group.add_argument("--weights", default=None, help=f"weight precision: {DTYPES_HELP} (default bf16)")
    group.add_argument("--grads", default=None, help="gradient precision (default: as weights; 'none' to omit)")
    group.add_argument("--optimizer", default=None, help=f"one of {', '.join(OPTIMIZER_ARRAYS)} (default adamw)")
    group.add_argument("--moments", default=None, help=f"optimizer state precision: {DTYPES_HELP} (default fp32)")
    group.add_argument("--master", default=None, help="precision of a master copy of the weights (default none)")
    group.add_argument("--frozen-params", type=count_or_zero_arg, default=None, help="frozen weights (default 0)")


def spec_flags_given(args: argparse.Namespace) -> list[str]:
    """The declared-format flags the user gave (as ``--flag``)."""
    return ["--" + k.replace("_", "-") for k in SPEC_FLAGS if getattr(args, k) is not None]


def spec_from_args(args: argparse.Namespace) -> StateSpec:
    """The :class:`StateSpec` the flags of :func:`add_spec_flags` describe (unset flags take its defaults)."""
    given = {k: getattr(args, k) for k in SPEC_FLAGS if getattr(args, k) is not None}
    spec = StateSpec(num_params=args.params, **given)
    if "moments" in given and not OPTIMIZER_ARRAYS[spec.optimizer]:
        raise InputError(f"--moments sets the precision of optimizer state, and {spec.optimizer} keeps none: drop it")
    return spec


def compute(args: argparse.Namespace) -> StateResult:
    if args.model and args.params:
        raise InputError("give either --model or --params, not both")
    if args.model:
        ignored = spec_flags_given(args)
        if ignored:
            raise InputError(
                f"{flags_verb(ignored, 'applies', 'apply')} only to a declared format (--params); "
                f"--model {args.model} is inventoried in its own precisions: drop them"
            )
        return workload_state(load_workload(args.model), take_step=not args.no_step)
    if not args.params:
        raise InputError("give --model NAME|file.py:factory, or --params N with the formats (see --help)")
    if args.no_step:
        raise InputError("--no-step applies to --model (a declared format takes no step): drop it")
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
