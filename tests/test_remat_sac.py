"""PyTorch's SAC MILP on CPU, fed from our trace: its ModuleInfo against the model's own parameters, its
plans against its own memory model and budget, the plain step against our traced ledger."""

from __future__ import annotations

import copy
import importlib.util

import pytest
from benchmarks.torch_sac import module_info, own_peak_bytes, sac_compare, torch_sac_extra

from trainledger.commands.pareto import sac_cell
from trainledger.examples import gpt_tiny
from trainledger.remat import Planner

# Looked up, not imported: pwlf and torch's ILP utilities take seconds to import, and only the slow tests use them.
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("pulp", "pwlf")),
    reason="PyTorch's SAC MILP needs pulp and pwlf: pip install 'trainledger[sac]'",
)


@pytest.fixture(scope="module")
def planner() -> Planner:
    return Planner.build(gpt_tiny(n_layer=2))


@pytest.fixture(scope="module")
def comparison(planner):
    plain = planner.plain_peak_bytes
    budgets = [plain, (plain + planner.floor_bytes) // 2, planner.floor_bytes]
    return sac_compare(planner, budgets)


@pytest.mark.slow
def test_module_info_parameter_bytes_are_each_modules_own(planner, comparison):
    model = planner.workload.model
    root = type(model).__name__
    stats = {m["fqn"]: m for m in comparison.module_info["mod_stats"]}
    named = dict(model.named_modules())
    assert stats, "no module statistics"
    for fqn, m in stats.items():
        module = named[fqn[len(root) + 1 :] if fqn != root else ""]
        expected = sum(p.numel() * p.element_size() for p in module.parameters())
        assert m["param_per_module"] == expected, fqn
    assert stats[root]["param_per_module"] == sum(p.numel() * p.element_size() for p in model.parameters())
    # non-leaf modules carry a trade-off curve built from our ops; leaves none (SACEstimator's rule)
    for fqn, m in stats.items():
        assert m["is_leaf"] == (next(named[fqn[len(root) + 1 :] if fqn != root else ""].children(), None) is None)
        if not m["is_leaf"]:
            assert m["sac_memory"] > 0 and m["sac_runtime"] > 0 and len(m["slopes"]) == m["n_segments"]


@pytest.mark.slow
def test_module_info_leaves_weights_as_traced(planner):
    before = {k: v.clone() for k, v in planner.workload.model.state_dict().items()}
    module_info(planner)
    after = planner.workload.model.state_dict()
    assert all(before[k].equal(after[k]) for k in before)


@pytest.mark.slow
def test_plans_respect_their_own_budget_by_their_own_accounting(comparison):
    from torch.distributed._tools.ilp_utils import parse_module_info

    info = comparison.module_info
    graph = parse_module_info(copy.deepcopy(info))
    acm = {n["fqn"]: n["sac_memory"] for n in graph.nodes}
    root = graph.nodes[0]["fqn"]
    num_checked = 0
    for p in (*comparison.as_given, *comparison.less_optimizer):
        if not p.feasible:
            continue
        num_checked += 1
        assert p.own_peak_bytes is not None
        # sac_milp returns discard ratios rounded to 4 decimals: at most 0.5e-4 of each module's ACM
        slack = sum(0.5e-4 * acm[f"{root}.{path}"] for path in p.decisions) + 1
        assert p.own_peak_bytes <= p.milp_budget_bytes + slack
    assert num_checked > 0, "no feasible plan to check"


@pytest.mark.slow
def test_empty_plan_is_its_baseline_and_leaves_out_the_optimizer(planner, comparison):
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline, parse_module_info

    graph = parse_module_info(copy.deepcopy(comparison.module_info))
    baseline, _ = get_peak_memory_runtime_baseline(graph)
    assert own_peak_bytes(graph, {}) == baseline == comparison.baseline_peak_bytes
    plain = planner.plain
    optimizer = sum(e.nbytes for e in plain.select(category="optimizer"))
    assert comparison.optimizer_bytes == optimizer > 0
    # at the plain step's budget it recomputes nothing, and the empty plan replays to our traced peak
    top = comparison.as_given[0]
    assert top.feasible and top.decisions == {} and top.recompute_ms == 0
    assert top.replayed_peak_bytes == planner.plain_peak_bytes
    # its model of the step is below the traced peak by about the optimizer state it leaves out
    assert comparison.baseline_peak_bytes < planner.plain_peak_bytes


def test_sac_cell():
    row = {
        "feasible": True,
        "recompute_ms": 1.234,
        "replayed_peak_bytes": 1500,
        "full_peak_bytes": None,
        "budget_bytes": 1000,
    }
    assert sac_cell(row) == "1.23 ms → 1,500 over"
    assert sac_cell({**row, "replayed_peak_bytes": None, "full_peak_bytes": 900}) == "1.23 ms → 900*"
    assert sac_cell({**row, "feasible": False}) == "infeasible"


@pytest.mark.slow
def test_pareto_says_what_to_install_when_missing(planner, monkeypatch):
    import benchmarks.torch_sac as sac

    monkeypatch.setattr(sac, "sac_missing", lambda: ("pulp",))
    assert torch_sac_extra(planner, [planner.plain_peak_bytes]) == {
        "ran": False,
        "summary": "not run: pip install pulp",
    }
