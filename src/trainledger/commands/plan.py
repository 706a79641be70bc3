"""``trainledger plan``: choose what to recompute so the step fits a budget; ``--verify`` proves it."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import keyword
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainledger.commands._gpu import Target, add_device_flags, device_line, reserved_text
from trainledger.commands._hfstep import add_step_source_flags, small_workload, workload_for
from trainledger.commands.common import add_json_flag, input_paths, print_json
from trainledger.commands.estimate import kernel_kind_of
from trainledger.errors import InputError
from trainledger.report.exports import check_output_path
from trainledger.report.terminal import UNITS_NOTE, both_units, make_console, notes_text, peak_text, print_renderables
from trainledger.units import counted

if TYPE_CHECKING:
    from trainledger.remat import PlanResult

# The command line's choices, kept here so that `--help` needs neither numpy nor scipy (the planner does);
# a test holds them equal to trainledger.remat's SOLVERS, COSTS and BUDGET_ON. argparse checks them; nothing else does.
SOLVERS = ("auto", "dp", "milp", "greedy", "sqrt-n", "uniform")
COSTS = ("seconds", "flops")
BUDGET_ON = ("allocated", "reserved")


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
        default=None,
        help="a share of the plain step's traced peak (60%%) or a size (2GiB); per rank with --world "
        "(default with --device: its usable memory)",
    )
    add_kernel_flags(p)
    add_budget_on_flag(p, "what must fit the budget")
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


def add_kernel_flags(p: argparse.ArgumentParser) -> None:
    """``--device-kind``, ``--device`` and ``--allocator``; shared by ``plan`` and ``pareto``."""
    p.add_argument(
        "--device-kind",
        default=None,
        choices=("cpu", "cuda"),
        metavar="KIND",
        help="whose kernels: cpu (default, the ones that run here) or cuda (the step as PyTorch's CUDA kernels "
        "would run it, on fake tensors; the card is --device's, default an H100; cost in FLOPs)",
    )
    add_device_flags(p)


def add_budget_on_flag(p: argparse.ArgumentParser, what: str) -> None:
    """``--budget-on allocated|reserved``; shared by ``plan`` and ``pareto``."""
    p.add_argument(
        "--budget-on",
        default=None,
        choices=BUDGET_ON,
        help=f"{what}: the peak of allocated bytes, or the caching allocator's predicted reserved bytes "
        "(default reserved with --device or --allocator, else allocated)",
    )


def kernel_kind_for(args: argparse.Namespace) -> str:
    """``--device-kind``; with ``--device``, its kernels (``cuda``) unless a contradicting kind is refused."""
    if args.device is not None:
        return kernel_kind_of(args)
    return args.device_kind or "cpu"


def check_kernel_kind(args: argparse.Namespace) -> str:
    """The kernel kind, checked against the cost; a CUDA-kind step from a config is built on fake tensors."""
    kind = kernel_kind_for(args)
    if kind == "cuda":
        if args.cost == "seconds":
            raise InputError(
                "--cost seconds times this machine's kernels; --device-kind cuda plans with CUDA's, which do not run "
                "here: the cost is FLOPs (drop --cost)"
            )
        if from_config(args):
            args.fake = True  # as trace: a CUDA-kind step runs on fake tensors, never built with values
    return kind


def add_cost_flag(p: argparse.ArgumentParser) -> None:
    """What the solver minimises; shared by ``plan`` and ``pareto``."""
    p.add_argument(
        "--cost",
        default=None,
        choices=COSTS,
        help="what to minimise: seconds (measured) or flops (default seconds; flops with --fake)",
    )


def from_config(args: argparse.Namespace) -> bool:
    """Whether the step is built from a config (``--hf-config``, ``--diffusers-config``), not ``--model``."""
    return bool(args.hf_config or args.diffusers_config)


def require_model(args: argparse.Namespace) -> None:
    """``plan`` and ``pareto`` run a model: ``--model`` is required (a config's step is planned on fake tensors)."""
    if not args.model:
        raise InputError("give --model NAME|file.py:factory, or a config with --fake (see --help)")


def budget_for(args: argparse.Namespace) -> Any:
    """``--budget`` parsed, or the usable memory of ``--device``."""
    from trainledger.remat import Budget

    if args.budget is not None:
        return Budget.parse(args.budget)
    if args.device is not None:
        return Budget(nbytes=args.device.usable_bytes)
    raise InputError("give --budget (a share such as 60%, or a size such as 70GiB) or --device NAME (its memory)")


def budget_on(args: argparse.Namespace) -> Literal["allocated", "reserved"]:
    """``--budget-on``, by default ``reserved`` when the allocator model runs (``--device``, ``--allocator``)."""
    return args.budget_on or ("reserved" if args.device is not None or args.allocator is not None else "allocated")


def compute(args: argparse.Namespace) -> PlanResult:
    require_solvers()
    from trainledger.remat import plan_and_verify

    kind = check_kernel_kind(args)
    budget = budget_for(args)  # before the step is traced
    for flag, given in (("--save", args.save), ("--export-policy", args.export_policy)):
        if given is not None and not given.strip():
            raise InputError(f"{flag} was given an empty path; give a file name (plan.json, remat_policy.py)")
    if args.save:
        check_output_path(args.save, (".json",), what="plan", protect=input_paths(args))
    if args.export_policy:
        check_policy_path(args)
    if full_size(args, kind):
        return compute_fake(args, budget, kind)
    require_model(args)
    workload = workload_for(args)  # refuses the flags that only a config's step takes
    return plan_and_verify(
        workload,
        budget,
        solver=args.solver,
        cost=args.cost or "seconds",
        verify=args.verify,
        budget_on=budget_on(args),
        allocator=args.allocator,
    )


def _refuse_a_loaded_module(path: str) -> None:
    """Refuse to write over the source of a module this process imported (a model file's own layers)."""
    target = Path(path).resolve()
    for name, module in list(sys.modules.items()):
        source = getattr(module, "__file__", None)
        if isinstance(source, str) and Path(source).resolve() == target:
            raise InputError(
                f"policy file path {path!r} is the source of module {name!r}, which the model imported; "
                "refusing to overwrite it: pick another path"
            )


def check_policy_path(args: argparse.Namespace) -> None:
    """``--export-policy``: a writable ``.py`` path whose name can be imported."""
    path = check_output_path(args.export_policy, (".py",), what="policy file", protect=input_paths(args))
    if path.suffix != ".py":  # import finds module.py, not module.PY
        raise InputError(f"policy file name {path.name!r} must end in .py (lower case) for `import {path.stem}`")
    if not path.stem.isidentifier() or keyword.iskeyword(path.stem):
        raise InputError(
            f"policy file name {path.name!r} cannot be imported (`import {path.stem}`); "
            "use letters, digits and _, as in remat_policy.py"
        )
    if _names_a_module(path.stem):  # torch.py beside a training script hides torch itself from it
        raise InputError(
            f"policy file name {path.name!r} is the name of a module Python finds already ({path.stem}): beside a "
            "training script it would hide that module; pick another name, as in remat_policy.py"
        )


def _names_a_module(name: str) -> bool:
    """Whether ``import name`` finds a module without the policy file: one of the standard library's, or one this
    environment has installed (a file of that name in the current folder is the user's own, not counted)."""
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return True
    here = {str(Path.cwd()), "", "."}
    return importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if p not in here]) is not None


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
        if key == "allocator":  # parsed options: the flag alone stands for PyTorch's defaults
            parts += [flag] if value == type(value)() else []
            continue
        value = getattr(value, "name", value)  # a device of the table by its name
        parts += [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


def full_size(args: argparse.Namespace, kind: str = "cpu") -> bool:
    """A step on fake tensors (``--fake``, or CUDA's kernels); ``--hf-config`` and sharding need it
    (``InputError`` otherwise)."""
    given = [
        f
        for f, on in (
            ("--hf-config", args.hf_config),
            ("--diffusers-config", args.diffusers_config),
            ("--world", args.world > 1),
            ("--stage", args.stage != "0"),
        )
        if on
    ]
    if given and not args.fake and kind != "cuda":
        raise InputError(f"with {', '.join(given)}, plan plans a step at full size on fake tensors: add --fake")
    if args.fake and args.cost == "seconds":
        raise InputError("--cost seconds needs the step to run; on fake tensors the cost is flops (drop --cost)")
    return bool(args.fake) or kind == "cuda"


def fake_planner(args: argparse.Namespace, kind: str = "cpu") -> tuple[Any, Any, Any]:
    """The workload the flags describe on fake tensors, its planner (FLOP costs, ``kind``'s kernels) and its
    sharding."""
    from trainledger.remat import Planner, Sharding
    from trainledger.shard import parse_strategy

    sharding = Sharding(world_size=args.world, strategy=parse_strategy(args.stage))
    workload = workload_for(args)
    gpu = args.device if kind == "cuda" else None
    with config_steps_run_fake(args):
        planner = Planner.build(workload, cost="flops", fake=True, kernel_kind=kind, cuda_device=gpu)  # type: ignore[arg-type]
    return workload, planner, sharding


@contextmanager
def config_steps_run_fake(args: argparse.Namespace) -> Iterator[None]:
    """A config's step that fake tensors cannot run: say that a plan of it needs ``--model`` (trace's advice,
    to drop ``--fake``, does not apply to a plan made from a config)."""
    try:
        yield
    except InputError as exc:
        if not from_config(args) or "without --fake" not in str(exc):
            raise
        raise InputError(
            f"{exc}; a plan from a config is made on fake tensors: plan this model on a real step with "
            "--model file.py:factory (at a size that fits here)"
        ) from exc


def _real_or_none(workload: Any) -> Any:
    """``--model --fake`` of a model with real weights: its gradients are compared on the real step itself."""
    from torch._subclasses.fake_tensor import FakeTensor

    params = list(workload.model.parameters())
    fake = any(isinstance(q, FakeTensor) or q.is_meta for q in params)
    return None if fake or not params else workload


def compute_fake(args: argparse.Namespace, budget: Any, kind: str = "cpu") -> PlanResult:
    """``plan --fake`` (or with CUDA's kernels): plan on the fake step's trace, per rank, on allocated or
    reserved memory; ``--verify`` re-traces it on fake tensors under the same kernels and compares gradients
    on a real CPU step (the model itself for ``--model``, a small instance for ``--hf-config``)."""
    from dataclasses import replace

    from trainledger.allocator import AllocatorConfig
    from trainledger.remat import PlanResult, candidate_costs, peak_by_evidence, verify_fake

    configured = from_config(args)
    # a config's small instance is built before the (long) plan: one too large to step is refused at once
    small, what = small_workload(args) if args.verify and configured else (None, "")
    workload, planner, sharding = fake_planner(args, kind)
    target = Target.of(args)
    budget_bytes = budget.resolve(sharding.rank_ledger(planner.plain).peak().bytes)
    reserved_budget = budget_bytes if budget_on(args) == "reserved" else None
    config = target.allocator if target.allocator is not None else AllocatorConfig()
    p, fit = _solve(args, planner, budget_bytes, sharding, config if reserved_budget or target.allocator else None)
    p = replace(p, extra_seconds=None)  # fake kernels compute nothing: their times mean nothing
    verification = None
    if args.verify:
        small = small if configured else _real_or_none(workload)
        verification = verify_fake(
            workload,
            p,
            sharding,
            small=small,
            allocator=config if fit is not None else None,
            capacity_bytes=target.capacity_bytes,
            reserved_budget_bytes=reserved_budget,
        )
        p = replace(p, notes=(*p.notes, verification_note(kind, small is not None, what)))
    costs = candidate_costs(planner.candidates, planner.model)
    state_floor = planner.state_floor_bytes if sharding.trivial else None
    baselines = planner.baselines(_per_rank_peak(planner, sharding), timed=False)
    summary = p.predicted.summary() if p.predicted else None
    by_evidence = peak_by_evidence(p.predicted) if p.predicted else None
    return PlanResult(p, costs, state_floor, verification, summary, by_evidence, baselines, fit, args.device)


def _solve(args: argparse.Namespace, planner: Any, budget_bytes: int, sharding: Any, config: Any) -> tuple[Any, Any]:
    """The plan for ``budget_bytes`` on the bytes ``--budget-on`` names, with the allocator model's prediction
    (:class:`~trainledger.remat.ReservedFit`) when it is on (``config``), else ``None``."""
    from trainledger.remat import solve_budget

    capacity = args.device.usable_bytes if args.device is not None else None
    return solve_budget(
        planner,
        budget_bytes,
        sharding,
        budget_on=budget_on(args),
        config=config,
        capacity_bytes=capacity,
        solver=args.solver,
    )


def verification_note(kind: str, compared: bool, instance: str = "") -> str:
    """What ``--verify`` re-traced, under which kernels, and where the gradients were compared (``instance``:
    the small instance of a config's architecture they were compared on, in words; empty: the model itself)."""
    kernels = f"{kind} kernels" + (" substituted" if kind == "cuda" else "")
    traced = f"verification: the planned step traced again on fake tensors with {kernels} (the peak compared)"
    if not compared:
        return f"{traced}; gradients cannot be compared on a model built on fake tensors"
    if instance:
        return (
            f"{traced}; gradients and state compared on a real CPU step of a small instance of the architecture "
            f"({instance}) running the same plan by module path and policy "
            "(block i as block i mod its depth there), with this machine's cpu kernels"
        )
    return f"{traced}; gradients and state compared on a real CPU step of the model itself, with this machine's kernels"


def _per_rank_peak(planner: Any, sharding: Any) -> Any:
    """The fullest rank's peak of a choice of candidates, replayed and sharded (``None``: not sharded)."""
    if sharding.trivial:
        return None
    from trainledger.remat import replay

    return lambda choice: sharding.rank_ledger(replay(planner.candidates, choice)).peak().bytes


def run(args: argparse.Namespace) -> int:
    result = compute(args)
    v = result.verification
    failed = v is not None and not v.passed
    outputs = [f for f in (args.save, args.export_policy) if f]
    if args.save and not failed:  # a plan its verification failed is not written for a training loop to apply
        result.plan.save(args.save, extra={"baselines": [b.to_dict() for b in result.baselines]})
    if args.export_policy and not failed:
        _refuse_a_loaded_module(args.export_policy)  # known now that the model is built: its own layers
        result.plan.export_policy(args.export_policy, command=command_line(args))
    if args.json:
        print_json(result.to_dict())
    else:
        render(result, make_console(), saved=", ".join(outputs) if not failed else None)
    if failed and outputs:
        sys.stderr.write(f"trainledger plan: the plan failed its verification: {', '.join(outputs)} not written\n")
    return 1 if failed else 0


def kernels_line(p: Any) -> str:
    """The kernels a plan's figures assume (a saved plan from before kernel kinds: cpu)."""
    if p.kernel_kind == "cuda":
        return (
            f"kernels: cuda as on {p.cuda_device or 'an H100'} (CUDA's kernels substituted in a trace on fake CPU "
            "tensors; nothing ran on a GPU; cost in FLOPs)"
        )
    return "kernels: cpu (the ones that run here)"


def device_check(result: PlanResult, device: Any) -> str:
    """The plan's predicted allocated peak beside ``device``'s usable memory (an estimate: total less context)."""
    peak = result.plan.predicted_peak_bytes or 0
    usable = device.usable_bytes
    verdict = "fits" if peak <= usable else f"EXCEEDS it by {peak - usable:,} bytes ({both_units(peak - usable)})"
    missing = "" if result.reserved is not None else "; reserved memory not predicted (add --allocator)"
    return f"on {device.name}: the predicted allocated peak {peak:,} bytes {verdict} its usable {usable:,}{missing}"


def reserved_lines(result: PlanResult, device: Any) -> list[Any]:
    """The allocator model's figures for the plan, and how a budget on reserved memory was met."""
    fit = result.reserved
    if fit is None:
        return []
    if fit.budget_bytes is None:
        how = "budget on allocated bytes; reserved predicted for the plan, not budgeted"
    else:
        within = "within" if fit.max_reserved_bytes <= fit.budget_bytes else "ABOVE"
        how = (
            f"budget on reserved memory: predicted reserved {fit.max_reserved_bytes:,} bytes, {within} the budget "
            f"{fit.budget_bytes:,}; solved for an allocated budget of {fit.allocated_budget_bytes:,} bytes after "
            f"{counted(fit.num_rounds, 'round')} ({_how_rounds(fit.num_rounds)})"
        )
    return [Text(how), reserved_text(fit.prediction, device)]


def _how_rounds(num_rounds: int) -> str:
    from trainledger.remat import RESERVED_LOWERING_ROUNDS as lowering

    if num_rounds <= lowering:
        return "each lowers it by the reserved excess"
    return (
        f"the first {lowering} lower it by the reserved excess, the other {num_rounds - lowering} "
        "bisect it between the floor and the last budget tried"
    )


def render(result: PlanResult, console: Console, *, saved: str | None = None) -> None:
    p = result.plan
    device = result.device
    first = [_head(result), kernels_line(p)]
    if device is not None:
        first += [device_line(device), device_check(result, device)]
    items: list[Any] = [Text("\n".join(first)), *reserved_lines(result, device)]
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
        lines.insert(0, evidence_line(result.peak_by_evidence, p.kernel_kind))
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
    "analytic": "gathered parameters and communication buffers the sharding engine adds, by its model",
}


