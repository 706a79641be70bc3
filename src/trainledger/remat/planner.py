"""``trainledger.plan(workload, budget=...)``: trace the step, find candidates, solve, return a :class:`Plan`.

A budget is an absolute size (``2GiB``, bytes) or a percentage of the plain step's traced peak. A budget
no plan meets raises :class:`InfeasibleBudget`, which states the floor and carries the best plan found.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from trainledger.errors import InputError
from trainledger.ledger import Ledger, LedgerSummary
from trainledger.remat._plan import Plan, structure_fingerprint
from trainledger.remat._record import ForwardRecord, record_forward
from trainledger.remat.candidates import (
    Candidates,
    CostKind,
    find_candidates,
    linear_model,
    regions_of,
    replay,
)
from trainledger.remat.solvers import SOLVERS, LinearModel, NoPlan, Solution, SolverName, min_peak, solve
from trainledger.units import format_bytes, parse_size
from trainledger.workload import Workload

_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


class InfeasibleBudget(InputError):
    """No plan keeps the peak within the budget. Carries the floor and the best (lowest-peak) plan."""

    def __init__(self, message: str, *, budget_bytes: int, floor_bytes: int, best: Plan) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.floor_bytes = floor_bytes
        self.best = best


def parse_budget(text: str | int, plain_peak_bytes: int) -> int:
    """``60%`` of the plain peak, or a size: ``2GiB``, ``512MiB``, ``1e9``, plain bytes.

    Example:
        >>> parse_budget("50%", 1000), parse_budget("1KiB", 1000)
        (500, 1024)
    """
    if isinstance(text, str):
        m = _PERCENT.match(text)
        if m:
            share = float(m.group(1))
            if share <= 0:
                raise InputError(f"budget {text!r} must be a positive percentage of the plain peak")
            return int(plain_peak_bytes * share // 100)
        if text.strip().endswith("%"):
            raise InputError(f"budget {text!r} is not understood; use a percentage (60%) or a size (2GiB, bytes)")
    try:
        return parse_size(text)
    except InputError:
        raise InputError(
            f"budget {text!r} is not understood; use a percentage of the plain peak (60%) or a size "
            "(2GiB, 512MiB, bytes)"
        ) from None


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

    def restore(self) -> None:
        """Put the model and optimizer back in the state the plain step was traced from, so a re-trace
        sees the same weights (and, in data-dependent models such as an MoE, the same routing)."""
        if self.initial_state is None:
            return
        model_state, opt_state = self.initial_state
        self.workload.model.load_state_dict(copy.deepcopy(model_state))
        self.workload.get_optimizer().load_state_dict(copy.deepcopy(opt_state))

    @classmethod
    def build(cls, workload: Workload, *, cost: CostKind = "seconds", plain: Ledger | None = None) -> Planner:
        from trainledger.trace import trace

        if cost not in ("seconds", "flops"):
            raise InputError(f"unknown cost {cost!r}; accepted: seconds, flops")
        initial = None
        if plain is None:
            initial = (
                copy.deepcopy(workload.model.state_dict()),
                copy.deepcopy(workload.get_optimizer().state_dict()),
            )
            plain = trace(workload)
        record = record_forward(workload)
        cs = find_candidates(plain, workload.model, record)
        lm = linear_model(cs, cost=cost)
        floor, choice = min_peak(lm)
        return cls(workload, plain, record, cs, lm, cost, floor, choice, _state_floor(plain), initial)

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
            extra_seconds=sum(c.seconds for c in chosen),
            solver=sol.solver,
            optimal=sol.optimal,
            gap=sol.gap,
            lp_bound=sol.lp_bound,
            floor_bytes=self.floor_bytes,
            notes=(*cs.notes, *sol.notes),
        )

    def solve(self, budget: str | int, *, solver: SolverName = "auto", time_limit_s: float = 20.0) -> Plan:
        """The cheapest plan found whose predicted peak is within ``budget``."""
        if solver not in SOLVERS:
            raise InputError(f"unknown solver {solver!r}; accepted: {', '.join(SOLVERS)}")
        budget_bytes = parse_budget(budget, self.plain_peak_bytes)
        try:
            sol = solve(
                self.model,
                budget_bytes,
                solver=solver,
                time_limit_s=time_limit_s,
                block_candidates=self.block_candidates(),
            )
        except NoPlan as exc:
            best = self.to_plan(
                Solution(self.floor_choice, self.floor_bytes, self.model.total_cost(self.floor_choice), "milp", True),
                budget_bytes=budget_bytes,
            )
            if budget_bytes >= self.floor_bytes:  # a heuristic solver missed a plan the floor proves exists
                raise InputError(
                    f"solver {solver} found no plan within {_both(budget_bytes)} ({exc}); use --solver auto or milp"
                ) from None
            if not self.candidates.candidates:
                raise InfeasibleBudget(
                    f"budget {_both(budget_bytes)} is below the plain step's peak {_both(self.floor_bytes)}, and "
                    "this model has no region worth recomputing (each module called once, saving activations "
                    "of its own: e.g. blocks of a ModuleList; single layers keep their inputs anyway); group "
                    "layers into block modules, or raise the budget",
                    budget_bytes=budget_bytes,
                    floor_bytes=self.floor_bytes,
                    best=best,
                ) from None
            raise InfeasibleBudget(
                f"budget {_both(budget_bytes)} is below the floor {_both(self.floor_bytes)}: the lowest peak "
                f"any plan reaches on this model (persistent state and the largest op's outputs alone are "
                f"{_both(self.state_floor_bytes)}); the best plan recomputes "
                f"{len(best.regions)} regions and peaks at {_both(best.predicted_peak_bytes or 0)}; "
                "raise the budget or shard the state",
                budget_bytes=budget_bytes,
                floor_bytes=self.floor_bytes,
                best=best,
            ) from None
        return self.to_plan(sol, budget_bytes=budget_bytes)

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
    budget: str | int,
    *,
    solver: SolverName = "auto",
    cost: CostKind = "seconds",
    time_limit_s: float = 20.0,
) -> Plan:
    """Choose what to recompute so the step's peak fits ``budget``, at the least extra compute.

    Arguments:
        workload: the step (it is traced, so it runs: a warm-up step and a traced step).
        budget: ``"60%"`` of the plain step's traced peak, or a size (``"2GiB"``, bytes).
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
    return Planner.build(workload, cost=cost).solve(budget, solver=solver, time_limit_s=time_limit_s)


