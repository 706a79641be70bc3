"""Watching a rank's step from the inside: the collectives it issues, and collectives settled so that a
traced step's frees happen where the step drops its buffers (FSDP2's storages for the tracer are
:func:`trainledger.trace.fsdp_storages`, which ``record`` uses too).

Both are torch-side helpers of :mod:`trainledger.shard.launch`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainledger.shard._comm import Collective
from trainledger.trace import active_tracer

# --- counting collectives ------------------------------------------------------------------------------

# c10d ops as the dispatcher sees them -> (kind, which argument holds the payload)
_C10D_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "broadcast_": "broadcast",
}


class CollectiveCounter(TorchDispatchMode):
    """Counts every ``c10d`` op dispatched while active: kind, payload bytes, calls and time.

    DDP's reducer, ``ZeroRedundancyOptimizer`` and FSDP2 all reach their collectives through the
    dispatcher's ``c10d`` ops (checked by the tests), so this sees what each engine actually moves.
    Payload: all-reduce and broadcast the tensors' bytes; reduce-scatter its input; all-gather its
    output.
    """

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size
        self.counts: dict[tuple[str, str], list[int]] = {}
        self.phase = "step"
        self.wait_seconds = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != "c10d":
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        kind = _C10D_KINDS.get(name)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.wait_seconds += time.perf_counter() - start
        if kind is not None:
            payload = _payload(name, args)
            c = self.counts.setdefault((kind, name), [0, 0])
            c[0] += payload
            c[1] += 1
        return out

    def waits(self) -> contextlib.AbstractContextManager[None]:
        """Also count time spent in ``Work.wait()`` (asynchronous collectives finish there)."""

        def counted(wait: Any) -> Any:
            start = time.perf_counter()
            try:
                return wait()
            finally:
                self.wait_seconds += time.perf_counter() - start

        return _around_work_wait(counted)

    def collectives(self) -> list[Collective]:
        return [
            Collective(kind, "step", f"c10d.{name}", payload, self.group_size, calls)  # type: ignore[arg-type]
            for (kind, name), (payload, calls) in sorted(self.counts.items())
        ]


def _nbytes(x: Any) -> int:
    """Bytes of the tensors in ``x`` (a tensor, or lists and tuples of them)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _payload(name: str, args: tuple[Any, ...]) -> int:
    if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        return _nbytes(args[1])  # (output, input, ...)
    if name == "reduce_scatter_":
        return _nbytes(args[1])  # (outputs, input_lists, ...)
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_"):
        return _nbytes(args[0])  # output(s)
    return _nbytes(args[0])


# --- collectives settled for tracing ------------------------------------------------------------------

SETTLE_SECONDS = 0.002
"""How long a rank pauses after each collective completes while it is traced (see ``settled_collectives``)."""


@contextlib.contextmanager
def settled_collectives(seconds: float = SETTLE_SECONDS) -> Iterator[None]:
    """Pause briefly after each collective completes so the backend's worker threads let go of it.

    gloo runs each collective on a worker thread that holds the work — and so the tensors it was given
    (an all-gather's output views, the copy a reduce-scatter makes of its input, the flat buffer DDP
    broadcasts its module buffers in) — until it finishes its loop, a moment after the caller's wait has
    returned. When the step drops its own references in that moment, the worker frees the buffer later,
    at whatever event the step has reached by then: the traced timeline varies between runs by a buffer.
    After ``Work.wait()`` the step still holds what it gave the collective: a pause there lets the worker
    go first, and the step frees the buffer itself. DDP's buffer broadcast
    (``torch.distributed._broadcast_coalesced``) waits and drops its flat buffers inside C++: it pauses
    after the call too, and the active tracer is told the step is waiting for the workers during the call
    and the pause (:meth:`trainledger.trace.StepTracer.letting_go`), so a worker that lets go of a flat
    buffer frees it within the call, not events later. The tracer counts the frees that still happen on
    another thread (``Ledger.meta["frees_on_other_threads"]``).
    """

    def paused(call: Any) -> Any:
        try:
            return call()
        finally:
            time.sleep(seconds)

    def waited_for(call: Any) -> Any:
        tracer = active_tracer()
        with tracer.letting_go() if tracer is not None else contextlib.nullcontext():
            return paused(call)

    with _around_work_wait(paused), _around_broadcast_coalesced(waited_for):
        yield


@contextlib.contextmanager
def _around_broadcast_coalesced(around: Any) -> Iterator[None]:
    """Run every ``torch.distributed._broadcast_coalesced`` as ``around(call)`` while active (DDP looks it
    up on the module at each call)."""
    import torch.distributed as dist

    original = getattr(dist, "_broadcast_coalesced", None)
    if original is None:  # a build without it: nothing to wrap
        yield
        return

    def broadcast_coalesced(*args: Any, **kwargs: Any) -> Any:
        return around(lambda: original(*args, **kwargs))

    dist._broadcast_coalesced = broadcast_coalesced
    try:
        yield
    finally:
        dist._broadcast_coalesced = original


@contextlib.contextmanager
def _around_work_wait(around: Any) -> Iterator[None]:
    """Run every ``Work.wait()`` as ``around(wait)`` while active (``wait()`` calls the original)."""
    from torch._C._distributed_c10d import Work

    original = Work.wait

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        return around(lambda: original(work, *args, **kwargs))

    try:
        Work.wait = wait  # type: ignore[method-assign]
    except (TypeError, AttributeError):  # a build whose Work cannot be patched: wait as it comes
        yield
        return
    try:
        yield
    finally:
        Work.wait = original  # type: ignore[method-assign]
