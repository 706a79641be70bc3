"""Plans at full size: a step traced on fake tensors, a budget per rank of a sharded step, and the proof.

A model too large to run here is traced on fake tensors (``trace(workload, fake=True)``): every byte is
exact, but nothing is computed, so the candidates' costs are FLOPs (``torch.utils.flop_counter``'s
formulas, op by op) and never seconds. With data-parallel sharding (ZeRO, FSDP) the budget is what one
rank holds: each plan is replayed on the plain step's ledger, and the replayed ledger is sharded
(:func:`trainledger.shard.shard`); the plan must fit the peak of the fullest rank.

The solvers work on the unsharded step. Sharding takes persistent state off each rank (nearly the same
bytes whatever is recomputed) and adds communication buffers, so an unsharded budget is found that makes
the sharded peak fit: start at the per-rank budget plus what sharding took off the plain step, and lower it
by the overshoot until the sharded replay fits (:func:`solve_per_rank`).

Verification at full size (:func:`verify_fake`) applies the plan to the fake model, traces the step again
on fake tensors, shards it the same way and compares the traced peak per rank with the prediction.
Gradients cannot be compared on fake tensors; they are compared bit for bit on a small real instance of
the same architecture, with the same plan by module path and policy (:func:`plan_for_instance`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from torch import nn

from trainledger.allocator import AllocatorConfig
from trainledger.checks import one_of
from trainledger.ledger import Ledger
from trainledger.remat._candidates import replay
from trainledger.remat._plan import Plan, Region, structure_fingerprint
from trainledger.remat._planner import InfeasibleBudget, Planner, _both
from trainledger.remat._reserved import BUDGET_ON, BudgetOn, ReservedFit, reserved_of
from trainledger.remat._solvers import Solution, SolverName, min_peak
from trainledger.remat._verify import (
    Compared,
    Verification,
    compare_gradients,
    compare_state,
    verification_of,
    with_reserved,
)
from trainledger.shard import Strategy, shard, totals_on_step_clock
from trainledger.units import counted
from trainledger.workload import Workload

_MAX_ROUNDS = 8
"""Rounds of lowering the unsharded budget by the sharded overshoot (two suffice on the models seen)."""
RESERVED_LOWERING_ROUNDS = 6
"""Rounds of lowering the allocated budget by the reserved excess (one or two suffice on the models seen), before
as many more bisect it."""
_BLOCK_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """How the step is spread over data-parallel ranks (``world_size=1``: not at all).

    Example:
        >>> Sharding().trivial, Sharding(world_size=8, strategy="zero3").trivial
        (True, False)
    """

    world_size: int = 1
    """Data-parallel ranks."""
    strategy: Strategy = "zero0"
    """A ZeRO stage or FSDP strategy (:data:`trainledger.shard.STRATEGIES`)."""

    @property
    def trivial(self) -> bool:
        return self.world_size == 1 and self.strategy == "zero0"

    def rank_ledger(self, ledger: Ledger) -> Ledger:
        """The ledger of the rank whose peak is highest (``ledger`` itself when nothing is sharded)."""
        if self.trivial:
            return ledger
        ranks = shard(ledger, world_size=self.world_size, strategy=self.strategy).rank_classes()
        return max((led for *_, led in ranks), key=lambda led: led.peak().bytes)

    def label(self) -> str:
        return "one process" if self.trivial else f"{self.strategy} over {self.world_size} ranks"


@dataclass(frozen=True)
class RankPlanner:
    """A planner whose solvers see the fullest rank's memory, with the figures every budget needs."""

    planner: Planner
    """The unsharded step's planner (its ledger is what plans are replayed on)."""
    rank: Planner
    """The same candidates, the linear model's plain live bytes those of the fullest rank."""
    sharding: Sharding
    plain_rank_bytes: int
    """The plain step's peak on the fullest rank."""
    floor_plan: Plan
    """The lowest-peak plan on the fullest rank (predicted on the unsharded step)."""
    floor_rank_bytes: int
    """Its peak on the fullest rank: the floor per rank."""

    @classmethod
    def of(cls, planner: Planner, sharding: Sharding) -> RankPlanner:
        """Sharding shards persistent state, not activations, so what each candidate changes (the linear
        model's ``delta``) is the same on every rank; only the plain step's live bytes (``base``, every
        candidate's recomputation laid out) differ. FSDP's hooks add events between the step's ops: each
        is counted at the op after it (:func:`trainledger.shard.totals_on_step_clock`); the replay of every
        plan, sharded, settles what that leaves out. The floor is solved again."""
        import numpy as np

        cs = planner.candidates
        laid_out = replay(cs, [], phantoms=range(len(cs.candidates)))
        base = np.asarray(totals_on_step_clock(sharding.rank_ledger(laid_out)), dtype=np.int64)
        assert base.shape == planner.model.base.shape, (base.shape, planner.model.base.shape)
        model = replace(planner.model, base=base)
        floor, choice = min_peak(model)
        rank = replace(planner, model=model, floor_bytes=floor, floor_choice=choice)
        floor_plan = rank.to_plan(_floor_solution(rank), budget_bytes=None)
        return cls(
            planner,
            rank,
            sharding,
            sharding.rank_ledger(planner.plain).peak().bytes,
            floor_plan,
            sharding.rank_ledger(floor_plan.predicted).peak().bytes,  # type: ignore[arg-type]
        )


