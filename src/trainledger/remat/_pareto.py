"""The trade-off curve: peak memory against extra compute, from the plain peak down to the floor.

For each budget: our plan (``auto``: the chain DP, or the MILP), the MILP optimum over the same plans, and
the greedy knapsack; beside them the fixed plans people use: uniform per-block checkpointing (what
Hugging Face's ``gradient_checkpointing_enable()`` does) and Chen et al.'s √n segments.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trainledger.allocator import AllocatorConfig, predict_reserved
from trainledger.checks import MAX_BUDGETS, one_of, positive_number, whole_number
from trainledger.devices import Device, KernelKind
from trainledger.errors import InputError
from trainledger.ledger import LedgerSummary
from trainledger.remat._baselines import Baseline
from trainledger.remat._candidates import COSTS, CostKind, replay
from trainledger.remat._full import InfeasibleReserved, RankPlanner, Sharding, solve_per_rank, solve_reserved
from trainledger.remat._plan import Plan
from trainledger.remat._planner import Planner, no_region_why
from trainledger.remat._reserved import BUDGET_ON, BudgetOn, ReservedFit, reserved_of
from trainledger.remat._solvers import NoPlan, Solution, solve, solve_greedy, solve_milp, sqrt_n_choice
from trainledger.remat._verify import verify as run_verify
from trainledger.workload import Workload, require_workload

PARETO_SCHEMA = "trainledger.remat-pareto/1"
SAC_NOT_RUN: dict[str, Any] = {
    "ran": False,
    "summary": "not run here: a benchmark (python benchmarks/torch_sac.py; pip install 'trainledger[sac]')",
}
"""PyTorch's SAC MILP beside our plans is a benchmark, with its own extra (``pulp``, ``pwlf``)."""


@dataclass(frozen=True)
class Point:
    """One plan: which regions, its predicted peak and its extra compute."""

    method: str
    peak_bytes: int
    extra_seconds: float
    extra_flops: int
    regions: tuple[str, ...]
    optimal: bool = False
    gap: float | None = None
    traced_peak_bytes: int | None = None
    """With ``verify``: the peak of the step traced again with the plan applied."""
    gradients_bitwise_equal: bool | None = None
    verified: bool | None = None
    """With ``verify``: the re-traced step was within the budget, its gradients and state bitwise equal to the plain
    step's, and every region ran (as ``plan --verify`` requires); ``None``: not verified."""
    extra_other_flops: int = 0
    """The cost charged to the recomputed ops ``FlopCounterMode`` counts 0 (one FLOP per output element)."""
    reserved_peak_bytes: int | None = None
    """With the allocator model on: the plan's predicted ``max_memory_reserved`` (``None``: not predicted)."""
    traced_reserved_peak_bytes: int | None = None
    """With ``verify`` and the allocator model on: the re-traced ledger's predicted ``max_memory_reserved``."""

    def cost(self, kind: CostKind) -> float:
        """What the solver minimised: measured seconds, or FLOPs with the other ops' charge."""
        return self.extra_seconds if kind == "seconds" else float(self.extra_flops + self.extra_other_flops)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "peak_bytes": self.peak_bytes,
            "extra_seconds": self.extra_seconds,
            "extra_flops": self.extra_flops,
            "regions": list(self.regions),
            "optimal": self.optimal,
            "gap": self.gap,
            "traced_peak_bytes": self.traced_peak_bytes,
            "gradients_bitwise_equal": self.gradients_bitwise_equal,
            "verified": self.verified,
            "extra_other_flops": self.extra_other_flops,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "traced_reserved_peak_bytes": self.traced_reserved_peak_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Point:
        return cls(**{**data, "regions": tuple(data["regions"])})


