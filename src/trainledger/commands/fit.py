"""``trainledger fit``: the configurations of a step that fit a device, best first, and what overflows."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainledger.allocator import AllocatorConfig
from trainledger.analytic import RECIPES, Candidate, FitOptions, FitResult, Setup, fit, with_traced_peaks
from trainledger.commands._gpu import device_line
from trainledger.commands.common import (
    add_json_flag,
    device_memory_arg,
    emit,
    positive_float,
    positive_int,
    size_arg,
)
from trainledger.commands.estimate import add_setup_flags, check_analytic_family, check_lora_flags, setup_from
from trainledger.devices import Device
from trainledger.errors import InputError
from trainledger.report.terminal import UNITS_NOTE, both_units, notes_text, print_renderables
from trainledger.units import format_bytes

DEFAULT_RECIPES = "bf16-master,bf16"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fit",
        help="which micro-batch, ZeRO stage, rematerialization and precision fit a device, best first",
        description="Search micro-batch × ZeRO stage × rematerialization × precision recipe with the analytic "
        "model; list what fits with its predicted peak and relative step cost, and what does not, by how much.",
    )
    add_setup_flags(
        p, micro_batch=False, dtype_help="search this one recipe: bf16-master, bf16 or fp32 (default: --recipes)"
    )
    p.add_argument("--device-memory", type=device_memory_arg, default=None, help="e.g. 80GiB, 24GB (or --device NAME)")
    p.add_argument(
        "--budget-on",
        default=None,
        choices=("allocated", "reserved"),
        help="what must fit: the peak of allocated bytes, or the caching allocator's predicted reserved bytes "
        "(default reserved with --device or --allocator, else allocated)",
    )
    p.add_argument("--reserve", type=size_arg, default=None, help="memory kept free (default none)")
    p.add_argument("--micro-batches", default="1,2,4,8,16,32", help="micro-batch sizes to try (default 1,2,4,8,16,32)")
    p.add_argument(
        "--recipes",
        default=None,
        help="precision recipes to try, comma-separated: bf16-master, bf16, fp32 (default bf16-master,bf16)",
    )
    p.set_defaults(dtype=None)  # --dtype R searches that one recipe; without it --recipes (or its default)
    p.add_argument(
        "--tflops", type=positive_float, default=400.0, help="sustained TFLOP/s per device, for the cost (default 400)"
    )
    p.add_argument(
        "--link-gbps", type=positive_float, default=400.0, help="per-rank Gbit/s for data parallelism (default 400)"
    )
    p.add_argument("--top", type=positive_int(), default=12, help="rows of each table (default 12)")
    p.add_argument(
        "--traced-top",
        type=positive_int(minimum=0),
        default=5,
        metavar="N",
        help="trace the N best configurations at full size on fake tensors and rank by the traced peak "
        "(default 5; 0: analytic only)",
    )
    add_json_flag(p)
    p.set_defaults(run=run)


def compute(args: argparse.Namespace) -> FitResult:
    try:
        mbs = tuple(sorted({int(x) for x in args.micro_batches.split(",")}))  # an empty entry is no number
    except ValueError:
        raise InputError(f"--micro-batches {args.micro_batches!r}: give whole numbers separated by commas") from None
    if not mbs or min(mbs) < 1:
        raise InputError(f"--micro-batches {args.micro_batches!r}: give positive whole numbers, e.g. 1,2,4,8")
    check_lora_flags(args)
    if args.dtype is not None and args.recipes is not None:
        raise InputError(f"give --dtype {args.dtype} (one recipe) or --recipes {args.recipes} (several), not both")
    text = args.recipes if args.recipes is not None else (args.dtype or DEFAULT_RECIPES)
    recipes = tuple(dict.fromkeys(r.strip() for r in text.split(",") if r.strip()))  # each once, in the order given
    if not recipes:
        raise InputError(f"--recipes {text!r} names no recipe; accepted: {', '.join(RECIPES)}")
    base: Setup = setup_from(args, micro_batch=1, recipe=recipes[0])
    options = FitOptions(
        device_memory=_device_memory(args),
        budget_on=args.budget_on or ("reserved" if args.device or args.allocator else "allocated"),
        world=args.world,
        micro_batches=mbs,
        recipes=recipes,
        tflops=args.tflops,
        link_gbps=args.link_gbps,
        reserve_bytes=args.reserve or 0,
    )
    check_analytic_family(args.hf_config)
    result = fit(args.hf_config, options, base)
    return trace_top(result, args.traced_top) if args.traced_top else result


def trace_top(result: FitResult, num_top: int, *, progress: Any = None) -> FitResult:
    """``result`` with its ``num_top`` best configurations traced at full size on fake tensors (a few layers,
    extended to the config's depth) and sharded as each says, the ranking using the traced peaks.

    The traces run the kernels the analytic rows assume (``result.base.device``): with ``cuda``, CUDA's kernels
    substituted on fake tensors for the card of ``result.base.gpu`` (default an H100), so that the analytic and
    traced columns compare like with like.

    A configuration that the traced peak pushes out of the device is replaced by the next best, which is
    traced in turn. Configurations that differ only in ZeRO stage share one trace (sharding is a transform
    of the traced ledger)."""
    traces: dict[tuple[int, str, str], Any] = {}
    peaks: dict[tuple[int, str, str, str], int] = {}
    why_not: dict[str, str] = {}
    while todo := [c for c in result.fitting[:num_top] if c.key not in peaks and c.remat not in why_not]:
        for c in todo:
            setup = replace(result.base, micro_batch=c.micro_batch, remat=c.remat, recipe=c.recipe)
            why = _untraceable(setup)
            if why is not None:
                why_not[c.remat] = why
                continue
            step = (c.micro_batch, c.remat, c.recipe)
            if step not in traces:
                traces[step] = _trace_setup(result.config, setup, progress)
            peaks[c.key] = _rank0_peak(traces[step], result.options.world, c.stage)
        result = with_traced_peaks(result, peaks)
    base = result.base
    kernels = f"cuda kernels as on {base.card.name}" if base.device == "cuda" else "cpu kernels"
    note = (
        f"traced peak: the step traced at full size on fake tensors with {kernels} ({len(traces)} traces, each a "
        "few layers deep extended to the config's depth), rank 0 under the row's ZeRO stage; it decides what fits"
    )
    return replace(result, notes=(*result.notes, note, *sorted(set(why_not.values()))))


def _untraceable(setup: Setup) -> str | None:
    if setup.tensor_parallel > 1 or setup.pipeline_parallel > 1:
        return "not traced: a traced step runs on one device; tensor and pipeline parallelism are analytic only"
    if setup.remat == "selective":
        return "not traced: selective recomputation is the analytic model's alone"
    return None


def _trace_setup(config: dict[str, Any], setup: Setup, progress: Any) -> Any:
    from trainledger.commands._stacked import trace_hf_stacked
    from trainledger.hf import workload_from_setup

    ledger, _ = trace_hf_stacked(
        config,
        lambda cfg: workload_from_setup(cfg, setup, fake=True),
        progress=progress,
        kernel_kind=setup.device,
        cuda_device=setup.card if setup.device == "cuda" else None,
    )
    return ledger


def _rank0_peak(ledger: Any, world: int, stage: str) -> int:
    if world == 1:
        return ledger.peak().bytes
    from trainledger.shard import ShardConfig, shard

    res = shard(ledger, ShardConfig(world_size=world, strategy=stage, engine="deepspeed"))  # type: ignore[arg-type]
    return res.ranks[0].peak().bytes


def _device_memory(args: argparse.Namespace) -> int:
    """``--device-memory``, or the usable memory of ``--device`` (one of the two)."""
    if args.allocator not in (None, AllocatorConfig()):
        raise InputError("fit replays with PyTorch's default allocator options: give --allocator without options")
    if args.device is not None and args.device_memory is not None:
        raise InputError(
            f"give --device {args.device.name} (its usable memory) or --device-memory {args.device_memory:,}, not both"
        )
    if args.device is None and args.device_memory is None:
        raise InputError("give the memory to fit: --device NAME (e.g. h100-80gb) or --device-memory SIZE (e.g. 80GiB)")
    return args.device.usable_bytes if args.device is not None else args.device_memory


def run(args: argparse.Namespace) -> int:
    result = compute(args)
    device = args.device
    return emit(result, lambda r, console: render(r, console, top=args.top, device=device), as_json=args.json)


def _gib(n: int) -> str:
    return format_bytes(n)


def render(result: FitResult, console: Console, *, top: int = 12, device: Device | None = None) -> None:
    o, b = result.options, result.base
    usable = o.device_memory - o.reserve_bytes
    on_reserved = o.budget_on == "reserved"
    head = Text(
        f"kernels: {b.device}; budget on {o.budget_on} bytes\n"
        + (device_line(device) + "\n" if device is not None else "")
        + f"{result.source}: {result.num_params:,} parameters, {b.seq_len} tokens per sequence, {b.optimizer}, "
        f"{b.attn_impl}, {o.world} data-parallel rank(s), {both_units(usable)} usable per device"
    )
    peak_col = f"predicted peak ({b.device} kernels)"
    cols = ["#", "micro-batch", "ZeRO", "remat", "precision", peak_col, *(["reserved"] if on_reserved else [])]
    fits = _fits_table(result, usable, top, columns=cols, on_reserved=on_reserved)
    items: list[object] = [head]
    if result.fitting:
        items.append(fits)
        more = len(result.fitting) - top
        if more > 0:
            items.append(Text(f"… and {more} more that fit (--top N or --json for all)"))
    else:
        items.append(Text("nothing fits: see what overflows below", style="bold red"))
    over = Table(title="does not fit (smallest overflow first)", title_justify="left")
    numeric = ("micro-batch", peak_col, "reserved", "over by")
    for col in ("micro-batch", "ZeRO", "remat", "precision", *cols[5:], "over by", "largest at the peak"):
        over.add_column(col, justify="right" if col in numeric else "left")
    for c in result.overflowing[:top]:
        cat, nbytes = c.largest_at_peak
        over.add_row(
            str(c.micro_batch),
            c.stage[-1],
            c.remat,
            c.recipe,
            _gib(c.peak_bytes),
            *([_gib(c.reserved_bytes or 0)] if on_reserved else []),
            _gib(c.overflow_bytes),
            f"{cat} {_gib(nbytes)} in {c.peak_phase}; largest {c.largest_entry[0]} {_gib(c.largest_entry[1])}",
        )
    if result.overflowing:
        items.append(over)
    items.append(
        notes_text(
            [
                "peaks are analytic estimates of rank 0 (evidence analytic); cost = compute + recompute + exposed "
                f"communication at {o.tflops:g} TFLOP/s and {o.link_gbps:g} Gbit/s; a micro-batch is listed "
                "as overflowing once, the larger ones are not tried",
                (
                    "reserved = what PyTorch's caching allocator would hold (its model replaying each ledger, "
                    "evidence analytic): rounding, segments and fragmentation included"
                    if on_reserved
                    else "allocator rounding and fragmentation are not counted: --budget-on reserved "
                    "(or --device NAME) replays each configuration through the caching allocator's model"
                ),
                *result.notes,
                UNITS_NOTE,
            ]
        )
    )
    print_renderables(*items, console=console)


def _fits_table(result: FitResult, usable: int, top: int, *, columns: list[str], on_reserved: bool) -> Table:
    """The configurations that fit; a traced-peak column where any was traced (free memory then follows it),
    and the predicted reserved memory when the budget is on it (free memory then follows that)."""
    traced = any(c.traced_peak_bytes is not None for c in result.fitting)
    fits = Table(title="fits (best first; cost per token relative to the best)", title_justify="left")
    columns = [*columns, *(["traced peak"] if traced else [])]
    for col in (*columns, "free", "rel. cost", "peak in"):
        fits.add_column(col, justify="right" if col not in ("ZeRO", "remat", "precision", "peak in") else "left")
    for i, c in enumerate(result.fitting[:top], 1):
        budget = c.reserved_bytes if on_reserved and c.reserved_bytes is not None else c.ranked_peak_bytes
        cells = [str(i), str(c.micro_batch), c.stage[-1], c.remat, c.recipe, _gib(c.peak_bytes)]
        cells += [_gib(c.reserved_bytes or 0)] if on_reserved else []
        cells += [_traced_cell(c)] if traced else []
        fits.add_row(*cells, _gib(usable - budget), f"{c.relative_cost:.2f}", c.peak_phase)
    return fits


def _traced_cell(c: Candidate) -> str:
    return "—" if c.traced_peak_bytes is None else _gib(c.traced_peak_bytes)
