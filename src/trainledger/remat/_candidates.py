"""Candidate regions and their costs, from a traced step, and the memory of any plan on that trace.

A candidate is one *call* of a module whose forward can be wrapped in non-reentrant
``torch.utils.checkpoint``. Only calls that ran in the traced step, with autograd recording and a backward
of their own, are candidates (a ``ModuleList`` is never called, so its blocks are the candidates). The
chain is found on the tree of calls: wrappers (a call holding one call) and stacks of repeated blocks
(two or more calls of the same class, or of the same module) are opened, and what remains are the chain's
positions; inside each, its large sub-calls (attention, MLP) and a selective policy (keep matmul
outputs) are finer candidates. A module called several times in one step (a shared block, a policy run
on two batches) gives one candidate per call.

A call that writes in place to state that existed before it would write it again when recomputed. Module
buffers (a BatchNorm's running statistics) are made safe: the plan keeps a copy of them from before the
call and runs the recomputation on that copy (see :mod:`trainledger.remat._plan`). A call that writes
anything else that is older than itself (its own input, a parameter) is not a candidate.

What non-reentrant checkpointing does, and what :func:`replay` therefore does to the plain step's ledger:

- forward: the region's ops run as usual but autograd keeps none of the tensors they save; each is
  freed when Python drops it (observed by :func:`~trainledger.trace.record_forward`, which runs
  the forward with saving switched off). The region's inputs are kept until its backward ends.
- backward: just before the region's first backward op, its forward runs again, *only up to the op
  that produces the last tensor its backward needs* (early stop), so the recomputation's cost and
  transient memory are those of that prefix. Recomputed saved tensors are then freed at their last use,
  as in the plain step.
- selective: outputs of matmul-like ops are cached in forward (held until the recomputation consumes
  them) and not recomputed.

Each recomputation appears as extra ``backward`` events (op ``recompute:<op>``) inserted before the
region's backward, so a plan's predicted ledger has a real breakdown at its peak instant.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any, Literal

import numpy as np
from torch import nn

from trainledger.ledger import Category, Entry, Event, Evidence, Ledger, ModuleCall
from trainledger.remat._plan import OP_POLICIES, Policy, Region
from trainledger.remat._solvers import Chain, LinearModel
from trainledger.trace import KERNEL_INTERNAL, RNG_STATE_ROLE, ForwardRecord, StorageRecord

OTHER_OP_FLOPS_PER_ELEMENT = 1
"""The recompute cost of an op ``FlopCounterMode`` has no formula for (elementwise ops, norms, softmax,
copies): one FLOP per element of its outputs. Cheap ops are then cheap to recompute but not free, so the
solver prefers recomputing them over matmuls without treating an op-level policy as costless."""
CostKind = Literal["seconds", "flops"]
COSTS: tuple[str, ...] = ("seconds", "flops")
"""What a solver can minimise: measured seconds of the recomputed ops, or their FLOPs."""
ROOT = "(root)"


# --- the tree of calls ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallTree:
    """The traced step's module calls as a tree, with what the planner asks of it."""

    calls: tuple[ModuleCall, ...]
    children: tuple[tuple[int, ...], ...]
    top: tuple[int, ...]
    """Calls made outside every module (the model's own call, modules called from the loss)."""
    subtree: tuple[frozenset[int], ...]
    """Per call, itself and every call made inside it."""
    num_calls: dict[str, int]
    """Calls per module path in the step."""

    @classmethod
    def of(cls, calls: Sequence[ModuleCall]) -> CallTree:
        kids: list[list[int]] = [[] for _ in calls]
        top = []
        for i, c in enumerate(calls):
            (top if c.parent is None else kids[c.parent]).append(i)
        subtree: list[frozenset[int]] = [frozenset()] * len(calls)
        for i in reversed(range(len(calls))):  # children come after their parent
            subtree[i] = frozenset({i}).union(*(subtree[k] for k in kids[i]))
        num: dict[str, int] = {}
        for c in calls:
            num[c.path] = num.get(c.path, 0) + 1
        return cls(tuple(calls), tuple(map(tuple, kids)), tuple(top), tuple(subtree), num)

    def runs_backward(self, i: int) -> bool:
        """Ran with autograd recording, dispatched ops, and some of them ran again in backward."""
        c = self.calls[i]
        return c.grad and c.stop > c.start and c.backward_start is not None

    def region(self, i: int, policy: Policy, restore: tuple[str, ...] = ()) -> Region:
        c = self.calls[i]
        n = self.num_calls[c.path]
        return Region(c.path, policy, call=c.index if n > 1 else None, num_calls=n, restore=restore)


