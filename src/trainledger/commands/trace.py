"""``trainledger trace``: trace one training step and report its true simultaneous peak."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from rich.console import Console
from rich.text import Text

from trainledger.commands._hfstep import add_step_source_flags, workload_for
from trainledger.commands._stacked import trace_hf_stacked
from trainledger.commands.common import add_json_flag, input_paths, print_json
from trainledger.errors import InputError
from trainledger.report.exports import ExportPaths, check_export_paths, write_exports
from trainledger.report.terminal import (
    UNITS_NOTE,
    both_units,
    largest_live_table,
    make_console,
    notes_text,
    peak_table,
    peak_text,
    print_renderables,
)
from trainledger.shard import parse_strategy
from trainledger.trace import TraceReport


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="trace one training step: every tensor's lifetime and the true simultaneous peak",
        description="Trace one steady-state training step (after a warm-up step) tensor by tensor.",
    )
    add_step_source_flags(p)
    p.add_argument(
        "--full-depth",
        action="store_true",
        help="with --hf-config and --fake: trace every layer, not 3 and 4 layers extended to the full depth",
    )
    p.add_argument("--measure", action="store_true", help="also run the real step with the allocator's counters")
    p.add_argument("--plot", metavar="FILE", help="write a timeline picture (.png or .svg)")
    p.add_argument("--export-memory-viz", metavar="FILE", help="write a PyTorch memory snapshot (.pickle)")
    p.add_argument("--export-perfetto", metavar="FILE", help="write a Chrome/Perfetto trace (.json)")
    p.add_argument("--export-json", metavar="FILE", help="write the ledger, every entry with its interval (.json)")
    p.add_argument(
        "--html", metavar="FILE", help="write a self-contained HTML page: timeline, live arrays, sortable tables"
    )
    add_json_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from trainledger.trace import trace

    if args.measure and args.fake:
        raise InputError("--measure runs the real step, --fake a step on fake tensors: drop one of them")
    outputs = _check_outputs(args)
    strategy = parse_strategy(args.stage)
    if args.full_depth and not (args.hf_config and args.fake):
        raise InputError("--full-depth applies to a fake trace of a Hugging Face config: add --hf-config and --fake")
    stacked = args.hf_config and args.fake and not (args.full_depth or args.model)
    workload = None if stacked else workload_for(args)
    err = Console(stderr=True)
    with _progress(err, quiet=not err.is_terminal) as progress:
        if workload is None:
            build_at = partial(workload_for, args)  # the same step, from the config at another depth
            ledger, num_params = trace_hf_stacked(args.hf_config, lambda cfg: build_at(config=cfg), progress=progress)
        else:
            num_params = sum(p.numel() for p in workload.model.parameters())
            ledger = trace(workload, fake=args.fake, progress=progress)
        measurement = None
        if args.measure and workload is not None:
            from trainledger.measure import measure

            measurement = measure(workload)
    sharded = None
    if args.world > 1 or strategy != "zero0":
        from trainledger.shard import shard

        sharded = shard(ledger, world_size=args.world, strategy=strategy).summary()
    written = list(write_exports(ledger, outputs).values())
    report = TraceReport.of(
        ledger,
        num_params=num_params,
        measured=measurement.summary() if measurement is not None else None,
        sharded=sharded,
    )
    if args.json:
        out = report.to_dict()
        out["written"] = [str(p) for p in written]
        print_json(out)
        return 0
    render(report, make_console(), written=written)
    return 0


def render(report: TraceReport, console: Console, *, written: Sequence[str] = ()) -> None:
    """Print a traced step: the peak, the breakdown at that instant, the largest arrays live then."""
    led = report.ledger
    pk = led.peak
    over = led.sum_of_category_maxima - pk.bytes
    phases = ", ".join(f"{k} {v}" for k, v in led.meta.get("events_per_phase", {}).items())
    lines = [
        f"model {led.meta.get('model') or '?'}{' (fake tensors)' if led.meta.get('fake') else ''}: "
        f"{led.num_events:,} events ({phases}), {report.num_entries:,} storages"
    ]
    items: list[Any] = [
        Text("\n".join(lines)),
        peak_text(pk, evidence=str(led.evidence), maxima=led.category_maxima, single_instant=False),
        peak_table(led),
        Text(
            f"summing category maxima would claim {led.sum_of_category_maxima:,} bytes: "
            f"{over:,} bytes ({100 * over / max(pk.bytes, 1):.1f}%) more than was ever live at once"
        ),
        largest_live_table(report.largest_live, pk.event),
    ]
    m = report.measured
    if m is not None:
        items.append(
            Text(
                f"measured peak {m.peak_bytes:,} bytes ({both_units(m.peak_bytes)}), evidence measured on {m.device}"
                f" (start from {m.start_source}); traced {m.traced_peak.bytes:,}; workspace not visible as tensors "
                f"{m.unseen_workspace_bytes:,} bytes (kernel-internal buffers, allocator rounding)"
                + (f"; reserved peak {m.reserved_peak_bytes:,}" if m.reserved_peak_bytes is not None else "")
                + "\nstep time {1:.2f} ms median, {0:.2f} fastest, {2:.2f} slowest".format(
                    *(t * 1e3 for t in m.step_spread_seconds)
                )
                + f" over {len(m.step_seconds)} untraced steps"
                + (f" on {m.step_threads} intra-op thread(s)" if m.step_threads else "")
            )
        )
    items += [Text(f"wrote {p}") for p in written]
    items.append(notes_text([*led.notes, UNITS_NOTE]))
    print_renderables(*items, console=console)
    if report.sharded is not None:
        from trainledger.commands.shard import collectives_table, ranks_text

        sh = report.sharded
        head = Text(f"sharded as {sh.label} over {sh.world_size} ranks, predicted from this trace:")
        print_renderables(head, ranks_text(sh), collectives_table(sh, None), console=console)


def _check_outputs(args: argparse.Namespace) -> ExportPaths:
    """Validate every output path before the (possibly long) trace runs."""
    return check_export_paths(
        plot=args.plot,
        memory_viz=args.export_memory_viz,
        perfetto=args.export_perfetto,
        ledger_json=args.export_json,
        html=args.html,
        protect=input_paths(args),
    )


@contextmanager
def _progress(console: Console, *, quiet: bool) -> Iterator[Callable[[str, int], None] | None]:
    """A status line on stderr while a long trace runs (nothing when stderr is not a terminal)."""
    if quiet:
        yield None
        return
    with console.status("tracing…") as status:

        def update(phase: str, num_events: int) -> None:
            status.update(f"tracing: {phase}, {num_events:,} events")

        yield update