def solve_per_rank(
    planner: Planner,
    budget_bytes: int,
    sharding: Sharding,
    *,
    solver: SolverName = "auto",
    time_limit_s: float = 20.0,
    rank_planner: RankPlanner | None = None,
) -> Plan:
    """The cheapest plan found whose predicted peak on the fullest rank is within ``budget_bytes``.

    The solvers run on :class:`RankPlanner` (``rank_planner``: made once for several budgets); each plan is
    then replayed on the plain step and sharded, and the budget lowered by any overshoot until the sharded
    replay fits. The returned plan's ``budget_bytes``, ``plain_peak_bytes``, ``predicted_peak_bytes``,
    ``floor_bytes`` and ``predicted`` are those of the fullest rank.

    Raises:
        InfeasibleBudget: even the lowest-peak plan exceeds the budget on the fullest rank (its floor is
            per rank).
    """
    if sharding.trivial:
        return planner.solve(budget_bytes, solver=solver, time_limit_s=time_limit_s)
    rp = rank_planner if rank_planner is not None else RankPlanner.of(planner, sharding)
    floor_rank = rp.floor_rank_bytes
    per_rank = {"plain_peak_bytes": rp.plain_rank_bytes, "floor_bytes": floor_rank, "budget_bytes": budget_bytes}
    if budget_bytes >= rp.plain_rank_bytes:
        return _on_rank(planner.solve(planner.plain_peak_bytes), sharding, per_rank)
    if budget_bytes < floor_rank:
        best = _on_rank(rp.floor_plan, sharding, per_rank)
        lowest = (
            f"the best plan recomputes {counted(len(best.regions), 'region')}"
            if best.regions
            else "no plan lowers the plain step's peak there (recomputing frees nothing at its instant)"
        )
        raise InfeasibleBudget(
            f"budget {_both(budget_bytes)} per rank is below the floor {_both(floor_rank)}: the lowest peak any "
            f"plan reaches on the fullest rank ({sharding.label()}); {lowest}; raise the budget, add ranks or "
            "shard more (--stage 3)",
            budget_bytes=budget_bytes,
            floor_bytes=floor_rank,
            best=best,
        )
    target = budget_bytes
    for _ in range(_MAX_ROUNDS):
        target = max(target, rp.rank.floor_bytes)
        p = _on_rank(rp.rank.solve(target, solver=solver, time_limit_s=time_limit_s), sharding, per_rank)
        over = (p.predicted_peak_bytes or 0) - budget_bytes
        if over <= 0:
            return p
        if target == rp.rank.floor_bytes:
            break
        target -= over
    return _on_rank(rp.floor_plan, sharding, per_rank)  # the floor fits (checked above)


