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
* ``html`` (:mod:`trainledger.report.html`) — a self-contained page: timeline, live arrays, sortable tables.

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

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainledger.allocator import SegmentInfo
from trainledger.errors import InputError
from trainledger.ledger import Ledger
from trainledger.report._files import (
    HTML_SUFFIXES,
    LEDGER_JSON_SUFFIXES,
    MEMORY_VIZ_SUFFIXES,
    PERFETTO_SUFFIXES,
    PLOT_SUFFIXES,
    atomic_write,
    check_output_path,
    event_times_us,
    peak_label,
)
from trainledger.report.memory_viz import ALIGN_BYTES, BASE_ADDRESS, to_memory_viz_snapshot, write_memory_viz
from trainledger.report.perfetto import to_perfetto, write_perfetto

__all__ = [
    "ALIGN_BYTES",
    "BASE_ADDRESS",
    "HTML_SUFFIXES",
    "LEDGER_JSON_SUFFIXES",
    "MEMORY_VIZ_SUFFIXES",
    "PERFETTO_SUFFIXES",
    "PLOT_SUFFIXES",
    "ExportPaths",
    "check_export_paths",
    "check_output_path",
    "event_times_us",
    "peak_label",
    "to_memory_viz_snapshot",
    "to_perfetto",
    "write_exports",
    "write_ledger_json",
    "write_memory_viz",
    "write_perfetto",
]


# --- the ledger itself --------------------------------------------------------------------------------


def write_ledger_json(
    ledger: Ledger, path: str | os.PathLike[str], *, protect: Iterable[str | os.PathLike[str]] = ()
) -> Path:
    """Write ``ledger.to_dict()`` (every entry with its interval, every event) as JSON (``.json``).

    ``Ledger.from_dict(json.load(open(path)))`` reads it back.
    """
    out = check_output_path(path, LEDGER_JSON_SUFFIXES, what="ledger JSON", protect=protect)
    data = ledger.to_dict()
    return atomic_write(out, lambda f: json.dump(data, f), binary=False)


# --- several at once, checked before the step runs -------------------------------------------------------

ExportKind = Literal["plot", "memory_viz", "perfetto", "ledger_json", "html"]
EXPORT_KINDS: tuple[ExportKind, ...] = ("plot", "memory_viz", "perfetto", "ledger_json", "html")
_WHAT = {
    "plot": "plot",
    "memory_viz": "memory_viz snapshot",
    "perfetto": "Perfetto trace",
    "ledger_json": "ledger JSON",
    "html": "HTML report",
}
_SUFFIXES = {
    "plot": PLOT_SUFFIXES,
    "memory_viz": MEMORY_VIZ_SUFFIXES,
    "perfetto": PERFETTO_SUFFIXES,
    "ledger_json": LEDGER_JSON_SUFFIXES,
    "html": HTML_SUFFIXES,
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
    html: Path | None = None
    """A self-contained HTML page (:func:`trainledger.report.html.write_html`)."""
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
    html: str | os.PathLike[str] | None = None,
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
    given = {"plot": plot, "memory_viz": memory_viz, "perfetto": perfetto, "ledger_json": ledger_json, "html": html}
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


def write_exports(
    ledger: Ledger, paths: ExportPaths, *, predicted_segments: Sequence[SegmentInfo] = ()
) -> dict[str, str]:
    """Write every export requested in ``paths``; returns ``{kind: path written}`` (for a command's JSON).

    ``predicted_segments``: the caching allocator model's segments at the peak, for the memory_viz snapshot.

    Example:
        >>> from trainledger.ledger import Ledger
        >>> write_exports(Ledger(()), check_export_paths())
        {}
    """
    from trainledger.report.html import write_html
    from trainledger.report.plot import plot_timeline

    writers: dict[str, Callable[..., Path]] = {
        "plot": plot_timeline,
        "memory_viz": write_memory_viz,
        "perfetto": write_perfetto,
        "ledger_json": write_ledger_json,
        "html": write_html,
    }
    written = {}
    for kind, path in paths.requested().items():
        extra = {"predicted_segments": predicted_segments} if kind == "memory_viz" else {}
        written[kind] = str(writers[kind](ledger, path, protect=paths.protect, **extra))
    return written
