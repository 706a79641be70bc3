"""Plans under CUDA's kernels and on reserved memory.

Oracles: the planned step traced again under the same kernels (``trace(kernel_kind="cuda")`` with the plan
applied, done here, not by ``--verify``); the plain step's gradients on a real CPU step, bit for bit; the
caching allocator's model (:func:`trainledger.allocator.predict_reserved`) called directly on the re-traced
ledger. The model (``tests/fixtures/sdpa_models.py``) runs SDPA with dropout in fp32, so the CPU saves the
math kernel's T×T weights and float masks where CUDA's memory-efficient kernel saves a log-sum-exp.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from trainledger.allocator import AllocatorConfig, predict_reserved
from trainledger.errors import InputError
from trainledger.remat import (
    AGREEMENT,
    InfeasibleReserved,
    Plan,
    Planner,
    Sharding,
    compare_gradients,
    reserved_of,
    solve_per_rank,
    solve_reserved,
)
from trainledger.trace import trace

MODELS = Path(__file__).parent / "fixtures" / "sdpa_models.py"
MODEL = f"{MODELS}:sdpa_stack"
RESERVED_BUDGET = 49_000_000
"""Between the floor's predicted reserved peak and the plain step's: met in a second round (see below)."""


def _build():
    spec = importlib.util.spec_from_file_location("sdpa_models_check", MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sdpa_stack()


@pytest.fixture(scope="module")
def cuda_planner() -> Planner:
    return Planner.build(_build(), cost="flops", fake=True, kernel_kind="cuda")


def _retraced(plan: Plan):
    """The plan applied to a fresh instance, its step traced again under the plan's kernels (the oracle)."""
    w = _build()
    plan.apply(w.model)
    try:
        return trace(w, kernel_kind=plan.kernel_kind, cuda_device=plan.cuda_device)
    finally:
        plan.remove(w.model)


@pytest.mark.slow
def test_cuda_plan_is_made_on_the_cuda_trace_and_predicts_its_retrace(cuda_planner, tmp_path):
    cpu = Planner.build(_build(), cost="flops", fake=True)
    # the two kernels' steps differ: the CPU saves the math kernel's T×T weights, CUDA a log-sum-exp
    saved = {e.name.split("#")[0] for e in cuda_planner.plain.entries}
    assert "aten._scaled_dot_product_efficient_attention" in saved
    assert "aten._scaled_dot_product_efficient_attention" not in {e.name.split("#")[0] for e in cpu.plain.entries}
    assert cuda_planner.plain.device == "cuda" and cuda_planner.candidates.notes == ()  # the forward lined up
    assert cuda_planner.plain_peak_bytes != cpu.plain_peak_bytes
    budget = (cuda_planner.plain_peak_bytes + cuda_planner.floor_bytes) // 2
    p = solve_per_rank(cuda_planner, budget, Sharding())
    assert p.regions and p.kernel_kind == "cuda" and p.cuda_device == "H100-80GB-SXM"
    assert p.predicted_peak_bytes <= budget
    traced = _retraced(p).peak().bytes
    assert abs(p.predicted_peak_bytes - traced) <= AGREEMENT * traced
    # the same plan, gradients on a real CPU step of the model, bit for bit
    equal, count, mismatched = compare_gradients(_build(), p)
    assert equal and count == 52 and not mismatched
    # the kernel kind survives the JSON round trip; a plan saved before kernel kinds reads as cpu
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).cuda_device == "H100-80GB-SXM"
    old = {k: v for k, v in p.to_dict().items() if k not in ("kernel_kind", "cuda_device")}
    assert (Plan.from_dict(old).kernel_kind, Plan.from_dict(old).cuda_device) == ("cpu", None)
    p.export_policy(tmp_path / "remat_policy.py")
    assert "# kernels: cuda as on H100-80GB-SXM" in (tmp_path / "remat_policy.py").read_text()