@dataclass(frozen=True)
class ParetoRow:
    """One budget of the sweep: our plan, the MILP optimum, the greedy knapsack (``None``: no plan)."""

    budget_bytes: int
    """On allocated bytes, or on predicted reserved bytes (``ParetoResult.budget_on``)."""
    ours: Point | None
    milp: Point | None
    greedy: Point | None
    reserved: ReservedFit | None = None
    """With a budget on reserved memory: how our plan was fitted (the allocated budget solved for, the rounds,
    the allocator model's prediction); where no round fits, those of the plan with the lowest reserved peak
    reached, which ``ours`` then is (``fits`` is ``False``). ``None``: the budget is on allocated bytes."""

    @property
    def fits(self) -> bool:
        """Whether our plan meets the budget: its predicted reserved peak with a budget on reserved memory, else
        its allocated peak."""
        if self.ours is None:
            return False
        if self.reserved is not None:
            return self.reserved.max_reserved_bytes <= self.budget_bytes
        return self.ours.peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "ours": self.ours.to_dict() if self.ours else None,
            "milp": self.milp.to_dict() if self.milp else None,
            "greedy": self.greedy.to_dict() if self.greedy else None,
            "fits": self.fits,
            "reserved": self.reserved.to_dict() if self.reserved is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParetoRow:
        def point(d: dict[str, Any] | None) -> Point | None:
            return Point.from_dict(d) if d is not None else None

        fit = ReservedFit.from_dict(data["reserved"]) if data.get("reserved") else None
        return cls(int(data["budget_bytes"]), point(data["ours"]), point(data["milp"]), point(data["greedy"]), fit)


@dataclass(frozen=True)
class ParetoResult:
    """The sweep: a row per budget and the fixed baselines."""

    model: str
    plain: LedgerSummary
    """The plain step's traced figures."""
    plain_peak_bytes: int
    floor_bytes: int
    """The lowest peak any plan reaches."""
    state_floor_bytes: int
    """Persistent state and the largest op alone."""
    rows: tuple[ParetoRow, ...]
    uniform: Point
    sqrt_n: Point
    cost: CostKind
    candidate_notes: tuple[str, ...] = ()
    """What the candidate regions leave out or assume."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further comparisons: ``torch_sac_ilp``, PyTorch's SAC MILP at the same budgets, filled in by the
    ``benchmarks/torch_sac.py`` benchmark (the sweep itself says where to find it)."""
    planner: Planner | None = field(default=None, repr=False, compare=False)
    """The planner the sweep ran (``None`` when read back from JSON)."""
    baselines: tuple[Baseline, ...] = ()
    """The named baselines (no recomputation, full per block, Megatron selective, op-level SAC per block)."""
    at_baselines: tuple[Point | None, ...] = ()
    """Per baseline, our plan with its peak as the budget (``None``: the baseline is not expressible)."""
    kernel_kind: str = "cpu"
    """Whose kernels the plain step was traced with (``cuda``: CUDA's, substituted on fake tensors)."""
    cuda_device: str | None = None
    """With ``cuda``: the card assumed."""
    budget_on: BudgetOn = "allocated"
    """What the rows' budgets are on: allocated bytes (from the plain peak down to the floor), or the allocator
    model's predicted reserved bytes (from ``plain_reserved_bytes`` down to ``floor_reserved_bytes``)."""
    plain_reserved_bytes: int | None = None
    """With the allocator model on: the plain step's predicted reserved peak (``None``: the model was off)."""
    floor_reserved_bytes: int | None = None
    """With the allocator model on: the predicted reserved peak of the lowest-peak plan (``None``: off)."""

    def failed_verification(self) -> list[int]:
        """Budgets whose plan, applied and traced again, failed a check of ``plan --verify`` (empty unverified)."""
        return [r.budget_bytes for r in self.rows if r.ours is not None and r.ours.verified is False]

    def to_dict(self) -> dict[str, Any]:
        out = self.plain.to_dict()
        out.update(
            {
                "schema": PARETO_SCHEMA,
                "model": self.model,
                "cost": self.cost,
                "plain_peak_bytes": self.plain_peak_bytes,
                "floor_bytes": self.floor_bytes,
                "state_floor_bytes": self.state_floor_bytes,
                "rows": [r.to_dict() for r in self.rows],
                "uniform_per_block": self.uniform.to_dict(),
                "sqrt_n": self.sqrt_n.to_dict(),
                "candidate_notes": list(self.candidate_notes),
                "baselines": [
                    {**b.to_dict(), "ours": None if o is None else o.to_dict()}
                    for b, o in zip(self.baselines, self.at_baselines, strict=True)
                ],
                "kernel_kind": self.kernel_kind,
                "cuda_device": self.cuda_device,
                "budget_on": self.budget_on,
                "plain_reserved_bytes": self.plain_reserved_bytes,
                "floor_reserved_bytes": self.floor_reserved_bytes,
                **self.extra,
            }
        )
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParetoResult:
        """Read ``to_dict()`` back (``trainledger report``)."""
        if data.get("schema") != PARETO_SCHEMA:
            raise InputError(f"not a pareto sweep: schema {data.get('schema')!r}, expected {PARETO_SCHEMA!r}")
        return cls(
            model=str(data["model"]),
            plain=LedgerSummary.from_dict(data),
            plain_peak_bytes=int(data["plain_peak_bytes"]),
            floor_bytes=int(data["floor_bytes"]),
            state_floor_bytes=int(data["state_floor_bytes"]),
            rows=tuple(ParetoRow.from_dict(r) for r in data["rows"]),
            uniform=Point.from_dict(data["uniform_per_block"]),
            sqrt_n=Point.from_dict(data["sqrt_n"]),
            cost=data["cost"],
            candidate_notes=tuple(data.get("candidate_notes", ())),
            extra={k: data[k] for k in _EXTRA_KEYS if k in data},
            baselines=tuple(Baseline.from_dict(b) for b in data.get("baselines", ())),
            at_baselines=tuple(
                None if b.get("ours") is None else Point.from_dict(b["ours"]) for b in data.get("baselines", ())
            ),
            kernel_kind=str(data.get("kernel_kind", "cpu")),  # sweeps saved before kernel kinds: cpu
            cuda_device=data.get("cuda_device"),
            budget_on=data.get("budget_on", "allocated"),  # sweeps saved before budgets on reserved memory
            plain_reserved_bytes=data.get("plain_reserved_bytes"),
            floor_reserved_bytes=data.get("floor_reserved_bytes"),
        )


