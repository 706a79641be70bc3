"""``trainledger shard``: per-rank memory and communication of ZeRO/FSDP, predicted or run for real."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainledger.commands import state as state_cmd
from trainledger.commands._gpu import Target, add_device_flags, device_line, reserved_text
from trainledger.commands.common import (
    add_json_flag,
    add_model_flag,
    emit,
    flags_verb,
    positive_float,
    positive_int,
    print_json,
)
from trainledger.devices import Device, kernel_kind
from trainledger.errors import InputError
from trainledger.report.terminal import (
    UNITS_NOTE,
    both_units,
    category_table,
    make_console,
    notes_text,
    print_renderables,
)
from trainledger.shard import (
    ENGINES,
    CommTime,
    ShardConfig,
    ShardReport,
    ShardSummary,
    estimate_time,
    parse_strategy,
    shard,
)
from trainledger.state import spec_state
from trainledger.units import format_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "shard",
        help="ZeRO stages 0-3 and FSDP: each rank's memory and the communication, predicted or run",
        description="Per-rank memory and communication of ZeRO/FSDP, from a declared format (--params), "
        "a traced model (--model), or a real multi-process run (--model ... --run).",
    )
    add_model_flag(p, unless="--params")
    p.add_argument("--world", type=positive_int(), default=2, help="number of ranks (default 2)")
    p.add_argument(
        "--stage",
        default="3",
        help="ZeRO stage 0, 1, 2, 3, or full_shard, shard_grad_op, hybrid_shard, or 'all' (default 3)",
    )
    p.add_argument(
        "--nodes", type=positive_int(), default=None, help="with --stage hybrid_shard: number of nodes (default 1)"
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="padding and buffers of deepspeed or torch (default: deepspeed for --params, torch for --model)",
    )
    p.add_argument(
        "--prefetch",
        type=positive_int(minimum=0),
        default=None,
        help="with a traced --model: units gathered ahead in backward (default 1)",
    )
    p.add_argument(
        "--link-gbps",
        type=positive_float,
        default=None,
        help="link bandwidth (Gbit/s) to estimate time (default: no time estimate)",
    )
    p.add_argument(
        "--run", dest="run_ranks", action="store_true", help="run the ranks on torch.distributed and trace each"
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help=f"with --run: seconds before every rank is stopped (default {RUN_TIMEOUT_SECONDS:g})",
    )
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="with --run: gloo on CPU (default) or nccl, one GPU a rank",
    )
    p.add_argument(
        "--device-kind",
        default=None,
        choices=("cpu", "cuda"),
        metavar="KIND",
        help="with a traced --model: whose kernels, cpu (default, the ones that run here) or cuda (the step as "
        "PyTorch's CUDA kernels would run it, on fake tensors; the card is --device's, default an H100)",
    )
    add_device_flags(p)
    state_cmd.add_spec_flags(p.add_argument_group("a declared format instead of a model (as `trainledger state`)"))
    add_json_flag(p)
    p.set_defaults(run=run)


RUN_TIMEOUT_SECONDS = 300.0
RUN_ONLY = ("timeout", "backend")
"""Flags of a real run: refused without ``--run``, which alone uses them."""
PREDICTION_ONLY = ("engine", "prefetch", "link_gbps", "nodes")
"""Flags of the prediction: refused with ``--run``, which runs PyTorch's own engines as they are."""


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n) is not None]


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that would be ignored, naming them: each applies to one way of running ``shard``."""
    if args.model and args.params:
        raise InputError("give either --model or --params, not both")
    if args.model and state_cmd.spec_flags_given(args):
        flags = flags_verb(state_cmd.spec_flags_given(args), "applies", "apply")
        raise InputError(f"{flags} only to a declared format (--params); --model is traced as it is: drop them")
    if args.device_kind is not None and args.run_ranks:
        raise InputError(
            f"--device-kind {args.device_kind} shapes a trace on fake tensors; --run runs the ranks on this machine's "
            "kernels: drop one of them"
        )
    if args.device_kind is not None and not args.model:
        raise InputError(
            f"--device-kind {args.device_kind} applies to a traced --model (a declared format has no kernels)"
        )
    if args.run_ranks:
        if _given(args, PREDICTION_ONLY):
            flags = flags_verb(_given(args, PREDICTION_ONLY), "shapes", "shape")
            raise InputError(f"{flags} the prediction; --run runs PyTorch's own engines: drop them")
    elif _given(args, RUN_ONLY):
        raise InputError(
            f"{flags_verb(_given(args, RUN_ONLY), 'applies', 'apply')} only with --run: add it or drop them"
        )
    if args.nodes is not None and args.stage.strip().lower().replace("-", "_") != "hybrid_shard":
        raise InputError(
            f"--nodes {args.nodes} plays a part only with --stage hybrid_shard (shard within a node, replicate "
            "across nodes): drop it or use that stage"
        )
    if args.prefetch is not None and not args.model:
        raise InputError("--prefetch applies to a traced --model (a declared format has no timeline): drop it")


def compute(args: argparse.Namespace) -> ShardReport:
    check_flags(args)
    stages = ["zero0", "zero1", "zero2", "zero3"] if args.stage == "all" else [parse_strategy(args.stage)]
    compute_seconds = None
    fsdp_facts: dict[str, Any] = {}
    if args.model:
        from trainledger.shard.launch import reference_step

        cuda = args.device_kind == "cuda"
        ref = reference_step(
            args.model,
            # the phases' times are this machine's kernels': a CUDA-kind step has none (all exposed)
            time_phases=args.link_gbps is not None and not cuda,
            kernel_kind="cuda" if cuda else "cpu",
            cuda_device=args.device if cuda else None,
            world_size=args.world,
        )
        how = "with cuda kernels on fake tensors" if cuda else "in one process"
        ledger, source, engine = ref.ledger, f"{args.model}, traced {how}", args.engine or "torch"
        compute_seconds = ref.phase_seconds.measured() if ref.phase_seconds is not None else None
        fsdp_facts = {"units": ref.units, "late_units": ref.late_units}
    elif args.params:
        result = spec_state(state_cmd.spec_from_args(args))
        ledger, source, engine = result.ledger, result.source, args.engine or "deepspeed"
    else:
        raise InputError("give --model NAME|file.py:factory, or --params N with the formats (see --help)")
    results, times, reserved = [], [], []
    target = Target.of(args)
    for strategy in stages:
        config = ShardConfig(
            world_size=args.world,
            strategy=strategy,
            engine=engine,
            num_nodes=args.nodes or 1,
            backward_prefetch=1 if args.prefetch is None else args.prefetch,
            **fsdp_facts,
        )
        res = shard(ledger, config)
        results.append(res.summary())
        rank0 = res.ranks[0]
        reserved.append(target.predict(rank0, kernel_kind=kernel_kind(rank0.device)))
        times.append(
            estimate_time(res.collectives, link_gbps=args.link_gbps, compute_seconds=compute_seconds)
            if args.link_gbps is not None and res.collectives
            else None
        )
    return ShardReport(source, tuple(results), tuple(times), tuple(reserved) if target.allocator else ())


def run(args: argparse.Namespace) -> int:
    if args.run_ranks:
        return _run_for_real(args)
    device = args.device
    return emit(compute(args), lambda r, console: render(r, console, device=device), as_json=args.json)


def render(report: ShardReport, console: Console, *, device: Device | None = None) -> None:
    items: list[Any] = [Text(device_line(device))] if device is not None else []
    if len(report.results) > 1:
        items.append(_stages_table(report))
    else:
        res = report.results[0]
        items.append(
            category_table(
                res.rank0_groups,
                title=f"rank 0 of {res.world_size:,}, {res.label}",
                single_instant=res.rank0.num_events <= 1,
            )
        )
        items.append(ranks_text(res))
    items.append(collectives_table(report.results[-1], report.times[-1]))
    for res, pred in zip(report.results, report.reserved, strict=False):
        if pred is not None:
            items += [Text(f"{res.label}, rank 0:"), reserved_text(pred, device)]
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
    """One line per class of identical ranks (uneven partitions make the last ranks differ), eight at most."""
    single = res.source_single_instant
    what = "model states" if single else "predicted peak"
    lines = []
    for rank in res.ranks[:8]:
        pk, first, last, count = rank.peak, rank.rank, rank.last_rank, rank.num_ranks
        where = "" if single else f" at event {pk.event} ({pk.phase}, {pk.op})"
        who = f"rank {first}" if count == 1 else f"ranks {first:,}-{last:,} ({count:,} ranks, identical)"
        if count > 1 and last - first + 1 != count:
            who = f"ranks {first:,}-{last:,} of each shard group ({count:,} ranks, identical)"
        kinds = "" if single else f" ({kernel_kind(res.rank0.device)} kernels)"
        lines.append(f"{who}: {what} {pk.bytes:,} bytes ({both_units(pk.bytes)}){kinds}{where}")
    if len(res.ranks) > 8:
        largest = max(rank.peak.bytes for rank in res.ranks)
        lines.append(f"… {len(res.ranks) - 8} more classes of ranks (largest {largest:,} bytes)")
    return Text("\n".join(lines))


def collectives_table(res: ShardSummary, t: CommTime | None) -> Table:
    """The collectives one rank runs per step, with the bytes it sends (and their time, when estimated)."""
    table = Table(title="collectives per rank per step", title_justify="left")
    numeric = ("calls", "payload bytes", "wire bytes sent")
    for col in ("kind", "phase", "moves", *numeric):
        table.add_column(col, justify="right" if col in numeric else "left")
    for c in res.collectives[:40]:
        table.add_row(c.kind, c.phase, c.label, str(c.num_calls), f"{c.payload_bytes:,}", f"{c.wire_bytes:,}")
    total = sum(c.wire_bytes for c in res.collectives)
    caption = (
        "payload bytes: what each call is handed (all-gather: its output, reduce-scatter: its input); "
        f"wire bytes: what a rank sends over the link with ring algorithms, in all {total:,} bytes "
        f"({both_units(total)})"
    )
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
        raise InputError("--run needs a model to run: give --model NAME|file.py:factory (a declared format has none)")
    check_flags(args)
    strategy = parse_strategy(args.stage) if args.stage != "all" else None
    if strategy is None:
        raise InputError("--run takes one --stage (0, 1, 2 or 3), not 'all'")
    config = RunConfig(
        model=args.model,
        world_size=args.world,
        strategy=strategy,
        backend=args.backend or "gloo",
        timeout_seconds=args.timeout or RUN_TIMEOUT_SECONDS,
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
    for col in ("rank", "predicted peak", "traced peak", "error", "collective payload bytes", "wait", "step"):
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
        f"collective payload bytes: what each c10d call of one step is handed, counted (predicted {predicted:,}; "
        "not wire bytes, which `shard` without --run reports beside them); "
        "wait: time inside collectives and waiting on them; step: one untraced step"
    )
    print_renderables(table, notes_text([*d.get("run_notes", ()), UNITS_NOTE]), console=console)
