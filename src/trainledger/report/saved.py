"""Re-open what trainledger saved: any command's ``--json``, a ledger, a plan, or a folder of per-rank ledgers.

:func:`open_saved` reads a file, recognises its schema (and, for ``trainledger.ledger/1``, the ``result``
key naming the command's result), and returns the typed result the command computed, read back with its
``from_dict``. A folder is read as one ledger per rank and compared (:class:`RankComparison`).

Only JSON is read. A pickle (a memory_viz snapshot) is recognised by its first byte and refused without
being unpickled: unpickling runs code the file chooses.

Example:
    >>> import json, tempfile, os
    >>> from trainledger.ledger import Category, Entry, Ledger
    >>> path = os.path.join(tempfile.mkdtemp(), "state.json")
    >>> with open(path, "w") as f:
    ...     json.dump(Ledger((Entry("w", Category.WEIGHTS, "param", "float32", 10, 40),)).to_dict(), f)
    >>> open_saved(path).result.peak().bytes
    40
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainledger.checks import fields_of_their_types, unreadable_json
from trainledger.errors import InputError
from trainledger.ledger import SCHEMA as LEDGER_SCHEMA
from trainledger.ledger import Entry, Ledger, LedgerSummary

if TYPE_CHECKING:
    from trainledger.analytic import EstimateResult, FitResult
    from trainledger.remat import ParetoResult, PlanResult
    from trainledger.shard import ShardReport
    from trainledger.state import StateResult
    from trainledger.trace import TraceReport

PLAN_SCHEMA = "trainledger.remat-plan/1"
PARETO_SCHEMA = "trainledger.remat-pareto/1"
RANKS_SCHEMA = "trainledger.ranks/1"

# The ``result`` key of a ``trainledger.ledger/1`` object: which command's result it is.
RESULTS = ("state", "estimate", "fit", "shard", "shard-run", "trace")
ACCEPTED = (
    f"{LEDGER_SCHEMA} (a ledger from trace --export-json, or --json of state, estimate, fit, shard, trace), "
    f"{PLAN_SCHEMA} (plan --save, plan --json), {PARETO_SCHEMA} (pareto --json)"
)
_PICKLE_PROTOCOL_MARK = 0x80  # the first byte of every pickle of protocol 2 and later


@dataclass(frozen=True)
class RankRow:
    """One rank's ledger in a folder of per-rank ledgers."""

    rank: int
    path: str
    """The file it was read from."""
    summary: LedgerSummary
    largest: Entry | None
    """The largest array live at the rank's peak instant."""
    allocated: Entry | None
    """The largest array allocated at the peak event: the allocation that reached the peak (``None``: the
    peak event allocated nothing, as at a single instant)."""