_EXTRA_KEYS = ("torch_sac_ilp", "per_rank")


def _point(planner: Planner, method: str, sol: Solution, *, peak_bytes: int | None = None) -> Point:
    """The point of a solution; its peak the solution's (the linear model's, or the floor plan's replay where the
    sweep fell back to it) unless ``peak_bytes`` (the fullest rank's) is given."""
    cs = planner.candidates
    chosen = [cs.candidates[j] for j in sol.choice]
    return Point(
        method,
        sol.peak_bytes if peak_bytes is None else peak_bytes,
        sum(c.seconds for c in chosen),
        sum(c.flops for c in chosen),
        tuple(c.name for c in sorted(chosen, key=lambda c: c.fwd[0])),
        sol.optimal,
        sol.gap,
        extra_other_flops=sum(c.other_flops for c in chosen),
    )


def _fixed(planner: Planner, method: str, choice: Iterable[int]) -> Point:
    choice = tuple(choice)
    m = planner.model
    sol = Solution(choice, m.peak(choice), m.total_cost(choice), method, optimal=False)
    return _point(planner, method, sol)


def pareto(
    workload: Workload,
    *,
    num_budgets: int = 8,
    cost: CostKind = "seconds",
    verify: bool = False,
    time_limit_s: float = 20.0,
    fake: bool = False,
    sharding: Sharding | None = None,
    kernel_kind: KernelKind = "cpu",
    cuda_device: str | Device | None = None,
    allocator: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
    budget_on: BudgetOn = "allocated",
) -> ParetoResult:
    """Sweep ``num_budgets`` budgets from the plain step's traced peak down to the floor.

    Arguments:
        verify: apply each of our plans, trace the step again and compare gradients with the plain step's.
        fake: trace on fake tensors (full size; ``cost`` must be ``flops``; no ``verify``).
        sharding: peaks per rank of the step sharded so (see :func:`~trainledger.remat.solve_per_rank`).
        kernel_kind, cuda_device: as for :func:`trainledger.trace.trace` (``cuda``: on fake tensors, cost flops).
        allocator: replay each of our plans through the caching allocator's model: its predicted reserved
            peak (``Point.reserved_peak_bytes``), ``capacity_bytes`` the device's usable memory.
        budget_on: ``"reserved"``: every budget is on the allocator model's predicted reserved peak (``allocator``,
            default PyTorch's options), from the plain step's down to the lowest-peak plan's, each met as
            :func:`~trainledger.remat.solve_reserved` meets it; a budget no round meets keeps its row, with the
            plan of the lowest reserved peak reached and ``ParetoRow.fits`` false.

    Example:
        >>> from trainledger.examples import gpt_tiny
        >>> r = pareto(gpt_tiny(), num_budgets=8)
        >>> all(row.ours.peak_bytes <= row.budget_bytes for row in r.rows)
        True
    """
    require_workload(workload, "pareto")
    whole_number(
        num_budgets, "number of budgets", minimum=2, limit=MAX_BUDGETS, minimum_why="the plain peak and the floor"
    )
    one_of(cost, "cost", COSTS)
    one_of(budget_on, "budget_on", BUDGET_ON)
    positive_number(time_limit_s, "time limit", unit="seconds")
    if (fake or kernel_kind == "cuda") and verify:
        raise InputError("pareto on fake tensors cannot verify each plan; verify one with plan --fake --verify")
    planner = Planner.build(workload, cost=cost, fake=fake, kernel_kind=kernel_kind, cuda_device=cuda_device)
    if not planner.candidates.candidates:  # the solvers' models would have no variable
        raise InputError(
            f"its front is the plain peak alone: {no_region_why(planner.candidates.plain, planner.candidates.notes)}"
        )
    sharding = sharding or Sharding()
    if allocator is None and budget_on == "reserved":
        allocator = AllocatorConfig()
    sweep = None if allocator is None else _ReservedSweep.of(planner, sharding, allocator, capacity_bytes)
    on_reserved = sweep if budget_on == "reserved" else None
    if sharding.trivial:
        result = _sweep(planner, workload, num_budgets, verify, time_limit_s, allocator, on_reserved)
    else:
        result = pareto_per_rank(
            planner, sharding, num_budgets=num_budgets, time_limit_s=time_limit_s, reserved=on_reserved
        )
    result = replace(result, kernel_kind=planner.kernel_kind, cuda_device=planner.cuda_device, budget_on=budget_on)
    if sweep is None:
        return result
    result = replace(result, plain_reserved_bytes=sweep.plain_bytes, floor_reserved_bytes=sweep.floor_bytes)
    return result if on_reserved is not None else with_reserved(result, planner, sharding, allocator, capacity_bytes)


