"""Plans on models nobody tuned for (``tests/zoo.py``): only regions that run are offered, shared modules are
recomputed per call, modules that update buffers in forward are recomputed on a copy of them, and every
plan is verified by re-tracing and by comparing gradients, parameters, buffers and optimizer state bitwise."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.zoo import ZOO, shared_block, stateful_cnn, wrapped
from trainledger.errors import InputError
from trainledger.remat import Plan, Planner, Region, compare_state, structure_fingerprint, verify

_PLANNERS: dict[str, Planner] = {}


def planner(name: str) -> Planner:
    """One traced planner per zoo model for the whole module (tracing is what costs)."""
    if name not in _PLANNERS:
        _PLANNERS[name] = Planner.build(ZOO[name]())
    return _PLANNERS[name]


def _verified(p: Planner, budget: int) -> None:
    plan = p.solve(budget)
    assert plan.predicted_peak_bytes <= budget
    p.restore()
    v = verify(p.workload, plan, timing=False)
    assert v.passed, (plan.regions, v.to_dict())
    assert abs(v.relative_error) <= 0.01, (plan.regions, v.predicted_peak_bytes, v.traced_peak_bytes)
    assert v.num_gradients > 0 and v.num_state > v.num_gradients  # parameters, buffers and optimizer state


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_plans_down_to_the_floor_run_and_change_nothing_but_memory(name):
    p = planner(name)
    assert p.candidates.candidates, name
    modules = dict(p.workload.model.named_modules())
    for c in p.candidates.candidates:  # every candidate is a module call that ran, never a container
        assert type(modules[c.region.path]).forward is not nn.Module.forward, c.region
        assert p.plain.calls[c.call].path == c.region.path
    assert p.floor_bytes < p.plain_peak_bytes
    for budget in (p.floor_bytes, (p.floor_bytes + p.plain_peak_bytes) // 2):
        _verified(p, budget)


@pytest.mark.slow
def test_a_policy_inside_a_wrapper_is_planned_per_block():
    """The DPO pair from the report: the floor was 92.5% of the plain peak, set by a ModuleList."""
    p = planner("dpo-pair-concat")
    paths = {c.region.path for c in p.candidates.candidates}
    assert "policy.blocks" not in paths and "policy" not in paths
    assert {"policy.blocks.0", "policy.blocks.1", "policy.blocks.2"} <= paths
    assert p.floor_bytes < 0.6 * p.plain_peak_bytes
    assert not any(c.region.path.startswith("reference") for c in p.candidates.candidates)  # under no_grad


@pytest.mark.slow
def test_a_shared_block_is_recomputed_per_call():
    p = planner("shared-block")
    calls = [c.region for c in p.candidates.candidates if c.region.path == "block" and c.region.policy == "full"]
    assert [r.call for r in calls] == [0, 1, 2, 3] and all(r.num_calls == 4 for r in calls)
    assert [p.candidates.candidates[j].region for j in p.block_candidates()] == calls
    assert p.floor_bytes < 0.5 * p.plain_peak_bytes  # checkpointing each call of the block


@pytest.mark.slow
def test_in_place_writes_to_older_tensors_are_never_recomputed():
    p = planner("stateful-cnn")
    assert "stem_relu" not in {c.region.path for c in p.candidates.candidates}
    assert any("stem_relu" in n for n in p.candidates.notes)
    blocks = [c.region for c in p.candidates.candidates if c.region.path == "blocks.0"]
    assert blocks and set(blocks[0].restore) == {
        "blocks.0.bn.running_mean",
        "blocks.0.bn.running_var",
        "blocks.0.bn.num_batches_tracked",
        "blocks.0.stat.mean",
    }


@pytest.mark.slow
def test_recomputing_a_stateful_module_without_its_copy_is_caught():
    """The oracle can fail: without ``restore`` the running scale (a module of the model's own) is updated twice
    and its recomputed output differs, and verification says so. BatchNorm's running statistics are recomputed on
    a copy even so (a region written by hand lists no buffers)."""
    w = stateful_cnn()
    names = (
        "blocks.1.bn.num_batches_tracked",
        "blocks.1.bn.running_mean",
        "blocks.1.bn.running_var",
        "blocks.1.stat.mean",
    )
    fingerprint = structure_fingerprint(w.model)
    safe = Plan(regions=(Region("blocks.1", restore=names),), fingerprint=fingerprint)
    unsafe = Plan(regions=(Region("blocks.1"),), fingerprint=fingerprint)
    assert compare_state(w, safe)[0]
    equal, count, mismatched = compare_state(w, unsafe)
    assert not equal and count > 0
    assert "buffer blocks.1.stat.mean" in mismatched and not [m for m in mismatched if ".bn." in m]


def test_a_container_that_is_never_called_is_refused():
    w = wrapped("list")
    plan = Plan(regions=(Region("model.blocks"),), fingerprint=structure_fingerprint(w.model))
    with pytest.raises(InputError, match=r"never called .* model\.blocks\.0, model\.blocks\.1, model\.blocks\.2"):
        plan.apply(w.model)
    assert "forward" not in w.model.model.blocks.__dict__  # nothing was wrapped


@pytest.mark.slow
def test_a_call_of_a_shared_module_is_counted_from_each_forward_of_the_model():
    w = shared_block()
    plan = Plan(regions=(Region("block", call=2, num_calls=4),), fingerprint=structure_fingerprint(w.model))
    plan.apply(w.model)
    try:
        for _ in range(3):
            w.model(*w.batch).backward()
        assert plan.runs(w.model) == {plan.regions[0]: 3}  # once per step: the third call of four
        with torch.no_grad():
            w.model(*w.batch)
        assert plan.runs(w.model) == {plan.regions[0]: 3}  # nothing checkpointed without grad
    finally:
        plan.remove(w.model)
    assert "forward" not in w.model.block.__dict__ and not any("_trainledger" in k for k in w.model.__dict__)


@pytest.mark.parametrize(
    ("regions", "fragment"),
    [
        ((Region("block", call=4, num_calls=4),), "call 4 is not one of its 4 calls"),
        ((Region("block", call=0, num_calls=4), Region("block", call=0, num_calls=4)), "twice"),
        ((Region("block"), Region("block", call=1, num_calls=4)), "twice"),
        ((Region("block", restore=("block.nothing",)),), "not buffers of this model"),
    ],
)
def test_bad_regions_are_one_line_errors(regions, fragment):
    w = shared_block()
    with pytest.raises(InputError, match=fragment):
        Plan(regions=regions, fingerprint=structure_fingerprint(w.model)).apply(w.model)


def test_regions_with_calls_and_copies_round_trip_through_json(tmp_path):
    w = shared_block()
    regions = (Region("block", "selective", call=1, num_calls=4), Region("head"))
    plan = Plan(regions=regions, fingerprint=structure_fingerprint(w.model))
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    saved = json.loads((tmp_path / "p.json").read_text())["regions"]
    assert saved == [
        {"path": "block", "policy": "selective", "call": 1, "num_calls": 4},
        {"path": "head", "policy": "full"},
    ]
    assert regions[0].label == "block (call 2 of 4) (selective)"
