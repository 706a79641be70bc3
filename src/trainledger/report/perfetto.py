"""The ledger as a Chrome trace-event JSON that https://ui.perfetto.dev and ``chrome://tracing`` open.

The step's ops as nested slices (phase › module path › op), live bytes per category as counter tracks,
and the peak as an instant. See :mod:`trainledger.report.exports` for the time axis.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainledger.ledger import CATEGORY_ORDER, Ledger
from trainledger.report._files import (
    PERFETTO_SUFFIXES,
    atomic_write,
    check_output_path,
    entry_interval,
    event_times_us,
    peak_label,
)
from trainledger.units import format_bytes

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
        start, stop = entry_interval(e, n)
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
    return atomic_write(out, lambda f: json.dump(trace, f), binary=False)
