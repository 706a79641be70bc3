"""``trainledger plan``: choose what to recompute so the step fits a budget; ``--verify`` proves it."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainledger.commands._hfstep import add_step_source_flags, small_workload, workload_for
from trainledger.commands.common import add_json_flag, input_paths, print_json
from trainledger.errors import InputError
from trainledger.report.exports import check_output_path
from trainledger.report.terminal import UNITS_NOTE, both_units, make_console, notes_text, peak_text, print_renderables
from trainledger.sources import load_workload

if TYPE_CHECKING:
    from trainledger.remat import PlanResult

# The command line's choices, kept here so that `--help` needs neither numpy nor scipy (the planner does);
# a test holds them equal to trainledger.remat's SOLVERS and COSTS. argparse checks them; nothing else does.
SOLVERS = ("auto", "dp", "milp", "greedy", "sqrt-n", "uniform")
COSTS = ("seconds", "flops")


def require_solvers() -> None:
    """The planner's solvers need numpy and scipy (the ``solve`` extra): say how to install them."""
    missing = [m for m in ("numpy", "scipy") if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(
            f"activation checkpointing plans need {' and '.join(missing)}, which is not installed; "
            "install it with: pip install 'trainledger[solve]'"
        )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="activation checkpointing: what to recompute so the step's peak fits a budget",
        description="Trace the step, choose the regions to recompute at the least extra compute, and "
        "(--verify) apply the plan, trace again and compare gradients with the plain step's.",
    )
    add_step_source_flags(p)
    p.add_argument(
        "--budget",
        required=True,
        help="a share of the plain step's traced peak (60%%) or a size (2GiB); per rank with --world",
    )
    p.add_argument("--verify", action="store_true", help="apply the plan, trace the step again, compare gradients")
    p.add_argument("--solver", default="auto", choices=SOLVERS, help=f"one of {', '.join(SOLVERS)} (default auto)")
    add_cost_flag(p)
    p.add_argument("--save", metavar="FILE", help="write the plan as JSON (apply it later with Plan.load)")
    p.add_argument(
        "--export-policy",
        metavar="FILE.py",
        help="write the plan as a Python module that needs only torch: import it, call apply(model)",
    )
    add_json_flag(p)
    p.set_defaults(run=run)


def add_cost_flag(p: argparse.ArgumentParser) -> None:
    """What the solver minimises; shared by ``plan`` and ``pareto``."""
    p.add_argument(
        "--cost",
        default=None,
        choices=COSTS,
        help="what to minimise: seconds (measured) or flops (default seconds; flops with --fake)",
    )


def require_model(args: argparse.Namespace) -> None:
    """``plan`` and ``pareto`` run a model: ``--model`` is required."""
    if not args.model:
        raise InputError("give --model NAME|file.py:factory (see --help)")


def compute(args: argparse.Namespace) -> PlanResult:
    require_solvers()
    from trainledger.remat import Budget, plan_and_verify

    budget = Budget.parse(args.budget)  # before the step is traced
    if args.save:
        check_output_path(args.save, (".json",), what="plan", protect=input_paths(args))
    if args.export_policy:
        check_policy_path(args)
    if full_size(args):
        return compute_fake(args, budget)
    require_model(args)
    workload = load_workload(args.model)
    return plan_and_verify(workload, budget, solver=args.solver, cost=args.cost or "seconds", verify=args.verify)


def check_policy_path(args: argparse.Namespace) -> None:
    """``--export-policy``: a writable ``.py`` path whose name can be imported."""
    path = check_output_path(args.export_policy, (".py",), what="policy file", protect=input_paths(args))
    if not path.stem.isidentifier():
        raise InputError(
            f"policy file name {path.name!r} cannot be imported (`import {path.stem}`); "
            "use letters, digits and _, as in remat_policy.py"
        )


# Flags left out of the command line written into an exported policy file: outputs, and defaults.
_NOT_THE_PLAN = ("run", "command", "json", "save", "export_policy", "verify")
_FLAG_DEFAULTS = {"world": 1, "stage": "0", "solver": "auto"}


