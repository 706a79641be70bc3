"""``trainledger shard``: per-rank memory and communication of ZeRO/FSDP, predicted or run for real."""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainledger.commands import state as state_cmd
from trainledger.commands.common import add_json_flag, add_model_flag, emit, positive_int, print_json
from trainledger.errors import InputError
from trainledger.report.terminal import (
    UNITS_NOTE,
    both_units,
    category_table,
    make_console,
    notes_text,
    print_renderables,
)
from trainledger.shard import ShardReport, ShardSummary
from trainledger.shard.comm import CommTime, estimate_time
from trainledger.shard.transform import ENGINES, ShardConfig, parse_strategy, shard
from trainledger.state import spec_state
from trainledger.units import format_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "shard",
        help="ZeRO stages 0-3 and FSDP: each rank's memory and the communication, predicted or run",
        description="Per-rank memory and communication of ZeRO/FSDP, from a declared format (--params), "
        "a traced model (--model), or a real multi-process run (--model ... --run).",
    )
    add_model_flag(p)
    p.add_argument("--world", type=positive_int("--world"), default=2, help="number of ranks (default 2)")
    p.add_argument(
        "--stage",
        default="3",
        help="ZeRO stage 0, 1, 2, 3, or full_shard, shard_grad_op, hybrid_shard, or 'all' (default 3)",
    )
    p.add_argument("--nodes", type=positive_int("--nodes"), default=1, help="hybrid_shard: number of nodes")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="padding and buffers of deepspeed or torch (default: deepspeed for --params, torch for --model)",
    )
    p.add_argument("--prefetch", type=int, default=1, help="units gathered ahead in backward (default 1)")
    p.add_argument("--link-gbps", type=float, default=None, help="link bandwidth (Gbit/s) to estimate time")
    p.add_argument(
        "--run", dest="run_ranks", action="store_true", help="run the ranks on torch.distributed and trace each"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="--run: seconds before every rank is stopped")
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="--run: gloo on CPU (default) or nccl, one GPU a rank",
    )
    state_cmd.add_spec_flags(p.add_argument_group("a declared format instead of a model (as `trainledger state`)"))
    add_json_flag(p)
    p.set_defaults(run=run)


def compute(args: argparse.Namespace) -> ShardReport:
    if args.model and args.params:
        raise InputError("give either --model or --params, not both")
    stages = ["zero0", "zero1", "zero2", "zero3"] if args.stage == "all" else [parse_strategy(args.stage)]
    if args.prefetch < 0:
        raise InputError(f"--prefetch {args.prefetch} must be 0 or more units")
    compute_seconds = None
    fsdp_facts: dict[str, Any] = {}
    if args.model:
        from trainledger.shard.launch import _units_of, late_units
        from trainledger.trace import trace
        from trainledger.workload import load_workload

        workload = load_workload(args.model)
        ledger = trace(workload)
        source = f"{args.model}, traced in one process"
        engine = args.engine or "torch"
        compute_seconds = _phase_seconds(workload) if args.link_gbps is not None else None
        units = _units_of(workload.model)
        fsdp_facts = {"units": units, "late_units": late_units(workload, units)}
    elif args.params:
        result = spec_state(state_cmd.spec_from_args(args))
        ledger, source, engine = result.ledger, result.source, args.engine or "deepspeed"
    else:
        raise InputError("give --model NAME|file.py:factory, or --params N with the formats (see --help)")
    results, times = [], []
    for strategy in stages:
        config = ShardConfig(
            world_size=args.world,
            strategy=strategy,
            engine=engine,
            num_nodes=args.nodes,
            backward_prefetch=args.prefetch,
            **fsdp_facts,
        )
        res = shard(ledger, config)
        results.append(res.summary())
        times.append(
            estimate_time(res.collectives, link_gbps=args.link_gbps, compute_seconds=compute_seconds)
            if args.link_gbps is not None and res.collectives
            else None
        )
    return ShardReport(source, tuple(results), tuple(times))


def _phase_seconds(workload: Any) -> dict[str, float]:
    """Wall time of each phase of one untraced step (the compute collectives can hide behind)."""
    import time

    from trainledger.workload import run_step

    marks: list[tuple[str, float]] = []
    run_step(workload, on_phase=lambda phase: marks.append((phase, time.perf_counter())))
    return {a: t1 - t0 for (a, t0), (_, t1) in itertools.pairwise(marks)}


def run(args: argparse.Namespace) -> int:
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise InputError(f"--link-gbps {args.link_gbps} must be a positive bandwidth in gigabits per second")
    if args.run_ranks:
        return _run_for_real(args)
    return emit(compute(args), render, as_json=args.json)


def render(report: ShardReport, console: Console) -> None:
    items: list[Any] = []
    if len(report.results) > 1:
        items.append(_stages_table(report))
    else:
        res = report.results[0]
        items.append(category_table(res.rank0_groups, title=f"rank 0 of {res.world_size}, {res.label}"))
        items.append(ranks_text(res))
    items.append(collectives_table(report.results[-1], report.times[-1]))
    notes = []
    for r in report.results:
        notes += [n for n in r.notes if n not in notes]
    items.append(notes_text([*notes, *report.results[0].source_notes, UNITS_NOTE]))
    print_renderables(*items, console=console)


