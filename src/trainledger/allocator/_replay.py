"""Replay a ledger's allocations and frees, in event order, through ``CachingAllocatorModel``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from trainledger.allocator._config import AllocatorConfig
from trainledger.allocator._engine import AllocatorOutOfMemory, CachingAllocatorModel
from trainledger.allocator._results import AllocatorReplay, OOMEvent, PeakState, ReservedChange
from trainledger.allocator._sizes import round_size
from trainledger.errors import InputError
from trainledger.ledger import Entry, Ledger

NonCuda = Literal["replay", "skip"]


@dataclass
class _Plan:
    """Which entries are replayed, and what happens at each event boundary (indices into ``entries``)."""

    entries: list[Entry]
    streams: list[int]
    before_step: list[int]
    frees_at: list[list[int]]
    transients_at: list[list[int]]
    allocs_at: list[list[int]]
    notes: list[str] = field(default_factory=list)


@dataclass
class _Run:
    """What one pass over the plan observed."""

    model: CachingAllocatorModel
    reserved_before_step: int = 0
    timeline: list[ReservedChange] = field(default_factory=list)
    max_reserved_event: int | None = None
    peak_event: int | None = None
    peak_allocated: int = -1
    requested_peak: int = 0
    rounded_peak: int = 0
    oom: OOMEvent | None = None
    snapshot: PeakState | None = None


def replay(
    ledger: Ledger,
    config: AllocatorConfig | None = None,
    *,
    capacity_bytes: int | None = None,
    non_cuda: NonCuda = "replay",
    device: str | None = None,
    stream_of: Callable[[Entry], int] | None = None,
) -> AllocatorReplay:
    """Predict what PyTorch's CUDA caching allocator reserves for the step a ledger describes.

    Entries are allocated and freed in event order: first the entries that exist before the step
    (``alloc_event is None``), once each, in ledger order; then at each event the entries whose life
    ends there are freed, entries that live for no event (``alloc_event == free_event``) are allocated
    and freed, and the entries born there are allocated, each group in ledger order. Entries with
    ``free_event is None`` are never freed.

    Arguments:
        ledger: the step (a traced ledger is what this is for; any ledger works).
        config: allocator options; PyTorch's defaults when omitted.
        capacity_bytes: bytes the allocator may reserve (the device's usable memory); ``None``: unlimited.
        non_cuda: entries on a device that is not CUDA (a ledger traced on this CPU machine says ``cpu``):
            ``"replay"`` them as if they were on the GPU (a CPU-traced step standing in for the CUDA
            step), or ``"skip"`` them.
        device: the CUDA device to model when the ledger's entries span several (``"cuda:1"``).
        stream_of: the CUDA stream of each entry (each stream has its own pools); default: stream 0.

    Example:
        >>> from trainledger.ledger import Category, Entry, Event, Ledger
        >>> ev = (Event(0, "forward", "mm"), Event(1, "forward", "relu"))
        >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 1, 5 << 20)
        >>> a = Entry("a", Category.ACTIVATIONS, "saved", "float32", 1, 12 << 20, alloc_event=0, free_event=2)
        >>> r = replay(Ledger((w, a), ev))
        >>> r.max_reserved_bytes >> 20, r.peak.allocated_bytes >> 20, r.peak.num_segments
        (20, 17, 1)
        >>> r.fits(20 << 20), r.fits(19 << 20)
        (True, False)
    """
    if non_cuda not in ("replay", "skip"):
        raise InputError(f"non_cuda={non_cuda!r}; choose 'replay' (as if on the GPU) or 'skip'")
    config = config if config is not None else AllocatorConfig()
    plan = _plan(ledger, non_cuda, device, stream_of)
    first = _run(plan, config, capacity_bytes, snapshot_at=None)
    peak = None
    if first.peak_event is not None:  # a second pass stops at the peak to take its snapshot
        peak = _run(plan, config, capacity_bytes, snapshot_at=first.peak_event, ledger=ledger).snapshot
    model = first.model
    return AllocatorReplay(
        config=config,
        capacity_bytes=capacity_bytes,
        max_reserved_bytes=model.max_reserved_bytes,
        max_reserved_event=first.max_reserved_event,
        max_allocated_bytes=model.max_allocated_bytes,
        peak=peak,
        reserved_before_step_bytes=first.reserved_before_step,
        reserved_timeline=tuple(first.timeline),
        rounded_peak_bytes=first.rounded_peak,
        requested_peak_bytes=first.requested_peak,
        num_cache_flushes=model.num_cache_flushes,
        releasable_after_step_bytes=model.releasable_bytes(),
        oom=first.oom,
        num_entries=len(plan.entries),
        notes=tuple(plan.notes),
        _rerun=lambda cap: replay(
            ledger, config, capacity_bytes=cap, non_cuda=non_cuda, device=device, stream_of=stream_of
        ),
    )


def _plan(ledger: Ledger, non_cuda: NonCuda, device: str | None, stream_of: Callable[[Entry], int] | None) -> _Plan:
    target = _target_device(ledger.entries, device)
    n = ledger.num_events
    plan = _Plan([], [], [], [[] for _ in range(n + 1)], [[] for _ in range(n)], [[] for _ in range(n)])
    other: dict[str, int] = {}
    num_empty = num_after_end = 0
    for entry in ledger.entries:
        dev = _normalise(entry.device)
        if dev.startswith("cuda"):
            if dev != target:
                continue
        else:
            other[dev] = other.get(dev, 0) + 1
            if non_cuda == "skip":
                continue
        if entry.nbytes == 0:
            num_empty += 1
            continue
        if entry.alloc_event is not None and entry.alloc_event >= n:
            num_after_end += 1  # born after the last event: live at no event, nothing to replay against
            continue
        i = len(plan.entries)
        plan.entries.append(entry)
        plan.streams.append(0 if stream_of is None else stream_of(entry))
        a, f = entry.alloc_event, entry.free_event
        if a is None:
            plan.before_step.append(i)
        elif f is not None and f == a:
            plan.transients_at[a].append(i)
        else:
            plan.allocs_at[a].append(i)
        if f is not None and (a is None or f > a):
            plan.frees_at[f].append(i)
    if plan.before_step:
        plan.notes.append(
            f"{len(plan.before_step)} entries exist before the step: they are allocated first, once each, in "
            "ledger order; their real order and any frees in earlier steps are unknown"
        )
    if other:
        where = ", ".join(f"{count} on {dev}" for dev, count in sorted(other.items()))
        verb = "skipped" if non_cuda == "skip" else "replayed as if on the GPU"
        plan.notes.append(f"entries not on a CUDA device ({where}) {verb}")
    if num_empty:
        plan.notes.append(f"{num_empty} entries of 0 bytes allocate nothing and are left out")
    if num_after_end:
        plan.notes.append(f"{num_after_end} entries born after the last event (live at no event) are left out")
    plan.notes.append(
        "only the ledger's entries are replayed: the CUDA context, library workspaces and buffers the ledger "
        "does not list are not in the prediction"
    )
    return plan


def _normalise(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def _target_device(entries: Sequence[Entry], device: str | None) -> str | None:
    cuda = sorted({_normalise(e.device) for e in entries if _normalise(e.device).startswith("cuda")})
    if device is not None:
        target = _normalise(device)
        if not target.startswith("cuda"):
            raise InputError(f"device {device!r} is not a CUDA device; name one such as 'cuda:0'")
        return target
    if len(cuda) > 1:
        raise InputError(f"the ledger's entries span {', '.join(cuda)}; choose one with device='{cuda[0]}'")
    return cuda[0] if cuda else None


def _run(
    plan: _Plan,
    config: AllocatorConfig,
    capacity_bytes: int | None,
    *,
    snapshot_at: int | None,
    ledger: Ledger | None = None,
) -> _Run:
    run = _Run(CachingAllocatorModel(config, capacity_bytes=capacity_bytes))
    model = run.model
    addresses: dict[int, int] = {}
    rounded = [round_size(e.nbytes, config.roundup_divisions_for(e.nbytes)) for e in plan.entries]
    rounded_live = 0

    def allocate(i: int, event: int | None) -> bool:
        nonlocal rounded_live
        entry = plan.entries[i]
        try:
            addresses[i] = model.malloc(entry.nbytes, plan.streams[i], entry.name)
        except AllocatorOutOfMemory as exc:
            run.oom = OOMEvent(event=event, entry=entry.name, request=exc.failed)
            return False
        rounded_live += rounded[i]
        return True

    def release(i: int) -> None:
        nonlocal rounded_live
        model.free(addresses.pop(i))
        rounded_live -= rounded[i]

    for i in plan.before_step:
        if not allocate(i, None):
            return run
    run.reserved_before_step = last_reserved = model.reserved_bytes
    for event in range(len(plan.allocs_at)):
        max_before = model.max_reserved_bytes
        for i in plan.frees_at[event]:
            release(i)
        for i in plan.transients_at[event]:
            if not allocate(i, event):
                return run
            release(i)
        for i in plan.allocs_at[event]:
            if not allocate(i, event):
                return run
        if model.max_reserved_bytes > max_before:
            run.max_reserved_event = event
        if model.reserved_bytes != last_reserved:
            run.timeline.append(ReservedChange(event, model.reserved_bytes))
            last_reserved = model.reserved_bytes
        run.requested_peak = max(run.requested_peak, model.requested_bytes)
        run.rounded_peak = max(run.rounded_peak, rounded_live)
        if model.allocated_bytes > run.peak_allocated:
            run.peak_allocated, run.peak_event = model.allocated_bytes, event
        if event == snapshot_at:
            assert ledger is not None
            run.snapshot = _snapshot(model, ledger, event)
            return run
    for i in plan.frees_at[-1]:  # freed after the last event: the state the step leaves behind
        release(i)
    return run


def _snapshot(model: CachingAllocatorModel, ledger: Ledger, event: int) -> PeakState:
    ev = ledger.events[event]
    return PeakState(
        event=event,
        phase=ev.phase,
        op=ev.op,
        allocated_bytes=model.allocated_bytes,
        requested_bytes=model.requested_bytes,
        reserved_bytes=model.reserved_bytes,
        largest_free_block_bytes=model.largest_free_block_bytes(),
        releasable_bytes=model.releasable_bytes(),
        segments=model.segments(),
    )
