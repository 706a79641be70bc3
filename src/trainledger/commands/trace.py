"""``trainledger trace``: trace one training step and report its true simultaneous peak."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from trainledger.commands._gpu import Target, add_device_flags, device_line, reserved_text
from trainledger.commands._hfstep import (
    add_step_source_flags,
    any_workload,
    given_step_flags,
    in_analytic_family,
    vision_workload,
    workload_for,
)
from trainledger.commands._stacked import trace_hf_stacked, weights_numel
from trainledger.commands.common import (
    add_json_flag,
    argparse_type,
    input_paths,
    parse_torch_device,
    print_json,
)
from trainledger.devices import kernel_kind
from trainledger.errors import InputError
from trainledger.ledger import LedgerSummary
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
from trainledger.workload import Workload

if TYPE_CHECKING:
    from trainledger.hf import HFConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="trace one training step: every tensor's lifetime and the true simultaneous peak",
        description="Trace one steady-state training step (after a warm-up step) tensor by tensor.",
    )
    anymodel = add_step_source_flags(p)
    anymodel.add_argument("--timm", metavar="NAME", help="a timm model by name, no pretrained weights (the timm extra)")
    p.add_argument(
        "--full-depth",
        action="store_true",
        help="with --hf-config or --timm, and --fake: trace every layer, not 3 and 4 layers extended to the full depth",
    )
    p.add_argument(
        "--meta-device",
        type=argparse_type(parse_torch_device),
        metavar="DEVICE",
        help="with --fake: the device a model built on the meta device is traced as (cpu, cuda; default cpu)",
    )
    p.add_argument("--measure", action="store_true", help="also run the real step with the allocator's counters")
    p.add_argument(
        "--plan",
        metavar="FILE",
        help="trace the step under a saved plan (plan --save): what it keeps, recomputes and peaks at",
    )
    p.add_argument(
        "--device-kind",
        default="cpu",
        choices=("cpu", "cuda"),
        metavar="KIND",
        help="whose kernels: cpu (default, the ones that run here) or cuda (the step as PyTorch's CUDA kernels "
        "would run it, on fake tensors; the card is --device's, default an H100)",
    )
    add_device_flags(p)
    p.add_argument("--plot", metavar="FILE", help="write a timeline picture (.png or .svg)")
    p.add_argument("--export-memory-viz", metavar="FILE", help="write a PyTorch memory snapshot (.pickle)")
    p.add_argument("--export-perfetto", metavar="FILE", help="write a Chrome/Perfetto trace (.json)")
    p.add_argument("--export-json", metavar="FILE", help="write the ledger, every entry with its interval (.json)")
    p.add_argument(
        "--html", metavar="FILE", help="write a self-contained HTML page: timeline, live arrays, sortable tables"
    )
    add_json_flag(p)
    p.set_defaults(run=run)


def _trace_workload(args: argparse.Namespace, *, config: HFConfig | None = None) -> Workload:
    """The step to trace: what :func:`workload_for` builds (``--model``, a ``--hf-config`` of any architecture,
    a timm or diffusers model)."""
    if not any(getattr(args, f) for f in ("model", "hf_config", "timm", "diffusers_config")):
        raise InputError(
            "give --model NAME|file.py:factory, --hf-config PATH, --timm NAME or --diffusers-config PATH (see --help)"
        )
    if args.model and args.fake:
        from trainledger.trace import EmptyWeights

        # the factory's model at full size without its weights' memory; what its constructor computes is real
        with EmptyWeights():
            return workload_for(args, config=config)
    return workload_for(args, config=config)


def _any_stack(args: argparse.Namespace) -> tuple[Any, Any] | None:
    """The config of an architecture outside the analytic families and the depth of its one stack of blocks,
    when it has one to trace a few blocks deep (``None``: traced whole)."""
    from trainledger.anymodel import depth_of, load_any_config

    if args.timm or args.diffusers_config:
        return None
    cfg = load_any_config(args.hf_config, task=args.task)
    depth = depth_of(cfg)
    return None if depth is None else (cfg, depth)


def _timm_stack(args: argparse.Namespace) -> int | None:
    """The number of blocks of a timm model whose ``depth`` sets its one list of blocks (ViT's ``blocks``), to trace
    a few blocks deep; ``None``: traced whole (a net of stages, ResNet's, ConvNeXt's)."""
    if not args.timm or args.model or args.hf_config or args.diffusers_config:
        return None  # several sources: refused where the workload is built
    from trainledger.vision import timm_depth

    return timm_depth(args.timm, image_size=args.image_size)


def _trace_any_stacked(args: argparse.Namespace, cfg: Any, depth: Any, **kwargs: Any) -> tuple[Any, int]:
    """:func:`trainledger.trace.trace_stacked` over ``cfg`` built at each depth (its notes printed once)."""
    from dataclasses import replace

    from trainledger.anymodel import at_depth, skeleton
    from trainledger.trace import trace_stacked

    given = given_step_flags(args)
    quiet = replace(cfg, notes=())
    built: list[int] = []

    def build(blocks: int) -> Workload:
        source = quiet if built else cfg  # the config's notes printed with the first build only
        built.append(blocks)
        at = source if blocks == depth.num_layers else at_depth(source, depth, blocks)
        return any_workload(args, given, at)

    def skeleton_at(blocks: int) -> Any:
        return skeleton(at_depth(quiet, depth, blocks), image_size=args.image_size)

    ledger = trace_stacked(build, depth.num_layers, fake=True, differs=depth.uneven, skeleton=skeleton_at, **kwargs)
    return ledger, weights_numel(ledger)


def _trace_timm_stacked(args: argparse.Namespace, num_blocks: int, **kwargs: Any) -> tuple[Any, int]:
    """:func:`trainledger.trace.trace_stacked` over the timm model built ``d`` blocks deep (its ``depth``)."""
    from trainledger.trace import trace_stacked
    from trainledger.vision import timm_skeleton

    given = given_step_flags(args)

    def build(blocks: int) -> Workload:
        return vision_workload(args, given, depth=None if blocks == num_blocks else blocks)

    def skeleton_at(blocks: int) -> Any:
        return timm_skeleton(args.timm, image_size=args.image_size, depth=None if blocks == num_blocks else blocks)

    ledger = trace_stacked(build, num_blocks, fake=True, skeleton=skeleton_at, **kwargs)
    return ledger, weights_numel(ledger)


def run(args: argparse.Namespace) -> int:

    if args.measure and args.fake:
        raise InputError("--measure runs the real step, --fake a step on fake tensors: drop one of them")
    cuda = args.device_kind == "cuda"
    if args.measure and cuda:
        raise InputError("--measure runs the step on this machine's kernels, --device-kind cuda on CUDA's: drop one")
    kinds = {
        "kernel_kind": args.device_kind,
        "cuda_device": args.device if cuda else None,
        "world_size": args.world if cuda else 1,
    }
    if cuda and (args.hf_config or args.timm or args.diffusers_config):
        args.fake = True  # a CUDA-kind trace runs on fake tensors: build the model without values
    outputs = _check_outputs(args)
    strategy = parse_strategy(args.stage)
    if args.meta_device is not None and not args.fake:
        raise InputError(f"--meta-device {args.meta_device} names the device of a fake trace: add --fake")
    if args.meta_device is not None and not args.model:
        raise InputError(
            f"--meta-device {args.meta_device} applies to a model built on the meta device (--model "
            "file.py:factory); models from configs and names are built on fake tensors already: drop it"
        )
    if args.full_depth and not ((args.hf_config or args.timm) and args.fake):
        raise InputError(
            "--full-depth applies to a fake trace of a Hugging Face config or a timm model: add --hf-config or "
            "--timm, and --fake"
        )
    plan = _saved_plan(args)
    ledger, num_params, measurement = _traced(args, kinds, plan)
    sharded = None
    if args.world > 1 or strategy != "zero0":
        from trainledger.shard import shard

        sharded = shard(ledger, world_size=args.world, strategy=strategy).summary()
    target = Target.of(args)
    reserved = target.predict(ledger, kernel_kind=kernel_kind(ledger.device))
    segments = reserved.segments if reserved is not None else ()
    written = list(write_exports(ledger, outputs, predicted_segments=segments).values())
    report = TraceReport.of(
        ledger,
        num_params=num_params,
        measured=measurement.summary() if measurement is not None else None,
        sharded=sharded,
        reserved=reserved,
    )
    if args.json:
        out = report.to_dict()
        out["written"] = [str(p) for p in written]
        print_json(out)
        return 0
    render(report, make_console(), written=written, target=target)
    return 0


def render(report: TraceReport, console: Console, *, written: Sequence[str] = (), target: Target | None = None) -> None:
    """Print a traced step: the peak, the breakdown at that instant, the largest arrays live then."""
    led = report.ledger
    pk = led.peak
    over = led.sum_of_category_maxima - pk.bytes
    phases = ", ".join(f"{k} {v}" for k, v in led.meta.get("events_per_phase", {}).items())
    kinds = report.kernel_kind
    lines = [
        f"model {led.meta.get('model') or '?'}{' (fake tensors)' if led.meta.get('fake') else ''}: "
        f"{led.num_events:,} events ({phases}), {report.num_entries:,} storages",
        _kernels_line(led),
    ]
    device = target.device if target is not None else None
    if device is not None:
        lines.append(device_line(device))
    items: list[Any] = [
        Text("\n".join(lines)),
        peak_text(pk, evidence=str(led.evidence), maxima=led.category_maxima, single_instant=False, kernels=kinds),
        peak_table(led),
        Text(
            f"summing category maxima would claim {led.sum_of_category_maxima:,} bytes: "
            f"{over:,} bytes ({100 * over / max(pk.bytes, 1):.1f}%) more than was ever live at once"
        ),
        largest_live_table(report.largest_live, pk.event),
    ]
    if report.reserved is not None:
        items.append(reserved_text(report.reserved, device))
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


def _kernels_line(led: LedgerSummary) -> str:
    """Whose kernels the figures assume; for CUDA, the card, the SDPA backends and what lies outside the allocator."""
    if led.meta.get("kernel_kind") != "cuda":
        return (
            f"kernels: {kernel_kind(led.device)} (traced on {led.device}; a CUDA step's kernels save and allocate "
            "differently: SDPA backend, fused optimizers, autocast's op lists, cuBLAS workspace; --device-kind cuda)"
        )
    backends = ", ".join(f"{k} ×{n}" for k, n in sorted(led.meta.get("sdpa_backends", {}).items())) or "none"
    outside = "; ".join(
        f"{o['name']} {o['bytes']:,} bytes ({both_units(o['bytes'])}, {o['evidence']})"
        for o in led.meta.get("outside_allocator", ())
    )
    return (
        f"kernels: cuda as on {led.meta.get('cuda_device')}, substituted on fake CPU tensors (SDPA backends: "
        f"{backends}); unvalidated on a GPU\noutside the allocator, not in the peak: {outside}"
    )


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


def _traced(args: argparse.Namespace, kinds: dict[str, Any], plan: Any) -> tuple[Any, int, Any]:
    """The ledger of the step the flags describe (a few blocks deep and extended where it can be), its number of
    parameters, and with ``--measure`` the measurement; with ``plan``, the step runs under it."""
    from trainledger.trace import trace

    cuda = args.device_kind == "cuda"
    whole = args.full_depth or args.model or plan is not None  # a plan names the blocks of the whole model
    at_full_size = args.hf_config and (args.fake or cuda) and not whole
    stacked = at_full_size and in_analytic_family(args)
    any_stack = _any_stack(args) if at_full_size and not stacked else None
    timm_blocks = _timm_stack(args) if args.fake and not whole else None
    workload = None if stacked or any_stack is not None or timm_blocks is not None else _trace_workload(args)
    err = Console(stderr=True)
    measurement = None
    with _progress(err, quiet=not err.is_terminal) as progress:
        if timm_blocks is not None:
            ledger, num_params = _trace_timm_stacked(args, timm_blocks, progress=progress, **kinds)
        elif any_stack is not None:
            ledger, num_params = _trace_any_stacked(args, *any_stack, progress=progress, **kinds)
        elif workload is None:
            build_at = partial(_trace_workload, args)  # the same step, from the config at another depth
            ledger, num_params = trace_hf_stacked(
                args.hf_config, lambda cfg: build_at(config=cfg), progress=progress, **kinds
            )
        else:
            num_params = sum(p.numel() for p in workload.model.parameters())
            device = args.meta_device or "cpu"
            with _under(plan, workload.model, args.plan) as noted:
                ledger = trace(workload, fake=args.fake, progress=progress, device=device, **kinds)
                if args.measure:
                    from trainledger.measure import measure

                    measurement = measure(workload)
            ledger = replace(ledger, notes=(*ledger.notes, *noted))
    return ledger, num_params, measurement


def _saved_plan(args: argparse.Namespace) -> Any:
    """``--plan FILE``'s plan (``None`` without it)."""
    if not args.plan:
        return None
    from trainledger.remat import Plan

    return Plan.load(args.plan)


@contextmanager
def _under(plan: Any, model: Any, path: str) -> Iterator[list[str]]:
    """``model`` running under ``plan`` (read from ``path``; nothing without one) while the block runs; the list
    it yields is filled, as it ends, with the note that says so."""
    noted: list[str] = []
    if plan is None:
        yield noted
        return
    plan.apply(model)  # refuses a plan made for a model of another structure
    try:
        yield noted
        runs = plan.runs(model)
    finally:
        plan.remove(model)
    never = [r.label for r, n in runs.items() if not n]
    labels = ", ".join(r.label for r in plan.regions[:6]) + (", …" if len(plan.regions) > 6 else "")
    note = f"traced under the plan {path}: {len(plan.regions)} region(s) recomputed in backward ({labels})"
    note += f"; never ran in the traced step: {', '.join(never)}" if never else "; each ran"
    if plan.predicted_peak_bytes:
        note += f"; it predicted a peak of {plan.predicted_peak_bytes:,} bytes for the step it was made on"
    noted.append(note)