_CUDA_EVIDENCE_WORDS = {
    "traced": "tensor storages, traced with CUDA's kernels substituted",
    "declared": "the cuBLAS workspace, CUDA's size for the card",
}


def evidence_line(by_evidence: dict[str, int], kernel_kind: str = "cpu") -> str:
    """What the predicted peak is made of, by evidence: what the budget is compared with."""
    words = {**_EVIDENCE_WORDS, **(_CUDA_EVIDENCE_WORDS if kernel_kind == "cuda" else {})}
    order = [*words, *sorted(set(by_evidence) - set(words))]
    parts = [f"{k} {by_evidence[k]:,} ({words.get(k, k)})" for k in order if k in by_evidence]
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
    kind = result.plan.kernel_kind
    budget = f"{v.budget_bytes:,}" if v.budget_bytes is not None else "(none)"
    where = "" if kind == "cpu" else f" with {kind} kernels; gradients from a real cpu step"
    lines = [
        f"verification (the plan applied, the step traced again{where}):",
        f"  traced peak {v.traced_peak_bytes:,} bytes, predicted {v.predicted_peak_bytes:,}: "
        f"{100 * v.relative_error:+.3f}% ({'agree' if v.agrees else 'DISAGREE'}, limit {100 * AGREEMENT:.0f}%)",
        f"  within the budget {budget}: {yes[v.within_budget]}",
    ]
    if v.reserved is not None:
        r = v.reserved
        lines.append(
            f"  re-traced ledger through the allocator model: predicted reserved {r.max_reserved_bytes:,} bytes, "
            f"fragmentation at the peak {r.fragmentation_bytes:,}"
            + (
                f"; within the reserved budget {v.reserved_budget_bytes:,}: {yes[bool(v.reserved_within_budget)]}"
                if v.reserved_budget_bytes is not None
                else ""
            )
        )
    lines += [
        "  gradients bitwise equal to the plain step's (same seed, cpu, dropout on): "
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
