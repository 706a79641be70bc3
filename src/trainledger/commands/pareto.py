"""``trainledger pareto``: peak against extra compute, from the plain peak down to the floor."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainledger.commands._gpu import Target, device_line
from trainledger.commands._hfstep import add_step_source_flags, workload_for
from trainledger.commands.common import add_json_flag, input_paths, positive_int, print_json
from trainledger.commands.plan import (
    add_budget_on_flag,
    add_cost_flag,
    add_kernel_flags,
    budget_on,
    check_kernel_kind,
    config_steps_run_fake,
    full_size,
    kernels_line,
    require_model,
    require_solvers,
)
from trainledger.report.terminal import UNITS_NOTE, both_units, make_console, notes_text, print_renderables

if TYPE_CHECKING:
    from trainledger.remat import ParetoResult, Point


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pareto",
        help="activation checkpointing: peak against extra compute, plain peak down to the floor",
        description="Sweep budgets from the plain step's traced peak down to the floor and compare our plans "
        "with the MILP optimum, a greedy knapsack, uniform per-block checkpointing and Chen's sqrt(n); with "
        "--budget-on reserved, budgets on the caching allocator's predicted reserved bytes instead.",
    )
    add_step_source_flags(p)
    p.add_argument("--budgets", type=positive_int(minimum=2), default=8, help="number of budgets, 2 to 64 (default 8)")
    add_cost_flag(p)
    add_kernel_flags(p)
    add_budget_on_flag(p, "what each budget of the sweep is on")
    p.add_argument("--verify", action="store_true", help="apply each of our plans and trace the step again")
    p.add_argument("--plot", metavar="FILE", help="write the curve as a picture (.png or .svg)")
    add_json_flag(p)
    p.set_defaults(run=run)


def compute(args: argparse.Namespace) -> ParetoResult:
    require_solvers()
    from trainledger.remat import pareto

    if args.plot:
        from trainledger.report.exports import check_export_paths

        check_export_paths(plot=args.plot, protect=input_paths(args))  # the suffix, the folder, matplotlib
    kind = check_kernel_kind(args)
    target = Target.of(args)
    kinds: dict[str, Any] = {
        "kernel_kind": kind,
        "cuda_device": args.device if kind == "cuda" else None,
        "allocator": target.allocator,
        "capacity_bytes": target.capacity_bytes,
        "budget_on": budget_on(args),
    }
    if full_size(args, kind):
        from trainledger.remat import Sharding
        from trainledger.shard import parse_strategy

        sharding = Sharding(world_size=args.world, strategy=parse_strategy(args.stage))
        workload = workload_for(args)
        with config_steps_run_fake(args):
            return pareto(
                workload,
                num_budgets=args.budgets,
                cost="flops",
                verify=args.verify,
                fake=True,
                sharding=sharding,
                **kinds,
            )
    require_model(args)
    workload = workload_for(args)  # refuses the flags that only a config's step takes
    return pareto(workload, num_budgets=args.budgets, cost=args.cost or "seconds", verify=args.verify, **kinds)


def run(args: argparse.Namespace) -> int:
    result = compute(args)
    from trainledger.report.plot import plot_pareto

    written = plot_pareto(result, args.plot) if args.plot else None
    if args.json:
        out = result.to_dict()
        out["written"] = [str(written)] if written else []
        print_json(out)
    else:
        render(result, make_console(), device=args.device)
        if written:
            make_console().print(f"wrote {written}")
    failed = result.failed_verification()
    if failed:  # as plan --verify: a plan that failed its checks is an error, whatever else was printed
        sys.stderr.write(
            f"trainledger pareto: {len(failed)} of {len(result.rows)} plans failed their verification (over the "
            "budget, gradients or state not bitwise equal, or a region not run): budgets "
            f"{', '.join(map(str, failed))}\n"
        )
    return 1 if failed else 0


def _cost(p: Point | None, seconds: bool) -> str:
    if p is None:
        return "no plan"
    return f"{p.extra_seconds * 1e3:.2f} ms" if seconds else f"{p.extra_flops / 1e6:,.1f} MFLOP"


def render(result: ParetoResult, console: Console, *, device: Any = None) -> None:
    seconds = result.cost == "seconds"
    reserved = any(r.ours and r.ours.reserved_peak_bytes is not None for r in result.rows)
    sac = result.extra.get("torch_sac_ilp") or {}
    first = [kernels_line(result)] + ([device_line(device)] if device is not None else [])
    lines = [
        f"plain step's traced peak {result.plain_peak_bytes:,} bytes ({both_units(result.plain_peak_bytes)}); floor "
        f"{result.floor_bytes:,} bytes ({both_units(result.floor_bytes)}), the lowest peak any plan reaches; "
        f"persistent state and the largest op alone {result.state_floor_bytes:,} bytes",
    ]
    if result.plain_reserved_bytes is not None and result.floor_reserved_bytes is not None:
        lines.append(
            f"predicted reserved (allocator model): plain step {result.plain_reserved_bytes:,} bytes "
            f"({both_units(result.plain_reserved_bytes)}), the lowest-peak plan {result.floor_reserved_bytes:,} "
            f"({both_units(result.floor_reserved_bytes)})"
        )
    for p in (result.uniform, result.sqrt_n):
        name = "uniform per-block checkpointing" if p.method == "uniform" else "Chen's sqrt(n) segments"
        lines.append(f"{name}: peak {p.peak_bytes:,} bytes at {_cost(p, seconds)} ({len(p.regions)} regions)")
    if sac:
        lines.append(f"PyTorch SAC MILP: {sac.get('summary', '')}")
    if sac.get("ran"):
        lines.append(
            "  its column: its predicted recomputation ms -> the peak of its plan replayed on our traced step, given "
            "the budget as it is and (-optim) less the optimizer state; * = it discards part of a module's "
            "activations (a per-op policy), shown with those modules recomputed whole; over = above the budget"
        )
    if result.budget_on == "reserved":
        lines += _reserved_notes(result)
    elif reserved:
        lines.append(
            "ours: reserved: the plan's ledger replayed through the caching allocator's model, its predicted "
            "max_memory_reserved (analytic, not measured); the peaks beside it are traced allocated bytes"
        )
    items: list[Any] = [Text("\n".join(first)), sweep_table(result), Text("\n".join(lines))]
    if result.baselines:
        items.append(baselines_table(result))
    items.append(notes_text([*result.candidate_notes, UNITS_NOTE]))
    print_renderables(*items, console=console)


def _reserved_notes(result: ParetoResult) -> list[str]:
    """What a sweep on reserved memory's columns are, and the budgets no round met."""
    lines = [
        "budgets on predicted reserved bytes (the allocator model's max_memory_reserved of each plan's ledger, "
        "analytic, not measured), from the plain step's down to the lowest-peak plan's: each solved on allocated "
        "bytes, replayed through the allocator model and the allocated budget lowered by the excess (then "
        "bisected) over 'rounds', as plan --budget-on reserved does; '% plain' is of the plain step's reserved, 'ours: "
        "peak' the plan's allocated peak; MILP and greedy are left out (they see allocated bytes only)"
    ]
    missed = [r for r in result.rows if not r.fits]
    if missed:
        budgets = ", ".join(f"{r.budget_bytes:,}" for r in missed)
        lines.append(
            f"NOT MET: no round fits the budget {budgets} on reserved memory; those rows show the plan with the "
            "lowest predicted reserved peak reached"
        )
    return lines


