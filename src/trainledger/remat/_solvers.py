"""Solvers for activation rematerialization: which regions to recompute so the peak fits a budget.

Pure: numpy and scipy only, no torch. Everything here works on a :class:`LinearModel`, the memory of one
training step as a function of the recompute decisions:

    live(e, c) = base[e] + Σ_j c_j · delta[j, e]        for every point e of the step's clock,

where ``c_j ∈ {0, 1}`` says whether candidate region ``j`` is recomputed, ``base`` is the plain step's
live bytes and ``delta[j]`` the change that recomputing ``j`` alone makes (negative while its saved
activations would have been held, positive while it is recomputed during backward). The points include
a copy of each candidate's recomputation, placed just before its backward. Candidates that cover the
same part of the model conflict (at most one of them is chosen); disjoint candidates add exactly, which
``candidates.py`` checks against a transformed ledger.

Solvers:

- :func:`solve_milp`: the exact MILP (Checkmate's idea, Jain et al., MLSys 2020: binary decisions, memory
  accounted at every point of the schedule), restricted to plans that non-reentrant
  ``torch.utils.checkpoint`` executes: each region recomputed once, right before its backward. HiGHS
  through ``scipy.optimize.milp``, with a time limit; reports the LP-relaxation bound and the gap.
- :func:`solve_dp`: an exact dynamic program for chains (Rotor's idea, Beaumont, Herrmann et al.: a stage
  either records all its activations or keeps only its input), over the Pareto frontier of
  (bytes saved so far, recompute cost so far); vectorised with numpy. When the frontier would exceed
  ``max_states`` it is discretised, rounding savings down, which keeps every plan feasible.
- :func:`solve_greedy`: knapsack by bytes saved per unit of recompute cost (a baseline).
- :func:`sqrt_n_choice` and :func:`uniform_choice`: Chen et al.'s √n segments and "checkpoint every block"
  (what Hugging Face's ``gradient_checkpointing_enable()`` does), as fixed plans.
- :func:`solve`: ``"auto"`` picks the DP when the model is a chain and the MILP otherwise.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

SolverName = Literal["auto", "dp", "milp", "greedy", "sqrt-n", "uniform"]
SOLVERS: tuple[str, ...] = ("auto", "dp", "milp", "greedy", "sqrt-n", "uniform")


@dataclass(frozen=True)
class Chain:
    """How a :class:`LinearModel` is a chain: positions in forward order, each with its options.

    Position ``k``'s span is the points where only its own decision matters besides the prefix savings:
    its forward, its recomputation and its backward. Between a position's forward end and its backward
    start, each of its options must change memory by a constant ``-saving`` and by nothing outside;
    :func:`chain_savings` checks this.
    """

    options: tuple[tuple[tuple[int, ...], ...], ...]
    """Per position, the allowed sets of candidates (the empty set, "record all", is always allowed)."""
    span: np.ndarray
    """``(num_positions, num_points)`` bool: points inside each position's span."""
    prefix: np.ndarray
    """``(num_points,)`` int: number of positions whose forward is over and backward not begun."""


@dataclass(frozen=True)
class LinearModel:
    """Live bytes at every point of the step as an affine function of the recompute decisions."""

    base: np.ndarray
    """``(num_points,)`` int64: live bytes of the plain step (nothing recomputed)."""
    delta: np.ndarray
    """``(num_candidates, num_points)`` int64: change in live bytes when candidate ``j`` is recomputed."""
    cost: np.ndarray
    """``(num_candidates,)`` float: recompute cost of each candidate (FLOPs, or seconds)."""
    covers: tuple[frozenset[str], ...]
    """Atoms of the model each candidate covers; candidates sharing an atom conflict."""
    names: tuple[str, ...]
    chain: Chain | None = None

    def __post_init__(self) -> None:
        n, p = self.delta.shape
        assert self.base.shape == (p,), (self.base.shape, p)
        assert self.cost.shape == (n,) and len(self.covers) == n and len(self.names) == n

    @property
    def num_candidates(self) -> int:
        return int(self.delta.shape[0])

    def live(self, choice: Sequence[int]) -> np.ndarray:
        """Live bytes at every point when the candidates in ``choice`` are recomputed."""
        idx = list(choice)
        return self.base + (self.delta[idx].sum(axis=0) if idx else 0)

    def peak(self, choice: Sequence[int]) -> int:
        return int(self.live(choice).max())

    def total_cost(self, choice: Sequence[int]) -> float:
        return float(sum(self.cost[j] for j in choice))

    def compatible(self, choice: Sequence[int]) -> bool:
        seen: set[str] = set()
        for j in choice:
            if seen & self.covers[j]:
                return False
            seen |= self.covers[j]
        return True


