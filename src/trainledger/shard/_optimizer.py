"""The optimizer step on a rank: the temporaries it makes, and the order it makes them in. Pure, no torch.

FSDP2's optimizer updates each parameter's local shard, so each temporary has the real rows of the
parameter it was made for (``optimizer_workspace``).

``ZeroRedundancyOptimizer`` gives each rank whole parameters (largest first, to the least-loaded rank)
and each rank's own optimizer steps only those, in the order they were assigned. A single-tensor
optimizer (the default on CPU) updates one parameter after another: its temporaries for one parameter
(Adam's ``exp_avg_sq.sqrt()`` and the division by the bias correction) live while that parameter is
updated, and the last of them (``denom``) until the next parameter's replaces it. So what a rank holds
during its step depends on which parameters follow which *in its own order*: the reference step's
segments (one per parameter, found from the tracer's attribution of optimizer ops to the parameter
they update, ``Event.module``) are laid out again in the rank's order, and a temporary that outlived its
segment is freed at the same point of the segment that follows it on the rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainledger.ledger import Category, Entry, Event
from trainledger.shard._context import Context
from trainledger.shard._partition import resized


def optimizer_workspace(ctx: Context, out: list[Entry], kept: int, full: int, srank: int) -> list[Entry]:
    """Temporaries of the optimizer step, as the rank's optimizer makes them.

    The tracer names the parameter each temporary was made for (its ``owner``). FSDP2's optimizer runs on
    each parameter's local shard: such a temporary, and one shaped like a parameter, has that parameter's
    real rows on the rank; one of any other shape (a scalar) is kept whole. ``ZeroRedundancyOptimizer``'s
    rank makes the temporaries of the parameters it owns, and none of the others'. Temporaries of no known
    parameter, and the DeepSpeed engine's, scale with the fraction ``kept / full`` of optimizer state the
    rank updates (an approximation).
    """
    partition = ctx.plan.partition
    phases = [ev.phase for ev in ctx.ledger.events]
    by_shape = {p.shape: p for p in ctx.params if p.category == Category.WEIGHTS and p.shape}
    scaled = []
    for e in out:
        if e.category == Category.WORKSPACE and e.alloc_event is not None and phases[e.alloc_event] == "optimizer":
            p = ctx.param_by_name.get(e.owner)
            if partition == "greedy" and p is not None and p.name in ctx.owner:
                if ctx.owner[p.name] != srank:
                    continue
            elif partition == "dim0" and (p is not None or e.shape in by_shape):
                e = resized(e, ctx.held(e, p if p is not None else by_shape[e.shape], srank, real=True))
            elif partition != "dim0":
                e = replace(e, nbytes=e.nbytes * kept // full, numel=e.numel * kept // full)
        scaled.append(e)
    return scaled


def optimizer_segments(events: Sequence[Event]) -> dict[str, tuple[int, int]] | None:
    """``parameter -> (first event, end)`` of each parameter's run of optimizer events, in step order;
    ``None`` when the step is not one parameter after another (a foreach op over every parameter, an op
    on no parameter, a parameter updated in two places)."""
    segments: dict[str, tuple[int, int]] = {}
    last = ""
    for ev in events:
        if ev.phase != "optimizer":
            continue
        if not ev.module:
            return None
        if ev.module == last and segments[last][1] == ev.index:
            segments[last] = (segments[last][0], ev.index + 1)
            continue
        if ev.module in segments:
            return None
        segments[ev.module] = (ev.index, ev.index + 1)
        last = ev.module
    return segments or None


def resequence_optimizer(
    events: Sequence[Event], entries: Sequence[Entry], order: Sequence[str]
) -> tuple[tuple[Event, ...], list[Entry]]:
    """Events and entries of a step whose optimizer updates only ``order``'s parameters, in that order.

    Entries allocated in a dropped parameter's segment are dropped; the rest keep their offsets within
    their segment. Returns the input unchanged when the step cannot be cut into segments.
    """
    segments = optimizer_segments(events)
    if segments is None:
        return tuple(events), list(entries)
    first = min(s for s, _ in segments.values())
    end = max(e for _, e in segments.values())
    kept = [p for p in order if p in segments]
    new_index: dict[int, int] = {i: i for i in range(first)}
    out_events: list[Event] = list(events[:first])
    start_of: dict[str, int] = {}
    for p in kept:
        start_of[p] = len(out_events)
        s, e = segments[p]
        for i in range(s, e):
            new_index[i] = len(out_events)
            out_events.append(replace(events[i], index=len(out_events)))
    phase_end = len(out_events)
    for i in range(end, len(events)):
        new_index[i] = len(out_events)
        out_events.append(replace(events[i], index=len(out_events)))
    segment_of = {i: p for p, (s, e) in segments.items() for i in range(s, e)}
    after = {p: (kept[k + 1] if k + 1 < len(kept) else None) for k, p in enumerate(kept)}
    carried = _carried_offsets(entries, segments, segment_of)

    def moved(i: int) -> int:
        """A point of the old clock on the new one: the first kept event at or after it."""
        while i < len(events) and i not in new_index:
            i += 1
        return new_index[i] if i < len(events) else len(out_events)

    def freed(e: Entry, born_in: str | None) -> int:
        i = e.free_event
        assert i is not None
        if i <= first:  # gone as the optimizer begins (the loss after backward): so on every rank's clock
            return i
        if born_in is None or e.alloc_event is None:
            return moved(i)
        s, end_own = segments[born_in]
        born = e.alloc_event - s
        if i < end_own or (i == end_own and born not in carried):  # within its own parameter's update
            return start_of[born_in] + (i - s)
        nxt = after[born_in]
        if i in segment_of:  # freed in the segment that followed: at the same point of the rank's next
            offset: int | None = i - segments[segment_of[i]][0]
        else:  # outlived the step as its last parameter's: as the others' were, if it has a successor here
            offset = carried.get(born)
        if nxt is None or offset is None:  # the rank's last parameter: its leftovers go when the step returns
            return phase_end
        s_next, e_next = segments[nxt]
        return start_of[nxt] + min(offset, e_next - s_next)

    out: list[Entry] = []
    for e in entries:
        born_in = segment_of.get(e.alloc_event) if e.alloc_event is not None else None
        if born_in is not None and born_in not in start_of:
            continue  # a temporary of a parameter this rank does not update
        out.append(
            replace(
                e,
                alloc_event=None if e.alloc_event is None else new_index.get(e.alloc_event, moved(e.alloc_event)),
                free_event=None if e.free_event is None else freed(e, born_in),
                last_use_event=None if e.last_use_event is None else moved(e.last_use_event),
            )
        )
    return tuple(out_events), out


def _carried_offsets(
    entries: Sequence[Entry], segments: dict[str, tuple[int, int]], segment_of: dict[int, str]
) -> dict[int, int]:
    """``offset born -> offset freed in the next segment`` of temporaries that outlive their parameter's
    update (the optimizer runs the same program for each parameter)."""
    order = list(segments)
    out: dict[int, int] = {}
    for e in entries:
        born_in = segment_of.get(e.alloc_event) if e.alloc_event is not None else None
        if born_in is None or e.alloc_event is None or e.free_event not in segment_of:
            continue
        k = order.index(born_in)
        if k + 1 < len(order) and segment_of[e.free_event] == order[k + 1]:
            out[e.alloc_event - segments[born_in][0]] = e.free_event - segments[order[k + 1]][0]
    return out
