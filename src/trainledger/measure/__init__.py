"""Measure a training step with the allocator's own counters (evidence ``measured``).

CUDA: ``torch.cuda`` memory statistics — ``memory_allocated`` at the step's start,
``max_memory_allocated`` over the step (absolute), ``max_memory_reserved`` for what the caching allocator
held. CPU: the profiler's memory events (``torch.profiler.profile(profile_memory=True)``), whose running
sum over the step's window gives the rise above the step's start; the bytes live at the start come from
the trace (the profiler cannot see allocations made before it started), and the report says so.

The difference between the measured and the traced peak is memory not visible as tensors: buffers that
kernels allocate and free internally, and allocator rounding (CUDA rounds blocks to 512 bytes).

Example:
    >>> from trainledger.examples import mlp
    >>> m = measure(mlp(), num_steps=2)
    >>> m.peak_bytes >= m.traced.peak().bytes - 64
    True
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from trainledger.checks import whole_number
from trainledger.ledger import Evidence, Ledger
from trainledger.trace import trace
from trainledger.workload import Workload, quiet_gc, require_workload, run_step

__all__ = ["Measurement", "measure"]

WINDOW = "trainledger.measured_step"


@dataclass(frozen=True)
class Measurement:
    """A measured step beside its trace."""

    device: str
    peak_bytes: int
    """Live bytes at the measured peak (absolute)."""
    start_bytes: int
    """Live bytes when the step began."""
    start_source: str
    """``allocator`` (CUDA counters) or ``trace`` (CPU: the traced bytes live before the step's first op)."""
    reserved_peak_bytes: int | None
    """What the caching allocator held at most (CUDA only)."""
    step_seconds: tuple[float, ...]
    traced: Ledger
    step_threads: int = 1
    """Intra-op threads the steps were timed with."""

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def step_spread_seconds(self) -> tuple[float, float, float]:
        """Fastest, median and slowest step: a wide spread says the machine was busy."""
        return min(self.step_seconds), self.median_step_seconds, max(self.step_seconds)

    @property
    def unseen_workspace_bytes(self) -> int:
        """Measured minus traced peak: kernel-internal buffers and allocator rounding."""
        return self.peak_bytes - self.traced.peak().bytes

    def to_dict(self) -> dict[str, Any]:
        traced = self.traced.to_dict(entries=False)
        by_cat = dict(traced["peak"]["by_category"])
        by_cat["workspace_not_visible_as_tensors"] = self.unseen_workspace_bytes
        return {
            "schema": "trainledger.measure/1",
            "evidence": str(Evidence.MEASURED),
            "device": self.device,
            "peak": {**traced["peak"], "bytes": self.peak_bytes, "by_category": by_cat},
            "category_maxima": traced["category_maxima"],
            "sum_of_category_maxima": traced["sum_of_category_maxima"],
            "start_bytes": self.start_bytes,
            "start_source": self.start_source,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "traced_peak_bytes": self.traced.peak().bytes,
            "unseen_workspace_bytes": self.unseen_workspace_bytes,
            "step_seconds": list(self.step_seconds),
            "median_step_seconds": self.median_step_seconds,
            "min_step_seconds": min(self.step_seconds),
            "max_step_seconds": max(self.step_seconds),
            "step_threads": self.step_threads,
            "notes": [
                "peak is the allocator's own count; by_category is the trace's breakdown at its peak, "
                "plus the difference as workspace not visible as tensors"
            ],
        }


def measure(workload: Workload, *, num_steps: int = 5) -> Measurement:
    """Run the real step with the allocator's counters, beside a trace of the same step.

    Arguments:
        workload: the step's ingredients (its model runs for real: not fake).
        num_steps: plain steps timed for the median step time.
    """
    require_workload(workload, "measure")
    whole_number(num_steps, "number of timed steps")
    device = _device_of(workload)
    before = _snapshot(workload)
    ledger = trace(workload)  # a warm-up step, then the traced step
    _restore(workload, before)  # measure that same step: same weights, optimizer state and random numbers
    run_step(workload)
    if device.startswith("cuda"):
        peak, start, reserved = _cuda_peak(workload)
        start_source = "allocator"
    else:
        rise = _cpu_rise(workload)
        start = sum(e.nbytes for e in ledger.entries if e.alloc_event is None)
        peak, reserved, start_source = start + rise, None, "trace"
    times = _timed_steps(workload, device, num_steps)
    return Measurement(device, peak, start, start_source, reserved, times, ledger, STEP_THREADS)


STEP_THREADS = 1
"""Intra-op threads while steps are timed: with all cores, a busy machine made the median of the same
step 100 times slower (1.5 s against 15.6 ms quiet); one thread is repeatable (as ``plan --verify``)."""


def _timed_steps(workload: Workload, device: str, num_steps: int) -> tuple[float, ...]:
    """Wall times of ``num_steps`` untraced steps on :data:`STEP_THREADS` intra-op threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(STEP_THREADS)
    try:
        times = []
        for _ in range(num_steps):
            _sync(device)
            t0 = time.perf_counter()
            run_step(workload)
            _sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return tuple(times)


def _snapshot(workload: Workload) -> dict[str, Any]:
    """Copies (on the CPU, outside the measured device's memory) of everything a step changes."""
    to_cpu = lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else copy.deepcopy(t)  # noqa: E731
    state = {
        "model": {k: to_cpu(v) for k, v in workload.model.state_dict().items()},
        "optimizer": tree_map(to_cpu, workload.get_optimizer().state_dict()),
        "cpu_rng": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def _restore(workload: Workload, state: dict[str, Any]) -> None:
    workload.model.load_state_dict(state["model"])
    workload.get_optimizer().load_state_dict(state["optimizer"])
    torch.set_rng_state(state["cpu_rng"])
    if "cuda_rng" in state:
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def _device_of(workload: Workload) -> str:
    p = next(workload.model.parameters(), None)
    return str(p.device) if p is not None else "cpu"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _cuda_peak(workload: Workload) -> tuple[int, int, int]:
    """(peak, start, reserved peak) bytes from the CUDA caching allocator's statistics."""
    device = torch.device(_device_of(workload))
    torch.cuda.synchronize(device)
    with quiet_gc():
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        run_step(workload)
        torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), start, torch.cuda.max_memory_reserved(device)


def _cpu_rise(workload: Workload) -> int:
    """Largest rise of live CPU bytes above the step's start, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with _native_stderr_filtered(), quiet_gc():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function(WINDOW):
                run_step(workload)
    return window_rise(prof, WINDOW)


@contextlib.contextmanager
def _native_stderr_filtered(noise: str = "USDT:") -> Iterator[None]:
    """The profiler's native layer prints ``USDT:`` trace lines straight to file descriptor 2, where no
    Python setting reaches them: point fd 2 at a temporary file for the duration, then pass on every
    line but those (so real warnings and errors still reach the user)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True) if not line.startswith(noise.encode())]
            if kept:
                os.write(2, b"".join(kept))


def window_rise(prof: Any, window: str) -> int:
    """Max running sum of CPU ``[memory]`` events inside the named ``record_function`` window."""
    events = prof.profiler.kineto_results.events()
    spans = [e for e in events if e.name() == window]
    if not spans:
        raise RuntimeError(f"profiler window {window!r} not found")
    t0 = spans[0].start_ns()
    t1 = t0 + spans[0].duration_ns()
    run = best = 0
    mem = sorted(
        (e for e in events if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")),
        key=lambda e: e.start_ns(),
    )
    for e in mem:
        if t0 <= e.start_ns() <= t1:
            run += e.nbytes()
            best = max(best, run)
    return best
