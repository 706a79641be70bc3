"""Prove a plan: apply it, trace the step again, compare gradients bit for bit, time the step.

Gradients are compared on one forward and backward from the same model state and the same RNG seed, with
and without the plan (dropout on: the plan's checkpointing preserves the RNG state, so the masks drawn
during recomputation are the ones drawn in forward). The model and optimizer state are restored after.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from trainledger.ledger import LedgerSummary
from trainledger.remat._plan import Plan
from trainledger.workload import Workload, call_model, compute_loss, run_step

AGREEMENT = 0.01
"""Predicted and traced peaks must agree within this share of the traced peak."""


@dataclass(frozen=True)
class Verification:
    """What running the plan showed."""

    traced: LedgerSummary
    """The figures of the step traced again with the plan applied."""
    predicted_peak_bytes: int
    traced_peak_bytes: int
    budget_bytes: int | None
    gradients_bitwise_equal: bool
    num_gradients: int
    mismatched: tuple[str, ...]
    plain_step_seconds: float
    planned_step_seconds: float
    """Medians over repeated untraced steps."""

    @property
    def relative_error(self) -> float:
        return (self.predicted_peak_bytes - self.traced_peak_bytes) / max(1, self.traced_peak_bytes)

    @property
    def agrees(self) -> bool:
        return abs(self.relative_error) <= AGREEMENT

    @property
    def within_budget(self) -> bool:
        return self.budget_bytes is None or self.traced_peak_bytes <= self.budget_bytes

    @property
    def extra_step_seconds(self) -> float:
        return self.planned_step_seconds - self.plain_step_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "traced_peak_bytes": self.traced_peak_bytes,
            "relative_error": self.relative_error,
            "agrees_within": AGREEMENT,
            "agrees": self.agrees,
            "budget_bytes": self.budget_bytes,
            "within_budget": self.within_budget,
            "gradients_bitwise_equal": self.gradients_bitwise_equal,
            "num_gradients": self.num_gradients,
            "mismatched_gradients": list(self.mismatched),
            "plain_step_seconds": self.plain_step_seconds,
            "planned_step_seconds": self.planned_step_seconds,
            "extra_step_seconds": self.extra_step_seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, traced: LedgerSummary) -> Verification:
        """Read ``to_dict()`` back; the re-traced step's figures are saved beside it (``traced``)."""
        return cls(
            traced=traced,
            predicted_peak_bytes=int(data["predicted_peak_bytes"]),
            traced_peak_bytes=int(data["traced_peak_bytes"]),
            budget_bytes=data.get("budget_bytes"),
            gradients_bitwise_equal=bool(data["gradients_bitwise_equal"]),
            num_gradients=int(data["num_gradients"]),
            mismatched=tuple(data["mismatched_gradients"]),
            plain_step_seconds=float(data["plain_step_seconds"]),
            planned_step_seconds=float(data["planned_step_seconds"]),
        )


def gradients(workload: Workload, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of one forward and backward from the current state, with ``torch.manual_seed(seed)``."""
    model = workload.model
    saved = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = compute_loss(workload, call_model(model, workload.batch))
    loss.backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        p.grad = saved[n]
    return out


def compare_gradients(workload: Workload, plan: Plan, *, seed: int = 0) -> tuple[bool, int, tuple[str, ...]]:
    """Gradients with and without the plan, from the same state and seed: (bitwise equal, count, mismatched)."""
    model = workload.model
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    try:
        plain = gradients(workload, seed=seed)
        model.load_state_dict(state)
        plan.apply(model)
        try:
            planned = gradients(workload, seed=seed)
        finally:
            plan.remove(model)
    finally:
        model.load_state_dict(state)
        torch.set_rng_state(rng)
    names = sorted(plain.keys() | planned.keys())
    mismatched = tuple(n for n in names if n not in plain or n not in planned or not torch.equal(plain[n], planned[n]))
    return not mismatched, len(plain), mismatched


def step_seconds(workload: Workload, plan: Plan, *, repeats: int = 7) -> tuple[float, float]:
    """Median wall times of untraced steps without and with ``plan``, interleaved so that load on the
    machine affects both alike (one warm-up step of each first), on one intra-op thread; model and
    optimizer restored after."""
    model, opt = workload.model, workload.get_optimizer()
    state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    plain: list[float] = []
    planned: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the per-op costs: stable on a busy machine (see _record.record_forward)
    try:
        for i in range(repeats + 1):
            for times, applied in ((plain, False), (planned, True)):
                if applied:
                    plan.apply(model)
                try:
                    start = time.perf_counter()
                    run_step(workload)
                    if i:
                        times.append(time.perf_counter() - start)
                finally:
                    if applied:
                        plan.remove(model)
    finally:
        torch.set_num_threads(threads)
        model.load_state_dict(state)
        opt.load_state_dict(opt_state)
    return statistics.median(plain), statistics.median(planned)


def verify(workload: Workload, plan: Plan, *, repeats: int = 7, timing: bool = True) -> Verification:
    """Apply ``plan`` to ``workload.model``, trace the step, compare gradients and time; then remove it.

    The step is traced from the workload's current state; where shapes depend on the weights (an MoE's
    routing), restore the state the plan was made from first (``Planner.restore``), as the CLI does.

    Arguments:
        repeats: untraced steps timed with and without the plan (interleaved).
        timing: ``False`` skips the timing (both times are then reported as 0).
    """
    from trainledger.trace import trace

    equal, count, mismatched = compare_gradients(workload, plan)
    plain_s, planned_s = step_seconds(workload, plan, repeats=repeats) if timing else (0.0, 0.0)
    plan.apply(workload.model)
    try:
        traced = trace(workload)
    finally:
        plan.remove(workload.model)
    predicted = plan.predicted_peak_bytes if plan.predicted_peak_bytes is not None else traced.peak().bytes
    return Verification(
        traced=traced.summary(),
        predicted_peak_bytes=predicted,
        traced_peak_bytes=traced.peak().bytes,
        budget_bytes=plan.budget_bytes,
        gradients_bitwise_equal=equal,
        num_gradients=count,
        mismatched=mismatched,
        plain_step_seconds=plain_s,
        planned_step_seconds=planned_s,
    )