@dataclass(frozen=True)
class RankComparison:
    """Per-rank ledgers side by side: each rank's peak, the rank that sets the job's peak, the array whose
    allocation reached it and the largest array live then.

    Example:
        >>> from trainledger.ledger import Category, Entry, Ledger
        >>> a, b = (Ledger((Entry("w", Category.WEIGHTS, "param", "float32", n, 4 * n),)) for n in (10, 15))
        >>> c = RankComparison.of([("r0.json", a), ("r1.json", b)])
        >>> c.peak_row.rank, c.skew
        (1, 1.5)
    """

    rows: tuple[RankRow, ...]
    """By rank."""
    peak_ledger: Ledger
    """The ledger of the rank that set the job's peak (its timeline is the one drawn)."""

    @classmethod
    def of(cls, ledgers: list[tuple[str, Ledger]]) -> RankComparison:
        """Compare ledgers; a ledger's rank is ``meta["rank"]`` when it has one, else its place in ``ledgers``."""
        if not ledgers:
            raise InputError("no ledgers to compare")
        models = {str(led.meta.get("model", "")) for _, led in ledgers}
        if len(models) > 1:  # ranks run one model: these are steps of different ones
            raise InputError(
                f"the ledgers are of different models ({', '.join(sorted(m or '?' for m in models))}); a folder is "
                "read as the ranks of one step: give files one at a time"
            )
        ranks: dict[int, tuple[str, Ledger]] = {}
        for i, (path, led) in enumerate(ledgers):
            rank = led.meta.get("rank", i)
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise InputError(f"ledger {path!r} has meta rank {rank!r}; a rank is a whole number")
            if rank in ranks:
                raise InputError(f"ledgers {ranks[rank][0]!r} and {path!r} both say they are rank {rank}")
            ranks[rank] = (path, led)
        rows = []
        for rank in sorted(ranks):
            path, led = ranks[rank]
            summary = led.summary()
            live = led.largest_live(summary.peak.event, limit=len(led.entries))
            allocated = [e for e in live if e.alloc_event == summary.peak.event]
            rows.append(RankRow(rank, path, summary, live[0] if live else None, allocated[0] if allocated else None))
        peak = max(rows, key=lambda r: (r.summary.peak.bytes, -r.rank))
        return cls(tuple(rows), ranks[peak.rank][1])

    @property
    def peak_row(self) -> RankRow:
        """The rank whose peak is the job's (the lowest such rank on a tie)."""
        return max(self.rows, key=lambda r: (r.summary.peak.bytes, -r.rank))

    @property
    def skew(self) -> float | None:
        """Largest rank peak over the smallest (1.0: balanced); ``None`` when a rank peaks at 0 bytes."""
        peaks = [r.summary.peak.bytes for r in self.rows]
        return max(peaks) / min(peaks) if min(peaks) > 0 else None

    def to_dict(self) -> dict[str, Any]:
        """The job-peak rank's ledger keys at the top, every rank under ``ranks``."""
        top = self.peak_row
        out = top.summary.to_dict()
        out.update(
            {
                "schema": RANKS_SCHEMA,
                "peak_rank": top.rank,
                "allocated_at_peak": _entry(top.allocated),
                "largest_at_peak": _entry(top.largest),
                "skew": self.skew,
                "ranks": [
                    {
                        "rank": r.rank,
                        "path": r.path,
                        "evidence": str(r.summary.evidence),
                        "peak": r.summary.peak.to_dict(),
                        "allocated_at_peak": _entry(r.allocated),
                        "largest_at_peak": _entry(r.largest),
                    }
                    for r in self.rows
                ],
            }
        )
        return out


def _entry(e: Entry | None) -> dict[str, Any] | None:
    return e.to_dict() if e is not None else None


@dataclass(frozen=True)
class Saved:
    """What a path held: the typed result, what it is, and the files it came from."""

    kind: str
    """``ledger``, ``ranks``, ``plan``, ``pareto``, or a ``result`` key (``state``, ``estimate``, ``fit``…)."""
    result: Any
    """A ``Ledger``, ``RankComparison``, ``StateResult``, ``EstimateResult``, ``FitResult``, ``ShardReport``,
    ``TraceReport``, ``PlanResult`` or ``ParetoResult``; for ``shard-run``, the JSON object as saved."""
    paths: tuple[Path, ...]