@dataclass(frozen=True)
class Solution:
    """A set of candidates to recompute, what it costs and how far from optimal it may be."""

    choice: tuple[int, ...]
    peak_bytes: int
    cost: float
    solver: str
    optimal: bool
    """Proved optimal for the model (DP without discretisation, MILP with zero gap)."""
    lower_bound: float | None = None
    """A proved lower bound on the cost of any feasible plan (the MILP's dual bound, or the DP's optimum)."""
    lp_bound: float | None = None
    """The LP relaxation's optimum (a weaker lower bound), when the MILP ran."""
    gap: float | None = None
    """Relative optimality gap ``(cost - lower_bound) / cost`` (0 when proved optimal)."""
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)


class NoPlan(Exception):
    """Internal: the solver found no plan within the budget (the caller raises InfeasibleBudget)."""


# --- the exact MILP ------------------------------------------------------------------------------------


def _milp(*args: Any, **kwargs: Any) -> Any:
    """``scipy.optimize.milp`` with file descriptor 1 pointed at the null device while it runs: HiGHS writes
    some lines from C straight to it whatever ``disp`` says (``transformNewIntegerFeasibleSolution`` on
    large models), which would break a command's ``--json`` output."""
    from scipy.optimize import milp

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            return milp(*args, **kwargs)
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_milp(model: LinearModel, budget_bytes: int, *, time_limit_s: float = 20.0) -> Solution:
    """Minimum-cost plan with ``live(e) <= budget`` at every point, by HiGHS (``scipy.optimize.milp``).

    Example:
        >>> m = LinearModel(np.array([10, 12]), np.array([[-3, -3], [-1, -4]]), np.array([2.0, 1.0]),
        ...                 (frozenset({"a"}), frozenset({"b"})), ("a", "b"))
        >>> solve_milp(m, 9).choice
        (1,)
    """
    from scipy.optimize import Bounds, LinearConstraint

    t0 = time.perf_counter()
    n = model.num_candidates
    rows, rhs = _memory_rows(model, budget_bytes)
    if rows is None:
        raise NoPlan("a point exceeds the budget whatever is recomputed")
    constraints = []
    if len(rows):
        constraints.append(LinearConstraint(rows, -np.inf, rhs))
    conflict = _conflict_rows(model)
    if conflict is not None:
        constraints.append(LinearConstraint(conflict, 0, 1))
    # HiGHS stops at an absolute gap of 1e-6: with costs in seconds (~1e-3) that is a relative gap of
    # ~0.1%. Scale the objective to order 1e6 and ask for no relative gap, so "optimal" is exact.
    scale = 1e6 / float(np.max(np.abs(model.cost))) if np.any(model.cost) else 1.0
    c = model.cost.astype(float) * scale
    bounds = Bounds(np.zeros(n), np.ones(n))
    lp = _milp(c, constraints=constraints, integrality=np.zeros(n), bounds=bounds)
    if lp.status == 2:  # infeasible even fractionally
        raise NoPlan("the LP relaxation is infeasible")
    res = _milp(
        c,
        constraints=constraints,
        integrality=np.ones(n),
        bounds=bounds,
        options={"time_limit": float(time_limit_s), "disp": False, "mip_rel_gap": 0.0},
    )
    if res.x is None:
        if res.status == 2:
            raise NoPlan("the MILP is infeasible")
        raise NoPlan(f"the MILP found no plan within {time_limit_s:g} s ({res.message})")
    choice = tuple(int(j) for j in np.flatnonzero(np.round(res.x) > 0.5))
    cost = model.total_cost(choice)
    dual = getattr(res, "mip_dual_bound", None)
    bound = cost if res.status == 0 or dual is None else float(dual) / scale
    bound = min(bound, cost)
    gap = 0.0 if cost <= 0 else max(0.0, (cost - bound) / cost)
    return Solution(
        choice,
        model.peak(choice),
        cost,
        "milp",
        optimal=res.status == 0,
        lower_bound=bound,
        lp_bound=float(lp.fun) / scale if lp.fun is not None else None,
        gap=gap,
        seconds=time.perf_counter() - t0,
    )


