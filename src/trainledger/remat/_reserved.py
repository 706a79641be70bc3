"""Budgets on reserved memory: a plan whose predicted ``max_memory_reserved`` fits, not only its allocated peak.

On a GPU what decides an out-of-memory error is what PyTorch's caching allocator *reserves* (segments,
512-byte rounding, split remainders it cannot reuse), which exceeds the bytes tensors hold. The solvers see
allocated bytes only (a plan's peak is linear in its choices; the allocator's state is not), so the budget
on reserved memory is met by iteration (:func:`trainledger.remat.solve_reserved`, beside the per-rank
solver in :mod:`trainledger.remat._full`):

1. solve for the allocated budget (first: the reserved budget itself);
2. replay the plan on the plain step's ledger (exact against a re-trace, :mod:`trainledger.remat._verify`),
   on the fullest rank when sharded, and replay that ledger through the allocator model
   (:func:`trainledger.allocator.predict_reserved`);
3. if the predicted reserved peak exceeds the budget, lower the allocated budget by the excess and solve
   again, a few rounds at most; then bisect the allocated budget between the floor and the last one tried.

It works alike on a real model's trace (CPU kernels, replayed as if they were CUDA allocations) and on a
fake one: the plan's predicted ledger is a replay of the plain traced step either way.

Every reserved figure is the allocator model's prediction (evidence ``analytic``): nothing ran on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainledger.allocator import AllocatorConfig, ReservedPrediction, predict_reserved
from trainledger.remat._plan import Plan

BudgetOn = Literal["allocated", "reserved"]
"""What a budget is a budget on: the peak of allocated bytes, or the allocator model's predicted reserved peak."""
BUDGET_ON: tuple[BudgetOn, ...] = ("allocated", "reserved")


@dataclass(frozen=True)
class ReservedFit:
    """How a plan was made to fit a budget on reserved memory."""

    budget_bytes: int | None
    """The budget on predicted reserved memory (per rank when sharded); ``None``: the budget was on allocated
    bytes, and the prediction is reported beside the plan."""
    allocated_budget_bytes: int | None
    """The allocated budget the last round solved for (``None``: the budget was on allocated bytes)."""
    num_rounds: int
    """Plans solved and replayed through the allocator model (1: the allocated budget alone sufficed; 0: the
    budget was on allocated bytes)."""
    prediction: ReservedPrediction
    """The allocator model's prediction for the plan's replayed ledger (the fullest rank's)."""

    @property
    def max_reserved_bytes(self) -> int:
        return self.prediction.max_reserved_bytes

    @property
    def budget_on(self) -> BudgetOn:
        return "allocated" if self.budget_bytes is None else "reserved"

    @property
    def within_budget(self) -> bool | None:
        """Whether the predicted reserved peak meets the budget on reserved memory (``None``: none was set)."""
        return None if self.budget_bytes is None else self.max_reserved_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_on": self.budget_on,
            "budget_bytes": self.budget_bytes,
            "allocated_budget_bytes": self.allocated_budget_bytes,
            "num_rounds": self.num_rounds,
            "predicted_reserved": self.prediction.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReservedFit:
        """Read ``to_dict()`` back (the predicted segments are not saved)."""
        prediction = ReservedPrediction.from_dict(data["predicted_reserved"])
        return cls(data["budget_bytes"], data["allocated_budget_bytes"], int(data["num_rounds"]), prediction)


def reserved_of(plan: Plan, *, config: AllocatorConfig, capacity_bytes: int | None) -> ReservedPrediction:
    """The allocator model's prediction for ``plan``'s predicted ledger (the fullest rank's when sharded)."""
    assert plan.predicted is not None, "a plan made by the planner carries its predicted ledger"
    return predict_reserved(plan.predicted, kernel_kind=plan.kernel_kind, config=config, capacity_bytes=capacity_bytes)
