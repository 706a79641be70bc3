"""Output files of the reports: accepted suffixes, safe writes, the event clock's times, the peak's label."""

from __future__ import annotations

import itertools
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from trainledger.devices import kernel_kind
from trainledger.errors import InputError
from trainledger.ledger import Entry, Evidence, Ledger, LedgerSummary

PLOT_SUFFIXES = (".png", ".svg")
MEMORY_VIZ_SUFFIXES = (".pickle", ".pkl")
PERFETTO_SUFFIXES = (".json",)
LEDGER_JSON_SUFFIXES = (".json",)
HTML_SUFFIXES = (".html", ".htm")


# --- output paths --------------------------------------------------------------------------------------


def _same_file(a: str | os.PathLike[str], b: Path) -> bool:
    """Whether two existing paths name one file (a hard link to an input has another path, the same inode)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def check_output_path(
    path: str | os.PathLike[str],
    suffixes: Sequence[str],
    *,
    what: str,
    protect: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Validate an output path: accepted suffix, existing writable folder, not one of the user's input files.

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
        if Path(p).resolve() == resolved or _same_file(p, out):
            raise InputError(
                f"{what} path {str(path)!r} is one of the inputs; refusing to overwrite it: pick another path"
            )
    if out.exists() and not out.is_file():
        raise InputError(f"{what} path {str(path)!r} exists and is not a regular file; pick another path")
    _check_writable(parent, what)
    if out.is_file():
        _check_replaceable(out, what)
    return out


def _check_replaceable(file: Path, what: str) -> None:
    """An existing file is replaced only if it could be written: one without write permission (or immutable) is
    the user's to keep, though a rename in a writable folder would go over it. Opened to append nothing, it is
    left as it was."""
    try:
        open(file, "ab").close()  # opened to see whether it can be, and closed at once
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InputError(
            f"{what} path {str(file)!r} exists and cannot be written ({reason}); pick another path"
        ) from None


def _check_writable(folder: Path, what: str) -> None:
    """Create and remove a probe file in ``folder``: permission bits say nothing about ``/proc`` or a
    read-only mount (and everything looks writable to root), so only a real write is a proof."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".trainledger-probe-", dir=folder)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise InputError(
            f"folder {str(folder)!r} for the {what} is not writable ({reason}); pick a folder you can write to"
        ) from None
    os.close(fd)
    os.unlink(probe)


def atomic_write(path: Path, write: Callable[[Any], None], *, binary: bool) -> Path:
    """Write through a temporary file in the same folder, then rename: no half-written file is left."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise InputError(f"cannot write {str(path)!r}: {exc.strerror or type(exc).__name__}") from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it the usual permissions
        os.replace(tmp, path)
    except OSError as exc:  # the disk filled up, or the file was made read-only since it was checked
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"cannot write {str(path)!r}: {exc.strerror or type(exc).__name__}") from None
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


def peak_label(ledger: Ledger | LedgerSummary, size: str) -> str:
    """What the marked instant is called: a peak only with traced or measured evidence (the design's rule).

    Example:
        >>> from trainledger.ledger import Category, Entry, Ledger
        >>> peak_label(Ledger((Entry("w", Category.WEIGHTS, "param", "float32", 1, 4),)), "4 B")
        'total 4 B (inventoried state; not a peak: activations and workspace need a trace)'
    """
    summary = ledger.summary() if isinstance(ledger, Ledger) else ledger
    pk = summary.peak
    where = f" at {pk.op}" if pk.op else ""
    if pk.module:
        where += f" in {pk.module}"
    kinds = f"{kernel_kind(summary.device)} kernels"
    if summary.evidence in (Evidence.TRACED, Evidence.MEASURED):
        return f"peak {size}{where} ({pk.phase}; {kinds})"
    if summary.evidence == Evidence.ANALYTIC:
        return f"estimated peak {size}{where} ({pk.phase}; analytic, {kinds})"
    return f"total {size} ({summary.evidence} state; not a peak: activations and workspace need a trace)"


def entry_interval(entry: Entry, num_events: int) -> tuple[int, int]:
    """``[start, stop)`` on the clock; ``stop == num_events`` means freed after the last event (or never)."""
    start = 0 if entry.alloc_event is None else entry.alloc_event
    stop = num_events if entry.free_event is None else entry.free_event
    return start, stop