def sweep_table(result: ParetoResult) -> Table:
    """A row per budget: our plan, and beside it the MILP optimum and the greedy knapsack (allocated budgets),
    or how each budget on reserved memory was met."""
    seconds = result.cost == "seconds"
    on_reserved = result.budget_on == "reserved"
    verified = any(r.ours and r.ours.traced_peak_bytes is not None for r in result.rows)
    reserved = any(r.ours and r.ours.reserved_peak_bytes is not None for r in result.rows)
    sac = result.extra.get("torch_sac_ilp") or {}
    per_rank = "per_rank" in result.extra  # our plan is the MILP's; peaks are the fullest rank's
    on = "predicted reserved bytes" if on_reserved else "allocated bytes"
    table = Table(
        title=f"{result.model}: cheapest recomputation per budget on {on} (extra compute = "
        + ("measured ms of recomputed ops" if seconds else "recomputed FLOPs")
        + ")",
        title_justify="left",
    )
    plain = result.plain_reserved_bytes if on_reserved else result.plain_peak_bytes
    assert plain is not None, "a sweep on reserved memory has the plain step's reserved peak"
    columns = ["budget", "% plain", "ours: reserved", "fits", "ours: peak", "rounds"]
    if not on_reserved:
        columns = ["budget", "% plain", "ours: peak", *(["ours: reserved"] if reserved else [])]
    columns += ["ours: extra", *([] if on_reserved else ["MILP optimum", "greedy"]), "recomputed"]
    columns += ["traced peak", "grads equal"] if verified else []
    columns += ["traced reserved"] if verified and reserved else []
    columns += ["PyTorch SAC MILP"] if sac.get("ran") else []
    for col in columns:
        table.add_column(col, justify="left" if col == "recomputed" else "right")
    for k, r in enumerate(result.rows):
        o = r.ours
        row = [f"{r.budget_bytes:,}", f"{100 * r.budget_bytes / plain:.1f}%"]
        if on_reserved:
            assert o is not None and r.reserved is not None  # every budget on reserved memory has a plan
            row += [f"{r.reserved.max_reserved_bytes:,}", "yes" if r.fits else "NO", f"{o.peak_bytes:,}"]
            row.append(str(r.reserved.num_rounds))
        else:
            row.append(f"{o.peak_bytes:,}" if o else "-")
            if reserved:
                row.append(f"{o.reserved_peak_bytes:,}" if o and o.reserved_peak_bytes is not None else "-")
        row.append(_cost(o, seconds))
        if not on_reserved:
            row += ["-" if per_rank else _cost(r.milp, seconds), "-" if per_rank else _cost(r.greedy, seconds)]
        row.append(", ".join(o.regions) if o and o.regions else "nothing")
        if verified:
            over = o is not None and o.traced_peak_bytes is not None and o.traced_peak_bytes > r.budget_bytes
            traced = f"{o.traced_peak_bytes:,}" + (" (over)" if over else "") if o else "-"
            row += [traced, "yes" if o and o.gradients_bitwise_equal else "NO"]
        if verified and reserved:
            traced = o.traced_reserved_peak_bytes if o else None
            row.append(f"{traced:,}" if traced is not None else "-")
        if sac.get("ran"):
            row.append(f"{sac_cell(sac['as_given'][k])}\n-optim: {sac_cell(sac['less_optimizer'][k])}")
        table.add_row(*row)
    return table