def _positions(tree: CallTree, model: nn.Module) -> tuple[list[int], set[int]]:
    """The chain: calls in forward order, found by opening the model's call, wrappers and block stacks.

    Returns the positions and, among them, the blocks of repeated stacks (what uniform checkpointing wraps).
    """
    live = [tree.runs_backward(i) for i in range(len(tree.calls))]
    kids = [[k for k in tree.children[i] if live[k]] for i in range(len(tree.calls))]

    def kind(i: int) -> type:
        return type(_module(model, tree.calls[i].path))

    def repeated(i: int) -> set[type]:
        """Classes of which ``i`` calls two or more blocks (calls that themselves call modules)."""
        seen: dict[type, int] = {}
        for k in kids[i]:
            if kids[k]:
                seen[kind(k)] = seen.get(kind(k), 0) + 1
        return {t for t, n in seen.items() if n >= 2}

    stacks = {i: repeated(i) for i in range(len(tree.calls)) if live[i]}
    holds_stack = {i for i in stacks if any(stacks[j] for j in tree.subtree[i] if j in stacks)}
    positions: list[int] = []
    blocks: set[int] = set()

    def level(ids: Sequence[int], block_kinds: set[type]) -> Iterator[tuple[int, bool, set[type]]]:
        """The live calls among ``ids``, each with whether it is a wrapper at this level."""
        ids = [i for i in ids if live[i]]
        for i in ids:
            yield i, (len(ids) == 1 or len(kids[i]) == 1) and kind(i) not in block_kinds, block_kinds

    # depth first, in forward order, with a stack of levels (a recursive inner function would refer to itself,
    # a cycle that holds the model until a collection)
    levels = [level(tree.top, set())]
    while levels:
        step = next(levels[-1], None)
        if step is None:
            levels.pop()
            continue
        i, wrapper, block_kinds = step
        # opened: the model's own call, a call alone at its level or holding one call (a wrapper and what it
        # wraps) unless it is a block of a stack (a residual block around one Sequential is what checkpointing
        # wraps), and calls that hold a stack of blocks somewhere inside
        if tree.calls[i].path == ROOT or wrapper or i in holds_stack:
            levels.append(level(kids[i], stacks[i]))
        else:
            positions.append(i)
            if kind(i) in block_kinds:
                blocks.add(i)
    return sorted(positions, key=lambda i: tree.calls[i].start), blocks


def _module(model: nn.Module, path: str) -> nn.Module:
    return model if path == ROOT else model.get_submodule(path)


# --- candidates -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One region that can be recomputed, located on the plain step's event clock."""

    region: Region
    call: int
    """Position of the module call in ``Ledger.calls``."""
    position: int
    """Index of the chain position it belongs to."""
    fwd: tuple[int, int]
    """First and last forward event of the call (inclusive)."""
    bwd: tuple[int, int]
    """First and last backward event of the call (inclusive)."""
    stop: int
    """Last forward event the recomputation runs (early stop: the last op whose output backward needs)."""
    saved_bytes: int
    """Bytes of saved activations no longer held between the region's forward and its backward."""
    flops: int
    """FLOPs of the recomputed ops that ``FlopCounterMode`` counts (matmuls, convolutions, attention)."""
    seconds: float
    covers: frozenset[str]
    """The calls inside the region; overlapping candidates conflict."""
    other_flops: int = 0
    """The cost charged to the recomputed ops ``FlopCounterMode`` counts as 0: :data:`OTHER_OP_FLOPS_PER_ELEMENT`
    per element of the outputs they allocate (a view or an in-place op allocates nothing: 0)."""
    cached: frozenset[int] = frozenset()
    """Forward events whose outputs the region's op-level policy keeps (empty for ``full``)."""

    @property
    def name(self) -> str:
        return self.region.label


@dataclass(frozen=True)
class _EntryInfo:
    savers: frozenset[int]
    unsaved_free: int


@dataclass
class Candidates:
    """Candidates of one traced step, with what :func:`replay` needs to rebuild the step under any plan."""

    plain: Ledger
    record: ForwardRecord | None
    candidates: tuple[Candidate, ...]
    positions: tuple[str, ...]
    """The chain's positions, by label."""
    tree: CallTree = field(repr=False)
    info: dict[int, _EntryInfo] = field(repr=False)
    """Per entry index of ``plain`` (forward-allocated entries only)."""
    inputs: dict[int, tuple[int, ...]] = field(repr=False)
    """Per candidate call, plain entry indices of its inputs (allocated in forward before it)."""
    blocks: tuple[int, ...] = ()
    """Full-policy candidates of the blocks of repeated stacks (what uniform checkpointing wraps)."""
    notes: tuple[str, ...] = ()

    def index(self, region: Region) -> int:
        for i, c in enumerate(self.candidates):
            if c.region == region:
                return i
        for i, c in enumerate(self.candidates):  # a region as written by hand: path, policy and call
            if (c.region.path, c.region.policy, c.region.call) == (region.path, region.policy, region.call):
                return i
        raise KeyError(region)


