"""A stack of identical blocks: a ledger traced at a few blocks, extended to the full depth exactly.

A transformer is an embedding, ``L`` identical blocks and a head. Its traced step at depth ``d`` is a
sequence of events in which each block's ops form one contiguous run per *sweep* of the stack: forward
goes up (blocks ``0 .. d-1``), backward comes down, each pass of the optimizer over the parameters goes up
again. Between sweeps lie the *gaps*: the embedding, the head and loss, the seed of backward.

:func:`extend` turns a ledger traced at ``d >= 3`` blocks into the ledger at ``n >= d`` blocks: block 0
and the last block keep their own events (they border the embedding and the head), block ``d-2`` is
repeated for blocks ``d-2 .. n-2``. Every name that carries a block's index (module paths, parameter
names, optimizer slots) is renumbered; every name that carries an event (``aten.mm#812``) is shifted
with it; every lifetime keeps its place relative to its own block (an output freed in the next block's
forward is freed in the next block's forward at every depth; the input a checkpointed block keeps, last
unpacked as its recomputation starts, is last used just before that block's backward at every depth), but one
that reaches from one end of the stack to the other reaches the other end at every depth (T5's block 0 computes
the position bias that every block adds; the gradient the last block starts is freed in block 0's backward).
Where a lifetime reaches into a neighbouring block whose run is not op for op the run of the block repeated there
(T5's last block has one op fewer: it starts that gradient's sum, the others add to it), the runs are aligned.
Nothing is assumed without a check: a ledger whose events are not sweeps of whole blocks raises
:class:`NotRepeating`, and the caller checks the extension against a trace at another depth
(:func:`first_difference`) before it trusts it.

Pure data: no torch, so a 126-block ledger is synthesized in well under a second.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from trainledger.ledger import ROOT_SCOPE, Entry, Event, Ledger, ModuleCall

__all__ = ["NotRepeating", "Stack", "extend", "find_stack", "first_difference", "source_block"]

T = TypeVar("T")

_EVENT_REF = re.compile(r"#(\d+)")
_INDEXED_CALL = re.compile(r"^(.+)\.(\d+)$")
_UNSTABLE_META = ("traced_step_seconds",)
"""Meta that differs between two traces of the same step (wall time), left out of comparisons."""


class NotRepeating(Exception):
    """The traced depths do not show a block that repeats exactly; the message says where."""


@dataclass(frozen=True)
class Stack:
    """The module list that holds the blocks, by its path (``model.layers``, ``transformer.h``)."""

    prefix: str

    def __post_init__(self) -> None:
        pattern = r"(?:^|(?<=[.:]))" + re.escape(self.prefix) + r"\.(\d+)(?=[.:#]|$)"
        object.__setattr__(self, "_pattern", re.compile(pattern))
        object.__setattr__(self, "_pieces", {})  # text -> its pieces around the block indices it carries

    def encloses(self, path: str) -> bool:
        """Whether the module at ``path`` holds the blocks: the model itself, a module above the list, or the list
        itself (an ``nn.Sequential`` is called, as timm's ViT calls its ``blocks``)."""
        return path in (ROOT_SCOPE, self.prefix) or self.prefix.startswith(path + ".")

    def block_of(self, text: str) -> int | None:
        """The block index a name carries (the first one), or ``None``."""
        m = self._pattern.search(text)  # type: ignore[attr-defined]
        return None if m is None else int(m.group(1))

    def shift(self, text: str, by: int) -> str:
        """``text`` with every block index it carries moved by ``by``."""
        if not by:
            return text
        pieces = self._pieces.get(text)  # type: ignore[attr-defined]
        if pieces is None:  # split once: a block's names are renumbered once per block of the target
            pieces = self._pieces[text] = self._pattern.split(text)  # type: ignore[attr-defined]
        if len(pieces) == 1:
            return text
        out = [pieces[0]]
        for i in range(1, len(pieces), 2):
            out += (f"{self.prefix}.{int(pieces[i]) + by}", pieces[i + 1])
        return "".join(out)


def source_block(t: int, base_depth: int, depth: int) -> int:
    """The block of a ``base_depth``-block trace that block ``t`` of the ``depth``-block extension repeats: the
    first and the last keep their own, the one before the last repeats for all between.

    Example:
        >>> [source_block(t, 3, 6) for t in range(6)]
        [0, 1, 1, 1, 1, 2]
    """
    if t == depth - 1:
        return base_depth - 1
    return min(t, base_depth - 2)


def find_stack(calls_at_depth: dict[int, Sequence[ModuleCall]]) -> Stack:
    """The one module list whose called children are numbered exactly ``0 .. d-1`` at every traced depth ``d``.

    Example:
        >>> calls = lambda d: [ModuleCall(f"h.{i}", 0, None, i, i + 1) for i in range(d)]
        >>> find_stack({3: calls(3), 4: calls(4)}).prefix
        'h'
    """
    candidates: set[str] | None = None
    for depth, calls in calls_at_depth.items():
        indices: dict[str, set[int]] = {}
        for c in calls:
            m = _INDEXED_CALL.match(c.path)
            if m:
                indices.setdefault(m.group(1), set()).add(int(m.group(2)))
        here = {p for p, found in indices.items() if found == set(range(depth))}
        candidates = here if candidates is None else candidates & here
    if not candidates:
        raise NotRepeating("no module list holds one block per layer at every traced depth")
    if len(candidates) > 1:
        raise NotRepeating(f"several module lists grow with the depth ({', '.join(sorted(candidates))})")
    return Stack(candidates.pop())


@dataclass(frozen=True, slots=True)
class _Place:
    """Where a base event lies: in gap ``segment``, or in block ``block`` of sweep ``segment``."""

    segment: int
    block: int | None
    offset: int


Home = tuple[int, int] | None
"""The block an entry or call belongs to: ``(base block, target block)``; ``None``: the skeleton."""


class _Layout:
    """The base ledger's events as gaps and sweeps, and the target's events built from them."""

    def __init__(self, base: Ledger, stack: Stack, base_depth: int, depth: int) -> None:
        if base_depth < 3:
            raise ValueError(f"extension needs a trace of at least 3 blocks, not {base_depth}")
        if depth < base_depth:
            raise ValueError(f"cannot extend {base_depth} blocks to fewer ({depth})")
        self.stack, self.d, self.n = stack, base_depth, depth
        self.base_events = base.events
        self.places: list[_Place] = [_Place(0, None, 0)] * len(base.events)
        self.starts: dict[tuple[int, int | None], int] = {}
        self.lengths: dict[tuple[int, int | None], int] = {}
        self.sweeps: dict[int, tuple[bool, int]] = {}  # segment: (ascending, its first base event)
        self.runs: dict[tuple[int, int], list[int]] = {}  # (sweep, base block): its base events
        self._aligned: dict[tuple[int, int, int], dict[int, int]] = {}
        self.events: list[Event] = []
        for s, (block_runs, ascending) in enumerate(self._segments()):
            if ascending is None:
                self._place(s, None, block_runs[0], None)
                continue
            self.sweeps[s] = (ascending, min(run[0] for run in block_runs))
            for b, run in enumerate(block_runs):
                self.runs[(s, b)] = run
                for o, p in enumerate(run):
                    self.places[p] = _Place(s, b, o)
            for t in range(depth) if ascending else reversed(range(depth)):
                self._place(s, t, block_runs[self.source(t)], self.source(t))

    def _place(self, s: int, t: int | None, run: list[int], b: int | None) -> None:
        self.starts[(s, t)], self.lengths[(s, t)] = len(self.events), len(run)
        for o, p in enumerate(run):
            ev = self.base_events[p]
            if b is None:
                self.places[p] = _Place(s, None, o)
            module = ev.module if b is None or t is None else self.stack.shift(ev.module, t - b)
            self.events.append(Event(len(self.events), ev.phase, ev.op, module))

    def _segments(self) -> list[tuple[list[list[int]], bool | None]]:
        """``([events], None)`` for a gap; ``([events of block 0], …, [block d-1]], ascending)`` for a sweep."""
        runs: list[tuple[tuple[str, int] | None, list[int]]] = []
        for p, ev in enumerate(self.base_events):
            b = self.stack.block_of(ev.module)
            key = None if b is None else (ev.phase, b)
            if runs and runs[-1][0] == key:
                runs[-1][1].append(p)
            else:
                runs.append((key, [p]))
        segments: list[tuple[list[list[int]], bool | None]] = []
        i = 0
        while i < len(runs):
            if runs[i][0] is None:
                segments.append(([runs[i][1]], None))
                i += 1
            else:
                sweep, i = self._sweep(runs, i)
                segments.append(sweep)
        return segments

    def _sweep(
        self, runs: list[tuple[tuple[str, int] | None, list[int]]], i: int
    ) -> tuple[tuple[list[list[int]], bool], int]:
        """The sweep whose first block run is ``runs[i]``, and the index of the run after it. Events outside
        every block between two blocks' runs (a residual add in the parent's forward) join the block before."""
        first = runs[i]
        assert first[0] is not None
        phase, blocks, events = first[0][0], [], []  # type: ignore[var-annotated]
        outside = -1  # the first event of the last events outside every block joined to a block's run
        while len(blocks) < self.d and i < len(runs):
            key, run = runs[i]
            if key is None:
                after = runs[i + 1][0] if i + 1 < len(runs) else None
                if after is None or after[0] != phase:
                    break
                events[-1], outside = events[-1] + run, run[0]
            elif key[0] != phase:
                break
            elif blocks and key[1] == blocks[-1]:
                why = (
                    "autograd ran them for no block's node (a reentrant checkpoint's recomputation runs so; "
                    "checkpoint with use_reentrant=False to have the stack extended)"
                    if phase == "backward"
                    else "the step runs them in the middle of that block's work"
                )
                raise NotRepeating(
                    f"events outside every block (event {outside}, {self.base_events[outside].op}) split the "
                    f"{phase} run of block {key[1]}: {why}"
                )
            else:
                blocks.append(key[1])
                events.append(list(run))
            i += 1
        ascending = blocks == list(range(self.d))
        if not (ascending or blocks == list(reversed(range(self.d)))):
            raise NotRepeating(
                f"the {phase} events from event {first[1][0]} on are not one run per block in block order "
                f"(blocks {blocks})"
            )
        by_block = dict(zip(blocks, events, strict=True))
        return ([by_block[b] for b in range(self.d)], ascending), i

    def source(self, t: int) -> int:
        """The base block whose events target block ``t`` repeats."""
        return source_block(t, self.d, self.n)

    def targets(self, b: int) -> range:
        """The target blocks that repeat base block ``b``."""
        if b == self.d - 1:
            return range(self.n - 1, self.n)
        if b == self.d - 2:
            return range(self.d - 2, self.n - 1)
        return range(b, b + 1)

    def position(self, p: int | None, home: Home, anchor: int | None = None) -> int | None:
        """The target event of base event ``p`` for something belonging to ``home`` (for the skeleton: that
        came to be at base event ``anchor``, ``None`` before the step)."""
        if p is None:
            return None
        if p >= len(self.base_events):
            return len(self.events) + (p - len(self.base_events))
        place = self.places[p]
        if place.block is None:
            return self.starts[(place.segment, None)] + place.offset
        if home is None:
            t = self._skeleton_block(place, anchor)
        elif {home[0], place.block} == {0, self.d - 1}:
            t = 0 if place.block == 0 else self.n - 1  # from one end of the stack to the other, at every depth
        else:
            t = home[1] + place.block - home[0]
        offset = self._counterpart(place, self.source(t)) if 0 <= t < self.n else None
        if offset is None or offset >= self.lengths[(place.segment, t)]:
            raise NotRepeating(f"event {p} of block {place.block} has no counterpart in block {t}")
        return self.starts[(place.segment, t)] + offset

    def _counterpart(self, place: _Place, block: int) -> int | None:
        """The offset in base block ``block``'s run of the sweep of the event at ``place`` (in another block's run
        of it, for a lifetime that reaches from its own block into the next or the one before), or ``None``.

        The blocks' runs are alike but need not be equal: T5's last block is the first to reach the relative
        position bias that block 0 computed in backward, so its gradient there starts the sum that the blocks
        below it add to, one event more each. The runs are aligned by op and block-relative module."""
        assert place.block is not None
        if block == place.block:
            return place.offset
        key = (place.segment, place.block, block)
        if key not in self._aligned:
            self._aligned[key] = self._align(place.segment, place.block, block)
        return self._aligned[key].get(place.offset)

    def _align(self, segment: int, a: int, b: int) -> dict[int, int]:
        """Offsets in block ``a``'s run of ``segment`` matched to offsets in block ``b``'s."""

        def keys(block: int) -> list[tuple[str, str]]:
            events = (self.base_events[p] for p in self.runs[(segment, block)])
            return [(ev.op, self.stack.shift(ev.module, -block)) for ev in events]

        xs, ys = keys(a), keys(b)
        if xs == ys:
            return {o: o for o in range(len(xs))}
        matcher = difflib.SequenceMatcher(None, xs, ys, autojunk=False)
        return {m.a + k: m.b + k for m in matcher.get_matching_blocks() for k in range(m.size)}

    def end(self, p: int | None, start: int | None, home: Home, anchor: int | None = None) -> int | None:
        """The target of ``p``, one past the last event of something that began at ``start`` (a lifetime's
        free event, a call's stop): one past the target of its last event, so that an array freed right
        after the last block's last op is freed right after that op in every block, not at the head. What is
        freed when the step has ended (gradients set to ``None`` after a last sweep over the blocks, OPT's
        master copies written back) is freed when the extended step has ended."""
        if p is None or p == 0 or p == start or p >= len(self.base_events):
            return self.position(p, home, anchor)
        last = self.position(p - 1, home, anchor)
        assert last is not None
        return last + 1

    def before(self, p: int | None, home: Home, anchor: int | None = None) -> int | None:
        """The target of ``p`` for what happened between events ``p`` and ``p + 1`` and is stamped ``p`` (a
        saved tensor's unpack: its last use is the event before it): one before the target of ``p + 1``.

        An unpack belongs to the autograd node that runs next, so it moves with the event after it. Where that
        node opens a block's backward run, ``p`` is the last event of another block's run or of a gap: a
        checkpointed block's recomputation first unpacks the block's inputs, right after the block above
        it (or the head, for the last block) has run its backward."""
        if p is None:
            return None
        after = self.position(p + 1, home, anchor)
        assert after is not None
        return after - 1

    def _skeleton_block(self, place: _Place, anchor: int | None) -> int:
        """The target block in which the skeleton (the embedding, the head, the loss) reaches into a sweep:
        the block as many visits from the sweep's start, or from its end, as in the base (the nearer; when
        both are as near, the start if the skeleton's array came to be before the sweep)."""
        assert place.block is not None
        ascending, first = self.sweeps[place.segment]
        from_start = place.block if ascending else self.d - 1 - place.block
        from_end = self.d - 1 - from_start
        if from_start > from_end or (from_start == from_end and anchor is not None and anchor > first):
            from_start = self.n - 1 - from_end
        return from_start if ascending else self.n - 1 - from_start

    def rename(self, text: str, home: Home, anchor: int | None = None) -> str:
        """``text`` with its block indices renumbered and the events it names moved."""
        if home is not None:
            text = self.stack.shift(text, home[1] - home[0])
        if "#" in text:
            text = _EVENT_REF.sub(lambda m: f"#{self.position(int(m.group(1)), home, anchor)}", text)
        return text

    def block_of_event(self, p: int | None) -> int | None:
        return None if p is None or p >= len(self.base_events) else self.places[p].block

    def homes(self, b: int | None) -> list[Home]:
        return [None] if b is None else [(b, t) for t in self.targets(b)]

    def expand_runs(self, items: Iterable[T], block_of: Callable[[T], int | None]) -> list[tuple[T, Home]]:
        """Items in base order (module calls, parameters), each consecutive run of one block's items repeated
        for the target blocks that repeat it, in ascending order."""
        runs: list[tuple[int | None, list[T]]] = []
        for item in items:
            b = block_of(item)
            if runs and runs[-1][0] == b and b is not None:
                runs[-1][1].append(item)
            else:
                runs.append((b, [item]))
        return [(item, home) for b, run in runs for home in self.homes(b) for item in run]


def _entry_block(e: Entry, layout: _Layout) -> int | None:
    """The block an entry belongs to: where it was allocated, else the block its name or owner names, else
    the block of the event its name carries."""
    for b in (layout.block_of_event(e.alloc_event), layout.stack.block_of(e.name), layout.stack.block_of(e.owner)):
        if b is not None:
            return b
    m = _EVENT_REF.search(e.name)
    return layout.block_of_event(int(m.group(1))) if m else None


def _entry(e: Entry, layout: _Layout, home: Home) -> Entry:
    def rename(text: str) -> str:
        return layout.rename(text, home, e.alloc_event)

    def position(p: int | None) -> int | None:
        return layout.position(p, home, e.alloc_event)

    return Entry(  # every field by keyword (dataclasses.replace costs a third of an extension to 126 blocks)
        name=rename(e.name),
        category=e.category,
        role=e.role,
        dtype=e.dtype,
        numel=e.numel,
        nbytes=e.nbytes,
        device=e.device,
        owner=rename(e.owner),
        alloc_event=position(e.alloc_event),
        free_event=layout.end(e.free_event, e.alloc_event, home, e.alloc_event),
        evidence=e.evidence,
        shape=e.shape,
        aliases=tuple(map(rename, e.aliases)),
        last_use_event=layout.before(e.last_use_event, home, e.alloc_event),
        kernel=e.kernel,
    )


def _entries(base: Ledger, layout: _Layout) -> list[Entry]:
    out = [_entry(e, layout, home) for e in base.entries for home in layout.homes(_entry_block(e, layout))]
    out.sort(key=_tracer_order)
    return out


def _tracer_order(e: Entry) -> tuple[int, str, str]:
    """The tracer's order: by allocation event (before the step first), then name, then owner (a foreach op's
    outputs, one per parameter). A temporary made outside
    dispatch (role ``untracked_temporary``) is ordered as what it was first taken for: state from before."""
    before = e.alloc_event is None or e.role == "untracked_temporary"
    return (-1 if before else e.alloc_event, e.name, e.owner)  # type: ignore[return-value]


def _calls(base: Ledger, layout: _Layout) -> list[ModuleCall]:
    def block_of(i: int) -> int | None:
        c = base.calls[i]
        b = layout.stack.block_of(c.path)
        if b is not None:
            return b
        if layout.stack.encloses(c.path):  # the model, a module holding the list (BERT's encoder, whose
            return None  # first op is block 0's): the skeleton, wherever its first event lies
        return layout.block_of_event(c.start)  # a module shared by the blocks, called inside one

    homes = layout.expand_runs(range(len(base.calls)), block_of)
    at: dict[tuple[int, Home], int] = {(i, home): pos for pos, (i, home) in enumerate(homes)}
    seen: Counter[str] = Counter()
    out = []
    for i, home in homes:
        c = base.calls[i]
        path = layout.rename(c.path, home)
        parent = None
        if c.parent is not None:
            pb = block_of(c.parent)
            parent_home = None if pb is None else (pb, pb + (0 if home is None else home[1] - home[0]))
            if (c.parent, parent_home) not in at:
                raise NotRepeating(f"the call of {c.path!r} runs inside a call of another block")
            parent = at[(c.parent, parent_home)]
        out.append(
            replace(
                c,
                path=path,
                index=seen[path],
                parent=parent,
                start=layout.position(c.start, home, c.start),
                stop=layout.end(c.stop, c.start, home, c.start),
                backward_start=layout.position(c.backward_start, home, c.start),
                backward_stop=layout.end(c.backward_stop, c.backward_start, home, c.start),
                writes=tuple(layout.rename(w, home, c.start) for w in c.writes),
            )
        )
        seen[path] += 1
    return out


def extend(
    base: Ledger,
    kernels: Sequence[tuple[int, str, str, Hashable]],
    stack: Stack,
    *,
    base_depth: int,
    depth: int,
) -> tuple[Ledger, list[tuple[int, str, str, Any]]]:
    """The ledger of the same step with ``depth`` blocks, from ``base`` traced with ``base_depth``.

    Arguments:
        base: a traced ledger (events, entries, module calls) of ``base_depth >= 3`` blocks.
        kernels: the trace's kernel calls ``(event, op, module, call)``, extended alongside.
        stack: the module list holding the blocks (:func:`find_stack`).

    Returns:
        The extended ledger and kernel calls. Raises :class:`NotRepeating` when the base's events are not
        whole sweeps of blocks. The result is exact only if the block repeats: check it against a trace at
        another depth with :func:`first_difference` before trusting it.
    """
    if base.meta.get("frees_on_other_threads"):
        raise NotRepeating("storages freed on other threads make free events vary between runs")
    layout = _Layout(base, stack, base_depth, depth)
    events = tuple(layout.events)
    params = layout.expand_runs(base.meta.get("parameter_order", []), stack.block_of)
    recomputed = layout.expand_runs(base.meta.get("recomputed_modules", []), stack.block_of)
    held = {(name, event) for name, event in base.meta.get("freed_after_backward", ())}
    meta = {
        **base.meta,
        "events_per_phase": dict(Counter(ev.phase for ev in events)),
        **(
            {"parameter_order": [layout.rename(p, home) for p, home in params]}
            if "parameter_order" in base.meta
            else {}
        ),
        **(
            {"recomputed_modules": [layout.rename(m, home) for m, home in recomputed]}
            if "recomputed_modules" in base.meta
            else {}
        ),
        **(
            {
                "freed_after_backward": sorted(
                    [moved.name, moved.free_event]
                    for e in base.entries
                    if (e.name, e.free_event) in held
                    for moved in (_entry(e, layout, home) for home in layout.homes(_entry_block(e, layout)))
                )
            }
            if held
            else {}
        ),
    }
    ledger = Ledger(
        tuple(_entries(base, layout)),
        events,
        evidence=base.evidence,
        device=base.device,
        notes=base.notes,
        meta=meta,
        calls=tuple(_calls(base, layout)),
    )
    out_kernels = [
        (layout.position(p, home), op, layout.rename(module, home), call)
        for p, op, module, call in kernels
        for home in layout.homes(layout.block_of_event(p))
    ]
    out_kernels.sort(key=lambda k: k[0])
    return ledger, out_kernels  # type: ignore[return-value]


def first_difference(predicted: tuple[Ledger, Sequence[Any]], traced: tuple[Ledger, Sequence[Any]]) -> str | None:
    """Where an extended ledger differs from the trace at the same depth (``None``: nowhere)."""
    (a, ka), (b, kb) = predicted, traced
    for what, xs, ys in (
        ("event", a.events, b.events),
        ("entry", a.entries, b.entries),
        ("module call", a.calls, b.calls),
        ("kernel call", ka, kb),
        ("note", a.notes, b.notes),
    ):
        if len(xs) != len(ys):
            return f"{len(xs)} {what}s predicted, {len(ys)} traced"
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if x != y:
                return f"{what} {i} differs: predicted {x!r}, traced {y!r}"[:400]
    meta_a, meta_b = ({k: v for k, v in m.items() if k not in _UNSTABLE_META} for m in (a.meta, b.meta))
    if meta_a != meta_b:
        keys = sorted(k for k in meta_a.keys() | meta_b.keys() if meta_a.get(k) != meta_b.get(k))
        return f"meta {', '.join(keys)} differs"
    if (a.evidence, a.device) != (b.evidence, b.device):
        return "evidence or device differs"
    return None