def baselines_table(result: ParetoResult) -> Table:
    """Each named baseline beside our plan at the baseline's own peak (the budget it sets)."""
    seconds = result.cost == "seconds"
    unit = "ms" if seconds else "FLOPs"
    table = Table(title="named baselines, and our plan with each one's peak as the budget", title_justify="left")
    for col in ("baseline", "peak", f"its extra {unit}", f"ours: extra {unit}", "ours: peak", "note"):
        table.add_column(col, justify="left" if col in ("baseline", "note") else "right")
    for b, o in zip(result.baselines, result.at_baselines, strict=True):
        if b.peak_bytes is None:
            table.add_row(b.label, "-", "-", "-", "-", b.note)
            continue
        cost = (b.extra_seconds or 0.0) * 1e3 if seconds else b.cost_flops
        row = [b.label, f"{b.peak_bytes:,}", f"{cost:,.2f}" if seconds else f"{cost:,}"]
        if o is None:
            row += ["-", "-"]
        else:
            ours = o.cost(result.cost)
            row += [f"{ours * 1e3:,.2f}" if seconds else f"{int(ours):,}", f"{o.peak_bytes:,}"]
        table.add_row(*row, b.note)
    if not seconds:
        table.caption = "FLOPs: FlopCounterMode's, plus one per output element of the other recomputed ops"
    return table


def sac_cell(row: dict[str, Any]) -> str:
    """One point of PyTorch's SAC MILP (``benchmarks/torch_sac.py``) in a table cell: ``infeasible``, or its
    predicted recomputation ms and the peak of its plan replayed on our traced step (``*``: the modules it
    chose recomputed whole, where it asked for part; ``over``: above the budget).

    Example:
        >>> row = {"feasible": True, "recompute_ms": 0.5, "replayed_peak_bytes": None, "budget_bytes": 1000}
        >>> sac_cell({**row, "full_peak_bytes": 1024})
        '0.50 ms → 1,024* over'
    """
    if not row["feasible"]:
        return "infeasible"
    text = f"{row['recompute_ms']:.2f} ms"
    b, mark = row["replayed_peak_bytes"], ""
    if b is None:
        b, mark = row["full_peak_bytes"], "*"
    if b is None:
        return f"{text}, not replayed"
    return f"{text} → {b:,}{mark}" + (" over" if b > row["budget_bytes"] else "")