@dataclass(frozen=True)
class _ReservedSweep:
    """What a sweep on reserved memory needs at every budget: the allocator model's options, the sharding, the
    end points (the plain step's and the floor plan's predicted reserved peaks)."""

    config: AllocatorConfig
    capacity_bytes: int | None
    sharding: Sharding
    rank_planner: RankPlanner | None
    """With sharding: made once for every budget."""
    plain_bytes: int
    floor_bytes: int

    @classmethod
    def of(
        cls, planner: Planner, sharding: Sharding, config: AllocatorConfig, capacity_bytes: int | None
    ) -> _ReservedSweep:
        rp = None if sharding.trivial else RankPlanner.of(planner, sharding)
        floor_allocated = planner.floor_bytes if rp is None else rp.floor_rank_bytes
        floor = solve_per_rank(planner, floor_allocated, sharding, rank_planner=rp)
        plain = predict_reserved(
            sharding.rank_ledger(planner.plain),
            kernel_kind=planner.kernel_kind,
            config=config,
            capacity_bytes=capacity_bytes,
        )
        floor_reserved = reserved_of(floor, config=config, capacity_bytes=capacity_bytes)
        return cls(config, capacity_bytes, sharding, rp, plain.max_reserved_bytes, floor_reserved.max_reserved_bytes)

    def budgets(self, num_budgets: int) -> list[int]:
        return budget_sweep(self.plain_bytes, self.floor_bytes, num_budgets)

    def row(self, planner: Planner, workload: Workload, budget: int, verify: bool, time_limit_s: float) -> ParetoRow:
        """Our plan for ``budget`` on reserved memory, or the one closest to it where no round meets it."""
        try:
            plan, fit = solve_reserved(
                planner,
                budget,
                self.sharding,
                config=self.config,
                capacity_bytes=self.capacity_bytes,
                time_limit_s=time_limit_s,
                rank_planner=self.rank_planner,
            )
        except InfeasibleReserved as exc:
            plan, fit = exc.best, exc.fit
        assert plan.predicted_peak_bytes is not None
        choice = tuple(planner.candidates.index(r) for r in plan.regions)
        sol = Solution(choice, plan.predicted_peak_bytes, planner.model.total_cost(choice), "ours", plan.optimal)
        ours = replace(
            _point(planner, "ours", replace(sol, gap=plan.gap), peak_bytes=plan.predicted_peak_bytes),
            reserved_peak_bytes=fit.max_reserved_bytes,
        )
        if not self.sharding.trivial:
            ours = replace(ours, extra_seconds=0.0)  # as pareto_per_rank: on fake tensors, nothing is timed
        if verify:
            ours = _verified(planner, workload, ours, plan, self.config, budget)
        return ParetoRow(budget, ours, None, None, reserved=fit)


