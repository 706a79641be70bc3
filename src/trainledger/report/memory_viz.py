"""The ledger as a PyTorch memory snapshot: what ``torch.cuda.memory._snapshot()`` produces.

https://pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` read it. Every entry of the ledger
becomes one allocation with a synthetic address; its name, category, role, dtype, shape, and the
op/module/phase that allocated and freed it are written into the ``frames`` the viewer shows on hover.
See :mod:`trainledger.report.exports` for the time axis and the known limitations.
"""

from __future__ import annotations

import bisect
import os
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainledger.allocator import SegmentInfo
from trainledger.ledger import CATEGORY_ORDER, Entry, Event, Ledger
from trainledger.report._files import (
    MEMORY_VIZ_SUFFIXES,
    atomic_write,
    check_output_path,
    entry_interval,
    event_times_us,
)

# Smallest block of the CUDA caching allocator (kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp).
# Used only so synthetic addresses are aligned like real device pointers; sizes stay exact.
ALIGN_BYTES = 512
# Where the synthetic segment starts: a plausible device address, so the viewer's hex addresses read
# like a real snapshot's. Any positive value works.
BASE_ADDRESS = 0x7F00_0000_0000
# memory_viz's unpickler (``unpickle`` in torch/utils/viz/MemoryViz.js) accepts protocols 2 to 4.
PICKLE_PROTOCOL = 4
# Where the allocator model's predicted segments start: apart from the trace's synthetic addresses.
PREDICTED_BASE_ADDRESS = 0x7E00_0000_0000
# The site of entries that existed before the step.
_BEFORE = "<before the step>"

# --- memory_viz snapshot ------------------------------------------------------------------------------