def find_candidates(
    plain: Ledger,
    model: nn.Module,
    record: ForwardRecord | None,
    *,
    min_share: float = 0.05,
) -> Candidates:
    """Candidate regions of ``model`` on its plain traced ``plain`` ledger.

    Arguments:
        plain: the traced plain step (with its module calls).
        model: the model (for the classes of its modules).
        record: :func:`record_forward` of the same step (forward frees, savers, FLOPs and times); when
            it does not line up with the trace, saved tensors are assumed freed at the end of their
            region's forward and the note says so.
        min_share: a sub-call of a position is a candidate when it saves at least this share of the
            position's activations.
    """
    if not plain.calls:
        raise ValueError("the ledger has no module calls; plan from a fresh trace")
    notes: list[str] = []
    tree = CallTree.of(plain.calls)
    num_fwd = sum(1 for e in plain.events if e.phase == "forward")
    if record is not None and (
        tuple(e.op for e in plain.events[:num_fwd]) != record.ops
        or tuple((c.path, c.index) for c in plain.calls) != record.calls
    ):
        notes.append(
            "the recorded forward did not line up with the trace op for op; saved tensors of recomputed "
            "regions are assumed freed at the end of the region's forward (an overestimate)"
        )
        record = None
    info = _entry_info(plain, record, num_fwd)
    positions, block_calls = _positions(tree, model)
    unsafe = _unsafe_writes(plain, tree)
    skipped = sorted({tree.calls[i].path for i in unsafe if i in positions})
    if skipped:
        notes.append(
            "not recomputed, because their forward writes in place to a tensor older than the call (an input, "
            "a parameter) that recomputation would write again: " + ", ".join(skipped)
        )
    overwritten = _arguments_overwritten(tree, record)
    skipped = sorted({tree.calls[i].path for i in overwritten - unsafe if i in positions})
    if skipped:
        notes.append(
            "not recomputed, because a later op writes in place to a tensor the call was given (h += block(h)), "
            "which the checkpoint keeps for the recomputation as it was (PyTorch would fail in backward): "
            + ", ".join(skipped)
        )
    unsafe |= overwritten
    drawing = _drawing_privately(tree, record)
    skipped = sorted({tree.calls[i].path for i in drawing - unsafe if i in positions})
    if skipped:
        notes.append(
            "not recomputed, because they draw random numbers from a torch.Generator of their own, whose state "
            "checkpointing does not keep (the recomputation would draw others): " + ", ".join(skipped)
        )
    unsafe |= drawing
    cands: list[Candidate] = []
    labels: list[str] = []
    blocks: list[int] = []
    for i in positions:
        if i in unsafe:
            continue
        whole = _candidate(plain, tree, record, info, i, "full", len(labels))
        if whole is None or whole.saved_bytes == 0:
            continue
        labels.append(whole.region.label)
        if i in block_calls:
            blocks.append(len(cands))
        cands.append(whole)
        cands.extend(_op_level(plain, tree, record, info, i, whole))
        for k in tree.children[i]:
            if k in unsafe or not tree.runs_backward(k):
                continue
            c = _candidate(plain, tree, record, info, k, "full", whole.position)
            if c is not None and c.saved_bytes >= min_share * whole.saved_bytes:
                cands.append(c)
    inputs = {c.call: _inputs_of(plain, record, c) for c in cands}
    return Candidates(plain, record, tuple(cands), tuple(labels), tree, info, inputs, tuple(blocks), tuple(notes))


def _op_level(
    plain: Ledger,
    tree: CallTree,
    record: ForwardRecord | None,
    info: dict[int, _EntryInfo],
    call: int,
    whole: Candidate,
) -> list[Candidate]:
    """The op-level candidates of one call: one per policy of :data:`OP_POLICIES` that keeps something,
    saves bytes and costs less than recomputing the call whole, and none of whose kept outputs a later op writes
    in place; a policy that keeps the same outputs as an earlier one here (no attention op, say) is the same plan
    and is left out."""
    out: list[Candidate] = []
    seen: set[frozenset[int]] = set()
    # an output a policy keeps must not be written in place later (Funnel's ``positional_attn *= cls_mask`` on a
    # bmm's output): PyTorch refuses the mutated cache in backward
    written = {a for storages in record.writes for a in storages} if record is not None else set()
    for name in OP_POLICIES:
        c = _candidate(plain, tree, record, info, call, name, whole.position)
        if c is None or not c.cached or c.cached in seen or c.saved_bytes <= 0 or not written.isdisjoint(c.cached):
            continue
        seen.add(c.cached)
        if c.seconds < whole.seconds or c.flops + c.other_flops < whole.flops + whole.other_flops:
            out.append(c)
    return out


def _entry_info(plain: Ledger, record: ForwardRecord | None, num_fwd: int) -> dict[int, _EntryInfo]:
    """Entries allocated in forward, matched to the recorded storages by (alloc event, bytes)."""
    info: dict[int, _EntryInfo] = {}
    if record is None:
        return info
    pool: dict[tuple[int, int], list[StorageRecord]] = {}
    for s in record.storages:
        pool.setdefault((s.alloc_event, s.nbytes), []).append(s)
    for i, e in enumerate(plain.entries):
        if e.alloc_event is None or e.alloc_event >= num_fwd or e.role == KERNEL_INTERNAL:
            continue  # (a kernel's own buffer is no storage the recorded forward saw)
        recs = pool.get((e.alloc_event, e.nbytes))
        if recs:
            s = recs.pop(0)
            info[i] = _EntryInfo(s.savers, s.unsaved_free_event)
    return info


