"""``trainledger.plan(workload, budget=...)``: trace the step, find candidates, solve, return a :class:`Plan`.

A budget is an absolute size (``2GiB``, bytes) or a percentage of the plain step's traced peak. A budget
no plan meets raises :class:`InfeasibleBudget`, which states the floor and carries the best plan found.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from trainledger.checks import one_of, positive_number
from trainledger.devices import Device, KernelKind, lookup
from trainledger.errors import InputError
from trainledger.ledger import Ledger, LedgerSummary
from trainledger.remat._baselines import Baseline, baseline_choices
from trainledger.remat._budget import Budget
from trainledger.remat._candidates import (
    COSTS,
    CandidateCost,
    Candidates,
    CostKind,
    find_candidates,
    linear_model,
    regions_of,
    replay,
)
from trainledger.remat._plan import Plan, Region, structure_fingerprint
from trainledger.remat._policy_file import cache_back, cache_off
from trainledger.remat._reserved import ReservedFit
from trainledger.remat._solvers import SOLVERS, LinearModel, NoPlan, Solution, SolverName, min_peak, solve
from trainledger.remat._verify import Verification
from trainledger.trace import ForwardRecord, record_forward
from trainledger.units import counted, format_bytes
from trainledger.workload import Workload, require_workload

_FIXED_PLANS = ("sqrt-n", "uniform")
"""Solvers whose plan does not depend on the budget (baselines): asked for, they are given."""


NO_REGION = (
    "this model has no region worth recomputing (each module called once, saving activations of its own: e.g. blocks "
    "of a ModuleList; single layers keep their inputs anyway)"
)
"""Why a model has no plan but its plain step: said by ``plan`` below its plain peak, and by ``pareto``."""


def no_region_why(plain: Ledger, notes: tuple[str, ...] = ()) -> str:
    """Why ``plain``'s model has no region to recompute, and what would give it one: a model that checkpoints
    its own modules already saves only what its checkpoints keep; calls the candidates' ``notes`` say cannot be
    recomputed (their own writes, or a later op's, in place)."""
    refused = [n for n in notes if n.startswith("not recomputed")]
    if refused:
        return "no region can be recomputed here: " + "; ".join(refused)
    own = plain.meta.get("recomputed_modules")
    if not own:
        return f"{NO_REGION}; group layers into block modules"
    shown = ", ".join(own[:3]) + (f" and {len(own) - 3} more" if len(own) > 3 else "")
    return (
        f"this model already recomputes {counted(len(own), 'module')} in backward ({shown}: its own activation "
        "checkpointing), and no other region is worth recomputing; take its own checkpointing out to let plan "
        "choose what to recompute"
    )


CACHE_OFF_NOTE = (
    "the model's key/value cache (use_cache=True) is off in the plain step traced here, as it is under any plan: "
    "trace, with it on, also holds every layer's cached keys and values through the step"
)


class InfeasibleBudget(InputError):
    """No plan keeps the peak within the budget. Carries the floor and the best (lowest-peak) plan."""

    def __init__(self, message: str, *, budget_bytes: int, floor_bytes: int, best: Plan) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.floor_bytes = floor_bytes
        self.best = best


@dataclass
class Planner:
    """The traced plain step of one workload and its candidates: solve for as many budgets as wanted."""

    workload: Workload
    plain: Ledger
    record: ForwardRecord
    candidates: Candidates
    model: LinearModel
    cost: CostKind
    floor_bytes: int
    floor_choice: tuple[int, ...]
    state_floor_bytes: int
    """Persistent state plus the largest single op's outputs: no plan of any kind goes below it."""
    initial_state: tuple[dict[str, Any], dict[str, Any]] | None = None
    """Model and optimizer state before the plain step was traced (tracing takes optimizer steps)."""
    kernel_kind: KernelKind = "cpu"
    """Whose kernels the plain step was traced with (``cuda``: CUDA's, substituted on fake tensors)."""
    cuda_device: str | None = None
    """With ``cuda``: the card's name in the device table."""

    def floor_solution(self) -> Solution:
        """The floor plan's choice, at its replayed peak (the floor every reported plan is measured against)."""
        return Solution(self.floor_choice, self.floor_bytes, self.model.total_cost(self.floor_choice), "milp", True)

    def restore(self) -> None:
        """Put the model and optimizer back in the state the plain step was traced from, so a re-trace
        sees the same weights (and, in data-dependent models such as an MoE, the same routing)."""
        if self.initial_state is None:
            return
        model_state, opt_state = self.initial_state
        self.workload.model.load_state_dict(copy.deepcopy(model_state))
        self.workload.get_optimizer().load_state_dict(copy.deepcopy(opt_state))

    @classmethod
    def build(
        cls,
        workload: Workload,
        *,
        cost: CostKind = "seconds",
        plain: Ledger | None = None,
        fake: bool = False,
        kernel_kind: KernelKind = "cpu",
        cuda_device: str | Device | None = None,
    ) -> Planner:
        """Trace ``workload`` (unless ``plain`` is given) and find its candidates.

        ``fake``: trace and record on fake tensors (full size, nothing allocated); the costs are then FLOPs
        alone (nothing runs, so nothing is timed) and ``cost`` must be ``"flops"``.

        ``kernel_kind``, ``cuda_device``: as for :func:`trainledger.trace.trace`. With ``cuda`` the plain step
        and the recorded forward run CUDA's kernels on fake tensors, so the candidates, their bytes and the
        plain peak are the CUDA step's; nothing runs on a card, so ``cost`` must be ``"flops"``.
        """
        from trainledger.trace import cuda_device_of, trace

        gpu = cuda_device_of(kernel_kind, cuda_device)
        if (fake or gpu is not None) and cost != "flops":
            what = "CUDA's kernels, which do not run here" if gpu is not None else "fake tensors"
            raise InputError(f"a plan on {what} minimises FLOPs (nothing runs, nothing is timed): use cost flops")
        initial = None
        kinds: dict[str, Any] = {"kernel_kind": kernel_kind, "cuda_device": gpu}
        # the step is traced and recorded as it runs under a plan: with a Hugging Face model's key/value cache off
        # (a plan turns it off), which a training step with it on fills with every layer's keys and values
        cached = cache_off(workload.model, warn=False)
        try:
            if plain is None:
                if not fake and gpu is None:
                    initial = (
                        copy.deepcopy(workload.model.state_dict()),
                        copy.deepcopy(workload.get_optimizer().state_dict()),
                    )
                plain = trace(workload, fake=fake, **kinds)
            record = record_forward(workload, fake=fake, **kinds)
        finally:
            cache_back(workload.model)
        cs = find_candidates(plain, workload.model, record)
        if cached:
            cs = replace(cs, notes=(*cs.notes, CACHE_OFF_NOTE))
        lm = linear_model(cs, cost=cost)
        _, choice = min_peak(lm)
        # the floor is the floor plan's own replay, as every plan's predicted peak is: the linear model adds up
        # each region's change alone, which can miss where two adjacent regions share what they keep
        floor = replay(cs, choice).peak().bytes
        name = gpu.name if gpu is not None else None
        return cls(
            workload, plain, record, cs, lm, cost, floor, choice, _state_floor(plain), initial, kernel_kind, name
        )

    @property
    def plain_peak_bytes(self) -> int:
        return self.plain.peak().bytes

    def to_plan(self, sol: Solution, *, budget_bytes: int | None) -> Plan:
        cs = self.candidates
        predicted = replay(cs, sol.choice)
        chosen = [cs.candidates[j] for j in sol.choice]
        return Plan(
            regions=regions_of(cs, sol.choice),
            fingerprint=structure_fingerprint(self.workload.model),
            model=self.workload.name,
            budget_bytes=budget_bytes,
            plain_peak_bytes=self.plain_peak_bytes,
            predicted_peak_bytes=predicted.peak().bytes,
            predicted=predicted,
            extra_flops=sum(c.flops for c in chosen),
            extra_other_flops=sum(c.other_flops for c in chosen),
            extra_seconds=sum(c.seconds for c in chosen),
            solver=sol.solver,
            optimal=sol.optimal,
            gap=sol.gap,
            lp_bound=sol.lp_bound,
            floor_bytes=self.floor_bytes,
            notes=(*cs.notes, *sol.notes),
            kernel_kind=self.kernel_kind,
            cuda_device=self.cuda_device,
        )

    def solve(self, budget: Budget | str | int, *, solver: SolverName = "auto", time_limit_s: float = 20.0) -> Plan:
        """The cheapest plan found whose predicted peak is within ``budget`` (a string or int is parsed)."""
        budget_bytes = Budget.parse(budget).resolve(self.plain_peak_bytes)
        if budget_bytes >= self.plain_peak_bytes and solver not in _FIXED_PLANS:
            # the cheapest plan within a budget the plain step already meets recomputes nothing
            note = "the budget is at or above the plain step's traced peak: nothing to recompute"
            sol = Solution((), self.plain_peak_bytes, 0.0, solver, optimal=True, gap=0.0, notes=(note,))
            return self.to_plan(sol, budget_bytes=budget_bytes)
        try:
            sol = solve(
                self.model,
                budget_bytes,
                solver=solver,
                time_limit_s=time_limit_s,
                block_candidates=self.block_candidates(),
            )
        except NoPlan as exc:
            best = self.to_plan(self.floor_solution(), budget_bytes=budget_bytes)
            if budget_bytes >= self.floor_bytes and solver in ("auto", "milp"):
                return best  # the linear model put the floor plan above the budget; its replay is within it
            if budget_bytes >= self.floor_bytes:  # a heuristic solver missed a plan the floor proves exists
                raise InputError(
                    f"solver {solver} found no plan within {_both(budget_bytes)} ({exc}); use --solver auto or milp"
                ) from None
            raise InfeasibleBudget(
                self._no_plan_within(budget_bytes, best),
                budget_bytes=budget_bytes,
                floor_bytes=self.floor_bytes,
                best=best,
            ) from None
        return self.to_plan(sol, budget_bytes=budget_bytes)

    def _no_plan_within(self, budget_bytes: int, best: Plan) -> str:
        """Why no plan meets ``budget_bytes`` (below the floor), and what would: ``best`` is the floor's plan."""
        if not self.candidates.candidates:
            return (
                f"budget {_both(budget_bytes)} is below the plain step's peak {_both(self.floor_bytes)}, and "
                f"{no_region_why(self.candidates.plain, self.candidates.notes)}, or raise the budget"
            )
        state = f"persistent state and the largest op's outputs alone are {_both(self.state_floor_bytes)}"
        if not best.regions:  # the floor is the plain peak: recomputation frees nothing at its instant
            peak = self.candidates.plain.peak()
            return (
                f"budget {_both(budget_bytes)} is below the plain step's peak {_both(self.floor_bytes)}, which no "
                f"plan lowers: it is at event {peak.event} ({peak.phase}, {peak.op}), where recomputing "
                f"frees nothing ({state}); raise the budget or shard the state"
            )
        return (
            f"budget {_both(budget_bytes)} is below the floor {_both(self.floor_bytes)}: the lowest peak "
            f"any plan reaches on this model ({state}); the best plan recomputes "
            f"{counted(len(best.regions), 'region')} and peaks at {_both(best.predicted_peak_bytes or 0)}; "
            "raise the budget or shard the state"
        )

    def baselines(
        self, peak_of: Callable[[tuple[int, ...]], int] | None = None, *, timed: bool = True
    ) -> tuple[Baseline, ...]:
        """The named baselines (:mod:`~trainledger.remat._baselines`) with their predicted peaks: by
        ``peak_of`` a choice of candidates (default: the linear model's, exact), ``timed=False`` on fake tensors."""
        peak = peak_of or self.model.peak
        return tuple(
            replace(
                b,
                peak_bytes=None if b.choice is None else peak(b.choice),
                extra_seconds=b.extra_seconds if timed else None,
            )
            for b in baseline_choices(self.candidates)
        )

    def block_candidates(self) -> list[int]:
        """The full-policy candidate of each block of the repeated stacks (what uniform checkpointing wraps)."""
        return list(self.candidates.blocks)


def _state_floor(plain: Ledger) -> int:
    persistent = sum(e.nbytes for e in plain.entries if e.persistent)
    outputs: dict[int, int] = {}
    for e in plain.entries:
        if e.alloc_event is not None:
            outputs[e.alloc_event] = outputs.get(e.alloc_event, 0) + e.nbytes
    return persistent + max(outputs.values(), default=0)


def _both(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({format_bytes(nbytes)})"


def plan(
    workload: Workload,
    budget: Budget | str | int,
    *,
    solver: SolverName = "auto",
    cost: CostKind = "seconds",
    time_limit_s: float = 20.0,
) -> Plan:
    """Choose what to recompute so the step's peak fits ``budget``, at the least extra compute.

    Arguments:
        workload: the step (it is traced, so it runs: a warm-up step and a traced step).
        budget: a :class:`Budget`, or what :meth:`Budget.parse` reads: ``"60%"`` of the plain step's traced
            peak, or a size (``"2GiB"``, bytes).
        solver: ``auto`` (DP on chains, else MILP), ``dp``, ``milp``, ``greedy``, ``sqrt-n``, ``uniform``.
        cost: what the solver minimises: measured ``seconds`` of the recomputed ops, or ``flops``.
        time_limit_s: the MILP's time limit.

    Returns:
        A :class:`Plan`; ``plan.apply(model)`` makes the model run it.

    Raises:
        InfeasibleBudget: no plan meets the budget (it states the floor and carries the best plan).

    Example:
        >>> from trainledger.examples import gpt_tiny
        >>> p = plan(gpt_tiny(), "70%")
        >>> p.predicted_peak_bytes <= p.budget_bytes
        True
    """
    budget = check_plan_arguments(workload, budget, solver=solver, cost=cost, time_limit_s=time_limit_s, caller="plan")
    return Planner.build(workload, cost=cost).solve(budget, solver=solver, time_limit_s=time_limit_s)


def check_plan_arguments(
    workload: Any, budget: Any, *, solver: Any, cost: Any, time_limit_s: Any, caller: str
) -> Budget:
    """The checks of :func:`plan` and :func:`plan_and_verify`, made once and before anything is traced.

    Returns the budget, parsed.
    """
    require_workload(workload, caller)
    parsed = Budget.parse(budget)
    one_of(solver, "solver", SOLVERS)
    one_of(cost, "cost", COSTS)
    positive_number(time_limit_s, "time limit", unit="seconds")
    return parsed


@dataclass(frozen=True)
class PlanResult:
    """What ``trainledger plan`` reports: the plan, its candidates, and the verification when asked."""

    plan: Plan
    candidates: tuple[CandidateCost, ...]
    """Every candidate region the solver chose from, with its costs (empty in a ``plan --save`` file)."""
    state_floor_bytes: int | None
    """Persistent state and the largest op alone (``None``: not saved, as in a ``plan --save`` file)."""
    verification: Verification | None = None
    """What running the plan showed, or ``None`` without ``verify``."""
    predicted: LedgerSummary | None = None
    """The figures of the plain step with the plan replayed on it (``plan.predicted.summary()``)."""
    peak_by_evidence: dict[str, int] | None = None
    """The predicted peak split by how each part is known (``traced`` storages, ``measured`` kernel
    workspace, ``declared`` RNG states of the checkpoints, ...); ``None``: not known (a saved plan)."""
    baselines: tuple[Baseline, ...] = ()
    """The named baselines on the same step (no recomputation, full per block, Megatron selective, op-level
    SAC per block), to set beside the plan."""
    reserved: ReservedFit | None = None
    """The allocator model's prediction for the plan, and how a budget on reserved memory was met (``None``:
    the allocator model was off)."""
    device: Device | None = None
    """The accelerator the plan is judged against (``--device``): its usable memory; ``None``: none named."""

    def recomputed(self) -> tuple[tuple[Region, CandidateCost | None], ...]:
        """The plan's regions, each with its candidate's costs (``None``: not saved with the plan)."""
        by_region = {c.key: c for c in self.candidates}
        return tuple((r, by_region.get((r.path, r.policy, r.call))) for r in self.plan.regions)

    @property
    def budget_percent(self) -> float | None:
        """The budget as a percentage of the plain step's traced peak (``None``: either is unknown)."""
        p = self.plan
        if p.budget_bytes is None or p.plain_peak_bytes is None:
            return None
        return 100 * p.budget_bytes / max(p.plain_peak_bytes, 1)

    def to_dict(self) -> dict[str, Any]:
        out = {**(self.predicted.to_dict() if self.predicted is not None else {}), **self.plan.to_dict()}
        out["state_floor_bytes"] = self.state_floor_bytes
        out["candidates"] = [c.to_dict() for c in self.candidates]
        out["baselines"] = [b.to_dict() for b in self.baselines]
        out["peak_by_evidence"] = self.peak_by_evidence
        out["reserved"] = self.reserved.to_dict() if self.reserved is not None else None
        d = self.device
        out["target_device"] = None if d is None else {"name": d.name, "usable_bytes": d.usable_bytes}
        if self.verification is not None:
            if self.predicted is not None:
                out["predicted"] = self.predicted.to_dict()
            out.update({k: v for k, v in self.verification.traced.to_dict().items() if k in _TOP_LEVEL})
            out["verification"] = self.verification.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanResult:
        """Read ``to_dict()`` or a saved plan (``Plan.save``) back (``trainledger report``).

        With a verification the top level is the re-traced step and the prediction is under ``predicted``.
        """
        predicted = data.get("predicted", data)
        verification = None
        if "verification" in data:
            verification = Verification.from_dict(data["verification"], traced=LedgerSummary.from_dict(data))
        return cls(
            plan=Plan.from_dict(data),
            candidates=tuple(CandidateCost.from_dict(c) for c in data.get("candidates", ())),
            state_floor_bytes=data.get("state_floor_bytes"),
            verification=verification,
            predicted=LedgerSummary.from_dict(predicted) if "peak" in predicted else None,
            baselines=tuple(Baseline.from_dict(b) for b in data.get("baselines", ())),
            peak_by_evidence=data.get("peak_by_evidence"),
            reserved=ReservedFit.from_dict(data["reserved"]) if data.get("reserved") else None,
            device=lookup(data["target_device"]["name"]) if data.get("target_device") else None,
        )


# The top-level keys a verified plan's JSON takes from the re-traced step (the prediction is beside it).
_TOP_LEVEL = ("evidence", "device", "peak", "category_maxima", "sum_of_category_maxima")


def peak_by_evidence(ledger: Ledger) -> dict[str, int]:
    """The bytes live at ``ledger``'s peak instant, by evidence (they sum to the peak).

    Example:
        >>> from trainledger.ledger import Category, Entry, Event, Evidence, Ledger
        >>> e = Entry("a", Category.ACTIVATIONS, "saved", "float32", 4, 16, alloc_event=0, free_event=1,
        ...           evidence=Evidence.TRACED)
        >>> peak_by_evidence(Ledger((e,), (Event(0, "forward", "aten.mm", ""),)))
        {'traced': 16}
    """
    event = ledger.peak().event
    entries = ledger.entries if event is None else ledger.live_at(event)
    out: dict[str, int] = {}
    for e in entries:
        out[str(e.evidence)] = out.get(str(e.evidence), 0) + e.nbytes
    return out
