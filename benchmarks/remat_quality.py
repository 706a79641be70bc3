"""Plan quality: every plan applied and traced again, at budgets from the plain peak down to the floor.

For the GPT example and a U-Net with skip connections, at ``--budgets`` budgets (default 8) evenly spaced
from the plain step's traced peak down to the floor (the lowest peak any plan reaches):

- our plan (``solver="auto"``) is applied to the model and the step is traced again: the traced peak must
  be within the budget and within 1% of the predicted peak, and gradients must be bitwise equal to the
  plain step's (same seed, dropout on);
- its extra compute is compared with the MILP optimum over the same plans (must be within 2%) and with
  uniform per-block checkpointing (what ``gradient_checkpointing_enable()`` does) wherever that fits;
- the greedy knapsack and Chen's √n are listed beside them.

It also runs PyTorch's own SAC MILP (``torch.distributed._tools.sac_ilp.sac_milp``, needs ``pulp`` and
``pwlf``) at the same budgets, on a ModuleInfo built from MemTracker and our measured op times, and replays
its plans on the traced step; and it times the chain DP on a 96-block chain.

Needs the ``sac`` extra for PyTorch's SAC MILP (``pip install 'trainledger[sac]'``).

Run:  python benchmarks/remat_quality.py [--budgets 8] [--plots docs]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

try:
    from benchmarks.torch_sac import with_torch_sac
except ModuleNotFoundError:  # run as a script (python benchmarks/remat_quality.py): its folder is on the path
    from torch_sac import with_torch_sac  # type: ignore[no-redef]
from trainledger.examples import gpt_tiny, unet_small
from trainledger.remat import Chain, LinearModel, pareto, solve_dp, solve_milp, uniform_chain_model
from trainledger.report.plot import plot_pareto

MODELS = {"gpt-tiny": gpt_tiny, "unet-small": unet_small}


def quality(name: str, num_budgets: int, plot_dir: Path | None) -> dict[str, object]:
    workload = MODELS[name]()
    start = time.perf_counter()
    result = pareto(workload, num_budgets=num_budgets, verify=True)
    seconds = time.perf_counter() - start
    result = with_torch_sac(result)
    pl = result.planner
    uni = result.uniform
    print(f"\n### {name}\n")
    print(
        f"plain traced peak {pl.plain_peak_bytes:,} B; floor {pl.floor_bytes:,} B "
        f"({100 * pl.floor_bytes / pl.plain_peak_bytes:.1f}%); {len(pl.candidates.candidates)} candidates in "
        f"{len(pl.candidates.positions)} chain positions; uniform per-block: peak {uni.peak_bytes:,} B at "
        f"{uni.extra_seconds * 1e3:.2f} ms / {uni.extra_flops / 1e6:.1f} MFLOP; Chen √n: peak "
        f"{result.sqrt_n.peak_bytes:,} B at {result.sqrt_n.extra_seconds * 1e3:.2f} ms"
    )
    print()
    print(
        "| budget (B) | % of plain | predicted peak | traced peak | error | within budget | grads bitwise "
        "| ours: extra ms | ours: MFLOP | MILP optimum ms | ours / MILP | uniform ms (fits?) | greedy ms |"
    )
    print("|" + "---|" * 13)
    checks = {"within": True, "agree": True, "bitwise": True, "vs_milp": True, "vs_uniform": True}
    worst_err, worst_ratio = 0.0, 0.0
    for r in result.rows:
        o, m, g = r.ours, r.milp, r.greedy
        assert o is not None and o.traced_peak_bytes is not None
        err = (o.peak_bytes - o.traced_peak_bytes) / o.traced_peak_bytes
        worst_err = max(worst_err, abs(err))
        within = o.traced_peak_bytes <= r.budget_bytes
        ratio = o.extra_seconds / m.extra_seconds if m and m.extra_seconds > 0 else 1.0
        worst_ratio = max(worst_ratio, ratio - 1)
        fits = uni.peak_bytes <= r.budget_bytes
        checks["within"] &= within
        checks["agree"] &= abs(err) <= 0.01
        checks["bitwise"] &= bool(o.gradients_bitwise_equal)
        checks["vs_milp"] &= ratio <= 1.02
        if fits:
            checks["vs_uniform"] &= o.extra_seconds < uni.extra_seconds
        print(
            f"| {r.budget_bytes:,} | {100 * r.budget_bytes / pl.plain_peak_bytes:.1f}% | {o.peak_bytes:,} | "
            f"{o.traced_peak_bytes:,} | {100 * err:+.2f}% | {'yes' if within else 'NO'} | "
            f"{'yes' if o.gradients_bitwise_equal else 'NO'} | {o.extra_seconds * 1e3:.2f} | "
            f"{o.extra_flops / 1e6:.1f} | {m.extra_seconds * 1e3:.2f} | {ratio:.3f} | "
            f"{uni.extra_seconds * 1e3:.2f} ({'yes' if fits else 'no'}) | "
            f"{(g.extra_seconds * 1e3) if g else float('nan'):.2f} |"
            if m
            else f"| {r.budget_bytes:,} | MILP did not solve |"
        )
    print()
    print(
        f"checks: traced peak within budget at every budget: {checks['within']}; predicted vs traced within 1%: "
        f"{checks['agree']} (worst {100 * worst_err:.2f}%); gradients bitwise equal: {checks['bitwise']}; "
        f"within 2% of the MILP optimum: {checks['vs_milp']} (worst {100 * worst_ratio:+.2f}%); cheaper than "
        f"uniform per-block wherever it fits: {checks['vs_uniform']}; sweep took {seconds:.0f} s"
    )
    if plot_dir is not None:
        out = plot_pareto(result, plot_dir / f"remat_pareto_{name}.png")
        print(f"\nplot: {out}")
    sac = torch_sac_comparison(result)
    if sac:
        print(sac)
    return checks


def torch_sac_comparison(result: object) -> str:
    """PyTorch's SAC MILP (``torch.distributed._tools.sac_ilp.sac_milp``) at the same budgets, its plans
    replayed on our traced step (see ``benchmarks/torch_sac.py``)."""
    sac = result.extra["torch_sac_ilp"]  # type: ignore[attr-defined]
    if not sac.get("ran"):
        return "PyTorch's SAC MILP: " + sac["summary"]
    rows = result.rows  # type: ignore[attr-defined]
    out = [
        "",
        f"PyTorch's SAC MILP on the same step: its model of the plain step peaks at {sac['baseline_peak_bytes']:,} B "
        f"(MemTracker's whole step: {sac['memtracker_peak_bytes']:,} B; optimizer state it leaves out: "
        f"{sac['optimizer_bytes']:,} B). Its ms are its own prediction (piecewise-linear fit over our measured op "
        "times); its plan's peak is the plan replayed on our traced step, and measured ms the measured time of the "
        "ops it recomputes (* where it discards part of a module: those modules recomputed whole, which our plans "
        "can run).",
        "",
        "| budget (B) | ours: traced peak | ours: ms | SAC as given: feasible? | its own peak | its ms | its plan's "
        "peak | measured ms | fits? | SAC, budget less optimizer: feasible? | its own peak | its ms | its plan's peak "
        "| measured ms | fits? |",
        "|" + "---|" * 15,
    ]

    def cells(p: dict) -> str:
        if not p["feasible"]:
            return "infeasible | - | - | - | - | -"
        real, ms, mark = p["replayed_peak_bytes"], p["replayed_extra_seconds"], ""
        if real is None:
            real, ms, mark = p["full_peak_bytes"], p["full_extra_seconds"], "*"
        fits = "-" if real is None else ("yes" if real <= p["budget_bytes"] else "NO")
        real_text = "-" if real is None else f"{real:,}{mark}"
        ms_text = "-" if ms is None else f"{ms * 1e3:.2f}"
        return f"feasible | {p['own_peak_bytes']:,} | {p['recompute_ms']:.2f} | {real_text} | {ms_text} | {fits}"

    wrong_feasible = 0
    infeasible_ours_fits = 0
    for r, given, less in zip(rows, sac["as_given"], sac["less_optimizer"], strict=True):
        o = r.ours
        traced = o.traced_peak_bytes if o.traced_peak_bytes is not None else o.peak_bytes
        out.append(
            f"| {r.budget_bytes:,} | {traced:,} | {o.extra_seconds * 1e3:.2f} | {cells(given)} | {cells(less)} |"
        )
        for p in (given, less):
            real = p["replayed_peak_bytes"] if p["replayed_peak_bytes"] is not None else p["full_peak_bytes"]
            if p["feasible"] and real is not None and real > p["budget_bytes"]:
                wrong_feasible += 1
        if not less["feasible"] and traced <= r.budget_bytes:
            infeasible_ours_fits += 1
    out += [
        "",
        f"summary: {sac['summary']}; budgets where a plan it calls feasible peaks above the budget on the traced "
        f"step: {wrong_feasible} of {2 * len(rows)}; budgets it calls infeasible (less optimizer state) that our "
        f"plan meets on the traced step: {infeasible_ours_fits} of {len(rows)}",
    ]
    return "\n".join(out)


def chain_timing(num_blocks: int = 96) -> None:
    rng = random.Random(0)
    base = uniform_chain_model(
        num_blocks=num_blocks,
        saved_bytes=[rng.randint(8, 12) * 2**20 for _ in range(num_blocks)],
        input_bytes=2**20,
        transient_bytes=[rng.randint(2, 4) * 2**20 for _ in range(num_blocks)],
        grad_bytes=4 * 2**20,
        base_bytes=2**30,
        cost=[rng.uniform(0.9, 1.1) for _ in range(num_blocks)],
    )
    n = num_blocks
    # two more options per block, as in a transformer: selective (half the saving at a third of the cost)
    # and the MLP alone (a third of the saving at half the cost)
    model = LinearModel(
        base.base,
        np.vstack([base.delta, base.delta // 2, base.delta // 3]),
        np.r_[base.cost, base.cost / 3, base.cost / 2],
        base.covers * 3,
        base.names + tuple(f"{x}-sel" for x in base.names) + tuple(f"{x}-mlp" for x in base.names),
        chain=Chain(tuple(((), (i,), (i + n,), (i + 2 * n,)) for i in range(n)), base.chain.span, base.chain.prefix),
    )
    budget = (model.peak(()) + model.peak(tuple(range(n)))) // 2
    t0 = time.perf_counter()
    dp = solve_dp(model, budget)
    t_dp = time.perf_counter() - t0
    t0 = time.perf_counter()
    milp = solve_milp(model, budget, time_limit_s=60)
    t_milp = time.perf_counter() - t0
    print(
        f"\n### chain DP on {n} blocks × 3 options ({model.num_candidates} candidates, {len(model.base)} points)\n\n"
        f"DP {t_dp * 1e3:.0f} ms (optimal: {dp.optimal}, cost {dp.cost:.4f}); MILP {t_milp * 1e3:.0f} ms "
        f"(cost {milp.cost:.4f}, gap {milp.gap}); same optimum: {abs(dp.cost - milp.cost) < 1e-9}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, default=8)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--plots", type=Path, default=None, help="folder for the Pareto pictures")
    args = ap.parse_args()
    ok = True
    for name in args.models:
        checks = quality(name, args.budgets, args.plots)
        ok &= all(checks.values())
    chain_timing()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
