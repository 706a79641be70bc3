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
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function


def oracle(name: str) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        from trainledger import examples
        from trainledger.workload import run_step

        two_steps(examples.build(name), run_step)
    return {"peak_bytes": window_peak(prof)}


def two_steps(workload: Any, run_step: Callable[[Any], None]) -> None:
    """A warm-up step, then the step whose peak is counted, in the ``oracle.step`` window."""
    run_step(workload)
    gc.collect()
    gc.disable()
    with record_function("oracle.step"):
        run_step(workload)
    gc.enable()


def window_peak(prof: profile, window_name: str = "oracle.step") -> int:
    """The largest running sum of allocation events inside the ``record_function(window_name)`` window."""
    events = prof.profiler.kineto_results.events()
    window = next(e for e in events if e.name() == window_name)
    t0, t1 = window.start_ns(), window.start_ns() + window.duration_ns()
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    run = peak = 0
    for e in mem:
        run += e.nbytes()
        if t0 <= e.start_ns() <= t1:
            peak = max(peak, run)
    return peak


def boundary(*_args: Any) -> None:
    """Mark where one step ends and the next begins (call it, or register it as an optimizer hook)."""
    with record_function("oracle.boundary"):
        pass


def step_peaks(prof: profile) -> list[int]:
    """For each window between consecutive :func:`boundary` marks, the largest running sum of allocation
    events inside it (absolute, as :func:`window_peak`)."""
    events = prof.profiler.kineto_results.events()
    marks = sorted(e.start_ns() for e in events if e.name() == "oracle.boundary")
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    peaks = [0] * (len(marks) - 1)
    live = 0
    for e in mem:
        live += e.nbytes()
        for k in range(len(peaks)):
            if marks[k] <= e.start_ns() <= marks[k + 1]:
                peaks[k] = max(peaks[k], live)
    return peaks


if __name__ == "__main__":
    print(json.dumps(oracle(sys.argv[1])))