def with_reserved(
    result: ParetoResult, planner: Planner, sharding: Sharding, config: AllocatorConfig, capacity_bytes: int | None
) -> ParetoResult:
    """``result`` with each of our plans' predicted reserved peak: its ledger replayed on the plain step
    (the fullest rank's when sharded) and through the caching allocator's model."""
    cs = planner.candidates

    def reserved(point: Point | None) -> Point | None:
        if point is None:
            return None
        choice = tuple(j for j, c in enumerate(cs.candidates) if c.name in point.regions)
        ledger = sharding.rank_ledger(replay(cs, choice))
        p = predict_reserved(ledger, kernel_kind=planner.kernel_kind, config=config, capacity_bytes=capacity_bytes)
        return replace(point, reserved_peak_bytes=p.max_reserved_bytes)

    rows = tuple(replace(r, ours=reserved(r.ours)) for r in result.rows)
    return replace(result, rows=rows)


def _sweep(
    planner: Planner,
    workload: Workload,
    num_budgets: int,
    verify: bool,
    time_limit_s: float,
    allocator: AllocatorConfig | None = None,
    reserved: _ReservedSweep | None = None,
) -> ParetoResult:
    """The sweep of one process: on allocated bytes, or (``reserved``) on predicted reserved bytes, where the
    MILP and greedy columns are left out (each budget is met in rounds of our solver)."""
    if reserved is not None:
        rows = [reserved.row(planner, workload, b, verify, time_limit_s) for b in reserved.budgets(num_budgets)]
    else:
        rows = [
            _allocated_row(planner, workload, b, verify, time_limit_s, allocator)
            for b in _budgets(planner, num_budgets)
        ]
    blocks = planner.block_candidates()
    baselines = planner.baselines()
    at = tuple(
        None if b.peak_bytes is None else _point(planner, "ours", _solve_auto(planner, b.peak_bytes, time_limit_s))
        for b in baselines
    )
    return ParetoResult(
        model=workload.name,
        plain=planner.plain.summary(),
        plain_peak_bytes=planner.plain_peak_bytes,
        floor_bytes=planner.floor_bytes,
        state_floor_bytes=planner.state_floor_bytes,
        rows=tuple(rows),
        uniform=_fixed(planner, "uniform", blocks),
        sqrt_n=_fixed(planner, "sqrt-n", sqrt_n_choice(blocks)),
        cost=planner.cost,
        candidate_notes=tuple(planner.candidates.notes),
        extra={"torch_sac_ilp": SAC_NOT_RUN},
        planner=planner,
        baselines=baselines,
        at_baselines=at,
    )


def budget_sweep(plain_bytes: int, floor_bytes: int, num_budgets: int) -> list[int]:
    """``num_budgets`` evenly from the plain peak down to the floor, each once (where the floor is the plain
    peak, no plan lowers it: one row says so, not eight of the same)."""
    return list(dict.fromkeys(int(x) for x in np.linspace(plain_bytes, floor_bytes, num_budgets).round()))


def _budgets(planner: Planner, num_budgets: int) -> list[int]:
    return budget_sweep(planner.plain_peak_bytes, planner.floor_bytes, num_budgets)


def _allocated_row(
    planner: Planner, workload: Workload, b: int, verify: bool, time_limit_s: float, allocator: AllocatorConfig | None
) -> ParetoRow:
    """Our plan, the MILP optimum and the greedy knapsack for ``b`` allocated bytes."""
    sol = _solve_auto(planner, b, time_limit_s)
    ours = _point(planner, "ours", sol)
    try:
        milp: Point | None = _point(planner, "milp", solve_milp(planner.model, b, time_limit_s=time_limit_s))
    except NoPlan:
        milp = None
    try:
        greedy: Point | None = _point(planner, "greedy", solve_greedy(planner.model, b))
    except NoPlan:
        greedy = None
    if verify:
        ours = _verified(planner, workload, ours, planner.to_plan(sol, budget_bytes=b), allocator, None)
    return ParetoRow(b, ours, milp, greedy)


def _solve_auto(planner: Planner, budget: int, time_limit_s: float) -> Solution:
    """As :meth:`Planner.solve` with the auto solver: at a budget the floor plan's replay meets, where the linear
    model puts every plan above it (the sweep's last budget is the floor itself), the floor plan."""
    try:
        return solve(planner.model, budget, solver="auto", time_limit_s=time_limit_s)
    except NoPlan:
        if budget >= planner.floor_bytes:
            return planner.floor_solution()
        raise