def _arguments_overwritten(tree: CallTree, record: ForwardRecord | None) -> set[int]:
    """Calls given a tensor that an op after the call writes in place, before backward: a checkpoint keeps its
    arguments and checks at the recomputation that none was changed since."""
    if record is None or not record.writes:
        return set()
    written_at: dict[int, int] = {}  # alloc event of a storage -> the last forward event writing it in place
    for f, storages in enumerate(record.writes):
        for a in storages:
            written_at[a] = f
    return {
        i
        for i, c in enumerate(tree.calls)
        if i < len(record.call_args) and any(written_at.get(a, -1) >= c.stop for a in record.call_args[i])
    }


def _drawing_privately(tree: CallTree, record: ForwardRecord | None) -> set[int]:
    """Calls inside which an op draws from a generator of the model's own (see ``ForwardRecord.private_rng``)."""
    if record is None or not record.private_rng:
        return set()
    return {i for i, c in enumerate(tree.calls) if any(c.start <= f < c.stop for f in record.private_rng)}


def _unsafe_writes(plain: Ledger, tree: CallTree) -> set[int]:
    """Calls that write in place to something older than themselves other than a module buffer."""
    buffers = {e.name for e in plain.entries if e.role == "buffer"}
    return {i for i, c in enumerate(tree.calls) if any(w not in buffers for w in c.writes)}


def _candidate(
    plain: Ledger,
    tree: CallTree,
    record: ForwardRecord | None,
    info: dict[int, _EntryInfo],
    call: int,
    policy: Policy,
    position: int,
) -> Candidate | None:
    c = tree.calls[call]
    if not tree.runs_backward(call):
        return None
    f0, f1 = c.start, c.stop - 1
    t0, t1 = c.backward_start, c.backward_stop - 1  # type: ignore[operator]
    inside = tree.subtree[call]
    saved_in = _saved_inside(plain, info, inside, f0, f1, t0)  # type: ignore[arg-type]
    if not saved_in:
        return None
    # Early stop: the recomputation ends inside the save of the last tensor the region saved (its own
    # outputs, its inputs or its weights): the op dispatched just before that save is the last that runs.
    stop = max(plain.entries[i].alloc_event for i in saved_in)  # type: ignore[type-var]
    if record is not None and record.packs:
        stop = max([stop, *(f for f, k in record.packs if f0 <= f <= f1 and k in inside)])
    cached = cached_events(plain, f0, f1, policy)
    early = [i for i in saved_in if not _cached(plain, i, cached)]
    saved_bytes = sum(plain.entries[i].nbytes for i in early if not _mixed(info, i, inside))
    # outputs the policy keeps that autograd would not have saved are held by the cache until recomputation
    saved_bytes -= sum(
        e.nbytes
        for i, e in enumerate(plain.entries)
        if e.alloc_event is not None
        and f0 <= e.alloc_event <= f1
        and _cached(plain, i, cached)
        and i not in saved_in
        and (e.free_event is not None and e.free_event < t0)  # type: ignore[operator]
    )
    recomputed = [f for f in range(f0, stop + 1) if f not in cached]
    flops = sum(record.flops[f] for f in recomputed) if record is not None else 0
    seconds = sum(record.seconds[f] for f in recomputed) if record is not None else float(len(recomputed))
    other = _other_flops(plain, record, recomputed)
    restore = tuple(sorted(c.writes))
    return Candidate(
        tree.region(call, policy, restore),
        call,
        position,
        (f0, f1),
        (t0, t1),  # type: ignore[arg-type]
        stop,
        saved_bytes,
        flops,
        seconds,
        frozenset(str(k) for k in inside),
        other,
        cached,
    )


def cached_events(plain: Ledger, f0: int, f1: int, policy: Policy) -> frozenset[int]:
    """Forward events ``f0..f1`` (one call of a region) whose outputs ``policy`` keeps."""
    if policy == "full":
        return frozenset()
    keep = OP_POLICIES[policy].saved_positions([plain.events[f].op for f in range(f0, f1 + 1)])
    return frozenset(f0 + k for k, kept in enumerate(keep) if kept)


def _other_flops(plain: Ledger, record: ForwardRecord | None, events: Sequence[int]) -> int:
    """The cost of the ``events`` FlopCounterMode counts 0 for: elements of the outputs they allocate."""
    if record is None:
        return 0
    wanted = {f for f in events if record.flops[f] == 0}
    return OTHER_OP_FLOPS_PER_ELEMENT * sum(
        e.numel for e in plain.entries if e.alloc_event in wanted and e.role != KERNEL_INTERNAL
    )


