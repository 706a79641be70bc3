"""Activation rematerialization: choose what to recompute under a memory budget, run the plan, prove it.

Example:
    >>> from trainledger.examples import gpt_tiny
    >>> from trainledger import remat
    >>> w = gpt_tiny()
    >>> p = remat.plan(w, "60%")
    >>> p.predicted_peak_bytes <= p.budget_bytes
    True
    >>> p.apply(w.model); p.remove(w.model)

Private modules, public names chosen here: ``_budget`` (:class:`Budget`), ``_solvers`` (pure: chain DP,
MILP, greedy, √n), ``_candidates`` (regions and costs from a traced step, and the replay of any plan on
it), ``_planner`` (:func:`plan`), ``_plan`` (the :class:`Plan` object), ``_reserved`` and ``_full`` (budgets
on reserved memory, per rank), ``_plan_and_verify``, ``_verify`` and ``_pareto``.
"""

from __future__ import annotations

from trainledger.remat._budget import Budget
from trainledger.remat._candidates import (
    COSTS,
    OTHER_OP_FLOPS_PER_ELEMENT,
    Candidate,
    CandidateCost,
    Candidates,
    CostKind,
    candidate_costs,
    find_candidates,
    linear_model,
    regions_of,
    replay,
)
from trainledger.remat._full import (
    RESERVED_LOWERING_ROUNDS,
    InfeasibleReserved,
    RankPlanner,
    Sharding,
    plan_for_instance,
    solve_budget,
    solve_per_rank,
    solve_reserved,
    verify_fake,
)
from trainledger.remat._pareto import ParetoResult, ParetoRow, Point, pareto
from trainledger.remat._plan import OP_POLICIES, POLICIES, OpPolicy, Plan, Region, structure_fingerprint
from trainledger.remat._plan_and_verify import plan_and_verify
from trainledger.remat._planner import (
    InfeasibleBudget,
    Planner,
    PlanResult,
    peak_by_evidence,
    plan,
)
from trainledger.remat._reserved import BUDGET_ON, BudgetOn, ReservedFit, reserved_of
from trainledger.remat._solvers import (
    SOLVERS,
    Chain,
    LinearModel,
    NoPlan,
    Solution,
    SolverName,
    brute_force,
    chain_savings,
    min_peak,
    solve,
    solve_dp,
    solve_greedy,
    solve_milp,
    sqrt_n_choice,
    uniform_chain_model,
)
from trainledger.remat._verify import AGREEMENT, Verification, compare_gradients, compare_state, verify

__all__ = [
    "AGREEMENT",
    "BUDGET_ON",
    "COSTS",
    "OP_POLICIES",
    "OTHER_OP_FLOPS_PER_ELEMENT",
    "POLICIES",
    "RESERVED_LOWERING_ROUNDS",
    "SOLVERS",
    "Budget",
    "BudgetOn",
    "Candidate",
    "CandidateCost",
    "Candidates",
    "Chain",
    "CostKind",
    "InfeasibleBudget",
    "InfeasibleReserved",
    "LinearModel",
    "NoPlan",
    "OpPolicy",
    "ParetoResult",
    "ParetoRow",
    "Plan",
    "PlanResult",
    "Planner",
    "Point",
    "RankPlanner",
    "Region",
    "ReservedFit",
    "Sharding",
    "Solution",
    "SolverName",
    "Verification",
    "brute_force",
    "candidate_costs",
    "chain_savings",
    "compare_gradients",
    "compare_state",
    "find_candidates",
    "linear_model",
    "min_peak",
    "pareto",
    "peak_by_evidence",
    "plan",
    "plan_and_verify",
    "plan_for_instance",
    "regions_of",
    "replay",
    "reserved_of",
    "solve",
    "solve_budget",
    "solve_dp",
    "solve_greedy",
    "solve_milp",
    "solve_per_rank",
    "solve_reserved",
    "sqrt_n_choice",
    "structure_fingerprint",
    "uniform_chain_model",
    "verify",
    "verify_fake",
]