def describe(plan_: Plan) -> dict[str, Any]:
    """A short summary for tables: regions, peak, extra compute."""
    return {
        "regions": [f"{r.path}" + (" (selective)" if r.policy == "selective" else "") for r in plan_.regions],
        "predicted_peak_bytes": plan_.predicted_peak_bytes,
        "extra_flops": plan_.extra_flops,
        "extra_seconds": plan_.extra_seconds,
    }


@dataclass(frozen=True)
class PlanResult:
    """What ``trainledger plan`` reports: the plan, its candidates, and the verification when asked."""

    plan: Plan
    candidates: tuple[dict[str, Any], ...]
    state_floor_bytes: int | None
    """Persistent state and the largest op alone (``None``: not saved, as in a ``plan --save`` file)."""
    verification: Any = None
    """A :class:`~trainledger.remat._verify.Verification`, or ``None`` without ``--verify``."""
    predicted: LedgerSummary | None = None
    """The figures of the plain step with the plan replayed on it (``plan.predicted.summary()``)."""

    def to_dict(self) -> dict[str, Any]:
        out = {**(self.predicted.to_dict() if self.predicted is not None else {}), **self.plan.to_dict()}
        out["state_floor_bytes"] = self.state_floor_bytes
        out["candidates"] = list(self.candidates)
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
            from trainledger.remat._verify import Verification

            verification = Verification.from_dict(data["verification"], traced=LedgerSummary.from_dict(data))
        return cls(
            plan=Plan.from_dict(data),
            candidates=tuple(data.get("candidates", ())),
            state_floor_bytes=data.get("state_floor_bytes"),
            verification=verification,
            predicted=LedgerSummary.from_dict(predicted) if "peak" in predicted else None,
        )


# The top-level keys a verified plan's JSON takes from the re-traced step (the prediction is beside it).
_TOP_LEVEL = ("evidence", "device", "peak", "category_maxima", "sum_of_category_maxima")


def plan_and_verify(
    workload: Workload,
    budget: str | int,
    *,
    solver: SolverName = "auto",
    cost: CostKind = "seconds",
    verify: bool = False,
    time_limit_s: float = 20.0,
) -> PlanResult:
    """:func:`plan`, then (``verify=True``) apply it, trace the step again, compare gradients and time it."""
    from trainledger.remat.candidates import iter_candidate_rows

    planner = Planner.build(workload, cost=cost)
    p = planner.solve(budget, solver=solver, time_limit_s=time_limit_s)
    verification = None
    if verify:
        from trainledger.remat._verify import verify as run_verify

        planner.restore()  # re-trace from the state the plain step was traced from
        verification = run_verify(workload, p)
    rows = tuple(iter_candidate_rows(planner.candidates, planner.model))
    predicted = p.predicted.summary() if p.predicted is not None else None
    return PlanResult(p, rows, planner.state_floor_bytes, verification, predicted)