def _saved_inside(
    plain: Ledger, info: dict[int, _EntryInfo], inside: frozenset[int], f0: int, f1: int, t0: int
) -> list[int]:
    """Entries allocated in the region's forward that the region's own ops save for its backward."""
    out = []
    for i, e in enumerate(plain.entries):
        if e.alloc_event is None or not f0 <= e.alloc_event <= f1 or e.category != Category.ACTIVATIONS:
            continue
        if e.free_event is None or e.free_event <= t0:
            continue
        inf = info.get(i)
        if inf is not None and not inf.savers & inside:
            continue
        out.append(i)
    return out


def _mixed(info: dict[int, _EntryInfo], i: int, inside: frozenset[int]) -> bool:
    inf = info.get(i)
    return inf is not None and not inf.savers <= inside


def _cached(plain: Ledger, i: int, cached: frozenset[int]) -> bool:
    """The region's op-level policy keeps this output (not a kernel's own buffer)."""
    e = plain.entries[i]
    return e.alloc_event in cached and e.role != KERNEL_INTERNAL


def _inputs_of(plain: Ledger, record: ForwardRecord | None, c: Candidate) -> tuple[int, ...]:
    if record is None:
        return ()
    f0, f1 = c.fwd
    reads = {a for f in range(f0, f1 + 1) for a in record.inputs[f] if a < f0}
    # the checkpoint keeps every tensor argument of the call, whether its ops read it or not
    reads |= set(record.call_args[c.call]) if c.call < len(record.call_args) else set()
    return tuple(
        i
        for i, e in enumerate(plain.entries)
        if e.alloc_event is not None and e.alloc_event in reads and e.role != KERNEL_INTERNAL
    )


# --- replaying a plan on the trace ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    new: np.ndarray
    """old event index (0..N) -> new index."""
    start: dict[int, int]
    """candidate index -> new index of its first recomputation event."""
    events: tuple[Event, ...]


def _layout(cs: Candidates, phantoms: Sequence[int]) -> _Layout:
    plain = cs.plain
    n = plain.num_events
    order = sorted(phantoms, key=lambda j: (cs.candidates[j].bwd[0], j))
    shift = np.zeros(n + 1, dtype=np.int64)
    for j in order:
        c = cs.candidates[j]
        shift[c.bwd[0] :] += c.stop - c.fwd[0] + 1
    new = np.arange(n + 1, dtype=np.int64) + shift
    start: dict[int, int] = {}
    events: list[Event] = []
    k = 0
    for old in range(n):
        while k < len(order) and cs.candidates[order[k]].bwd[0] == old:
            j = order[k]
            c = cs.candidates[j]
            start[j] = len(events)
            for f in range(c.fwd[0], c.stop + 1):
                ev = plain.events[f]
                events.append(Event(len(events), "backward", f"recompute:{ev.op}", ev.module))
            k += 1
        ev = plain.events[old]
        events.append(Event(len(events), ev.phase, ev.op, ev.module))
    assert len(events) == int(new[n]), (len(events), new[n])
    return _Layout(new, start, tuple(events))


def replay(cs: Candidates, chosen: Sequence[int], *, phantoms: Sequence[int] | None = None) -> Ledger:
    """The plain step's ledger as it is predicted to be when the ``chosen`` candidates are recomputed.

    Arguments:
        chosen: candidate indices (compatible: no two covering the same call).
        phantoms: candidates whose recomputation points are laid out on the clock (default: ``chosen``);
            laying out every candidate's gives every plan the same points (the linear model's).
    """
    plain = cs.plain
    lay = _layout(cs, chosen if phantoms is None else phantoms)
    touched: dict[int, Entry] = {}
    extra: list[Entry] = []
    for j in chosen:
        _replay_one(cs, j, cs.candidates[j], lay, touched, extra)
    out = [touched[i] if i in touched else _moved(e, lay) for i, e in enumerate(plain.entries)]
    out.extend(extra)
    return Ledger(
        tuple(out),
        lay.events,
        evidence=plain.evidence,
        device=plain.device,
        notes=(*plain.notes, *cs.notes),
        meta={**plain.meta, "recomputed": [cs.candidates[j].name for j in chosen]},
        calls=tuple(_moved_call(c, lay) for c in plain.calls),
    )


def _new(lay: _Layout, event: int | None) -> int | None:
    """Where event ``event`` of the plain step is on the new clock."""
    return None if event is None else int(lay.new[event])


def _end(lay: _Layout, event: int | None) -> int | None:
    """Where an end (a free, a stop: "not live from ``event`` on") of the plain step is on the new clock.

    Live through ``event - 1``, so freed before any recomputation inserted ahead of ``event``: a gradient
    the engine frees just before the node that triggers a recomputation is not live during it.
    """
    return None if event is None else (int(lay.new[event - 1]) + 1 if event else 0)


