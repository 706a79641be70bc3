"""Activation rematerialization: choose what to recompute under a memory budget, run the plan, prove it.

Example:
    >>> from trainledger.examples import gpt_tiny
    >>> from trainledger import remat
    >>> w = gpt_tiny()
    >>> p = remat.plan(w, "60%")
    >>> p.predicted_peak_bytes <= p.budget_bytes
    True
    >>> p.apply(w.model); p.remove(w.model)

Modules: ``solvers`` (pure: chain DP, MILP, greedy, √n), ``candidates`` (regions and costs from a traced
step, and the replay of any plan on it), ``planner`` (budgets, :func:`plan`), plus the private ``_plan``
(the :class:`Plan` object), ``_verify`` and ``_pareto``.
"""

from __future__ import annotations

from trainledger.remat._pareto import ParetoResult, pareto, plot_pareto
from trainledger.remat._plan import Plan, Region, structure_fingerprint
from trainledger.remat._verify import Verification, verify
from trainledger.remat.planner import InfeasibleBudget, Planner, PlanResult, parse_budget, plan, plan_and_verify

__all__ = [
    "InfeasibleBudget",
    "ParetoResult",
    "Plan",
    "PlanResult",
    "Planner",
    "Region",
    "Verification",
    "pareto",
    "parse_budget",
    "plan",
    "plan_and_verify",
    "plot_pareto",
    "structure_fingerprint",
    "verify",
]
