"""Budgets on reserved memory for a real model (CPU kernels) and across the ``pareto`` sweep.

Oracles: the caching allocator's model (:func:`trainledger.allocator.predict_reserved`, its public API) run
directly on each plan's ledger, rebuilt here with :func:`trainledger.remat.replay`, and on the planned step
traced again here (a fresh instance, the plan applied, ``trace``), not by ``--verify``.
"""

from __future__ import annotations

import json

import pytest

from trainledger.allocator import predict_reserved
from trainledger.commands import pareto as pareto_cmd
from trainledger.examples import gpt_tiny
from trainledger.remat import (
    ParetoResult,
    Plan,
    Planner,
    Point,
    Sharding,
    pareto,
    plan_and_verify,
    replay,
    solve_reserved,
    structure_fingerprint,
)
from trainledger.trace import trace

MISSED_BY_LOWERING = 8_095_560
"""A reserved budget on gpt-tiny (FLOP costs) that six rounds of lowering the allocated budget by the reserved
excess do not meet (each lowers it by a fraction of a 2 MiB segment): the bisection that follows does."""
RESERVED_BUDGET = 10_000_000
"""Between the floor plan's predicted reserved peak (6,291,456) and the plain step's (12,582,912)."""


@pytest.fixture(scope="module")
def sweep() -> ParetoResult:
    return pareto(gpt_tiny(), num_budgets=4, cost="flops", budget_on="reserved")


@pytest.fixture(scope="module")
def planner(sweep) -> Planner:
    """gpt-tiny's planner on FLOP costs: the sweep's own (``Planner.build(gpt_tiny(), cost="flops")``; the sweep
    verifies nothing, so its model is as built)."""
    return sweep.planner


def _plan_of(point: Point, planner: Planner) -> Plan:
    regions = tuple(c.region for c in planner.candidates.candidates if c.name in point.regions)
    assert len(regions) == len(point.regions)
    return Plan(regions=regions, fingerprint=structure_fingerprint(planner.workload.model))


def _retraced_reserved(plan: Plan) -> int:
    """The plan applied to a fresh gpt-tiny, its step traced again, that ledger through the allocator model."""
    w = gpt_tiny()
    plan.apply(w.model)
    try:
        ledger = trace(w)
    finally:
        plan.remove(w.model)
    return predict_reserved(ledger, kernel_kind="cpu").max_reserved_bytes


def _replayed_reserved(point: Point, planner: Planner) -> int:
    cs = planner.candidates
    choice = [j for j, c in enumerate(cs.candidates) if c.name in point.regions]
    return predict_reserved(replay(cs, choice), kernel_kind="cpu").max_reserved_bytes


def test_a_budget_the_lowering_rounds_miss_is_met_by_bisection(planner):
    p, fit = solve_reserved(planner, MISSED_BY_LOWERING, Sharding())
    assert fit.num_rounds > 6  # the six rounds of lowering did not fit it
    assert fit.max_reserved_bytes <= MISSED_BY_LOWERING and p.budget_bytes == MISSED_BY_LOWERING
    assert p.predicted_peak_bytes <= fit.allocated_budget_bytes < MISSED_BY_LOWERING
    assert fit.max_reserved_bytes == predict_reserved(p.predicted, kernel_kind="cpu").max_reserved_bytes
    assert _retraced_reserved(p) == fit.max_reserved_bytes


def test_pareto_on_reserved_memory_sweeps_reserved_budgets_that_each_plan_meets(sweep):
    planner = sweep.planner
    plain = predict_reserved(planner.plain, kernel_kind="cpu").max_reserved_bytes
    assert sweep.budget_on == "reserved" and sweep.plain_reserved_bytes == plain == 12_582_912
    budgets = [r.budget_bytes for r in sweep.rows]
    assert budgets[0] == plain and budgets[-1] == sweep.floor_reserved_bytes == 6_291_456 and len(budgets) == 4
    recomputing = 0
    for r in sweep.rows:
        assert r.fits and r.reserved is not None and r.milp is None and r.greedy is None
        assert r.ours.reserved_peak_bytes == r.reserved.max_reserved_bytes <= r.budget_bytes
        assert r.ours.reserved_peak_bytes == _replayed_reserved(r.ours, planner)
        # the last round's allocated budget; below the floor, the floor plan is taken
        assert r.ours.peak_bytes <= max(r.reserved.allocated_budget_bytes, planner.floor_bytes)
        recomputing += bool(r.ours.regions)
    assert recomputing == 3  # every budget below the plain step's recomputes something
    floor = sweep.rows[-1].ours
    assert _retraced_reserved(_plan_of(floor, planner)) == floor.reserved_peak_bytes