def _moved(e: Entry, lay: _Layout, alloc: int | None = -1, free: int | None = -1, **changes: Any) -> Entry:
    """``e`` on the new clock; ``alloc``/``free`` given (not ``-1``) are already new event indices."""
    return replace(
        e,
        alloc_event=_new(lay, e.alloc_event) if alloc == -1 else alloc,
        free_event=_end(lay, e.free_event) if free == -1 else free,
        last_use_event=_new(lay, e.last_use_event),
        **changes,
    )


def _moved_call(c: ModuleCall, lay: _Layout) -> ModuleCall:
    return replace(
        c,
        start=int(lay.new[c.start]),
        stop=int(_end(lay, c.stop)),  # type: ignore[arg-type]
        backward_start=_new(lay, c.backward_start),
        backward_stop=_end(lay, c.backward_stop),
    )


@dataclass(frozen=True)
class _Recompute:
    """Where one recomputed candidate sits on the new clock: what each step of its replay needs."""

    c: Candidate
    start: int
    """New index of the recomputation's first event (the region's forward event ``c.fwd[0]`` again)."""
    rec_end: int
    """New index at which the recomputation is over (its early stop): its temporaries are gone."""
    keep_until: int
    """New index at which the region's backward is over: what the checkpoint keeps is freed there."""

    def ph(self, f: int) -> int:
        """New index of the recomputation of forward event ``f``."""
        return self.start + (f - self.c.fwd[0])


def _replay_one(cs: Candidates, j: int, c: Candidate, lay: _Layout, touched: dict[int, Entry], extra: list) -> None:
    """Move the plain step's entries of candidate ``j`` (into ``touched``) and add its recomputation (``extra``)."""
    start = lay.start[j]
    rc = _Recompute(c, start, start + (c.stop - c.fwd[0]) + 1, int(lay.new[c.bwd[1]]) + 1)
    saved_in = set(_saved_inside(cs.plain, cs.info, cs.tree.subtree[c.call], c.fwd[0], c.fwd[1], c.bwd[0]))
    for i, e in enumerate(cs.plain.entries):
        a = e.alloc_event
        if a is None or not c.fwd[0] <= a <= c.fwd[1]:
            continue
        if _cached(cs.plain, i, c.cached):  # op-level policy: kept by the cache, not recomputed
            if i not in saved_in:  # (a saved one is held from forward to its last use, as in the plain step)
                touched[i] = _replay_cached(cs, rc, lay, i, e)
        elif i in saved_in:
            touched[i], extra_entry = _replay_saved(cs, rc, lay, i, e)
            extra.append(extra_entry)
        elif a <= c.stop:  # recomputed but not saved: a temporary of the recomputation
            extra.append(_replay_temporary(cs, rc, lay, i, e))
    _keep_inputs(cs, rc, lay, touched)
    extra.extend(_state_copies(cs, rc, lay))
    extra.extend(_rng_state(cs, rc, lay))


@functools.cache
def cpu_rng_state_bytes() -> int:
    """Bytes of the CPU generator's state, which each checkpointed call copies (``preserve_rng_state``)."""
    import torch

    return torch.get_rng_state().nbytes


def _rng_state(cs: Candidates, rc: _Recompute, lay: _Layout) -> list[Entry]:
    """The CPU RNG state the checkpoint copies when the call starts and keeps until its backward is over,
    and the one its recomputation forks (``torch.random.fork_rng``: the state to go back to), held while it
    runs. Both are ``torch.get_rng_state()`` copies, made outside the dispatcher; the trace of the step with
    the plan applied sees them as the tracer sees every such copy. On a CUDA step they are host memory, and
    not counted on the device."""
    if not cs.plain.device.startswith("cpu"):
        return []
    label = rc.c.region.label
    return [
        _rng_entry(f"rng_state@{label}", rc.c.region, int(lay.new[rc.c.fwd[0]]), rc.keep_until),
        _rng_entry(f"rng_state@{label}.recompute", rc.c.region, rc.start, rc.rec_end),
    ]


def _rng_entry(name: str, region: Region, alloc: int, free: int | None) -> Entry:
    nbytes = cpu_rng_state_bytes()
    return Entry(
        name,
        Category.OTHER,
        RNG_STATE_ROLE,
        "uint8",
        nbytes,
        nbytes,
        owner=region.path,
        alloc_event=alloc,
        free_event=free,
        evidence=Evidence.DECLARED,
    )


def _unsaved_free(cs: Candidates, rc: _Recompute, i: int) -> int:
    """Forward event at which entry ``i`` would be freed if autograd saved nothing."""
    inf = cs.info.get(i)
    return inf.unsaved_free if inf is not None else rc.c.fwd[1] + 1


def _replay_cached(cs: Candidates, rc: _Recompute, lay: _Layout, i: int, e: Entry) -> Entry:
    """An output the selective policy caches (not saved by autograd): held until the recomputation uses it."""
    a, uf = e.alloc_event, _unsaved_free(cs, rc, i)
    assert a is not None
    if a <= rc.c.stop:
        end = rc.ph(uf) if uf <= rc.c.stop else rc.rec_end
    else:  # never consumed by the recomputation: held until the region's backward is over
        end = rc.keep_until
    free_old = _end(lay, e.free_event)
    return _moved(e, lay, free=end if free_old is None else max(end, free_old))


