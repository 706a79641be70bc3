"""What a replay returns: frozen records of segments, the peak instant, an out-of-memory event."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from trainledger.allocator._config import AllocatorConfig

Pool = Literal["small", "large"]


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block of a segment: a handed-out allocation or a cached free range."""

    address: int
    """Model address (not a real device pointer; addresses keep the allocator's order and adjacency)."""
    size_bytes: int
    """Block size: the rounded request, or the whole cached block when it was not split."""
    allocated: bool
    requested_bytes: int = 0
    """Bytes the caller asked for (0 for free blocks)."""
    label: str = ""
    """The ledger entry that owns the block (empty for free blocks)."""


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment: a ``cudaMalloc`` (or, with expandable segments, one contiguous mapped range)."""

    address: int
    size_bytes: int
    pool: Pool
    stream: int
    expandable: bool
    blocks: tuple[BlockInfo, ...]

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size_bytes for b in self.blocks if b.allocated)

    @property
    def largest_free_block_bytes(self) -> int:
        return max((b.size_bytes for b in self.blocks if not b.allocated), default=0)


@dataclass(frozen=True, slots=True)
class ReservedChange:
    """Reserved bytes at the end of ``event`` (listed only where they changed)."""

    event: int
    reserved_bytes: int


@dataclass(frozen=True, slots=True)
class PeakState:
    """The allocator's state at the end of the event where allocated bytes are highest."""

    event: int
    phase: str
    op: str
    allocated_bytes: int
    """Sum of handed-out block sizes: what ``torch.cuda.memory_allocated()`` would report."""
    requested_bytes: int
    """Sum of the ledger's own byte counts over live entries (before rounding)."""
    reserved_bytes: int
    """Bytes held from the driver: what ``torch.cuda.memory_reserved()`` would report."""
    largest_free_block_bytes: int
    """The largest cached free block (mapped, for expandable segments)."""
    releasable_bytes: int
    """What ``torch.cuda.empty_cache()`` would give back at this instant."""
    segments: tuple[SegmentInfo, ...]

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated: cached free blocks and split remainders."""
        return self.reserved_bytes - self.allocated_bytes

    @property
    def fragmentation_share(self) -> float:
        """``fragmentation_bytes / reserved_bytes`` (0.0 when nothing is reserved)."""
        return self.fragmentation_bytes / self.reserved_bytes if self.reserved_bytes else 0.0


@dataclass(frozen=True, slots=True)
class FailedRequest:
    """An allocation that failed after the allocator released what it could and retried."""

    requested_bytes: int
    rounded_bytes: int
    segment_bytes: int
    """Bytes the allocator tried to ``cudaMalloc`` (or, expandable, to map) for it."""
    pool: Pool
    stream: int
    allocated_bytes: int
    """Allocated bytes when it failed (the failing request not included)."""
    reserved_bytes: int
    """Reserved bytes after the allocator had released every cached block it could."""
    capacity_bytes: int

    @property
    def is_fragmentation(self) -> bool:
        """The live blocks plus this request fit the capacity: the allocator failed for lack of a large
        enough free range, not for lack of bytes."""
        return self.allocated_bytes + self.rounded_bytes <= self.capacity_bytes


@dataclass(frozen=True, slots=True)
class OOMEvent:
    """The ledger entry whose allocation failed, and when."""

    event: int | None
    """Event of the failing allocation; ``None``: while allocating the state that exists before the step."""
    entry: str
    request: FailedRequest

    @property
    def is_fragmentation(self) -> bool:
        """See ``FailedRequest.is_fragmentation``."""
        return self.request.is_fragmentation


@dataclass(frozen=True)
class AllocatorReplay:
    """A ledger replayed through the model of PyTorch's CUDA caching allocator.

    ``max_reserved_bytes`` is the prediction of ``torch.cuda.max_memory_reserved()`` for the step (after
    ``torch.cuda.reset_peak_memory_stats()`` on a fresh process whose only earlier allocations are the
    entries that exist before the step).
    """

    config: AllocatorConfig
    capacity_bytes: int | None
    """Bytes the allocator could reserve (``None``: unlimited)."""
    max_reserved_bytes: int
    max_reserved_event: int | None
    """The event during which reserved bytes first reached their maximum (``None``: before the step)."""
    max_allocated_bytes: int
    """Highest allocated bytes at any moment, as ``torch.cuda.max_memory_allocated()`` counts them."""
    peak: PeakState | None
    """The end of the event with the most allocated bytes; ``None`` only if the step failed before its
    first event."""
    reserved_before_step_bytes: int
    """Reserved once the state that exists before the step is allocated."""
    reserved_timeline: tuple[ReservedChange, ...]
    rounded_peak_bytes: int
    """Highest live total at an event end with each entry rounded as the allocator rounds it."""
    requested_peak_bytes: int
    """Highest live total at an event end of the replayed entries as the ledger counts them."""
    num_cache_flushes: int
    """Times an allocation found no room and the allocator freed every unsplit cached segment to retry
    (each one synchronises the device: a slowdown even when the step fits)."""
    releasable_after_step_bytes: int
    """What ``torch.cuda.empty_cache()`` would give back after the step."""
    oom: OOMEvent | None
    """The allocation that would fail under ``capacity_bytes``; ``None``: the step fits."""
    num_entries: int
    """Entries replayed (entries of 0 bytes allocate nothing and are not counted)."""
    notes: tuple[str, ...] = ()
    """Assumptions the prediction rests on, stated for the reader."""
    _rerun: Callable[[int], AllocatorReplay] | None = field(default=None, repr=False, compare=False)

    def at_capacity(self, device_bytes: int) -> AllocatorReplay:
        """This replay with the allocator limited to ``device_bytes`` (replayed again unless that is known).

        A limit at or above an unlimited replay's ``max_reserved_bytes`` never binds: that replay stands for it.
        """
        if device_bytes == self.capacity_bytes:
            return self
        if self.capacity_bytes is None and self.max_reserved_bytes <= device_bytes:
            return self
        if self._rerun is None:
            raise ValueError("this replay cannot be repeated at another capacity; call replay() again")
        return self._rerun(device_bytes)

    def fits(self, device_bytes: int) -> bool:
        """Whether the step runs with ``device_bytes`` available to the allocator, cache releases included.

        Example:
            >>> from trainledger.allocator import replay
            >>> from trainledger.ledger import Category, Entry, Event, Ledger
            >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 1, 30 << 20)
            >>> r = replay(Ledger((w,), (Event(0, "forward"),)))
            >>> r.max_reserved_bytes >> 20, r.fits(32 << 20), r.fits(29 << 20)
            (30, True, False)
        """
        return self.at_capacity(device_bytes).oom is None

    def oom_at(self, device_bytes: int) -> OOMEvent | None:
        """The allocation that fails with ``device_bytes`` available, or ``None`` if the step fits."""
        return self.at_capacity(device_bytes).oom
