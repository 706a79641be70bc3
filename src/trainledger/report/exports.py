"""Exports of a ledger for other people's viewers: PyTorch's memory_viz, Perfetto, and plain JSON.

* :func:`to_memory_viz_snapshot` / :func:`write_memory_viz` — the pickled dictionary that
  ``torch.cuda.memory._snapshot()`` produces, which https://pytorch.org/memory_viz and
  ``python -m torch.cuda._memory_viz`` read. Every entry of the ledger becomes one allocation with a
  synthetic address; its name, category, role, dtype, shape, and the op/module/phase that allocated and
  freed it are written into the ``frames`` the viewer shows on hover.
* :func:`to_perfetto` / :func:`write_perfetto` — Chrome trace-event JSON (``{"traceEvents": [...]}``) that
  https://ui.perfetto.dev and ``chrome://tracing`` open: the step's ops as nested slices
  (phase › module path › op), live bytes per category as counter tracks, and the peak as an instant.
* :func:`write_ledger_json` — the ledger itself (``Ledger.to_dict()``), every entry with its interval.

These are pure consumers of a :class:`~trainledger.ledger.Ledger` of any evidence; they import no torch.

The event clock on the time axis
--------------------------------
Both viewers need times. By default event ``i`` starts at ``i`` µs and lasts 1 µs. A producer that timed
its events may put ``meta["event_times_us"]`` (the start of each event, non-decreasing, one per event) and
optionally ``meta["event_durations_us"]`` (one per event, ≥ 0) in the ledger; they are then used instead.

Known limitations
-----------------
* Addresses in the snapshot are synthetic: a first-fit allocator with 512-byte alignment in one segment,
  so the viewer's "Allocator State History" shows *a* packing, not the CUDA caching allocator's; the
  segment's size is not a prediction of reserved memory. Allocated bytes are exact (the ledger's).
* Entries of zero bytes and entries never live on the clock (``alloc_event == free_event``) are left out
  of the snapshot: the allocator records neither.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import pickle
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainledger.errors import InputError
from trainledger.ledger import CATEGORY_ORDER, Entry, Event, Evidence, Ledger
from trainledger.units import format_bytes

# Smallest block of the CUDA caching allocator (kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp).
# Used only so synthetic addresses are aligned like real device pointers; sizes stay exact.
ALIGN_BYTES = 512
# Where the synthetic segment starts: a plausible device address, so the viewer's hex addresses read
# like a real snapshot's. Any positive value works.
BASE_ADDRESS = 0x7F00_0000_0000
# memory_viz's unpickler (``unpickle`` in torch/utils/viz/MemoryViz.js) accepts protocols 2 to 4.
PICKLE_PROTOCOL = 4

PLOT_SUFFIXES = (".png", ".svg")
MEMORY_VIZ_SUFFIXES = (".pickle", ".pkl")
PERFETTO_SUFFIXES = (".json",)
LEDGER_JSON_SUFFIXES = (".json",)


# --- output paths --------------------------------------------------------------------------------------


def check_output_path(
    path: str | os.PathLike[str],
    suffixes: Sequence[str],
    *,
    what: str,
    protect: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Validate an output path: accepted suffix, existing folder, not one of the user's input files.

    Arguments:
        path: where the file will be written (an existing file there is replaced).
        suffixes: accepted suffixes, lower case with the dot (``(".png", ".svg")``).
        what: what the file is, for the error message (``"plot"``).
        protect: the user's input files (a model file, a ledger read in); writing over one is refused.

    Raises:
        InputError: naming the bad path and what is accepted.
    """
    out = Path(path)
    if out.suffix.lower() not in suffixes:
        accepted = ", ".join(suffixes)
        raise InputError(f"{what} path {str(path)!r} has suffix {out.suffix or '(none)'!r}; accepted: {accepted}")
    if out.is_dir():
        raise InputError(f"{what} path {str(path)!r} is a folder; give a file name ending in {suffixes[0]}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"folder {str(parent)!r} for the {what} does not exist; create it or pick another path")
    resolved = out.resolve()
    for p in protect:
        if Path(p).resolve() == resolved:
            raise InputError(f"{what} path {str(path)!r} is one of the inputs; refusing to overwrite it")
    return out


def _atomic_write(path: Path, write: Callable[[Any], None], *, binary: bool) -> Path:
    """Write through a temporary file in the same folder, then rename: no half-written file is left."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- the event clock -------------------------------------------------------------------------------------


def event_times_us(ledger: Ledger) -> tuple[list[float], list[float]]:
    """Start and duration of every event in µs: ``meta["event_times_us"]`` if present, else the index.

    Example:
        >>> from trainledger.ledger import Ledger, Event
        >>> event_times_us(Ledger((), (Event(0, "forward"), Event(1, "backward"))))
        ([0, 1], [1, 1])
    """
    n = ledger.num_events
    starts = ledger.meta.get("event_times_us")
    if starts is None:
        return list(range(n)), [1] * n
    starts = _numbers(starts, n, "event_times_us")
    if any(b < a for a, b in itertools.pairwise(starts)):
        raise InputError("ledger meta 'event_times_us' must be non-decreasing (one start time per event)")
    durations = ledger.meta.get("event_durations_us")
    if durations is not None:
        durations = _numbers(durations, n, "event_durations_us")
        if any(d < 0 for d in durations):
            raise InputError("ledger meta 'event_durations_us' must hold durations >= 0")
        # An event ends by the time the next one starts, so the op slices of a track nest.
        return starts, [
            min(d, b - a) for d, (a, b) in zip(durations, itertools.pairwise([*starts, math.inf]), strict=True)
        ]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    return starts, [*gaps, gaps[-1] if gaps else 1]


def _numbers(values: Any, n: int, key: str) -> list[float]:
    ok = isinstance(values, (list, tuple)) and len(values) == n
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
    if not ok:
        raise InputError(f"ledger meta {key!r} must be a list of {n} finite numbers (one per event)")
    return list(values)


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


def _interval(entry: Entry, num_events: int) -> tuple[int, int]:
    """``[start, stop)`` on the clock; ``stop == num_events`` means freed after the last event (or never)."""
    start = 0 if entry.alloc_event is None else entry.alloc_event
    stop = num_events if entry.free_event is None else entry.free_event
    return start, stop


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


def to_memory_viz_snapshot(ledger: Ledger) -> dict[str, Any]:
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

    Example:
        >>> from trainledger.ledger import Category, Entry, Event, Ledger
        >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 256, 1024)
        >>> a = Entry("a", Category.ACTIVATIONS, "saved", "float32", 128, 512, alloc_event=0, free_event=1)
        >>> snap = to_memory_viz_snapshot(Ledger((w, a), (Event(0, "forward", "mm"), Event(1, "backward", "mm"))))
        >>> [(t["action"], t["size"]) for t in snap["device_traces"][0]][:4]
        [('alloc', 1024), ('alloc', 512), ('free_requested', 512), ('free_completed', 512)]
    """
    n = ledger.num_events
    events = ledger.events
    starts, durations = event_times_us(ledger)
    end_time = starts[-1] + durations[-1]
    before = "<before the step>"

    allocs_at: list[list[int]] = [[] for _ in range(n + 1)]
    frees_at: list[list[int]] = [[] for _ in range(n + 1)]
    kept: list[Entry] = []
    cat_rank = {c.value: i for i, c in enumerate(CATEGORY_ORDER)}
    for e in ledger.entries:
        start, stop = _interval(e, n)
        if e.nbytes <= 0 or stop <= start:
            continue  # never occupies memory on this clock
        kept.append(e)
    # Pre-existing entries first, in the fixed category order (the viewer's legend follows first use).
    kept.sort(key=lambda e: (e.alloc_event is not None, cat_rank[str(e.category)] if e.alloc_event is None else 0))
    for k, e in enumerate(kept):
        start, stop = _interval(e, n)
        allocs_at[start].append(k)
        if e.free_event is not None:
            frees_at[stop].append(k)

    heap = _FirstFit()
    addr: list[int] = [0] * len(kept)
    alloc_frames: list[list[dict[str, Any]]] = [[] for _ in kept]
    trace: list[dict[str, Any]] = []
    sites: dict[int | None, dict[str, Any]] = {}  # one frame object per site: the pickle stores it once

    def site(index: int | None) -> dict[str, Any]:
        if index not in sites:
            sites[index] = _site_frame(events, index, before=before)
        return sites[index]

    for t in range(n + 1):
        time_us = starts[t] if t < n else end_time
        for k in frees_at[t]:
            e = kept[k]
            frames = [alloc_frames[k][0], site(e.free_event)]
            for action in ("free_requested", "free_completed"):
                trace.append(_trace_entry(action, addr[k], e, time_us, frames))
            heap.release(addr[k] - BASE_ADDRESS, e.nbytes)
        for k in allocs_at[t]:
            e = kept[k]
            addr[k] = BASE_ADDRESS + heap.alloc(e.nbytes)
            alloc_frames[k] = [_entry_frame(e), site(e.alloc_event)]
            trace.append(_trace_entry("alloc", addr[k], e, time_us, alloc_frames[k]))
    # The viewer (annotate_snapshot in MemoryViz.js) appends "unknown" to the categories it has seen and
    # fails if it is missing; real snapshots carry a "snapshot" marker, which also names that category.
    trace.append(
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
    if heap.top:
        at_end = sorted((addr[k], kept[k].nbytes, k) for k in range(len(kept)) if kept[k].free_event is None)
        segments.append(_segment(device, heap.top, [(a, size, alloc_frames[k]) for a, size, k in at_end]))
    device_traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
    device_traces[device] = trace
    return {"segments": segments, "device_traces": device_traces}


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


def write_memory_viz(
    ledger: Ledger, path: str | os.PathLike[str], *, protect: Iterable[str | os.PathLike[str]] = ()
) -> Path:
    """Pickle :func:`to_memory_viz_snapshot` to ``path`` (``.pickle``): drop it on https://pytorch.org/memory_viz.

    Also readable by ``python -m torch.cuda._memory_viz trace_plot PATH -o out.html``.
    """
    out = check_output_path(path, MEMORY_VIZ_SUFFIXES, what="memory_viz snapshot", protect=protect)
    snapshot = to_memory_viz_snapshot(ledger)
    return _atomic_write(out, lambda f: pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL), binary=True)


# --- Perfetto / Chrome trace ------------------------------------------------------------------------

_PID = 1
_TID_OPS = 1


def to_perfetto(ledger: Ledger) -> dict[str, Any]:
    """Chrome trace-event JSON for https://ui.perfetto.dev (or ``chrome://tracing``).

    * One track, ``step``, of complete (``"X"``) slices nested phase › module path › op: one op slice
      per event, its args the event index, module, live bytes and bytes allocated/freed there.
    * Counter (``"C"``) events ``live bytes`` with one value per category at every event (Perfetto shows a
      track per category; ``chrome://tracing`` stacks them), and ``total live bytes``.
    * An instant (``"i"``) event at the peak, and the ledger's summary in ``otherData``.

    Example:
        >>> from trainledger.ledger import Category, Entry, Event, Ledger
        >>> a = Entry("a", Category.ACTIVATIONS, "saved", "float32", 128, 512, alloc_event=0, free_event=1)
        >>> tr = to_perfetto(Ledger((a,), (Event(0, "forward", "mm", "fc"), Event(1, "backward", "mm", "fc"))))
        >>> [(e["name"], e["ts"], e["dur"]) for e in tr["traceEvents"] if e["ph"] == "X"][:3]
        [('forward', 0, 1), ('fc', 0, 1), ('mm', 0, 1)]
    """
    n = ledger.num_events
    starts, durations = event_times_us(ledger)
    timeline = ledger.timeline()
    cats = [c.value for c in CATEGORY_ORDER if any(timeline[c.value])]
    totals = [sum(col) for col in zip(*timeline.values(), strict=True)]
    allocated = [0] * (n + 1)
    freed = [0] * (n + 1)
    for e in ledger.entries:
        start, stop = _interval(e, n)
        if stop <= start:
            continue
        if e.alloc_event is not None:
            allocated[start] += e.nbytes
        if e.free_event is not None:
            freed[stop] += e.nbytes

    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": f"trainledger step ({ledger.evidence})"}},
        {"ph": "M", "pid": _PID, "tid": _TID_OPS, "name": "thread_name", "args": {"name": "step"}},
    ]
    out.extend(_nested_slices(ledger, starts, durations, totals, allocated, freed))
    for i in range(n):
        out.append(
            {"ph": "C", "pid": _PID, "name": "live bytes", "ts": starts[i], "args": {c: timeline[c][i] for c in cats}}
        )
        out.append({"ph": "C", "pid": _PID, "name": "total live bytes", "ts": starts[i], "args": {"bytes": totals[i]}})
    end = starts[-1] + durations[-1]
    persistent_end = {c: 0 for c in cats}  # what outlives the step, so the counters end where the next step starts
    for e in ledger.entries:
        if e.free_event is None and str(e.category) in persistent_end:
            persistent_end[str(e.category)] += e.nbytes
    out.append({"ph": "C", "pid": _PID, "name": "live bytes", "ts": end, "args": persistent_end})
    out.append(
        {"ph": "C", "pid": _PID, "name": "total live bytes", "ts": end, "args": {"bytes": sum(persistent_end.values())}}
    )

    pk = ledger.peak()
    out.append(
        {
            "ph": "i",
            "s": "g",
            "pid": _PID,
            "tid": _TID_OPS,
            "name": peak_label(ledger, format_bytes(pk.bytes)),
            "ts": starts[pk.event],
            "args": {"bytes": pk.bytes, "event": pk.event, **{f"bytes.{k}": v for k, v in pk.by_category.items()}},
        }
    )
    return {"traceEvents": out, "otherData": ledger.to_dict(entries=False)}