def _replay_saved(cs: Candidates, rc: _Recompute, lay: _Layout, i: int, e: Entry) -> tuple[Entry, Entry]:
    """A saved activation of the region: a forward temporary now, and saved again by the recomputation."""
    a = e.alloc_event
    assert a is not None
    if _mixed(cs.info, i, cs.tree.subtree[rc.c.call]):  # also saved outside: held until the recomputation
        fwd_free = rc.start  # (an upper bound)
    else:
        # freed when Python drops it, as the forward recorded with saving off shows: at the region's end, or later
        # where something else holds it (autocast's cache keeps a weight's low-precision copy until autocast exits)
        fwd_free = _end(lay, max(a + 1, _unsaved_free(cs, rc, i)))
    forward = _moved(e, lay, free=fwd_free, category=Category.WORKSPACE, role="forward_temporary")
    again = _moved(
        e,
        lay,
        rc.ph(a),
        _end(lay, e.free_event),
        name=f"{e.name}@recompute",
        role="recomputed",
        category=Category.ACTIVATIONS,
    )
    return forward, again


def _replay_temporary(cs: Candidates, rc: _Recompute, lay: _Layout, i: int, e: Entry) -> Entry:
    """An unsaved output the recomputation makes again: live in the recomputation as in the forward."""
    a, uf = e.alloc_event, _unsaved_free(cs, rc, i)
    assert a is not None
    end = rc.ph(uf) if uf <= rc.c.stop else rc.rec_end
    if e.free_event == a + 1:  # lived one op (a kernel's own buffer, a dropped output): again so
        end = rc.ph(a) + 1
    return _moved(
        e,
        lay,
        rc.ph(a),
        max(end, rc.ph(a) + 1),
        name=f"{e.name}@recompute",
        role="recompute_temporary",
        category=Category.WORKSPACE,
    )


def _keep_inputs(cs: Candidates, rc: _Recompute, lay: _Layout, touched: dict[int, Entry]) -> None:
    """The region's inputs are kept by the checkpoint until its backward ends."""
    for i in cs.inputs.get(rc.c.call, ()):
        if i in touched:
            continue
        e = cs.plain.entries[i]
        free_old = _end(lay, e.free_event)
        if free_old is not None and free_old < rc.keep_until:
            touched[i] = _moved(e, lay, free=rc.keep_until)


def _state_copies(cs: Candidates, rc: _Recompute, lay: _Layout) -> list[Entry]:
    """State the call writes in place: copied before the call, the copy recomputed on, dropped with the backward."""
    by_name = {e.name: e for e in cs.plain.entries}
    return [
        replace(
            by_name[name],
            name=f"{name}@before:{rc.c.name}",
            category=Category.WORKSPACE,
            role="state_copy",
            alloc_event=int(lay.new[rc.c.fwd[0]]),
            free_event=rc.keep_until,
            last_use_event=None,
        )
        for name in rc.c.region.restore
    ]


# --- the linear model ------------------------------------------------------------------------------------


def linear_model(cs: Candidates, *, cost: CostKind = "seconds") -> LinearModel:
    """Live bytes at every point as ``base + Σ c_j delta_j``, every candidate's recomputation laid out.

    Exact for disjoint candidates (each replays only its own entries), which the tests check against
    :func:`replay` of whole plans.
    """
    every = list(range(len(cs.candidates)))
    base = np.asarray(replay(cs, [], phantoms=every).totals(), dtype=np.int64)
    lay = _layout(cs, every)
    num_points = len(base)
    delta = np.zeros((len(every), num_points), dtype=np.int64)

    def interval(e: Entry) -> tuple[int, int]:
        return (0 if e.alloc_event is None else e.alloc_event), (num_points if e.free_event is None else e.free_event)

    for j in every:  # only the entries candidate j moves or adds: a difference array over the points
        touched: dict[int, Entry] = {}
        extra: list[Entry] = []
        _replay_one(cs, j, cs.candidates[j], lay, touched, extra)
        diff = np.zeros(num_points + 1, dtype=np.int64)
        for i, moved in touched.items():
            old = cs.plain.entries[i]
            a = 0 if old.alloc_event is None else int(lay.new[old.alloc_event])
            b = num_points if old.free_event is None else _end(lay, old.free_event)
            diff[a] -= old.nbytes
            diff[b] += old.nbytes
            a, b = interval(moved)
            diff[a] += moved.nbytes
            diff[b] -= moved.nbytes
        for e in extra:
            a, b = interval(e)
            diff[a] += e.nbytes
            diff[b] -= e.nbytes
        delta[j] = np.cumsum(diff[:-1])
    costs = np.array([float(c.seconds if cost == "seconds" else c.flops + c.other_flops) for c in cs.candidates])
    chain = _chain(cs, every, len(base))
    return LinearModel(
        base,
        delta,
        costs,
        tuple(c.covers for c in cs.candidates),
        tuple(c.name for c in cs.candidates),
        chain=chain,
    )


