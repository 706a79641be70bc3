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

import copy
import time
import warnings
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils._pytree import tree_map

from trainledger.checks import whole_number
from trainledger.ledger import Ledger
from trainledger.trace import MeasuredStep, trace
from trainledger.workload import (
    Workload,
    intra_op_threads,
    profiler_stderr_filtered,
    quiet_gc,
    require_workload,
    run_step,
)

__all__ = ["Measurement", "measure"]

WINDOW = "trainledger.measured_step"


@dataclass(frozen=True)
class Measurement(MeasuredStep):
    """A measured step beside its trace: the figures of :class:`MeasuredStep` and the trace's whole ledger."""

    traced: Ledger
    """The trace taken beside the measurement (same weights, optimizer state and random numbers)."""

    def summary(self) -> MeasuredStep:
        """The figures reports print and save (``to_dict``), without the trace's entries."""
        return MeasuredStep(**{f.name: getattr(self, f.name) for f in fields(MeasuredStep)})


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
    if device.startswith("cuda"):
        run_step(workload)  # the warm-up step
        peak, start, reserved = _cuda_peak(workload)
        start_source = "allocator"
    else:
        rise = _cpu_rise(workload)
        start = sum(e.nbytes for e in ledger.entries if e.alloc_event is None)
        peak, reserved, start_source = start + rise, None, "trace"
    return Measurement(
        device=device,
        peak_bytes=peak,
        start_bytes=start,
        start_source=start_source,
        reserved_peak_bytes=reserved,
        step_seconds=_timed_steps(workload, device, num_steps),
        step_threads=STEP_THREADS,
        traced_peak=ledger.peak(),
        traced_category_maxima=ledger.category_maxima(),
        traced=ledger,
    )


STEP_THREADS = 1
"""Intra-op threads while steps are timed: with all cores, a busy machine made the median of the same
step 100 times slower (1.5 s against 15.6 ms quiet); one thread is repeatable (as ``plan --verify``)."""


def _timed_steps(workload: Workload, device: str, num_steps: int) -> tuple[float, ...]:
    """Wall times of ``num_steps`` untraced steps on :data:`STEP_THREADS` intra-op threads."""
    times = []
    with intra_op_threads(STEP_THREADS):
        for _ in range(num_steps):
            _sync(device)
            t0 = time.perf_counter()
            run_step(workload)
            _sync(device)
            times.append(time.perf_counter() - t0)
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


UNKNOWN_BLOCK = "Memory block of unknown size"
"""How the warning starts that the profiler's memory tracking gives (``CPUAllocator.cpp``) when a storage allocated
before it started is freed while it runs (a step that replaces a tensor it kept from the step before). Under
``-W error`` (pytest's ``filterwarnings = error``) a warning that reaches Python is raised inside the free, where
no one can catch it; ignored while the measured step runs, and there only."""


def _cpu_rise(workload: Workload) -> int:
    """Largest rise of live CPU bytes above the step's start, from the profiler's memory events.

    The warm-up step runs under the profiler too, outside the measured window: the profiler reports no free
    of a block allocated before it started, and state the warm-up step made may be freed in the measured
    step (a sparse momentum buffer's parts are replaced every step).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profiler_stderr_filtered(), quiet_gc(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=UNKNOWN_BLOCK)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run_step(workload)
            with record_function(WINDOW):
                run_step(workload)
    return window_rise(prof, WINDOW)


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