def _stages_table(report: ShardReport) -> Table:
    res0 = report.results[0]
    table = Table(title=f"{report.source}, {res0.world_size} ranks: per rank", title_justify="left")
    for col in ("stage", "weights", "gradients", "optimizer", "model states", "comm / rank", "excludes"):
        table.add_column(col, justify="left" if col in ("stage", "excludes") else "right")
    for res, t in zip(report.results, report.times, strict=True):
        by = res.ranks[0].by_category
        excluded = [short for key, short in _SHORT_EXCLUDED if any(key in n for n in res.notes)]
        if res.source_single_instant:
            excluded.append("activations, workspace")
        comm = sum(c.wire_bytes for c in res.collectives)
        table.add_row(
            res.label,
            _gb(by.get("weights", 0) + by.get("frozen", 0)),
            _gb(by.get("gradients", 0)),
            _gb(by.get("optimizer", 0)),
            _gb(res.ranks[0].model_state_bytes),
            _gb(comm) + (f", {t.total_seconds:.3g} s" if t else ""),
            ", ".join(excluded),
        )
    return table


_SHORT_EXCLUDED = (
    ("reduce bucket", "reduce bucket"),
    ("DDP gradient buckets", "DDP buckets"),
    ("parameters gathered", "gathered params"),
)


def _gb(nbytes: int) -> str:
    return format_bytes(nbytes, binary=False)


def ranks_text(res: ShardSummary) -> Text:
    """Each rank's predicted peak (or model states, for a single instant), eight ranks at most."""
    peaks = [rank.peak for rank in res.ranks]
    single = res.source_single_instant
    what = "model states" if single else "predicted peak"
    lines = []
    for r, pk in enumerate(peaks[:8]):
        where = "" if single else f" at event {pk.event} ({pk.phase}, {pk.op})"
        lines.append(f"rank {r}: {what} {pk.bytes:,} bytes ({both_units(pk.bytes)}){where}")
    if len(peaks) > 8:
        lines.append(f"… {len(peaks) - 8} more ranks (largest {max(p.bytes for p in peaks):,} bytes)")
    return Text("\n".join(lines))


def collectives_table(res: ShardSummary, t: CommTime | None) -> Table:
    """The collectives one rank runs per step, with the bytes it sends (and their time, when estimated)."""
    table = Table(title="collectives per rank per step", title_justify="left")
    for col in ("kind", "phase", "moves", "calls", "payload", "sent per rank"):
        table.add_column(col, justify="right" if col in ("calls", "payload", "sent per rank") else "left")
    for c in res.collectives[:40]:
        table.add_row(c.kind, c.phase, c.label, str(c.num_calls), f"{c.payload_bytes:,}", f"{c.wire_bytes:,}")
    total = sum(c.wire_bytes for c in res.collectives)
    caption = f"sent per rank in all: {total:,} bytes ({both_units(total)}), ring algorithms"
    if t is not None:
        caption += (
            f"; at {t.link_gbps:g} Gbit/s: {t.total_seconds:.4g} s, not hidden behind compute "
            f"{t.exposed_seconds:.4g} s" + ("" if t.compute_seconds else " (no compute time known: all exposed)")
        )
    table.caption = caption
    return table


def _run_for_real(args: argparse.Namespace) -> int:
    from trainledger.shard.launch import RunConfig, run

    if not args.model:
        raise InputError("--run needs --model NAME|file.py:factory (a declared format has nothing to run)")
    strategy = parse_strategy(args.stage) if args.stage != "all" else None
    if strategy is None:
        raise InputError("--run takes one --stage (0, 1, 2 or 3), not 'all'")
    config = RunConfig(
        model=args.model, world_size=args.world, strategy=strategy, backend=args.backend, timeout_seconds=args.timeout
    )
    result = run(config)
    d = result.to_dict()
    if args.json:
        print_json(d)
        return 0
    render_run(d, make_console())
    return 0


def render_run(d: dict[str, Any], console: Console) -> None:
    """Print a real run (``RunResult.to_dict()``, as ``shard --run --json`` saves it): predicted against
    traced, per rank."""
    run = d["run"]
    table = Table(
        title=f"{run['model']}, {run['world_size']} ranks, {run['engine']}, {run['backend']}", title_justify="left"
    )
    for col in ("rank", "predicted peak", "traced peak", "error", "collective bytes", "wait", "step"):
        table.add_column(col, justify="right")
    for r in d["ranks"]:
        err = r["relative_error"]
        table.add_row(
            str(r["rank"]),
            f"{r['predicted_peak_bytes']:,}",
            f"{r['traced_peak_bytes']:,}" if r["traced_peak_bytes"] is not None else "-",
            f"{100 * err:+.2f}%" if err is not None else "-",
            f"{r['collective_bytes']:,}",
            f"{r['wait_seconds']:.3f} s",
            f"{r['step_seconds']:.3f} s",
        )
    predicted = d["ranks"][0]["predicted_collective_bytes"] if d["ranks"] else 0
    table.caption = (
        f"collective bytes: payload counted at every c10d call of one step (predicted {predicted:,}); "
        "wait: time inside collectives and waiting on them; step: one untraced step"
    )
    print_renderables(table, notes_text([*d.get("run_notes", ()), UNITS_NOTE]), console=console)