def _floor_solution(planner: Planner) -> Solution:
    choice = planner.floor_choice
    return Solution(choice, planner.floor_bytes, planner.model.total_cost(choice), "milp", True)


def _on_rank(p: Plan, sharding: Sharding, per_rank: dict[str, int]) -> Plan:
    assert p.predicted is not None
    rank = sharding.rank_ledger(p.predicted)
    note = f"budget, peaks and floor are those of the fullest rank of the step sharded as {sharding.label()}"
    return replace(p, **per_rank, predicted_peak_bytes=rank.peak().bytes, predicted=rank, notes=(*p.notes, note))


def verify_fake(
    workload: Workload,
    plan: Plan,
    sharding: Sharding,
    *,
    small: Workload | None = None,
    allocator: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
    reserved_budget_bytes: int | None = None,
) -> Verification:
    """Apply ``plan`` to the fake ``workload``, trace its step again on fake tensors with the kernels the plan was
    made with (``plan.kernel_kind``), shard it as the plan was made, and compare the fullest rank's traced peak
    with the prediction; gradients and state are compared on ``small``, a real instance of the same
    architecture (see :func:`plan_for_instance`).

    Without ``small`` nothing is compared: the counts are 0 and the comparison reads as not failed.

    ``allocator``: also replay the re-traced ledger (the fullest rank's) through the allocator model, judged
    against ``capacity_bytes`` and, with ``reserved_budget_bytes``, against a budget on reserved memory.
    """
    from trainledger.trace import trace

    model = workload.model
    plan.apply(model)
    try:  # under the kernels the plan was made with (``Plan.kernel_kind``)
        traced = trace(workload, fake=True, kernel_kind=plan.kernel_kind, cuda_device=plan.cuda_device)  # type: ignore[arg-type]
        runs = plan.runs(model)
    finally:
        plan.remove(model)
    gradients: Compared = (True, 0, ())
    state: Compared = (True, 0, ())
    if small is not None:
        small_plan = plan_for_instance(plan, small.model)
        gradients, state = compare_gradients(small, small_plan), compare_state(small, small_plan)
    rank = sharding.rank_ledger(traced)
    v = verification_of(plan, rank, runs, gradients, state)
    return with_reserved(
        v, rank, plan, allocator=allocator, capacity_bytes=capacity_bytes, reserved_budget_bytes=reserved_budget_bytes
    )


def plan_for_instance(plan: Plan, model: nn.Module) -> Plan:
    """``plan`` for another instance of the same architecture with fewer blocks: each region keeps its
    module path and policy, with its block index taken modulo the instance's depth (block ``i`` of the
    full model is block ``i mod d``), so every kind of decision the plan makes runs on the instance. A
    region that lands on a block already taken (or inside or around a region kept) is left out.

    Example:
        >>> from trainledger.examples import gpt_tiny
        >>> m = gpt_tiny().model
        >>> p = Plan(regions=(Region("blocks.5"), Region("blocks.3", "selective")), fingerprint="")
        >>> [r.label for r in plan_for_instance(p, m).regions]
        ['blocks.1', 'blocks.3 (selective)']
    """
    modules = dict(model.named_modules())
    regions: dict[str, Region] = {}
    for r in plan.regions:
        path = r.path
        m = _BLOCK_INDEX.search(path)
        if m is not None:
            prefix = path[: m.start()]
            stack = modules.get(prefix)
            depth = len(stack) if isinstance(stack, (nn.ModuleList, nn.Sequential)) else 0
            if depth:
                path = f"{prefix}.{int(m.group(1)) % depth}{path[m.end() :]}"
        nested = any(path.startswith(k + ".") or k.startswith(path + ".") for k in regions)
        if path in modules and path not in regions and not nested:
            regions[path] = replace(r, path=path)
    return replace(plan, regions=tuple(regions.values()), fingerprint=structure_fingerprint(model), predicted=None)


