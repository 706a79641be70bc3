"""``ReservedPrediction``: the allocator model's verdict on a ledger for one device, as commands report it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from trainledger.allocator._config import AllocatorConfig
from trainledger.allocator._replay import replay
from trainledger.allocator._results import SegmentInfo
from trainledger.ledger import Ledger

Verdict = Literal["fits", "oom", "oom-although-allocated-fits", "no-limit"]


@dataclass(frozen=True)
class ReservedPrediction:
    """What PyTorch's caching allocator would reserve for a step, and whether a device of a given size holds it.

    Every figure is a model's prediction (evidence ``analytic``): the ledger's entries replayed through
    :class:`CachingAllocatorModel`; nothing ran on a GPU.
    """

    kernel_kind: str
    """Whose kernels the replayed ledger assumes (``cpu`` for a trace taken on this machine, ``cuda`` for an
    analytic ledger of CUDA kernels): the allocator model cannot correct for kernels it was not shown."""
    config: AllocatorConfig
    """The allocator options replayed (``PYTORCH_ALLOC_CONF``)."""
    capacity_bytes: int | None
    """Bytes the allocator may reserve (a device's usable memory); ``None``: no limit was given."""
    max_allocated_bytes: int
    """Predicted ``torch.cuda.max_memory_allocated()``: live blocks, each rounded as the allocator rounds it."""
    max_reserved_bytes: int
    """Predicted ``torch.cuda.max_memory_reserved()`` without a limit."""
    reserved_under_limit_bytes: int | None
    """Predicted ``max_memory_reserved()`` under the limit, where the step fits (cache flushes can keep it
    below ``max_reserved_bytes``); ``None`` without a limit or when the step does not fit."""
    fragmentation_bytes: int
    """Reserved but not allocated at the allocated peak (cached free blocks and split remainders)."""
    fragmentation_share: float
    """``fragmentation_bytes`` over the bytes reserved at the allocated peak."""
    largest_free_block_bytes: int
    """The largest cached free block at the allocated peak."""
    num_segments: int
    """Segments held at the allocated peak."""
    num_cache_flushes: int
    """Times the allocator, short of room under the limit, freed its cache and retried (each one a device
    synchronisation); 0 without a limit."""
    verdict: Verdict
    """``fits``; ``oom`` (the allocated bytes alone exceed the limit); ``oom-although-allocated-fits`` (the
    allocated peak is within the limit, but the allocator cannot place a block); ``no-limit``."""
    oom_entry: str | None = None
    """The ledger entry whose allocation fails under the limit."""
    oom_event: int | None = None
    segments: tuple[SegmentInfo, ...] = field(default=(), repr=False, compare=False)
    """The predicted segments at the allocated peak (for the memory_viz export)."""
    evidence: str = "analytic"

    @property
    def fits(self) -> bool | None:
        """Whether the step fits the limit; ``None`` when no limit was given."""
        return None if self.verdict == "no-limit" else self.verdict == "fits"

    def to_dict(self) -> dict[str, Any]:
        return {
            "evidence": self.evidence,
            "kernel_kind": self.kernel_kind,
            "allocator_config": asdict(self.config),
            "capacity_bytes": self.capacity_bytes,
            "max_allocated_bytes": self.max_allocated_bytes,
            "max_reserved_bytes": self.max_reserved_bytes,
            "reserved_under_limit_bytes": self.reserved_under_limit_bytes,
            "fragmentation_at_peak_bytes": self.fragmentation_bytes,
            "fragmentation_at_peak_share": self.fragmentation_share,
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "num_segments": self.num_segments,
            "num_cache_flushes": self.num_cache_flushes,
            "verdict": self.verdict,
            "fits": self.fits,
            "oom_entry": self.oom_entry,
            "oom_event": self.oom_event,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReservedPrediction:
        """Read ``to_dict()`` back (the segments are not saved)."""
        return cls(
            kernel_kind=str(data["kernel_kind"]),
            config=_config_from_dict(data["allocator_config"]),
            capacity_bytes=data["capacity_bytes"],
            max_allocated_bytes=int(data["max_allocated_bytes"]),
            max_reserved_bytes=int(data["max_reserved_bytes"]),
            reserved_under_limit_bytes=data["reserved_under_limit_bytes"],
            fragmentation_bytes=int(data["fragmentation_at_peak_bytes"]),
            fragmentation_share=float(data["fragmentation_at_peak_share"]),
            largest_free_block_bytes=int(data["largest_free_block_bytes"]),
            num_segments=int(data["num_segments"]),
            num_cache_flushes=int(data["num_cache_flushes"]),
            verdict=data["verdict"],
            oom_entry=data["oom_entry"],
            oom_event=data["oom_event"],
            evidence=str(data["evidence"]),
        )


def predict_reserved(
    ledger: Ledger,
    *,
    kernel_kind: str,
    config: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
) -> ReservedPrediction:
    """Replay ``ledger`` through the allocator model and judge it against ``capacity_bytes``.

    A CPU-traced ledger is replayed as if its entries were on the GPU (``replay(non_cuda="replay")``).

    Example:
        >>> from trainledger.ledger import Category, Entry, Event, Ledger
        >>> def act(name, mib, born):
        ...     return Entry(name, Category.ACTIVATIONS, "saved", "float32", 1, mib << 20, alloc_event=born,
        ...                  free_event=3)
        >>> sizes = [("a", 6, 0), ("b", 12, 0), ("c", 6, 1), ("d", 12, 1), ("e", 3, 2)]
        >>> led = Ledger(tuple(act(*s) for s in sizes), tuple(Event(i, "forward") for i in range(3)))
        >>> p = predict_reserved(led, kernel_kind="cpu", capacity_bytes=50 << 20)
        >>> p.max_allocated_bytes >> 20, p.max_reserved_bytes >> 20, p.verdict
        (39, 60, 'oom-although-allocated-fits')
    """
    config = config if config is not None else AllocatorConfig()
    unlimited = replay(ledger, config)
    limited = unlimited if capacity_bytes is None else unlimited.at_capacity(capacity_bytes)
    oom = limited.oom
    verdict: Verdict = "no-limit" if capacity_bytes is None else "fits"
    if oom is not None:
        assert capacity_bytes is not None
        allocated_fits = unlimited.max_allocated_bytes <= capacity_bytes
        verdict = "oom-although-allocated-fits" if allocated_fits else "oom"
    peak = unlimited.peak
    return ReservedPrediction(
        kernel_kind=kernel_kind,
        config=config,
        capacity_bytes=capacity_bytes,
        max_allocated_bytes=unlimited.max_allocated_bytes,
        max_reserved_bytes=unlimited.max_reserved_bytes,
        reserved_under_limit_bytes=limited.max_reserved_bytes if verdict == "fits" else None,
        fragmentation_bytes=peak.fragmentation_bytes if peak else 0,
        fragmentation_share=peak.fragmentation_share if peak else 0.0,
        largest_free_block_bytes=peak.largest_free_block_bytes if peak else 0,
        num_segments=peak.num_segments if peak else 0,
        num_cache_flushes=limited.num_cache_flushes,
        verdict=verdict,
        oom_entry=oom.entry if oom else None,
        oom_event=oom.event if oom else None,
        segments=peak.segments if peak else (),
    )


def _config_from_dict(data: dict[str, Any]) -> AllocatorConfig:
    divisions = data["roundup_power2_divisions"]
    return AllocatorConfig(
        **{**data, "roundup_power2_divisions": divisions if isinstance(divisions, int) else tuple(divisions)}
    )