def test_a_reserved_budget_no_round_meets_is_reported_not_dropped(sweep):
    row = sweep.rows[2]
    missed = type(row)(row.reserved.max_reserved_bytes - 1, row.ours, None, None, row.reserved)
    result = type(sweep)(**{**vars(sweep), "rows": (*sweep.rows[:2], missed, sweep.rows[3])})
    data = result.to_dict()
    assert [r["fits"] for r in data["rows"]] == [True, True, False, True]
    assert ParetoResult.from_dict(json.loads(json.dumps(data))).to_dict() == data
    from rich.console import Console

    console = Console(record=True, width=200)
    pareto_cmd.render(result, console)
    text = console.export_text()
    assert f"NOT MET: no round fits the budget {missed.budget_bytes:,} on reserved memory" in text
    assert "cheapest recomputation per budget on predicted reserved bytes" in text
    assert len(text.split(" NO ")) == 2  # one row says NO


def test_cli_pareto_budget_on_reserved(cli, cli_json, tmp_path):
    plot = tmp_path / "curve.svg"
    d = cli_json("pareto", "--model", "gpt-tiny", "--allocator", "--budgets", "3", "--plot", str(plot))
    assert d["budget_on"] == "reserved"  # the default with --allocator
    assert [r["budget_bytes"] for r in d["rows"]] == [12_582_912, 9_437_184, 6_291_456]
    for r in d["rows"]:
        assert r["fits"] and r["ours"]["reserved_peak_bytes"] <= r["budget_bytes"]
        assert r["reserved"]["budget_on"] == "reserved" and r["reserved"]["budget_bytes"] == r["budget_bytes"]
    assert "budgets on predicted reserved bytes" in plot.read_text()
    d = cli_json("pareto", "--model", "gpt-tiny", "--allocator", "--budget-on", "allocated", "--budgets", "2")
    assert d["budget_on"] == "allocated" and d["rows"][0]["budget_bytes"] == d["plain_peak_bytes"]
    assert d["rows"][0]["ours"]["reserved_peak_bytes"] == d["plain_reserved_bytes"] == 12_582_912


def test_cli_plan_on_reserved_memory_of_a_real_model(cli_json):
    d = cli_json("plan", "--model", "gpt-tiny", "--budget", str(RESERVED_BUDGET), "--allocator")
    assert d["kernel_kind"] == "cpu" and d["budget_bytes"] == RESERVED_BUDGET
    fit = d["reserved"]
    assert fit["budget_on"] == "reserved" and fit["num_rounds"] >= 2
    assert d["predicted_peak_bytes"] <= fit["allocated_budget_bytes"] < RESERVED_BUDGET
    assert fit["predicted_reserved"]["max_reserved_bytes"] <= RESERVED_BUDGET


def test_cli_plan_real_reserved_budget_below_what_the_floor_reserves_is_one_line_exit_2(cli, planner):
    budget = planner.floor_bytes + 50_000  # the allocated floor fits; the 6,291,456 it reserves does not
    code, out, err = cli("plan", "--model", "gpt-tiny", "--budget-on", "reserved", "--budget", str(budget))
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and "on reserved memory is not met" in err and "6,291,456" in err


@pytest.mark.slow
def test_plan_and_verify_on_reserved_memory_of_a_real_model():
    r = plan_and_verify(gpt_tiny(), RESERVED_BUDGET, cost="flops", budget_on="reserved", verify=True)
    assert r.reserved is not None and r.reserved.max_reserved_bytes <= RESERVED_BUDGET
    assert r.reserved.max_reserved_bytes == predict_reserved(r.plan.predicted, kernel_kind="cpu").max_reserved_bytes
    v = r.verification
    assert v.passed and v.reserved_budget_bytes == RESERVED_BUDGET and v.reserved_within_budget
    assert v.reserved.max_reserved_bytes == _retraced_reserved(r.plan) == r.reserved.max_reserved_bytes


@pytest.mark.slow
def test_pareto_on_reserved_memory_verified_re_traces_each_plan():
    result = pareto(gpt_tiny(), num_budgets=3, cost="flops", budget_on="reserved", verify=True)
    for r in result.rows:
        o = r.ours
        assert o.gradients_bitwise_equal and o.traced_reserved_peak_bytes is not None
        assert o.traced_reserved_peak_bytes == _retraced_reserved(_plan_of(o, result.planner)) <= r.budget_bytes
