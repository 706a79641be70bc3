"""Sharding: predicted per-rank peak against each rank's traced peak, and predicted against counted traffic.

For each model, world size and ZeRO stage, ``trainledger.shard.launch.run`` starts the ranks on gloo
(DDP for stage 0, + ``ZeroRedundancyOptimizer`` for 1, FSDP2 ``fully_shard`` for 2 and 3), traces every
rank's step, and counts every ``c10d`` call of an untraced step; the prediction is the sharding
transform applied to the same workload traced in one process. Then the ZeRO paper's model-state
arithmetic (Rajbhandari et al. 2019: 7.5B parameters, 64 devices, mixed-precision Adam) through the
declared path.

Run from the repository root:

    python -m benchmarks.shard_accuracy                      # gpt-tiny, worlds 2 and 4, stages 0-3
    python -m benchmarks.shard_accuracy --models mlp cnn lstm moe lora dpo bf16-master --worlds 2 \
        --stages 0 1 2 3 --out shard_accuracy_more.md

It prints Markdown tables and writes them to ``benchmarks/results/`` (``--out``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from trainledger.declared import StateSpec, declared_ledger
from trainledger.shard import shard
from trainledger.shard.launch import RankError, RunConfig, run

RESULTS = Path(__file__).parent / "results"
PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # Rajbhandari et al. 2019, Figure 1


def run_rows(models: list[str], worlds: list[int], stages: list[int]) -> list[str]:
    rows = [
        "| model | world | stage (engine) | predicted peak / rank | traced peak / rank | max abs error "
        "| collective bytes counted / rank | predicted | equal | step s | wait s | wall s |",
        "|---|---:|---|---:|---:|---:|---:|---:|:-:|---:|---:|---:|",
    ]
    for model in models:
        for world in worlds:
            for stage in stages:
                start = time.perf_counter()
                try:
                    res = run(RunConfig(model=model, world_size=world, strategy=f"zero{stage}", timeout_seconds=600))
                except RankError as exc:  # a workload the engine cannot run: say so in the table
                    rows.append(f"| {model} | {world} | {stage} | failed: {exc} |" + " |" * 8)
                    print(rows[-1], flush=True)
                    continue
                wall = time.perf_counter() - start
                d = res.to_dict()
                ranks = d["ranks"]
                pred = sorted({r["predicted_peak_bytes"] for r in ranks})
                traced = sorted({r["traced_peak_bytes"] for r in ranks})
                err = max(abs(r["relative_error"]) for r in ranks)
                counted = sorted({r["collective_bytes"] for r in ranks})
                predicted = ranks[0]["predicted_collective_bytes"]
                equal = all(r["collectives"] == r["predicted_collectives"] for r in ranks)
                step = sum(r["step_seconds"] for r in ranks) / len(ranks)
                wait = sum(r["wait_seconds"] for r in ranks) / len(ranks)
                rows.append(
                    f"| {model} | {world} | {stage} ({res.prediction.label}) | {_span(pred)} | {_span(traced)} "
                    f"| {100 * err:.2f}% | {_span(counted)} | {predicted:,} | {'yes' if equal else 'NO'} "
                    f"| {step:.3f} | {wait:.3f} | {wall:.0f} |"
                )
                print(rows[-1], flush=True)
    return rows


def _span(values: list[int]) -> str:
    return f"{values[0]:,}" if len(values) == 1 else f"{values[0]:,} – {values[-1]:,}"


def paper_rows() -> list[str]:
    spec = StateSpec(num_params=7_500_000_000, weights="fp16", master="fp32", moments="fp32", grads="fp16")
    led = declared_ledger(spec)
    rows = [
        "| stage | model states / device (GB) | paper (GB) | per-rank wire bytes / step | leaves out |",
        "|---|---:|---:|---:|---|",
    ]
    for stage in range(4):
        res = shard(led, world_size=64, strategy=f"zero{stage}")
        gb = res.model_state_bytes() / 1e9
        wire = sum(c.wire_bytes for c in res.collectives)
        left_out = "; ".join(n.removeprefix("excluded: ") for n in res.notes)
        left_out += "; activations, workspace, step counters, allocator rounding (declared state only)"
        rows.append(f"| {stage} | {gb:.4g} | {PAPER_GB[stage]} | {wire:,} | {left_out} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-tiny"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--out", default="shard_accuracy.md", help="file name under benchmarks/results/")
    args = parser.parse_args()
    paper = paper_rows()
    print("\n".join(paper), flush=True)
    runs = run_rows(args.models, args.worlds, args.stages)
    RESULTS.mkdir(exist_ok=True)
    text = (
        "## ZeRO paper, 7.5B parameters on 64 devices (declared)\n\n"
        + "\n".join(paper)
        + "\n\n## Predicted against traced, gloo on CPU\n\n"
        + "\n".join(runs)
        + "\n"
    )
    (RESULTS / args.out).write_text(text)


if __name__ == "__main__":
    main()