class _FirstFit:
    """A first-fit allocator over one growing address range: gives live blocks non-overlapping offsets."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (offset, size), sorted by offset, coalesced
        self.top = 0  # high-water mark of the range

    @staticmethod
    def rounded(nbytes: int) -> int:
        return max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)

    def alloc(self, nbytes: int) -> int:
        need = self.rounded(nbytes)
        for i, (off, size) in enumerate(self.free):
            if size >= need:
                if size == need:
                    del self.free[i]
                else:
                    self.free[i] = (off + need, size - need)
                return off
        off = self.top
        self.top += need
        return off

    def release(self, off: int, nbytes: int) -> None:
        size = self.rounded(nbytes)
        i = bisect.bisect_left(self.free, (off, 0))
        if i < len(self.free) and off + size == self.free[i][0]:  # merge with the next free range
            size += self.free[i][1]
            del self.free[i]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:  # and with the previous one
            off, size = self.free[i - 1][0], self.free[i - 1][1] + size
            i -= 1
            del self.free[i]
        self.free.insert(i, (off, size))


def _site_frame(events: Sequence[Event], index: int | None, *, before: str) -> dict[str, Any]:
    if index is None:
        return {"filename": before, "line": 0, "name": "existed before the step"}
    if index >= len(events):
        return {"filename": "<after the step>", "line": index, "name": "end of the step"}
    ev = events[index]
    op = ev.op or "(no op)"
    return {"filename": ev.module or "<top level>", "line": index, "name": f"{op} ({ev.phase})"}


def _entry_frame(e: Entry) -> dict[str, Any]:
    shape = f"[{', '.join(map(str, e.shape))}]" if e.shape else ""
    owner = f" owner {e.owner}" if e.owner and e.owner != e.name else ""
    aliases = f" aliases {', '.join(e.aliases)}" if e.aliases else ""
    return {
        "filename": "trainledger",
        "line": 0,
        "name": f"{e.name} {e.category}/{e.role} {e.dtype}{shape} {e.nbytes} B{owner}{aliases}",
    }


def _device_index(device: str) -> int:
    head, _, idx = device.partition(":")
    return int(idx) if head in ("cuda", "xpu", "mtia", "hip") and idx.isdigit() else 0


def to_memory_viz_snapshot(ledger: Ledger, predicted_segments: Sequence[SegmentInfo] = ()) -> dict[str, Any]:
    """The ledger as a ``torch.cuda.memory._snapshot()`` dictionary, for https://pytorch.org/memory_viz.

    Each entry is one ``alloc`` and (if freed) one ``free_requested`` + ``free_completed`` pair in
    ``device_traces``, with a synthetic address from a first-fit allocator. Within event ``e`` the frees
    of ``e`` come before the allocations of ``e``, so after the actions stamped ``time_us`` of event ``e``
    the allocated bytes equal ``ledger.totals()[e]``: the viewer's peak is the ledger's peak.

    Entries that existed before the step are allocations at the start of the trace (time of event 0),
    not blocks left out of the trace: the viewer colours allocations by ``category`` and shows their
    ``frames`` only for trace events, so this way the weights and optimizer state are labelled and
    coloured like everything else. ``segments`` holds the end state (entries still live after the step)
    so the "Allocator State History" view and ``torch.cuda._memory_viz.segsum`` agree with the trace.

    With ``predicted_segments`` (the caching allocator model's segments at the allocated peak,
    ``ReservedPrediction.segments``), ``segments`` holds those instead: each ``cudaMalloc`` the model predicts,
    its blocks allocated or cached, so ``segsum``/``segment_plot`` show the predicted fragmentation at the
    peak. The device trace is the ledger's either way; the viewer's "Allocator State History", which walks
    the trace back from the segments, does not apply to such a file.

    Example:
        >>> from trainledger.ledger import Category, Entry, Event, Ledger
        >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 256, 1024)
        >>> a = Entry("a", Category.ACTIVATIONS, "saved", "float32", 128, 512, alloc_event=0, free_event=1)
        >>> snap = to_memory_viz_snapshot(Ledger((w, a), (Event(0, "forward", "mm"), Event(1, "backward", "mm"))))
        >>> [(t["action"], t["size"]) for t in snap["device_traces"][0]][:4]
        [('alloc', 1024), ('alloc', 512), ('free_requested', 512), ('free_completed', 512)]
    """
    starts, durations = event_times_us(ledger)
    end_time = starts[-1] + durations[-1]
    kept = _kept_entries(ledger)
    replayed = _replay(ledger, kept, starts, end_time)
    # The viewer (annotate_snapshot in MemoryViz.js) appends "unknown" to the categories it has seen and
    # fails if it is missing; real snapshots carry a "snapshot" marker, which also names that category.
    replayed.trace.append(
        {
            "action": "snapshot",
            "addr": 0,
            "size": 0,
            "stream": 0,
            "time_us": end_time,
            "frames": [],
            "category": "unknown",
        }
    )
    device = _device_index(ledger.device)
    segments = []
    if predicted_segments:
        segments = [_predicted_segment(device, seg) for seg in predicted_segments]
    elif replayed.heap.top:
        at_end = sorted((replayed.addr[k], e.nbytes, k) for k, e in enumerate(kept) if e.free_event is None)
        live = [(a, size, replayed.alloc_frames[k]) for a, size, k in at_end]
        segments.append(_segment(device, replayed.heap.top, live))
    device_traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
    device_traces[device] = replayed.trace
    return {"segments": segments, "device_traces": device_traces}


def _kept_entries(ledger: Ledger) -> list[Entry]:
    """The entries that occupy memory on the clock: those that existed before the step first, in the fixed
    category order (the viewer's legend follows first use), then the step's own in ledger order."""
    n = ledger.num_events
    kept = [e for e in ledger.entries if e.nbytes > 0 and _lives(e, n)]
    cat_rank = {c.value: i for i, c in enumerate(CATEGORY_ORDER)}
    kept.sort(key=lambda e: (e.alloc_event is not None, cat_rank[str(e.category)] if e.alloc_event is None else 0))
    return kept


def _lives(e: Entry, n: int) -> bool:
    start, stop = entry_interval(e, n)
    return stop > start


@dataclass
class _Replayed:
    """The device trace of the kept entries, with where each was placed."""

    trace: list[dict[str, Any]]
    addr: list[int]
    """Each kept entry's synthetic address."""
    alloc_frames: list[list[dict[str, Any]]]
    heap: _FirstFit


def _replay(ledger: Ledger, kept: list[Entry], starts: Sequence[float], end_time: float) -> _Replayed:
    """Every kept entry's ``alloc`` and ``free_requested`` + ``free_completed``, event by event; within
    an event the frees come before the allocations, so the allocated bytes after event ``e`` are the
    ledger's total at ``e``."""
    n = ledger.num_events
    allocs_at: list[list[int]] = [[] for _ in range(n + 1)]
    frees_at: list[list[int]] = [[] for _ in range(n + 1)]
    for k, e in enumerate(kept):
        start, stop = entry_interval(e, n)
        allocs_at[start].append(k)
        if e.free_event is not None:
            frees_at[stop].append(k)
    out = _Replayed(trace=[], addr=[0] * len(kept), alloc_frames=[[] for _ in kept], heap=_FirstFit())
    sites: dict[int | None, dict[str, Any]] = {}  # one frame object per site: the pickle stores it once

    def site(index: int | None) -> dict[str, Any]:
        if index not in sites:
            sites[index] = _site_frame(ledger.events, index, before=_BEFORE)
        return sites[index]

    for t in range(n + 1):
        time_us = starts[t] if t < n else end_time
        for k in frees_at[t]:
            e = kept[k]
            frames = [out.alloc_frames[k][0], site(e.free_event)]
            for action in ("free_requested", "free_completed"):
                out.trace.append(_trace_entry(action, out.addr[k], e, time_us, frames))
            out.heap.release(out.addr[k] - BASE_ADDRESS, e.nbytes)
        for k in allocs_at[t]:
            e = kept[k]
            out.addr[k] = BASE_ADDRESS + out.heap.alloc(e.nbytes)
            out.alloc_frames[k] = [_entry_frame(e), site(e.alloc_event)]
            out.trace.append(_trace_entry("alloc", out.addr[k], e, time_us, out.alloc_frames[k]))
    return out


def _trace_entry(action: str, addr: int, e: Entry, time_us: float, frames: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "action": action,
        "addr": addr,
        "size": e.nbytes,
        "stream": 0,
        "time_us": time_us,
        "frames": frames,
        "category": str(e.category),
    }


def _segment(device: int, total_size: int, live: list[tuple[int, int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """One segment whose blocks tile it exactly: the live entries, and inactive gaps between them."""
    blocks: list[dict[str, Any]] = []
    cursor = BASE_ADDRESS
    for a, size, frames in live:
        if a > cursor:
            blocks.append(
                {"address": cursor, "size": a - cursor, "requested_size": 0, "state": "inactive", "frames": []}
            )
        blocks.append(
            {"address": a, "size": size, "requested_size": size, "state": "active_allocated", "frames": frames}
        )
        cursor = a + size
    end = BASE_ADDRESS + total_size
    if end > cursor:
        blocks.append({"address": cursor, "size": end - cursor, "requested_size": 0, "state": "inactive", "frames": []})
    allocated = sum(size for _, size, _ in live)
    return {
        "device": device,
        "address": BASE_ADDRESS,
        "total_size": total_size,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": allocated,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def _predicted_segment(device: int, seg: SegmentInfo) -> dict[str, Any]:
    """One of the allocator model's segments in the snapshot's format (``segmentInfo`` in
    ``torch/csrc/cuda/memory_snapshot.cpp``)."""
    blocks = [
        {
            "address": PREDICTED_BASE_ADDRESS + b.address,
            "size": b.size_bytes,
            "requested_size": b.requested_bytes,
            "state": "active_allocated" if b.allocated else "inactive",
            "frames": [{"filename": "trainledger", "line": 0, "name": b.label}] if b.label else [],
        }
        for b in seg.blocks
    ]
    allocated = seg.allocated_bytes
    return {
        "device": device,
        "address": PREDICTED_BASE_ADDRESS + seg.address,
        "total_size": seg.size_bytes,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(b.requested_bytes for b in seg.blocks),
        "stream": seg.stream,
        "segment_type": seg.pool,
        "segment_pool_id": (0, 0),
        "is_expandable": seg.expandable,
        "frames": [],
        "blocks": blocks,
    }


def write_memory_viz(
    ledger: Ledger,
    path: str | os.PathLike[str],
    *,
    protect: Iterable[str | os.PathLike[str]] = (),
    predicted_segments: Sequence[SegmentInfo] = (),
) -> Path:
    """Pickle :func:`to_memory_viz_snapshot` to ``path`` (``.pickle``): drop it on https://pytorch.org/memory_viz.

    Also readable by ``python -m torch.cuda._memory_viz trace_plot PATH -o out.html``.
    """
    out = check_output_path(path, MEMORY_VIZ_SUFFIXES, what="memory_viz snapshot", protect=protect)
    snapshot = to_memory_viz_snapshot(ledger, predicted_segments)
    return atomic_write(out, lambda f: pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL), binary=True)
