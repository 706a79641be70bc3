"""Which CPU kernels allocate memory they free before returning, and does the trace now see it?

``python -m benchmarks.kernel_workspace`` runs one training step of every built-in example under the
profiler (``profile_memory=True``) and, for every op, compares the most the allocator held inside the op
with what the op returned: ops that hold more are the ones whose kernels allocate internally (the list
``trainledger.trace._kernels.PROBED_OPS`` came from this table). Then it traces each example with and
without the measured kernel buffers and compares both peaks with the profiler oracle of
``tests/oracle_profiler.py`` (a fresh process, the profiler started before the model is built).

Writes ``benchmarks/results/kernel_workspace.md``.
"""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from trainledger import examples
from trainledger.trace import trace
from trainledger.workload import run_step

OUT = Path(__file__).parent / "results" / "kernel_workspace.md"
COMMAND = "python -m benchmarks.kernel_workspace"


def internal_by_op(name: str) -> dict[str, tuple[int, int]]:
    """Per op name: (calls holding more than they return, the most any held above what it returned)."""
    w = examples.build(name)
    run_step(w)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(w)
    events = prof.profiler.kineto_results.events()
    ops = sorted((e for e in events if e.name().startswith("aten::")), key=lambda e: (e.start_ns(), -e.duration_ns()))
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    starts = [m.start_ns() for m in memory]
    found: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    end = -1
    for op in ops:  # outermost aten ops only: their window holds every allocation of the ops inside
        if op.start_ns() < end:
            continue
        end = op.start_ns() + op.duration_ns()
        run = peak = 0
        for m in memory[bisect.bisect_left(starts, op.start_ns()) : bisect.bisect_right(starts, end)]:
            run += m.nbytes()
            peak = max(peak, run)
        if peak - max(run, 0) > 8:  # above a wrapped Python scalar
            found[op.name()][0] += 1
            found[op.name()][1] = max(found[op.name()][1], peak - max(run, 0))
    return {k: (v[0], v[1]) for k, v in found.items()}


def oracle_peak(name: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "tests.oracle_profiler", name], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


def main() -> None:
    torch.set_num_threads(torch.get_num_threads())
    names = [n for n in examples.EXAMPLES if n != "seed-423"]
    lines = [
        "# Kernel-internal memory on CPU",
        "",
        f"`{COMMAND}` (torch {torch.__version__}, {torch.get_num_threads()} threads).",
        "",
        "## Ops that hold more inside than they return (profiler events of one step)",
        "",
        "| example | op | calls | most held above its outputs (B) |",
        "|---|---|---:|---:|",
    ]
    for name in names:
        for op, (calls, most) in sorted(internal_by_op(name).items(), key=lambda kv: -kv[1][1]):
            lines.append(f"| {name} | `{op}` | {calls} | {most:,} |")
    lines += [
        "",
        "## Traced peaks with and without the measured kernel buffers, against the profiler oracle",
        "",
        "| example | oracle (B) | traced, tensors only (B) | gap | traced with kernel buffers (B) | gap |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        oracle = oracle_peak(name)
        plain = trace(examples.build(name), kernel_workspace=False).peak().bytes
        full = trace(examples.build(name)).peak().bytes
        lines.append(f"| {name} | {oracle:,} | {plain:,} | {oracle - plain:,} | {full:,} | {oracle - full:,} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