def _chain(cs: Candidates, every: list[int], num_points: int) -> Chain | None:
    lay = _layout(cs, every)
    new = lay.new
    npos = len(cs.positions)
    span = np.zeros((npos, num_points), dtype=bool)
    prefix = np.zeros(num_points, dtype=np.int64)
    ranges = []
    for k in range(npos):
        members = [j for j in every if cs.candidates[j].position == k]
        top = cs.candidates[members[0]]
        f0, f1 = int(new[top.fwd[0]]), int(new[top.fwd[1]])
        b0 = min(lay.start[j] for j in members)
        b1 = int(new[top.bwd[1]])
        ranges.append((f0, f1, b0, b1))
        span[k, f0 : f1 + 1] = True
        span[k, b0 : b1 + 1] = True
    for k in range(1, npos):  # nested: forwards in order, backwards in reverse order
        if not (ranges[k - 1][1] < ranges[k][0] and ranges[k][3] < ranges[k - 1][2]):
            return None
    if span.sum(axis=0).max(initial=0) > 1:
        return None
    idx = np.arange(num_points)
    for _f0, f1, b0, _b1 in ranges:
        prefix += (idx > f1) & (idx < b0)
    for k in range(npos):
        prefix[span[k]] = k
    options = []
    for k in range(npos):
        members = [j for j in every if cs.candidates[j].position == k]
        opts: list[tuple[int, ...]] = [()]
        for size in (1, 2, 3):
            for combo in combinations(members, size):
                covers = [cs.candidates[j].covers for j in combo]
                if all(not (a & b) for a, b in combinations(covers, 2)):
                    opts.append(combo)
        options.append(tuple(opts))
    return Chain(tuple(options), span, prefix)


def regions_of(cs: Candidates, choice: Sequence[int]) -> tuple[Region, ...]:
    return tuple(cs.candidates[j].region for j in sorted(choice, key=lambda j: cs.candidates[j].fwd[0]))


@dataclass(frozen=True)
class CandidateCost:
    """One candidate region as ``trainledger plan`` reports it: what recomputing it saves and costs."""

    path: str
    policy: Policy
    call: int | None
    label: str
    saved_bytes: int
    """Activations the region no longer holds from its forward to its backward."""
    recompute_flops: int
    recompute_seconds: float
    """Measured: medians of repeated single-thread runs of its ops, up to the early stop."""
    forward_events: tuple[int, int]
    """First and last forward event of the region's call in the plain step."""
    early_stop_event: int
    """Last forward event the recomputation runs."""
    recompute_transient_bytes: int | None = None
    """The most the recomputation adds above the plain step at any instant (``None``: not computed)."""

    @property
    def key(self) -> tuple[str, str, int | None]:
        """What identifies the region in a plan: path, policy, call."""
        return (self.path, self.policy, self.call)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "path": self.path,
            "policy": self.policy,
            "call": self.call,
            "label": self.label,
            "saved_bytes": self.saved_bytes,
            "recompute_flops": self.recompute_flops,
            "recompute_seconds": self.recompute_seconds,
            "forward_events": list(self.forward_events),
            "early_stop_event": self.early_stop_event,
        }
        if self.recompute_transient_bytes is not None:
            out["recompute_transient_bytes"] = self.recompute_transient_bytes
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CandidateCost:
        f0, f1 = d["forward_events"]
        return cls(
            path=str(d["path"]),
            policy=d["policy"],
            call=None if d.get("call") is None else int(d["call"]),
            label=str(d["label"]),
            saved_bytes=int(d["saved_bytes"]),
            recompute_flops=int(d["recompute_flops"]),
            recompute_seconds=float(d["recompute_seconds"]),
            forward_events=(int(f0), int(f1)),
            early_stop_event=int(d["early_stop_event"]),
            recompute_transient_bytes=d.get("recompute_transient_bytes"),
        )


def candidate_costs(cs: Candidates, model: LinearModel | None = None) -> tuple[CandidateCost, ...]:
    """One record per candidate; with the linear ``model``, also its recomputation's transient: the most it
    adds above the plain step at any instant (while its forward runs again)."""
    return tuple(
        CandidateCost(
            path=c.region.path,
            policy=c.region.policy,
            call=c.region.call,
            label=c.region.label,
            saved_bytes=c.saved_bytes,
            recompute_flops=c.flops,
            recompute_seconds=c.seconds,
            forward_events=(c.fwd[0], c.fwd[1]),
            early_stop_event=c.stop,
            recompute_transient_bytes=None if model is None else int(max(0, model.delta[j].max(initial=0))),
        )
        for j, c in enumerate(cs.candidates)
    )
