"""Prove a plan: apply it, trace the step again, compare gradients and state bit for bit, time the step.

Gradients are compared on one forward and backward from the same model state and the same RNG seed, with
and without the plan (dropout on: the plan's checkpointing preserves the RNG state, so the masks drawn
during recomputation are the ones drawn in forward). Then one whole training step is run from the same
state with and without the plan, and every parameter, buffer (a BatchNorm's running statistics) and
optimizer state tensor after it is compared bit for bit: a recomputation that updated a buffer a second
time shows here. The re-traced step also tells whether every region of the plan ran. The model and
optimizer state are restored after.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainledger.allocator import AllocatorConfig, ReservedPrediction, predict_reserved
from trainledger.inventory import optimizers_within
from trainledger.ledger import Ledger, LedgerSummary
from trainledger.remat._plan import Plan
from trainledger.trace import TrainingState
from trainledger.workload import Workload, call_model, compute_loss, intra_op_threads, run_step, user_errors

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
    state_bitwise_equal: bool
    """Parameters, buffers and optimizer state after one step with the plan equal those without it."""
    num_state: int
    mismatched_state: tuple[str, ...]
    not_run: tuple[str, ...]
    """Regions of the plan that were never recomputed in the traced step (a plan that does nothing there)."""
    plain_step_seconds: float | None
    planned_step_seconds: float | None
    """Medians over repeated untraced steps (``None``: not timed)."""
    reserved: ReservedPrediction | None = None
    """The allocator model's prediction for the re-traced ledger (``None``: the allocator model was off)."""
    reserved_budget_bytes: int | None = None
    """With a budget on reserved memory: that budget, which ``reserved`` must meet too."""

    @property
    def relative_error(self) -> float:
        return (self.predicted_peak_bytes - self.traced_peak_bytes) / max(1, self.traced_peak_bytes)

    @property
    def agrees(self) -> bool:
        return abs(self.relative_error) <= AGREEMENT

    @property
    def within_budget(self) -> bool:
        allocated = self.budget_bytes is None or self.traced_peak_bytes <= self.budget_bytes
        return allocated and self.reserved_within_budget is not False

    @property
    def reserved_within_budget(self) -> bool | None:
        """Whether the re-traced step's predicted reserved peak meets the reserved budget (``None``: none set)."""
        if self.reserved is None or self.reserved_budget_bytes is None:
            return None
        return self.reserved.max_reserved_bytes <= self.reserved_budget_bytes

    @property
    def passed(self) -> bool:
        """Within the budget, gradients and state bitwise equal, and every region ran."""
        return self.within_budget and self.gradients_bitwise_equal and self.state_bitwise_equal and not self.not_run

    @property
    def extra_step_seconds(self) -> float | None:
        if self.planned_step_seconds is None or self.plain_step_seconds is None:
            return None
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
            "state_bitwise_equal": self.state_bitwise_equal,
            "num_state_tensors": self.num_state,
            "mismatched_state": list(self.mismatched_state),
            "regions_not_run": list(self.not_run),
            "passed": self.passed,
            "plain_step_seconds": self.plain_step_seconds,
            "planned_step_seconds": self.planned_step_seconds,
            "extra_step_seconds": self.extra_step_seconds,
            "traced_reserved": self.reserved.to_dict() if self.reserved is not None else None,
            "reserved_budget_bytes": self.reserved_budget_bytes,
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
            state_bitwise_equal=bool(data["state_bitwise_equal"]),
            num_state=int(data["num_state_tensors"]),
            mismatched_state=tuple(data["mismatched_state"]),
            not_run=tuple(data["regions_not_run"]),
            plain_step_seconds=_seconds(data["plain_step_seconds"]),
            planned_step_seconds=_seconds(data["planned_step_seconds"]),
            reserved=ReservedPrediction.from_dict(data["traced_reserved"]) if data.get("traced_reserved") else None,
            reserved_budget_bytes=data.get("reserved_budget_bytes"),
        )


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


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
    return _with_and_without(workload, plan, lambda: gradients(workload, seed=seed))