class InfeasibleReserved(InfeasibleBudget):
    """No allocated budget tried gets the predicted reserved peak within the budget. ``best`` is the plan with
    the lowest predicted reserved peak reached, ``best_reserved_bytes`` that peak, ``fit`` how it was reached
    (the allocated budget solved for, the rounds tried, the allocator model's prediction)."""

    def __init__(self, message: str, *, budget_bytes: int, floor_bytes: int, best: Plan, fit: ReservedFit):
        super().__init__(message, budget_bytes=budget_bytes, floor_bytes=floor_bytes, best=best)
        self.fit = fit
        self.best_reserved_bytes = fit.max_reserved_bytes


def solve_reserved(
    planner: Planner,
    budget_bytes: int,
    sharding: Sharding,
    *,
    config: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
    solver: SolverName = "auto",
    time_limit_s: float = 20.0,
    max_rounds: int = RESERVED_LOWERING_ROUNDS,
    rank_planner: RankPlanner | None = None,
) -> tuple[Plan, ReservedFit]:
    """The cheapest plan found whose predicted reserved peak (the allocator model replaying the plan's ledger)
    is within ``budget_bytes``, by lowering the allocated budget by each round's excess.

    Reserved memory grows in whole segments (2 MiB, 20 MiB), so a small excess may take many rounds of lowering
    to clear: when ``max_rounds`` run out, up to ``max_rounds`` more bisect the allocated budget between the
    floor and the last one tried, keeping the highest that fits (the floor plan itself is the last try).

    Arguments:
        config: the allocator's options (``PYTORCH_ALLOC_CONF``; default PyTorch's).
        capacity_bytes: the device's usable memory, for the allocator model's verdict (``None``: no limit).
        rank_planner: with sharding, the :class:`RankPlanner` (made once for several budgets).

    Returns:
        The plan (its ``budget_bytes`` the reserved budget) and how it was fitted.

    Raises:
        InfeasibleReserved: no allocated budget down to the floor brings reserved within the budget; it
            carries the plan with the lowest reserved peak reached.
    """
    if rank_planner is None and not sharding.trivial:
        rank_planner = RankPlanner.of(planner, sharding)
    config = config if config is not None else AllocatorConfig()
    rounds = _ReservedRounds(
        planner, budget_bytes, sharding, config, capacity_bytes, solver, time_limit_s, rank_planner
    )
    target = budget_bytes
    tried: list[tuple[Plan, ReservedFit]] = []
    for _ in range(max_rounds):
        p, fit, at_floor = rounds.attempt(target, tried)
        over = fit.max_reserved_bytes - budget_bytes
        if over <= 0:
            return replace(p, budget_bytes=budget_bytes), fit
        if at_floor:
            break
        target = max(target - over, 1)
    else:
        found = _bisect_reserved(rounds, target, tried, max_rounds)
        if found is not None:
            return found
    plan, fit = min(tried, key=lambda t: t[1].max_reserved_bytes)
    raise InfeasibleReserved(
        f"budget {_both(budget_bytes)} on reserved memory is not met: the lowest predicted reserved peak reached "
        f"is {_both(fit.max_reserved_bytes)} (allocated {_both(plan.predicted_peak_bytes or 0)}, "
        f"{counted(len(plan.regions), 'region')} recomputed, after {len(tried)} rounds of lowering the allocated "
        "budget); "
        "raise the budget, shard more, or try --allocator expandable_segments:True",
        budget_bytes=budget_bytes,
        floor_bytes=plan.floor_bytes or 0,
        best=replace(plan, budget_bytes=budget_bytes),
        fit=replace(fit, num_rounds=len(tried)),
    )