def _verified(
    planner: Planner,
    workload: Workload,
    point: Point,
    plan: Plan,
    allocator: AllocatorConfig | None,
    reserved_budget_bytes: int | None,
) -> Point:
    """``point`` with what re-tracing its ``plan`` showed (and, with ``allocator``, the re-traced ledger's
    predicted reserved peak)."""
    planner.restore()  # the same weights as the plain trace (tracing takes optimizer steps)
    v = run_verify(workload, plan, timing=False, allocator=allocator, reserved_budget_bytes=reserved_budget_bytes)
    return replace(
        point,
        traced_peak_bytes=v.traced_peak_bytes,
        gradients_bitwise_equal=v.gradients_bitwise_equal,
        verified=v.passed,
        traced_reserved_peak_bytes=v.reserved.max_reserved_bytes if v.reserved is not None else None,
    )


def pareto_per_rank(
    planner: Planner,
    sharding: Sharding,
    *,
    num_budgets: int,
    time_limit_s: float = 20.0,
    reserved: _ReservedSweep | None = None,
) -> ParetoResult:
    """The sweep of :func:`~trainledger.remat.pareto` with every peak that of the fullest rank: budgets from
    the plain step's peak per rank down to the floor per rank, and at each baseline's own peak (so that each
    baseline is compared with the plan the solver finds at the same budget). MILP and greedy columns are
    left out (``None``): our plan there is the MILP's (``auto``). With ``reserved`` the rows' budgets are on
    the fullest rank's predicted reserved bytes; our plans at the baselines' peaks stay on allocated bytes."""
    cs = planner.candidates

    def point(
        method: str, choice: tuple[int, ...], peak: int, optimal: bool = False, gap: float | None = None
    ) -> Point:
        chosen = [cs.candidates[j] for j in choice]
        names = tuple(c.name for c in sorted(chosen, key=lambda c: c.fwd[0]))
        other = sum(c.other_flops for c in chosen)
        return Point(method, peak, 0.0, sum(c.flops for c in chosen), names, optimal, gap, extra_other_flops=other)

    def fixed(method: str, choice: tuple[int, ...]) -> Point:
        return point(method, choice, sharding.rank_ledger(replay(cs, choice)).peak().bytes)

    blocks = tuple(planner.block_candidates())
    uniform, sqrt_n = fixed("uniform", blocks), fixed("sqrt-n", tuple(sqrt_n_choice(list(blocks))))
    rank_planner = reserved.rank_planner if reserved is not None else None
    rank_planner = rank_planner or RankPlanner.of(planner, sharding)
    plain_rank, floor_rank = rank_planner.plain_rank_bytes, rank_planner.floor_rank_bytes
    baselines = planner.baselines(lambda ch: sharding.rank_ledger(replay(cs, ch)).peak().bytes, timed=False)
    at_peaks = {
        b.peak_bytes for b in baselines if b.peak_bytes is not None and floor_rank <= b.peak_bytes <= plain_rank
    }
    sweep = set(budget_sweep(plain_rank, floor_rank, num_budgets))
    sweep |= {p.peak_bytes for p in (uniform, sqrt_n) if floor_rank <= p.peak_bytes <= plain_rank} | at_peaks
    ours: dict[int, Point | None] = {}
    for b in sorted(sweep if reserved is None else at_peaks, reverse=True):
        p = solve_per_rank(planner, b, sharding, time_limit_s=time_limit_s, rank_planner=rank_planner)
        ours[b] = point("ours", tuple(cs.index(r) for r in p.regions), p.predicted_peak_bytes or 0, p.optimal, p.gap)
    if reserved is None:
        rows = [ParetoRow(b, o, None, None) for b, o in ours.items()]
    else:
        rows = [reserved.row(planner, planner.workload, b, False, time_limit_s) for b in reserved.budgets(num_budgets)]
    return ParetoResult(
        model=planner.workload.name,
        plain=sharding.rank_ledger(planner.plain).summary(),  # the fullest rank's plain step
        plain_peak_bytes=plain_rank,
        floor_bytes=floor_rank,
        state_floor_bytes=planner.state_floor_bytes,
        rows=tuple(rows),
        uniform=uniform,
        sqrt_n=sqrt_n,
        cost="flops",
        candidate_notes=(*cs.notes, f"every peak is that of the fullest rank, sharded as {sharding.label()}"),
        extra={
            "torch_sac_ilp": SAC_NOT_RUN,
            "per_rank": {"world_size": sharding.world_size, "strategy": sharding.strategy},
        },
        planner=planner,
        baselines=baselines,
        at_baselines=tuple(None if b.peak_bytes is None else ours.get(b.peak_bytes) for b in baselines),
    )
