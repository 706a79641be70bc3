"""The independent oracle for traced peaks: the profiler's own allocation events, in a fresh process.

``python -m tests.oracle_profiler NAME`` starts ``torch.profiler.profile(profile_memory=True)`` *before*
the model is built, builds the built-in example ``NAME``, runs a warm-up step and one more step, and
prints the largest running sum of the profiler's CPU allocation events inside that second step's window
(absolute live bytes: everything the process allocated since the profiler started, minus what it freed).
It shares no code with the tracer.
"""

from __future__ import annotations

import gc
import json
import sys

from torch.profiler import ProfilerActivity, profile, record_function


def oracle(name: str) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        from trainledger import examples
        from trainledger.workload import run_step

        w = examples.build(name)
        run_step(w)
        gc.collect()
        gc.disable()
        with record_function("oracle.step"):
            run_step(w)
        gc.enable()
    events = prof.profiler.kineto_results.events()
    window = next(e for e in events if e.name() == "oracle.step")
    t0, t1 = window.start_ns(), window.start_ns() + window.duration_ns()
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    run = peak = 0
    for e in mem:
        run += e.nbytes()
        if t0 <= e.start_ns() <= t1:
            peak = max(peak, run)
    return {"peak_bytes": peak}


if __name__ == "__main__":
    print(json.dumps(oracle(sys.argv[1])))
