"""``record``'s overhead on a step of gpt-small size, beside ``trace``'s on the same step.

Run from the repository root:

    python -m benchmarks.record_speed        # a Markdown table, benchmarks/results/record_speed.md

gpt-small: 4 layers, hidden 256, 8 heads, sequence 256, micro-batch 8, AdamW (as in ``trace_speed``). In one
process, repeated and interleaved: the plain step; ``trace(workload)``'s traced step (its
``traced_step_seconds``: the step under the tracer, without the warm-up step, the ledger's assembly and the
restore); the step recorded inside the user's own loop (``record``'s ``traced_step_seconds``: from the
previous optimizer step's return to this one's, under the tracer); and that recorded step's wall time as the
loop sees it, the ledger's assembly included. Medians; ratios to the plain step are the numbers to read
(absolute times on a shared 2-core machine are noisy).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def measure(repeats: int = 5) -> dict[str, float]:
    from benchmarks.trace_speed import build
    from trainledger import record, trace
    from trainledger.workload import run_step

    w = build("gpt-small")
    opt = w.get_optimizer()
    run_step(w)
    plain, traced, recorded, recorded_wall = [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_step(w)
        plain.append(time.perf_counter() - t0)
        traced.append(trace(w).meta["traced_step_seconds"])
        with record(w.model, opt, steps=1) as rec:
            run_step(w)
            t0 = time.perf_counter()
            run_step(w)
            recorded_wall.append(time.perf_counter() - t0)
        recorded.append(rec.ledger(step=1).meta["traced_step_seconds"])
    return {
        "plain_s": statistics.median(plain),
        "trace_s": statistics.median(traced),
        "record_s": statistics.median(recorded),
        "record_wall_s": statistics.median(recorded_wall),
    }


def main() -> None:
    r = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
    p = r["plain_s"]
    table = "\n".join(
        [
            "| gpt-small step | median (ms) | ratio to plain |",
            "|---|---:|---:|",
            f"| plain | {p * 1e3:.1f} | 1.00× |",
            f"| `trace(workload)`, traced step | {r['trace_s'] * 1e3:.1f} | {r['trace_s'] / p:.2f}× |",
            f"| `record`, traced step | {r['record_s'] * 1e3:.1f} | {r['record_s'] / p:.2f}× |",
            f"| `record`, step as the loop sees it (ledger built) | {r['record_wall_s'] * 1e3:.1f} | "
            f"{r['record_wall_s'] / p:.2f}× |",
        ]
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "record_speed.json").write_text(json.dumps(r, indent=2))
    (RESULTS / "record_speed.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