def _memory_rows(model: LinearModel, budget_bytes: int) -> tuple[np.ndarray | None, np.ndarray]:
    """Rows ``delta[:, e] · c <= budget - base[e]``, one per distinct point that can bind."""
    slack = budget_bytes - model.base
    d = model.delta.T  # (points, candidates)
    most_saved = np.minimum(d, 0).sum(axis=1)
    if np.any(slack - most_saved < 0):
        return None, slack
    binding = np.maximum(d, 0).sum(axis=1) > slack  # rows no choice can violate are dropped
    rows, rhs = d[binding], slack[binding]
    if len(rows):  # identical rows: keep the tightest
        keyed: dict[bytes, int] = {}
        for i, row in enumerate(rows):
            k = row.tobytes()
            if k not in keyed or rhs[i] < rhs[keyed[k]]:
                keyed[k] = i
        keep = sorted(keyed.values())
        rows, rhs = rows[keep], rhs[keep]
    return rows.astype(float), rhs.astype(float)


def _conflict_rows(model: LinearModel) -> np.ndarray | None:
    atoms: dict[str, list[int]] = {}
    for j, cov in enumerate(model.covers):
        for a in cov:
            atoms.setdefault(a, []).append(j)
    groups = [js for js in atoms.values() if len(js) > 1]
    if not groups:
        return None
    out = np.zeros((len(groups), model.num_candidates))
    for i, js in enumerate(groups):
        out[i, js] = 1
    return out


def min_peak(model: LinearModel, *, time_limit_s: float = 20.0) -> tuple[int, tuple[int, ...]]:
    """The lowest peak any compatible plan reaches, and the cheapest such plan (MILP: min t, then min cost)."""
    from scipy.optimize import Bounds, LinearConstraint

    n = model.num_candidates
    if n == 0:
        return int(model.base.max()), ()
    d, base = _peak_rows(model)
    # variables: c_0..c_{n-1}, t.  delta^T c - t <= -base
    a = np.hstack([d.astype(float), -np.ones((len(d), 1))])
    constraints = [LinearConstraint(a, -np.inf, -base.astype(float))]
    conflict = _conflict_rows(model)
    if conflict is not None:
        constraints.append(LinearConstraint(np.hstack([conflict, np.zeros((len(conflict), 1))]), 0, 1))
    obj = np.zeros(n + 1)
    obj[-1] = 1.0
    bounds = Bounds(np.zeros(n + 1), np.r_[np.ones(n), np.inf])
    for limit in (time_limit_s, 4 * time_limit_s):  # (a busy machine gives HiGHS little of the wall time)
        res = _milp(
            obj,
            constraints=constraints,
            integrality=np.r_[np.ones(n), 0],
            bounds=bounds,
            options={"time_limit": float(limit)},
        )
        if res.x is not None:
            break
    assert res.x is not None, res.message
    choice = tuple(int(j) for j in np.flatnonzero(np.round(res.x[:n]) > 0.5))
    floor = model.peak(choice)
    try:  # the cheapest plan at that peak
        best = solve(model, floor, solver="auto", time_limit_s=time_limit_s)
        return floor, best.choice
    except NoPlan:
        return floor, choice