def peak_label(ledger: Ledger, size: str) -> str:
    """What the marked instant is called: a peak only with traced or measured evidence (the design's rule).

    Example:
        >>> from trainledger.ledger import Category, Entry, Ledger
        >>> peak_label(Ledger((Entry("w", Category.WEIGHTS, "param", "float32", 1, 4),)), "4 B")
        'total 4 B (inventoried state; not a peak: activations and workspace need a trace)'
    """
    pk = ledger.peak()
    where = f" at {pk.op}" if pk.op else ""
    if pk.module:
        where += f" in {pk.module}"
    if ledger.evidence in (Evidence.TRACED, Evidence.MEASURED):
        return f"peak {size}{where} ({pk.phase})"
    if ledger.evidence == Evidence.ANALYTIC:
        return f"estimated peak {size}{where} ({pk.phase}; analytic)"
    return f"total {size} ({ledger.evidence} state; not a peak: activations and workspace need a trace)"


def _nested_slices(
    ledger: Ledger,
    starts: list[float],
    durations: list[float],
    totals: list[int],
    allocated: list[int],
    freed: list[int],
) -> list[dict[str, Any]]:
    """Complete slices phase › module path › op, nested by construction.

    A phase or module slice spans exactly the contiguous run of events beneath it (module slices are
    named by their full path, ``blocks.0.mlp``); each event is one op slice at the innermost level.
    """
    slices: list[tuple[float, float, int, dict[str, Any]]] = []  # (ts, -dur, depth, slice) to sort by
    open_: list[tuple[str, str, int]] = []  # (key, name, first event) of the open phase and module slices

    def close_to(depth: int, last: int) -> None:
        while len(open_) > depth:
            key, name, first = open_.pop()
            ts, dur = starts[first], starts[last] + durations[last] - starts[first]
            cat = "phase" if not open_ else "module"
            args = {"first_event": first, "last_event": last}
            s = {"ph": "X", "pid": _PID, "tid": _TID_OPS, "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}
            slices.append((ts, -dur, len(open_), s))

    for i, ev in enumerate(ledger.events):
        parts = ev.module.split(".") if ev.module else []
        keys = [f"phase:{ev.phase}"] + [".".join(parts[: d + 1]) for d in range(len(parts))]
        names = [ev.phase, *keys[1:]]
        same = 0
        while same < min(len(open_), len(keys)) and open_[same][0] == keys[same]:
            same += 1
        close_to(same, i - 1)
        for d in range(same, len(keys)):
            open_.append((keys[d], names[d], i))
        args = {
            "event": i,
            "phase": ev.phase,
            "module": ev.module,
            "live_bytes": totals[i],
            "allocated_bytes": allocated[i],
            "freed_bytes": freed[i],
        }
        s = {
            "ph": "X",
            "pid": _PID,
            "tid": _TID_OPS,
            "cat": "op",
            "name": ev.op or "(no op)",
            "ts": starts[i],
            "dur": durations[i],
            "args": args,
        }
        slices.append((starts[i], -durations[i], len(keys), s))
    close_to(0, ledger.num_events - 1)
    # A parent closes after its children; emit it first (earlier start, longer, or shallower), which is
    # the order in which chrome://tracing nests slices of equal start most reliably.
    slices.sort(key=lambda r: r[:3])
    return [r[3] for r in slices]


def write_perfetto(
    ledger: Ledger, path: str | os.PathLike[str], *, protect: Iterable[str | os.PathLike[str]] = ()
) -> Path:
    """Write :func:`to_perfetto` as JSON (``.json``): open it at https://ui.perfetto.dev."""
    out = check_output_path(path, PERFETTO_SUFFIXES, what="Perfetto trace", protect=protect)
    trace = to_perfetto(ledger)
    return _atomic_write(out, lambda f: json.dump(trace, f), binary=False)


# --- the ledger itself --------------------------------------------------------------------------------


def write_ledger_json(
    ledger: Ledger, path: str | os.PathLike[str], *, protect: Iterable[str | os.PathLike[str]] = ()
) -> Path:
    """Write ``ledger.to_dict()`` (every entry with its interval, every event) as JSON (``.json``).

    ``Ledger.from_dict(json.load(open(path)))`` reads it back.
    """
    out = check_output_path(path, LEDGER_JSON_SUFFIXES, what="ledger JSON", protect=protect)
    data = ledger.to_dict()
    return _atomic_write(out, lambda f: json.dump(data, f), binary=False)


# --- several at once, checked before the step runs -------------------------------------------------------

ExportKind = Literal["plot", "memory_viz", "perfetto", "ledger_json"]
EXPORT_KINDS: tuple[ExportKind, ...] = ("plot", "memory_viz", "perfetto", "ledger_json")
_WHAT = {
    "plot": "plot",
    "memory_viz": "memory_viz snapshot",
    "perfetto": "Perfetto trace",
    "ledger_json": "ledger JSON",
}
_SUFFIXES = {
    "plot": PLOT_SUFFIXES,
    "memory_viz": MEMORY_VIZ_SUFFIXES,
    "perfetto": PERFETTO_SUFFIXES,
    "ledger_json": LEDGER_JSON_SUFFIXES,
}


@dataclass(frozen=True, kw_only=True)
class ExportPaths:
    """Where to write each export; ``None``: not wanted. Build it with :func:`check_export_paths`."""

    plot: Path | None = None
    """PNG or SVG picture (:func:`trainledger.report.plot.plot_timeline`)."""
    memory_viz: Path | None = None
    """Pickled ``torch.cuda.memory._snapshot()`` dictionary (:func:`write_memory_viz`)."""
    perfetto: Path | None = None
    """Chrome trace-event JSON (:func:`write_perfetto`)."""
    ledger_json: Path | None = None
    """The ledger itself (:func:`write_ledger_json`)."""
    protect: tuple[Path, ...] = ()
    """The user's input files, never written over."""

    def requested(self) -> dict[str, Path]:
        return {k: p for k in EXPORT_KINDS if (p := getattr(self, k)) is not None}


def check_export_paths(
    *,
    plot: str | os.PathLike[str] | None = None,
    memory_viz: str | os.PathLike[str] | None = None,
    perfetto: str | os.PathLike[str] | None = None,
    ledger_json: str | os.PathLike[str] | None = None,
    protect: Iterable[str | os.PathLike[str]] = (),
) -> ExportPaths:
    """Check every requested output path before any work is done (a command calls this before tracing).

    Each path must have an accepted suffix, an existing folder, and not be an input; no two exports may
    share a path; a plot needs matplotlib. Raises :class:`~trainledger.errors.InputError` naming the
    first problem.

    Example:
        >>> check_export_paths(perfetto="step.json", ledger_json="step.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        trainledger.errors.InputError: ledger JSON path 'step.json' is also the Perfetto trace path; ...
    """
    protected = tuple(Path(p) for p in protect)
    given = {"plot": plot, "memory_viz": memory_viz, "perfetto": perfetto, "ledger_json": ledger_json}
    checked: dict[str, Path] = {}
    for kind, path in given.items():
        if path is None:
            continue
        out = check_output_path(path, _SUFFIXES[kind], what=_WHAT[kind], protect=protected)
        for other, other_path in checked.items():
            if other_path.resolve() == out.resolve():
                raise InputError(
                    f"{_WHAT[kind]} path {str(path)!r} is also the {_WHAT[other]} path; give each export its own file"
                )
        checked[kind] = out
    if "plot" in checked:
        from trainledger.report.plot import _matplotlib

        _matplotlib()  # a missing matplotlib is reported now, not after the step has run
    return ExportPaths(**checked, protect=protected)


def write_exports(ledger: Ledger, paths: ExportPaths) -> dict[str, str]:
    """Write every export requested in ``paths``; returns ``{kind: path written}`` (for a command's JSON).

    Example:
        >>> from trainledger.ledger import Ledger
        >>> write_exports(Ledger(()), check_export_paths())
        {}
    """
    from trainledger.report.plot import plot_timeline

    writers: dict[str, Callable[..., Path]] = {
        "plot": plot_timeline,
        "memory_viz": write_memory_viz,
        "perfetto": write_perfetto,
        "ledger_json": write_ledger_json,
    }
    return {kind: str(writers[kind](ledger, path, protect=paths.protect)) for kind, path in paths.requested().items()}