def command_line(args: argparse.Namespace) -> str:
    """The ``trainledger plan`` command that makes this plan (the flags that were given, not defaults)."""
    parts = ["trainledger", "plan"]
    for key, value in vars(args).items():
        if key in _NOT_THE_PLAN or value is None or value is False or _FLAG_DEFAULTS.get(key) == value:
            continue
        flag = "--" + key.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


def full_size(args: argparse.Namespace) -> bool:
    """A step on fake tensors (``--fake``); ``--hf-config`` and sharding need it (``InputError`` otherwise)."""
    given = [
        f
        for f, on in (("--hf-config", args.hf_config), ("--world", args.world > 1), ("--stage", args.stage != "0"))
        if on
    ]
    if given and not args.fake:
        raise InputError(f"{', '.join(given)} plan a step at full size on fake tensors: add --fake")
    if args.fake and args.cost == "seconds":
        raise InputError("--cost seconds needs the step to run; on fake tensors the cost is flops (drop --cost)")
    return bool(args.fake)


def fake_planner(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The workload the flags describe on fake tensors, its planner (FLOP costs) and its sharding."""
    from trainledger.remat import Planner, Sharding
    from trainledger.shard import parse_strategy

    sharding = Sharding(world_size=args.world, strategy=parse_strategy(args.stage))
    workload = workload_for(args)
    return workload, Planner.build(workload, cost="flops", fake=True), sharding


_SMALL_NOTE = (
    "verification: the full-size step is traced again on fake tensors; gradients and state are compared on a "
    "small real instance of the architecture (3 blocks, hidden 64, 2 sequences of 32 tokens) running the same "
    "plan by module path and policy (block i as block i mod 3)"
)
_NO_SMALL_NOTE = (
    "verification: traced again on fake tensors; gradients cannot be compared on a model built on fake tensors"
)


def _real_or_none(workload: Any) -> Any:
    """``--model --fake`` of a model with real weights: its gradients are compared on the real step itself."""
    from torch._subclasses.fake_tensor import FakeTensor

    params = list(workload.model.parameters())
    fake = any(isinstance(q, FakeTensor) or q.is_meta for q in params)
    return None if fake or not params else workload


def compute_fake(args: argparse.Namespace, budget: Any) -> PlanResult:
    """``plan --fake``: plan on the fake step's trace, per rank; ``--verify`` re-traces it on fake tensors
    and compares gradients on a small real instance (with ``--hf-config``)."""
    from dataclasses import replace

    from trainledger.remat import PlanResult, candidate_costs, peak_by_evidence, solve_per_rank, verify_fake

    workload, planner, sharding = fake_planner(args)
    budget_bytes = budget.resolve(sharding.rank_ledger(planner.plain).peak().bytes)
    p = solve_per_rank(planner, budget_bytes, sharding, solver=args.solver)
    p = replace(p, extra_seconds=None)  # fake kernels compute nothing: their times mean nothing
    verification = None
    if args.verify:
        small = small_workload(args) if args.hf_config else _real_or_none(workload)
        verification = verify_fake(workload, p, sharding, small=small)
        note = (
            _SMALL_NOTE if args.hf_config else "verification: traced again on fake tensors; gradients on the real model"
        )
        p = replace(p, notes=(*p.notes, note if small is not None else _NO_SMALL_NOTE))
    costs = candidate_costs(planner.candidates, planner.model)
    state_floor = planner.state_floor_bytes if sharding.trivial else None
    baselines = planner.baselines(_per_rank_peak(planner, sharding), timed=False)
    summary = p.predicted.summary() if p.predicted else None
    by_evidence = peak_by_evidence(p.predicted) if p.predicted else None
    return PlanResult(p, costs, state_floor, verification, summary, by_evidence, baselines)


def _per_rank_peak(planner: Any, sharding: Any) -> Any:
    """The fullest rank's peak of a choice of candidates, replayed and sharded (``None``: not sharded)."""
    if sharding.trivial:
        return None
    from trainledger.remat import replay

    return lambda choice: sharding.rank_ledger(replay(planner.candidates, choice)).peak().bytes


def run(args: argparse.Namespace) -> int:
    result = compute(args)
    if args.save:
        result.plan.save(args.save, extra={"baselines": [b.to_dict() for b in result.baselines]})
    if args.export_policy:
        result.plan.export_policy(args.export_policy, command=command_line(args))
    if args.json:
        print_json(result.to_dict())
    else:
        render(result, make_console(), saved=", ".join(f for f in (args.save, args.export_policy) if f))
    v = result.verification
    return 1 if v is not None and not v.passed else 0


def render(result: PlanResult, console: Console, *, saved: str | None = None) -> None:
    p = result.plan
    items: list[Any] = [Text(_head(result))]
    items.append(regions_table(result))
    if result.predicted is not None:
        pk = result.predicted.peak
        items.append(
            peak_text(
                pk, evidence="predicted from the trace", maxima=result.predicted.category_maxima, single_instant=False
            )
        )
    if p.optimal and not p.gap:
        gap = "proved optimal"
    elif p.gap is None:
        gap = "no optimality bound (a heuristic)"
    else:
        gap = f"optimality gap {100 * p.gap:.2f}%"
    lines = [
        _extra(p),
        f"solver: {p.solver}, {gap}" + (f"; LP lower bound {p.lp_bound:.4g}" if p.lp_bound is not None else ""),
        "floor: the lowest peak any plan reaches here is "
        + (f"{p.floor_bytes:,} bytes ({both_units(p.floor_bytes)})" if p.floor_bytes is not None else "not saved")
        + (
            f"; persistent state and the largest op alone are {result.state_floor_bytes:,} bytes"
            if result.state_floor_bytes is not None
            else ""
        ),
    ]
    if result.peak_by_evidence:
        lines.insert(0, evidence_line(result.peak_by_evidence))
    items.append(Text("\n".join(lines)))
    if result.baselines:
        items.append(baselines_table(result))
    if result.verification is not None:
        items.append(verification_text(result))
    if saved:
        items.append(Text(f"wrote {saved}"))
    items.append(notes_text([*p.notes, UNITS_NOTE]))
    print_renderables(*items, console=console)


_EVIDENCE_WORDS = {
    "traced": "tensor storages, traced",
    "measured": "kernel workspace, each kernel run alone",
    "declared": "the CPU RNG state each checkpointed call keeps, torch's size",
}


def evidence_line(by_evidence: dict[str, int]) -> str:
    """What the predicted peak is made of, by evidence: what the budget is compared with."""
    order = [*_EVIDENCE_WORDS, *sorted(set(by_evidence) - set(_EVIDENCE_WORDS))]
    parts = [f"{k} {by_evidence[k]:,} ({_EVIDENCE_WORDS.get(k, k)})" for k in order if k in by_evidence]
    return "the budget is compared with all of it: " + "; ".join(parts)


def _extra(p: Any) -> str:
    if p.extra_flops is None:
        return "extra compute: not saved with the plan"
    text = f"extra compute: {p.extra_flops:,} FLOPs recomputed in backward (matmuls, convolutions, attention)"
    if p.extra_other_flops is not None:
        text += (
            f" + {p.extra_other_flops:,} charged to the other recomputed ops (1 per output element; "
            "FlopCounterMode counts them 0)"
        )
    if p.extra_seconds is None:
        return text + "; counted on fake tensors, not timed"
    return (
        f"{text}; {p.extra_seconds * 1e3:.2f} ms measured "
        "(ops up to each region's early stop, medians of repeated single-thread runs)"
    )


def _head(result: PlanResult) -> str:
    p = result.plan
    budget, plain = p.budget_bytes, p.plain_peak_bytes
    head = f"plan for {p.model or 'the model'}: budget "
    head += f"{budget:,} bytes ({both_units(budget)})" if budget is not None else "not saved"
    if result.budget_percent is not None:
        head += f", {result.budget_percent:.1f}%"
    if plain is not None:
        head += f" of the plain step's traced peak {plain:,} bytes ({both_units(plain)})"
    return head


def verification_text(result: PlanResult) -> Text:
    """What running the plan showed, line by line."""
    from trainledger.remat import AGREEMENT

    v = result.verification
    assert v is not None
    yes = {True: "yes", False: "NO"}
    device = result.predicted.device if result.predicted is not None else "cpu"
    budget = f"{v.budget_bytes:,}" if v.budget_bytes is not None else "(none)"
    lines = [
        "verification (the plan applied, the step traced again):",
        f"  traced peak {v.traced_peak_bytes:,} bytes, predicted {v.predicted_peak_bytes:,}: "
        f"{100 * v.relative_error:+.3f}% ({'agree' if v.agrees else 'DISAGREE'}, limit {100 * AGREEMENT:.0f}%)",
        f"  within the budget {budget}: {yes[v.within_budget]}",
        f"  gradients bitwise equal to the plain step's (same seed, {device}, dropout on): "
        + (
            f"{yes[v.gradients_bitwise_equal]} ({v.num_gradients - len(v.mismatched)} of {v.num_gradients})"
            if v.num_gradients
            else "not compared"
        )
        + _first(v.mismatched),
        "  parameters, buffers and optimizer state after one step bitwise equal to the plain step's: "
        f"{yes[v.state_bitwise_equal]} ({v.num_state - len(v.mismatched_state)} of {v.num_state})"
        + _first(v.mismatched_state),
        "  every region recomputed in the traced step: "
        + ("yes" if not v.not_run else "NO, never ran: " + ", ".join(v.not_run)),
    ]
    if v.plain_step_seconds is None or v.planned_step_seconds is None or v.extra_step_seconds is None:
        lines.append("  step time: not measured")
    else:
        lines.append(
            f"  step time: plain {v.plain_step_seconds * 1e3:.1f} ms, with the plan {v.planned_step_seconds * 1e3:.1f} "
            f"ms: {v.extra_step_seconds * 1e3:+.1f} ms (medians of 7 untraced steps each, interleaved, one thread)"
        )
    return Text("\n".join(lines))


def _first(names: tuple[str, ...], limit: int = 3) -> str:
    if not names:
        return ""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return "; differ: " + ", ".join(names[:limit]) + more


def regions_table(result: PlanResult) -> Table | Text:
    """The recomputed regions with their costs (``-``: not saved; a ``plan --save`` file holds only the regions)."""
    if not result.plan.regions:
        return Text("nothing to recompute: the plain step already fits")
    table = Table(title="recompute (non-reentrant torch.utils.checkpoint, RNG state preserved)", title_justify="left")
    for col in ("module", "policy", "saved bytes", "recompute transient", "recompute FLOPs", "recompute ms"):
        table.add_column(col, justify="left" if col in ("module", "policy") else "right")
    for r, c in result.recomputed():
        policy = r.description
        if r.restore:
            policy += f"; recomputes on a copy of {len(r.restore)} buffers"
        if c is None:
            table.add_row(r.where, policy, "-", "-", "-", "-")
            continue
        transient = c.recompute_transient_bytes
        table.add_row(
            r.where,
            policy,
            f"{c.saved_bytes:,}",
            f"{transient:,}" if transient is not None else "-",
            f"{c.recompute_flops:,}",
            f"{c.recompute_seconds * 1e3:.3f}" if result.plan.extra_seconds is not None else "-",
        )
    return table


def baselines_table(result: PlanResult) -> Table:
    """The plan beside the named baselines on the same step: predicted peak and extra compute."""
    p = result.plan
    timed = p.extra_seconds is not None
    table = Table(title="beside the plans people use (predicted on the same trace)", title_justify="left")
    for col in ("plan", "peak bytes", "extra FLOPs", "other ops", *(("ms",) if timed else ()), "regions"):
        table.add_column(col, justify="left" if col == "plan" else "right")

    def row(name: str, peak: int | None, flops: int | None, other: int | None, ms: float | None, n: Any) -> None:
        cells = [name, "-" if peak is None else f"{peak:,}", "-" if flops is None else f"{flops:,}"]
        cells.append("-" if other is None else f"{other:,}")
        if timed:
            cells.append("-" if ms is None else f"{ms * 1e3:.2f}")
        table.add_row(*cells, "-" if n is None else str(n))

    row("this plan", p.predicted_peak_bytes, p.extra_flops, p.extra_other_flops, p.extra_seconds, len(p.regions))
    for b in result.baselines:
        label = b.label + (f"\n  {b.note}" if b.note else "")
        if b.choice is None:
            row(label, None, None, None, None, None)
        else:
            row(label, b.peak_bytes, b.extra_flops, b.extra_other_flops, b.extra_seconds, len(b.choice))
    table.caption = "other ops: the cost charged to ops FlopCounterMode counts 0, one FLOP per output element"
    return table
