"""What ``trainledger trace`` reports of one traced step, as typed summaries that its JSON holds.

The command prints the figures of the traced ledger (its peak, the per-category maxima, the largest
arrays live at the peak), optionally beside a measurement and a sharding prediction. :class:`TraceReport`
holds exactly that, so ``trainledger trace --json`` can be re-opened (``trainledger report``) and printed
as the command printed it. A ledger with every entry is written by ``--export-json``. No torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainledger.allocator import ReservedPrediction
from trainledger.devices import kernel_kind
from trainledger.ledger import Entry, Evidence, Ledger, LedgerSummary, Peak

if TYPE_CHECKING:
    from trainledger.shard import ShardSummary

UNSEEN = "workspace_not_visible_as_tensors"


@dataclass(frozen=True)
class MeasuredStep:
    """A measured step's figures beside its trace's (``Measurement.summary()``; JSON ``measured``)."""

    device: str
    peak_bytes: int
    """Live bytes at the measured peak (absolute)."""
    start_bytes: int
    start_source: str
    """``allocator`` (CUDA counters) or ``trace`` (CPU: the traced bytes live before the step's first op)."""
    reserved_peak_bytes: int | None
    step_seconds: tuple[float, ...]
    step_threads: int | None
    """Intra-op threads the steps were timed with (``None``: not recorded, in files saved before it was)."""
    traced_peak: Peak
    """The peak of the trace taken beside the measurement."""
    traced_category_maxima: dict[str, int]

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
        return self.peak_bytes - self.traced_peak.bytes

    def to_dict(self) -> dict[str, Any]:
        traced = self.traced_peak.to_dict()
        by_cat = {**traced["by_category"], UNSEEN: self.unseen_workspace_bytes}
        return {
            "schema": "trainledger.measure/1",
            "evidence": str(Evidence.MEASURED),
            "device": self.device,
            "peak": {**traced, "bytes": self.peak_bytes, "by_category": by_cat},
            "category_maxima": dict(self.traced_category_maxima),
            "sum_of_category_maxima": sum(self.traced_category_maxima.values()),
            "start_bytes": self.start_bytes,
            "start_source": self.start_source,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "traced_peak_bytes": self.traced_peak.bytes,
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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasuredStep:
        peak = dict(data["peak"])
        peak["by_category"] = {k: v for k, v in peak["by_category"].items() if k != UNSEEN}
        peak["bytes"] = data["traced_peak_bytes"]
        return cls(
            device=str(data["device"]),
            peak_bytes=int(data["peak"]["bytes"]),
            start_bytes=int(data["start_bytes"]),
            start_source=str(data["start_source"]),
            reserved_peak_bytes=data.get("reserved_peak_bytes"),
            step_seconds=tuple(float(t) for t in data["step_seconds"]),
            step_threads=data.get("step_threads"),
            traced_peak=Peak.from_dict(peak),
            traced_category_maxima={str(k): int(v) for k, v in data["category_maxima"].items()},
        )


@dataclass(frozen=True)
class TraceReport:
    """What ``trainledger trace`` reports: the traced step's figures, its largest arrays at the peak,
    and (when asked for) the measured step and each rank's prediction under sharding.

    Example:
        >>> from trainledger.ledger import Category, Entry, Event, Ledger
        >>> a = Entry("a", Category.ACTIVATIONS, "saved", "float32", 5, 20, alloc_event=0, free_event=1)
        >>> r = TraceReport.of(Ledger((a,), (Event(0, "forward"), Event(1, "backward"))))
        >>> TraceReport.from_dict(r.to_dict()) == r
        True
    """

    ledger: LedgerSummary
    """The traced step's figures (unsharded)."""
    num_entries: int
    """Storages in the trace."""
    largest_live: tuple[Entry, ...]
    """The largest arrays live at the peak instant, largest first."""
    num_params: int | None = None
    """Elements of the model's parameters (trainable or not)."""
    measured: MeasuredStep | None = None
    sharded: ShardSummary | None = None
    """The step sharded across ranks, predicted from this trace."""
    reserved: ReservedPrediction | None = None
    """The caching allocator model's prediction for the traced step (``--device``, ``--allocator``)."""

    @property
    def kernel_kind(self) -> str:
        """Whose kernels the trace ran (``cpu`` on a machine without a GPU)."""
        return kernel_kind(self.ledger.device)

    @classmethod
    def of(
        cls,
        ledger: Ledger,
        *,
        num_params: int | None = None,
        measured: MeasuredStep | None = None,
        sharded: ShardSummary | None = None,
        reserved: ReservedPrediction | None = None,
        limit: int = 10,
    ) -> TraceReport:
        summary = ledger.summary()
        largest = ledger.largest_live(summary.peak.event, limit=limit)
        return cls(summary, len(ledger.entries), largest, num_params, measured, sharded, reserved)

    def to_dict(self) -> dict[str, Any]:
        """``trace --json``: the top level is the traced ledger's, or rank 0's when sharded (with the
        unsharded figures under ``traced``)."""
        if self.sharded is not None:
            out = self.sharded.to_dict()
            out["traced"] = self.ledger.to_dict()
        else:
            out = self.ledger.to_dict()
        out["result"] = "trace"
        out["num_params"] = self.num_params
        out["num_entries"] = self.num_entries
        out["largest_live_at_peak"] = [{**e.to_dict(), "bytes": e.nbytes, "module": e.owner} for e in self.largest_live]
        if self.measured is not None:
            out["measured"] = self.measured.to_dict()
        out["kernel_kind"] = self.kernel_kind
        if self.reserved is not None:
            out["allocator"] = self.reserved.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceReport:
        """Read ``to_dict()`` back (``trainledger report``)."""
        sharded = None
        if "shard" in data:
            from trainledger.shard import ShardSummary

            sharded = ShardSummary.from_dict(data)
        entries = tuple(
            Entry.from_dict({k: v for k, v in e.items() if k not in ("bytes", "module")})
            for e in data["largest_live_at_peak"]
        )
        measured = data.get("measured")
        reserved = data.get("allocator")
        return cls(
            ledger=LedgerSummary.from_dict(data["traced"] if sharded is not None else data),
            num_entries=int(data["num_entries"]),
            largest_live=entries,
            num_params=data.get("num_params"),
            measured=MeasuredStep.from_dict(measured) if measured is not None else None,
            sharded=sharded,
            reserved=ReservedPrediction.from_dict(reserved) if reserved is not None else None,
        )