def state_after_step(workload: Workload, *, seed: int = 0) -> dict[str, Any]:
    """Every parameter, buffer and optimizer state value after one training step from the current state
    with ``torch.manual_seed(seed)`` (copies; the model and optimizer are left stepped)."""
    model, opt = workload.model, workload.get_optimizer()
    torch.manual_seed(seed)
    run_step(workload)
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        out[f"parameter {name}"] = p.detach().clone()
    for name, b in model.named_buffers():
        out[f"buffer {name}"] = b.detach().clone()
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            out[f"optimizer state {index}.{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return out


def compare_state(workload: Workload, plan: Plan, *, seed: int = 0) -> tuple[bool, int, tuple[str, ...]]:
    """One whole step with and without the plan, from the same state and seed: (bitwise equal, count, mismatched)."""
    return _with_and_without(workload, plan, lambda: state_after_step(workload, seed=seed))


def _with_and_without(
    workload: Workload, plan: Plan, observe: Callable[[], dict[str, Any]]
) -> tuple[bool, int, tuple[str, ...]]:
    """``observe()`` from the same model, optimizer and RNG state without and with the plan, compared value
    by value: (all bitwise equal, how many values, the names that differ). Everything is rewound after."""
    model, opt = workload.model, workload.get_optimizer()
    # parameters, buffers, gradients, the optimizer's state and its own parameters (fp32 masters of bf16 weights),
    # and every generator: the default ones, and a torch.Generator a module holds (which no seed resets)
    snapshot = TrainingState.of([model], optimizers_within(opt))
    rewind = snapshot.restore
    try:
        plain = observe()
        rewind()
        plan.apply(model)
        try:
            with user_errors("the step with the plan applied"):
                planned = observe()
        finally:
            plan.remove(model)
    finally:
        rewind()
    mismatched = tuple(n for n in sorted(plain.keys() | planned.keys()) if not _same(plain.get(n), planned.get(n)))
    return not mismatched, len(plain), mismatched


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a is not None and type(a) is type(b) and a == b


def step_seconds(workload: Workload, plan: Plan, *, repeats: int = 7) -> tuple[float, float]:
    """Median wall times of untraced steps without and with ``plan``, interleaved so that load on the
    machine affects both alike (one warm-up step of each first), on one intra-op thread; model, optimizer and
    every generator restored after (the re-trace that follows starts where the comparisons did: a LayerDrop that
    draws from torch's generator skipped another layer after the timed steps)."""
    model, opt = workload.model, workload.get_optimizer()
    snapshot = TrainingState.of([model], optimizers_within(opt))
    plain: list[float] = []
    planned: list[float] = []
    try:
        with intra_op_threads(1):  # as the per-op costs: stable on a busy machine (see trace.record_forward)
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
        snapshot.restore()
    return statistics.median(plain), statistics.median(planned)


def verify(
    workload: Workload,
    plan: Plan,
    *,
    repeats: int = 7,
    timing: bool = True,
    allocator: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
    reserved_budget_bytes: int | None = None,
) -> Verification:
    """Apply ``plan`` to ``workload.model``, trace the step, compare gradients and time; then remove it.

    The step is traced from the workload's current state; where shapes depend on the weights (an MoE's
    routing), restore the state the plan was made from first (``Planner.restore``), as the CLI does.

    Arguments:
        repeats: untraced steps timed with and without the plan (interleaved).
        timing: ``False`` skips the timing (both times are then ``None``).
        allocator, capacity_bytes, reserved_budget_bytes: also replay the re-traced ledger through the
            allocator model (see :func:`with_reserved`).
    """
    from trainledger.trace import trace

    equal, count, mismatched = compare_gradients(workload, plan)
    state_equal, num_state, state_mismatched = compare_state(workload, plan)
    plain_s, planned_s = step_seconds(workload, plan, repeats=repeats) if timing else (None, None)
    plan.apply(workload.model)
    try:
        traced = trace(workload)
        runs = plan.runs(workload.model)
    finally:
        plan.remove(workload.model)
    v = verification_of(
        plan,
        traced,
        runs,
        (equal, count, mismatched),
        (state_equal, num_state, state_mismatched),
        (plain_s, planned_s),
    )
    return with_reserved(
        v, traced, plan, allocator=allocator, capacity_bytes=capacity_bytes, reserved_budget_bytes=reserved_budget_bytes
    )


def with_reserved(
    v: Verification,
    traced: Ledger,
    plan: Plan,
    *,
    allocator: AllocatorConfig | None,
    capacity_bytes: int | None = None,
    reserved_budget_bytes: int | None = None,
) -> Verification:
    """``v`` with the allocator model's prediction for the re-traced ledger ``traced`` (the fullest rank's when
    sharded), judged against ``capacity_bytes`` and, with ``reserved_budget_bytes``, a budget on reserved memory;
    ``v`` itself when ``allocator`` is ``None`` (the model is off)."""
    if allocator is None:
        return v
    reserved = predict_reserved(traced, kernel_kind=plan.kernel_kind, config=allocator, capacity_bytes=capacity_bytes)
    return replace(v, reserved=reserved, reserved_budget_bytes=reserved_budget_bytes)


Compared = tuple[bool, int, tuple[str, ...]]
"""(all bitwise equal, how many values, the names that differ)."""


def verification_of(
    plan: Plan,
    traced: Ledger,
    runs: dict[Any, int],
    gradients: Compared,
    state: Compared,
    seconds: tuple[float | None, float | None] = (None, None),
) -> Verification:
    """What the re-traced step ``traced``, the recomputations counted (``runs``) and the comparisons showed."""
    predicted = plan.predicted_peak_bytes if plan.predicted_peak_bytes is not None else traced.peak().bytes
    return Verification(
        traced=traced.summary(),
        predicted_peak_bytes=predicted,
        traced_peak_bytes=traced.peak().bytes,
        budget_bytes=plan.budget_bytes,
        gradients_bitwise_equal=gradients[0],
        num_gradients=gradients[1],
        mismatched=gradients[2],
        state_bitwise_equal=state[0],
        num_state=state[1],
        mismatched_state=state[2],
        not_run=tuple(r.label for r, n in runs.items() if n == 0),
        plain_step_seconds=seconds[0],
        planned_step_seconds=seconds[1],
    )