def _peak_rows(model: LinearModel) -> tuple[np.ndarray, np.ndarray]:
    """The points that can set the lowest peak: each point is at least ``base + Σ min(delta, 0)`` under any
    plan, so the largest of those bounds the peak from below, and a point that stays below it whatever is
    recomputed (``base + Σ max(delta, 0)``) never binds; of identical rows the one with the highest base."""
    d = model.delta.T  # (points, candidates)
    lower = (model.base + np.minimum(d, 0).sum(axis=1)).max()
    keep = model.base + np.maximum(d, 0).sum(axis=1) >= lower
    d, base = d[keep], model.base[keep]
    keyed: dict[bytes, int] = {}
    for i, row in enumerate(d):
        k = row.tobytes()
        if k not in keyed or base[i] > base[keyed[k]]:
            keyed[k] = i
    rows = sorted(keyed.values())
    return d[rows], base[rows]


# --- the chain DP ------------------------------------------------------------------------------------


def _is_chain(model: LinearModel) -> bool:
    """Whether the chain DP applies: the model is a chain in the DP's sense (see :func:`chain_savings`)."""
    try:
        chain_savings(model)
    except ValueError:
        return False
    return True


def chain_savings(model: LinearModel) -> list[list[int]]:
    """Per position and option, the constant bytes the option saves between its forward and backward
    (negative where the checkpoint holds more than the option frees: its RNG state, say).

    Raises ``ValueError`` when the model is not a chain in the DP's sense (an option changes memory
    outside its span by anything other than a constant saving, or before its forward).
    """
    ch = model.chain
    if ch is None:
        raise ValueError("the model carries no chain structure")
    out: list[list[int]] = []
    for k, opts in enumerate(ch.options):
        outside = ~ch.span[k]
        held = outside & (ch.prefix > k)  # forward of k over, backward not begun
        free = outside & (ch.prefix <= k)
        row = []
        for opt in opts:
            d = model.delta[list(opt)].sum(axis=0) if opt else np.zeros_like(model.base)
            if np.any(d[free] != 0):
                raise ValueError(f"position {k}: option {opt} changes memory outside its lifetime")
            vals = np.unique(d[held])
            if len(vals) > 1:  # (a negative saving is allowed: an option whose checkpoint holds more than it frees)
                raise ValueError(f"position {k}: option {opt} does not save a constant amount")
            row.append(int(-vals[0]) if len(vals) else 0)
        out.append(row)
    return out