@dataclass(frozen=True)
class _ReservedRounds:
    """One budget on reserved memory: each round solves for an allocated budget and replays the plan."""

    planner: Planner
    budget_bytes: int
    sharding: Sharding
    config: AllocatorConfig
    capacity_bytes: int | None
    solver: SolverName
    time_limit_s: float
    rank_planner: RankPlanner | None

    @property
    def floor_bytes(self) -> int:
        """The lowest allocated peak any plan reaches (on the fullest rank when sharded)."""
        return self.planner.floor_bytes if self.rank_planner is None else self.rank_planner.floor_rank_bytes

    def attempt(self, target: int, tried: list[tuple[Plan, ReservedFit]]) -> tuple[Plan, ReservedFit, bool]:
        """The plan for ``target`` allocated bytes (the floor plan below the floor: then ``True``) and its
        predicted reserved peak, appended to ``tried``."""
        try:
            p = solve_per_rank(
                self.planner,
                target,
                self.sharding,
                solver=self.solver,
                time_limit_s=self.time_limit_s,
                rank_planner=self.rank_planner,
            )
            at_floor = False
        except InfeasibleBudget as exc:  # the allocated budget fell below the floor: the floor plan is the last try
            p, at_floor = exc.best, True
        prediction = reserved_of(p, config=self.config, capacity_bytes=self.capacity_bytes)
        fit = ReservedFit(self.budget_bytes, target, len(tried) + 1, prediction)
        tried.append((p, fit))
        return p, fit, at_floor


def _bisect_reserved(
    rounds: _ReservedRounds, high: int, tried: list[tuple[Plan, ReservedFit]], max_rounds: int
) -> tuple[Plan, ReservedFit] | None:
    """The plan of the highest allocated budget between the floor and ``high`` (which does not fit) whose
    predicted reserved peak fits, by bisection in ``max_rounds`` rounds, the floor plan the last try; ``None``:
    none fits."""
    low = rounds.floor_bytes
    found: tuple[Plan, ReservedFit] | None = None
    for _ in range(max_rounds):
        if high - low <= 1:
            break
        middle = (low + high) // 2
        p, fit, _ = rounds.attempt(middle, tried)
        if fit.max_reserved_bytes <= rounds.budget_bytes:
            found, low = (p, fit), middle
        else:
            high = middle
    if found is None:
        p, fit, _ = rounds.attempt(rounds.floor_bytes, tried)
        found = (p, fit) if fit.max_reserved_bytes <= rounds.budget_bytes else None
    return None if found is None else (replace(found[0], budget_bytes=rounds.budget_bytes), found[1])


def solve_budget(
    planner: Planner,
    budget_bytes: int,
    sharding: Sharding,
    *,
    budget_on: BudgetOn = "allocated",
    config: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
    solver: SolverName = "auto",
    time_limit_s: float = 20.0,
    rank_planner: RankPlanner | None = None,
) -> tuple[Plan, ReservedFit | None]:
    """The plan for ``budget_bytes`` on allocated bytes (:func:`solve_per_rank`) or on the predicted reserved
    peak (:func:`solve_reserved`, ``budget_on="reserved"``), with the allocator model's prediction for it when
    the model is on (``config`` given, or a budget on reserved memory); ``None`` when it is off.

    Example:
        >>> from trainledger.allocator import AllocatorConfig
        >>> from trainledger.examples import gpt_tiny
        >>> planner = Planner.build(gpt_tiny(), cost="flops")
        >>> p, fit = solve_budget(planner, 10_000_000, Sharding(), budget_on="reserved")
        >>> fit.max_reserved_bytes <= 10_000_000 < p.plain_peak_bytes
        True
    """
    one_of(budget_on, "budget_on", BUDGET_ON)
    if budget_on == "reserved":
        return solve_reserved(
            planner,
            budget_bytes,
            sharding,
            config=config,
            capacity_bytes=capacity_bytes,
            solver=solver,
            time_limit_s=time_limit_s,
            rank_planner=rank_planner,
        )
    p = solve_per_rank(
        planner, budget_bytes, sharding, solver=solver, time_limit_s=time_limit_s, rank_planner=rank_planner
    )
    if config is None:
        return p, None
    return p, ReservedFit(None, None, 0, reserved_of(p, config=config, capacity_bytes=capacity_bytes))
