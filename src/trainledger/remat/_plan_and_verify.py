"""``plan_and_verify``: what ``trainledger plan`` computes for a real model: the plan for a budget on allocated
or reserved bytes, and (``verify``) the planned step traced again, its gradients compared and timed."""

from __future__ import annotations

from trainledger.allocator import AllocatorConfig
from trainledger.checks import one_of
from trainledger.remat._budget import Budget
from trainledger.remat._candidates import CostKind, candidate_costs
from trainledger.remat._full import Sharding, solve_budget
from trainledger.remat._planner import Planner, PlanResult, check_plan_arguments, peak_by_evidence
from trainledger.remat._reserved import BUDGET_ON, BudgetOn
from trainledger.remat._solvers import SolverName
from trainledger.remat._verify import verify as run_verify
from trainledger.workload import Workload


def plan_and_verify(
    workload: Workload,
    budget: Budget | str | int,
    *,
    solver: SolverName = "auto",
    cost: CostKind = "seconds",
    verify: bool = False,
    time_limit_s: float = 20.0,
    budget_on: BudgetOn = "allocated",
    allocator: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
) -> PlanResult:
    """:func:`plan`, then (``verify=True``) apply it, trace the step again, compare gradients and time it.

    Arguments:
        budget_on: ``"reserved"``: the budget is on the caching allocator model's predicted reserved peak of the
            plan's predicted ledger, met by lowering the allocated budget (:func:`~trainledger.remat.solve_reserved`).
        allocator: the allocator model's options (default PyTorch's when ``budget_on="reserved"``); with the model
            on, ``PlanResult.reserved`` holds the plan's prediction and ``verify`` replays the re-traced ledger too.
        capacity_bytes: the device's usable memory, for the allocator model's verdict (``None``: no limit).

    Example:
        >>> from trainledger.examples import gpt_tiny
        >>> r = plan_and_verify(gpt_tiny(), 10_000_000, budget_on="reserved", cost="flops")
        >>> r.reserved.max_reserved_bytes <= 10_000_000
        True
    """
    budget = check_plan_arguments(
        workload, budget, solver=solver, cost=cost, time_limit_s=time_limit_s, caller="plan_and_verify"
    )
    one_of(budget_on, "budget_on", BUDGET_ON)
    config = allocator if allocator is not None or budget_on == "allocated" else AllocatorConfig()
    planner = Planner.build(workload, cost=cost)
    budget_bytes = budget.resolve(planner.plain_peak_bytes)
    p, fit = solve_budget(
        planner,
        budget_bytes,
        Sharding(),
        budget_on=budget_on,
        config=config,
        capacity_bytes=capacity_bytes,
        solver=solver,
        time_limit_s=time_limit_s,
    )
    verification = None
    if verify:
        planner.restore()  # re-trace from the state the plain step was traced from
        reserved_budget = budget_bytes if budget_on == "reserved" else None
        verification = run_verify(
            workload, p, allocator=config, capacity_bytes=capacity_bytes, reserved_budget_bytes=reserved_budget
        )
    costs = candidate_costs(planner.candidates, planner.model)
    predicted = p.predicted.summary() if p.predicted is not None else None
    by_evidence = peak_by_evidence(p.predicted) if p.predicted is not None else None
    baselines = planner.baselines()
    return PlanResult(p, costs, planner.state_floor_bytes, verification, predicted, by_evidence, baselines, fit)