@pytest.mark.slow
def test_reserved_budget_lowers_the_allocated_budget_until_reserved_fits(cuda_planner):
    config = AllocatorConfig()
    alone = solve_per_rank(cuda_planner, RESERVED_BUDGET, Sharding())
    assert (
        alone.predicted_peak_bytes
        <= RESERVED_BUDGET
        < reserved_of(alone, config=config, capacity_bytes=None).max_reserved_bytes
    )
    p, fit = solve_reserved(cuda_planner, RESERVED_BUDGET, Sharding(), config=config)
    assert fit.num_rounds >= 2 and fit.allocated_budget_bytes < RESERVED_BUDGET
    assert fit.max_reserved_bytes <= RESERVED_BUDGET and p.budget_bytes == RESERVED_BUDGET
    # the oracle: the re-traced step replayed through the allocator model directly
    retraced = predict_reserved(_retraced(p), kernel_kind="cuda", config=config)
    assert retraced.max_reserved_bytes <= RESERVED_BUDGET
    assert retraced.max_reserved_bytes == fit.max_reserved_bytes


@pytest.mark.slow
def test_a_reserved_budget_below_what_the_floor_reserves_is_infeasible(cuda_planner):
    floor = reserved_of(
        solve_per_rank(cuda_planner, cuda_planner.floor_bytes, Sharding()),
        config=AllocatorConfig(),
        capacity_bytes=None,
    )
    budget = cuda_planner.floor_bytes + 1000  # the allocated floor fits; what it reserves does not
    assert floor.max_reserved_bytes > budget
    with pytest.raises(InfeasibleReserved) as exc:
        solve_reserved(cuda_planner, budget, Sharding())
    assert exc.value.best_reserved_bytes == floor.max_reserved_bytes
    assert f"{floor.max_reserved_bytes:,}" in str(exc.value)


@pytest.mark.slow
def test_cli_plan_cuda_verify_says_which_figure_is_which(cli):
    code, out, err = cli("plan", "--model", MODEL, "--device-kind", "cuda", "--budget", "90%", "--verify")
    assert code == 0, err
    head = out.splitlines()
    assert any(line.startswith("kernels: cuda as on H100-80GB-SXM") for line in head[:4])
    assert "step traced again with cuda kernels; gradients from a real cpu step):" in out
    assert "(agree, limit 1%)" in out and ": yes (52 of 52)" in out
    assert "cuBLAS workspace" in out  # the declared part of the peak, named


@pytest.mark.slow
def test_cli_plan_on_reserved_memory_with_a_device(cli_json):
    out = cli_json("plan", "--model", MODEL, "--device", "h100", "--budget", str(RESERVED_BUDGET), "--verify")
    assert out["kernel_kind"] == "cuda" and out["target_device"]["name"] == "H100-80GB-SXM"
    fit = out["reserved"]
    assert fit["budget_on"] == "reserved" and fit["num_rounds"] >= 2
    assert fit["predicted_reserved"]["max_reserved_bytes"] <= RESERVED_BUDGET
    v = out["verification"]
    assert v["traced_reserved"]["max_reserved_bytes"] <= RESERVED_BUDGET and v["passed"]


@pytest.mark.slow
def test_cli_plan_infeasible_reserved_budget_is_one_line_exit_2(cli, cuda_planner):
    budget = str(cuda_planner.floor_bytes + 1000)
    code, out, err = cli(
        "plan", "--model", MODEL, "--device-kind", "cuda", "--budget-on", "reserved", "--budget", budget
    )
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and "on reserved memory is not met" in err


@pytest.mark.slow
def test_cli_pareto_with_the_allocator_adds_a_reserved_column(cli_json):
    out = cli_json("pareto", "--model", MODEL, "--device-kind", "cuda", "--allocator", "--budgets", "3")
    assert out["kernel_kind"] == "cuda"
    rows = out["rows"]
    assert len(rows) == 3 and all(r["ours"]["reserved_peak_bytes"] >= r["ours"]["peak_bytes"] for r in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device-kind", "cuda", "--cost", "seconds"], "--cost seconds"),
        (["--device", "h100", "--device-kind", "cpu"], "--device H100-80GB-SXM runs cuda kernels"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "pareto"])
def test_cli_bad_kernel_flags_are_one_line_exit_2(cli, command, argv, message):
    budget = ["--budget", "60%"] if command == "plan" else []
    code, out, err = cli(command, "--model", "gpt-tiny", *budget, *argv)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and message in err


def test_cli_plan_needs_a_budget_or_a_device(cli):
    code, _, err = cli("plan", "--model", "gpt-tiny")
    assert code == 2 and "give --budget" in err and "--device NAME" in err


def test_plan_of_another_kind_is_refused_for_seconds():
    from trainledger.examples import gpt_tiny

    with pytest.raises(InputError, match="CUDA's kernels"):
        Planner.build(gpt_tiny(), cost="seconds", kernel_kind="cuda")