def input_files(path: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The files ``path`` names: itself, or every ``*.json`` in a folder (sorted by name)."""
    p = Path(path)
    if p.is_dir():
        files = tuple(sorted(f for f in p.glob("*.json") if f.is_file()))
        if not files:
            inner = sorted(d.name for d in p.iterdir() if d.is_dir() and any(d.glob("*.json")))
            if inner:  # a callback's output, <output>/trainledger, holds one folder per recorded step
                shown = ", ".join(inner[:5]) + (", ..." if len(inner) > 5 else "")
                raise InputError(
                    f"folder {str(path)!r} holds no .json files, but its folders {shown} do: give one of them "
                    f"(trainledger report {str(p / inner[0])!r})"
                )
            raise InputError(f"folder {str(path)!r} holds no .json files; give a saved file or a folder of ledgers")
        return files
    if not p.exists():
        raise InputError(f"{str(path)!r}: no such file or folder; give a JSON file trainledger wrote, or a folder")
    return (p,)


def open_saved(path: str | os.PathLike[str]) -> Saved:
    """Read a saved file (or a folder of per-rank ledgers) into the typed result it holds.

    Raises:
        InputError: a missing path, a pickle, text that is not JSON, an unknown schema, or a malformed object
            (one line naming the file and what is accepted).
    """
    files = input_files(path)
    if Path(path).is_dir():
        return Saved("ranks", _compare(files), files)
    data = read_json(files[0])
    kind = recognise(data, files[0])
    return Saved(kind, _typed(kind, data, files[0]), files)


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a pickle is refused by its first byte and never unpickled."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {str(path)!r}: {exc.strerror}; give a readable file") from None
    if raw[:1] == bytes([_PICKLE_PROTOCOL_MARK]):
        raise InputError(
            f"{str(path)!r} is a pickle (a memory_viz snapshot?); trainledger report reads JSON only and never "
            "unpickles (open snapshots at https://pytorch.org/memory_viz)"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{str(path)!r} is not a UTF-8 text file; give a JSON file trainledger wrote") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{str(path)!r} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); give a JSON file "
            "trainledger wrote"
        ) from None
    except (RecursionError, ValueError) as exc:
        raise InputError(
            f"{str(path)!r} is JSON trainledger never writes ({unreadable_json(exc)}); give a file it wrote"
        ) from None
    if not isinstance(data, dict):
        raise InputError(
            f"{str(path)!r} holds a JSON {type(data).__name__}, not an object trainledger wrote; give one it wrote"
        )
    return data


def recognise(data: dict[str, Any], path: Path) -> str:
    """What a saved object is, from its ``schema`` (and ``result``) key."""
    schema = data.get("schema")
    if schema == PLAN_SCHEMA:
        return "plan"
    if schema == PARETO_SCHEMA:
        return "pareto"
    if schema != LEDGER_SCHEMA:
        raise InputError(f"{str(path)!r} has schema {schema!r}; accepted: {ACCEPTED}")
    result = data.get("result")
    if result is None:
        if "entries" in data and "events" in data:
            return "ledger"
        raise InputError(
            f"{str(path)!r} is a {LEDGER_SCHEMA} summary without entries and without a 'result' key (written by an "
            "older trainledger); re-run the command, or save the whole ledger with trace --export-json"
        )
    if result not in RESULTS:
        raise InputError(f"{str(path)!r} has result {result!r}; accepted: {', '.join(RESULTS)}")
    return str(result)


def _typed(kind: str, data: dict[str, Any], path: Path) -> Any:
    try:
        result = _READERS[kind](data)
    except InputError as exc:
        raise InputError(f"{str(path)!r}: {exc}") from None
    except ImportError as exc:
        raise InputError(
            f"reading {str(path)!r} needs {exc.name}, which is not installed; install it with: "
            "pip install 'trainledger[all]'"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc) or type(exc).__name__
        raise InputError(f"{str(path)!r} is not a valid {kind} file ({what}); save it again with trainledger") from None
    try:
        fields_of_their_types(result, type(result).__name__)
    except InputError as exc:
        raise InputError(f"{str(path)!r} is not a valid {kind} file ({exc}); save it again with trainledger") from None
    return result


def _compare(files: tuple[Path, ...]) -> RankComparison:
    ledgers = []
    for f in files:
        data = read_json(f)
        kind = recognise(data, f)
        if kind != "ledger":
            raise InputError(
                f"{str(f)!r} is a {kind} result, not a ledger; a folder is read as one ledger per rank "
                "(trace --export-json); give other files one at a time"
            )
        ledgers.append((f.name, _typed("ledger", data, f)))
    return RankComparison.of(ledgers)


def _state(data: dict[str, Any]) -> StateResult:
    from trainledger.state import StateResult

    return StateResult.from_dict(data)


def _estimate(data: dict[str, Any]) -> EstimateResult:
    from trainledger.analytic import EstimateResult

    return EstimateResult.from_dict(data)


def _fit(data: dict[str, Any]) -> FitResult:
    from trainledger.analytic import FitResult

    return FitResult.from_dict(data)


def _shard(data: dict[str, Any]) -> ShardReport:
    from trainledger.shard import ShardReport

    return ShardReport.from_dict(data)


def _shard_run(data: dict[str, Any]) -> dict[str, Any]:
    """``shard --run --json`` is rendered from its JSON object as saved (its ranks' ledgers are not in it)."""
    missing = [key for key in ("run", "ranks") if key not in data]
    if missing:
        raise KeyError(missing[0])
    return data


def _trace(data: dict[str, Any]) -> TraceReport:
    from trainledger.trace import TraceReport

    return TraceReport.from_dict(data)


def _plan(data: dict[str, Any]) -> PlanResult:
    from trainledger.remat import PlanResult

    return PlanResult.from_dict(data)


def _pareto(data: dict[str, Any]) -> ParetoResult:
    from trainledger.remat import ParetoResult

    return ParetoResult.from_dict(data)


_READERS = {
    "ledger": Ledger.from_dict,
    "state": _state,
    "estimate": _estimate,
    "fit": _fit,
    "shard": _shard,
    "shard-run": _shard_run,
    "trace": _trace,
    "plan": _plan,
    "pareto": _pareto,
}