def solve_dp(model: LinearModel, budget_bytes: int, *, max_states: int = 100_000) -> Solution:
    """Exact minimum-cost plan for a chain, by dynamic programming over positions.

    State after deciding positions ``0..k-1``: ``D`` = bytes their choices save while position ``k`` and
    later run. A point in position ``k``'s span needs ``base + delta_option - D <= budget``; a point
    between spans with ``m`` positions held needs ``base - D_m <= budget``. The frontier of
    non-dominated ``(D, cost)`` pairs is kept exactly, or on a grid of ``max_states`` cells (savings
    rounded down: still feasible, maybe not optimal, and then reported as not proved optimal).

    Example:
        >>> m = uniform_chain_model(num_blocks=4, saved_bytes=10, input_bytes=2, transient_bytes=3,
        ...                         grad_bytes=1, base_bytes=100)
        >>> solve_dp(m, 130).choice == solve_milp(m, 130).choice
        True
    """
    t0 = time.perf_counter()
    ch = model.chain
    if ch is None:
        raise ValueError("solve_dp needs a chain; use solve_milp for general graphs")
    savings = chain_savings(model)
    num_pos = len(ch.options)
    gap_need = _gap_needs(model, ch, budget_bytes)
    if gap_need[0] > 0:
        raise NoPlan("the step exceeds the budget before any region can help")
    grid = max(1, math.ceil(sum(max(s) for s in savings) / max_states))  # used only if the frontier grows
    front = _Frontier(np.zeros(1, dtype=np.int64), np.zeros(1), [])
    approx = False
    for k in range(num_pos):
        if gap_need[k] > -np.inf:
            front = front.keep(front.saved >= gap_need[k])
            if not len(front.saved):
                raise NoPlan(f"no plan: position {k} cannot be reached within the budget")
        front, rounded = _extend(model, ch, k, savings[k], front, budget_bytes, max_states, grid)
        approx = approx or rounded
    if gap_need[num_pos] > -np.inf:
        front = front.keep(front.saved >= gap_need[num_pos])
    if not len(front.saved):
        raise NoPlan("no plan: the end of the forward pass exceeds the budget")
    choice_t = _backtrack(ch, front, int(np.argmin(front.cost)))  # lowest cost; ties: the first (least saving)
    cost = model.total_cost(choice_t)
    notes = (f"memory discretised to {grid:,}-byte cells (savings rounded down)",) if approx else ()
    return Solution(
        choice_t,
        model.peak(choice_t),
        cost,
        "dp",
        optimal=not approx,
        lower_bound=cost if not approx else None,
        gap=0.0 if not approx else None,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


@dataclass(frozen=True)
class _Frontier:
    """The DP's non-dominated states after some positions, and how each was reached."""

    saved: np.ndarray
    """Bytes the choices so far save while later positions run (``D``), ascending."""
    cost: np.ndarray
    """Their recompute cost (``C``)."""
    back: list[tuple[np.ndarray, np.ndarray]]
    """Per position decided: (parent state index, option index) of each state of that position."""

    def keep(self, ok: np.ndarray) -> _Frontier:
        """Only the states where ``ok`` holds (their back-pointers with them)."""
        back = [*self.back[:-1], (self.back[-1][0][ok], self.back[-1][1][ok])] if self.back else []
        return _Frontier(self.saved[ok], self.cost[ok], back)


def _gap_needs(model: LinearModel, ch: Chain, budget_bytes: int) -> np.ndarray:
    """Per number ``m`` of positions held, the saving needed at the points outside every span (``-inf``: none)."""
    num_pos = len(ch.options)
    in_any = ch.span.any(axis=0)
    gap_need = np.full(num_pos + 1, -np.inf)
    for m in range(num_pos + 1):
        sel = (~in_any) & (ch.prefix == m)
        if sel.any():
            gap_need[m] = float(model.base[sel].max() - budget_bytes)
    return gap_need


def _extend(
    model: LinearModel,
    ch: Chain,
    k: int,
    savings: list[int],
    front: _Frontier,
    budget_bytes: int,
    max_states: int,
    grid: int,
) -> tuple[_Frontier, bool]:
    """Position ``k`` decided: every option from every state that keeps its span within the budget, then
    the non-dominated states (rounded down to ``grid`` when more than ``max_states``; the bool says so)."""
    D, C = front.saved, front.cost
    span = ch.span[k]
    cand_D, cand_C, cand_p, cand_o = [], [], [], []
    for oi, opt in enumerate(ch.options[k]):
        d = model.delta[list(opt)].sum(axis=0) if opt else 0
        need = float((model.base + d)[span].max() - budget_bytes) if span.any() else -np.inf
        ok = np.flatnonzero(D >= need)
        if not len(ok):
            continue
        cost = float(sum(model.cost[j] for j in opt))
        cand_D.append(D[ok] + savings[oi])
        cand_C.append(C[ok] + cost)
        cand_p.append(ok)
        cand_o.append(np.full(len(ok), oi))
    if not cand_D:
        raise NoPlan(f"no plan: position {k} exceeds the budget with every option")
    nD, nC = np.concatenate(cand_D), np.concatenate(cand_C)
    nP, nO = np.concatenate(cand_p), np.concatenate(cand_o)
    rounded = len(nD) > max_states
    if rounded:  # discretise: round savings down to a grid (conservative)
        nD = (nD // grid) * grid
    keep = _pareto(nD, nC)
    return _Frontier(nD[keep], nC[keep], [*front.back, (nP[keep], nO[keep])]), rounded


def _backtrack(ch: Chain, front: _Frontier, i: int) -> tuple[int, ...]:
    """The candidates chosen on the way to state ``i`` of the last position."""
    choice: list[int] = []
    for k in range(len(ch.options) - 1, -1, -1):
        parent, option = front.back[k]
        choice.extend(ch.options[k][int(option[i])])
        i = int(parent[i])
    return tuple(sorted(choice))


def _pareto(D: np.ndarray, C: np.ndarray) -> np.ndarray:
    """Indices of non-dominated (more saving, less cost) pairs, sorted by D ascending."""
    order = np.lexsort((-D, C))  # by cost ascending, then D descending
    best_D = np.maximum.accumulate(D[order])
    prev = np.r_[-1, best_D[:-1]]
    keep = order[D[order] > prev]
    return keep[np.argsort(D[keep], kind="stable")]


# --- baselines ---------------------------------------------------------------------------------------


def solve_greedy(model: LinearModel, budget_bytes: int) -> Solution:
    """Add candidates in order of bytes saved per unit cost until the peak fits; then drop any that
    are not needed (most expensive first)."""
    t0 = time.perf_counter()
    saved = np.maximum(-model.delta.min(axis=1), 0)
    ratio = saved / np.maximum(model.cost, 1e-30)
    order = sorted(range(model.num_candidates), key=lambda j: (-ratio[j], j))
    choice: list[int] = []
    for j in order:
        if model.peak(choice) <= budget_bytes:
            break
        if model.compatible([*choice, j]) and model.peak([*choice, j]) < model.peak(choice):
            choice.append(j)
    if model.peak(choice) > budget_bytes:
        raise NoPlan("greedy found no plan within the budget")
    for j in sorted(choice, key=lambda j: -model.cost[j]):
        rest = [i for i in choice if i != j]
        if model.peak(rest) <= budget_bytes:
            choice = rest
    choice_t = tuple(sorted(choice))
    return Solution(
        choice_t,
        model.peak(choice_t),
        model.total_cost(choice_t),
        "greedy",
        optimal=False,
        seconds=time.perf_counter() - t0,
    )


def uniform_choice(model: LinearModel, block_candidates: Sequence[int]) -> tuple[int, ...]:
    """Every block recomputed: what ``gradient_checkpointing_enable()`` does in Hugging Face models."""
    return tuple(sorted(block_candidates))


def sqrt_n_choice(block_candidates: Sequence[int], *, segment_len: int | None = None) -> tuple[int, ...]:
    """Chen et al. (2016), "Training deep nets with sublinear memory cost": checkpoints every ``√n`` blocks.

    With per-block regions, segments of ``⌈√n⌉`` blocks of which all but the segment's last block are
    recomputed: the last block of each segment keeps its activations (its output is the stored
    checkpoint the next segment starts from).
    """
    n = len(block_candidates)
    if n == 0:
        return ()
    seg = segment_len or max(1, math.ceil(math.sqrt(n)))
    return tuple(sorted(j for i, j in enumerate(block_candidates) if (i + 1) % seg != 0 or seg == 1))


def solve(
    model: LinearModel,
    budget_bytes: int,
    *,
    solver: SolverName = "auto",
    time_limit_s: float = 20.0,
    block_candidates: Sequence[int] = (),
) -> Solution:
    """Solve with the named solver; ``"auto"`` uses the DP for chains and the MILP otherwise.

    ``solver`` is one of :data:`SOLVERS`, checked where it enters (the command line, the public ``plan``).
    """
    if solver == "auto":
        if _is_chain(model):  # otherwise only the MILP handles a general graph
            with contextlib.suppress(NoPlan):  # a discretised frontier may lose plans: the MILP settles it
                return solve_dp(model, budget_bytes)
        return solve_milp(model, budget_bytes, time_limit_s=time_limit_s)
    if solver == "dp":
        return solve_dp(model, budget_bytes)
    if solver == "milp":
        return solve_milp(model, budget_bytes, time_limit_s=time_limit_s)
    if solver == "greedy":
        return solve_greedy(model, budget_bytes)
    assert solver in ("uniform", "sqrt-n"), solver
    choice = uniform_choice(model, block_candidates) if solver == "uniform" else sqrt_n_choice(block_candidates)
    peak = model.peak(choice)
    if peak > budget_bytes:
        raise NoPlan(f"{solver} reaches {peak:,} bytes, above the budget")
    return Solution(choice, peak, model.total_cost(choice), solver, optimal=False)


def brute_force(model: LinearModel, budget_bytes: int) -> tuple[tuple[int, ...], float] | None:
    """The cheapest compatible plan within the budget by trying every subset (tests; ``n <= 16``)."""
    n = model.num_candidates
    assert n <= 16, n
    best: tuple[tuple[int, ...], float] | None = None
    for mask in range(1 << n):
        choice = tuple(j for j in range(n) if mask >> j & 1)
        if not model.compatible(choice) or model.peak(choice) > budget_bytes:
            continue
        cost = model.total_cost(choice)
        if best is None or cost < best[1] - 1e-9:
            best = (choice, cost)
    return best


# --- a chain described by numbers -------------------------------------------------------------------------


def uniform_chain_model(
    *,
    num_blocks: int,
    saved_bytes: int | Sequence[int],
    input_bytes: int | Sequence[int],
    transient_bytes: int | Sequence[int],
    grad_bytes: int | Sequence[int],
    base_bytes: int,
    cost: float | Sequence[float] = 1.0,
    head_bytes: int = 0,
) -> LinearModel:
    """A chain of blocks described by numbers, simulated point by point (one candidate per block).

    Block ``i`` saves ``saved_bytes[i]`` of activations besides its input (``input_bytes[i]``, the
    previous block's output, kept in either case); its forward and its recomputation need
    ``transient_bytes[i]`` more at their widest point; its backward leaves ``grad_bytes[i]`` of weight
    gradients. Points: each block's forward end, the head (``head_bytes`` extra), then per block (last
    first) its recomputation and its backward. Used by tests and by the 96-block timing benchmark.
    """

    def per(v: int | float | Sequence, cast: type) -> list:
        return [cast(x) for x in v] if isinstance(v, Sequence) else [cast(v)] * num_blocks

    S, X, T, G = (per(v, int) for v in (saved_bytes, input_bytes, transient_bytes, grad_bytes))
    costs = per(cost, float)
    n = num_blocks
    # point layout: fwd_0..fwd_{n-1}, head, then for i = n-1..0: recompute_i, backward_i
    num_points = n + 1 + 2 * n
    base = np.zeros(num_points, dtype=np.int64)
    delta = np.zeros((n, num_points), dtype=np.int64)
    span = np.zeros((n, num_points), dtype=bool)
    prefix = np.zeros(num_points, dtype=np.int64)
    for i in range(n):  # forward of block i: earlier blocks' records, its input, its widest moment
        base[i] = base_bytes + sum(S[:i]) + sum(X[: i + 1]) + S[i] + T[i]
        delta[i, i] = 0  # the forward of a recomputed block still builds its activations once
        span[i, i] = True
        prefix[i] = i
    head = n
    base[head] = base_bytes + sum(S) + sum(X) + head_bytes
    prefix[head] = n
    for r, i in enumerate(range(n - 1, -1, -1)):
        rec, bwd = n + 1 + 2 * r, n + 2 + 2 * r
        held = base_bytes + sum(S[:i]) + sum(X[: i + 1]) + sum(G[i + 1 :])
        base[rec] = held + S[i]  # plain: nothing is recomputed; the point equals the backward's start
        delta[i, rec] = T[i]  # recomputation: its activations plus its transient on top
        base[bwd] = held + S[i] + G[i] + X[i]  # backward: activations, new weight grads, the input's grad
        span[i, [rec, bwd]] = True
        prefix[rec] = prefix[bwd] = i
    for i in range(n):  # outside its span, a recomputed block holds no saved activations
        held = (~span[i]) & (prefix > i)
        delta[i, held] = -S[i]
    return LinearModel(
        base,
        delta,
        np.array(costs),
        tuple(frozenset({f"block{i}"}) for i in range(n)),
        tuple(f"block{i}" for i in range(n)),
        chain=Chain(tuple(((), (i,)) for i in range(n)), span, prefix),
    )
