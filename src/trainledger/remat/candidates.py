"""Candidate regions and their costs, from a traced step, and the memory of any plan on that trace.

A candidate is a module whose forward can be wrapped in non-reentrant ``torch.utils.checkpoint``: the
blocks of the model's repeated containers (a ``ModuleList`` or ``Sequential``) and its other top-level
modules form the chain; inside a block, its large submodules (attention, MLP) and a selective policy
(keep matmul outputs) are finer candidates.

What non-reentrant checkpointing does, and what :func:`replay` therefore does to the plain step's ledger:

- forward: the region's ops run as usual but autograd keeps none of the tensors they save; each is
  freed when Python drops it (observed by :func:`~trainledger.remat._record.record_forward`, which runs
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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Literal

import numpy as np
from torch import nn

from trainledger.ledger import Category, Entry, Event, Ledger
from trainledger.remat._plan import SAVED_OP_NAMES, Policy, Region
from trainledger.remat._record import ForwardRecord, StorageRecord
from trainledger.remat.solvers import Chain, LinearModel

CostKind = Literal["seconds", "flops"]


# --- candidates -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One region that can be recomputed, located on the plain step's event clock."""

    region: Region
    position: int
    """Index of the top-level region (chain position) it belongs to."""
    fwd: tuple[int, int]
    """First and last forward event of the module (inclusive)."""
    bwd: tuple[int, int]
    """First and last backward event of the module (inclusive)."""
    stop: int
    """Last forward event the recomputation runs (early stop: the last op whose output backward needs)."""
    saved_bytes: int
    """Bytes of saved activations no longer held between the region's forward and its backward."""
    flops: int
    seconds: float
    covers: frozenset[str]
    """Module paths with forward ops inside the region; overlapping candidates conflict."""

    @property
    def name(self) -> str:
        return self.region.path + (" (selective)" if self.region.policy == "selective" else "")


@dataclass(frozen=True)
class _EntryInfo:
    savers: frozenset[str]
    unsaved_free: int


@dataclass
class Candidates:
    """Candidates of one traced step, with what :func:`replay` needs to rebuild the step under any plan."""

    plain: Ledger
    record: ForwardRecord | None
    candidates: tuple[Candidate, ...]
    positions: tuple[str, ...]
    info: dict[int, _EntryInfo] = field(repr=False)
    """Per entry index of ``plain`` (forward-allocated entries only)."""
    inputs: dict[str, tuple[int, ...]] = field(repr=False)
    """Per candidate path, plain entry indices of its inputs (allocated in forward before it)."""
    notes: tuple[str, ...] = ()

    def index(self, region: Region) -> int:
        for i, c in enumerate(self.candidates):
            if c.region == region:
                return i
        raise KeyError(region)


def _subtree(path: str, module: str) -> bool:
    return module == path or module.startswith(path + ".")


def find_candidates(
    plain: Ledger,
    model: nn.Module,
    record: ForwardRecord | None,
    *,
    min_share: float = 0.05,
) -> Candidates:
    """Candidate regions of ``model`` on its plain traced ``plain`` ledger.

    Arguments:
        plain: the traced plain step.
        model: the model (for its module tree).
        record: :func:`record_forward` of the same step (forward frees, savers, FLOPs and times); when
            it does not line up with the trace, saved tensors are assumed freed at the end of their
            region's forward and the note says so.
        min_share: a submodule of a block is a candidate when it saves at least this share of the
            block's activations.
    """
    notes: list[str] = []
    events = plain.events
    fwd_events = [e for e in events if e.phase == "forward"]
    if record is not None and tuple(e.op for e in fwd_events) != record.ops:
        notes.append(
            "the recorded forward did not line up with the trace op for op; saved tensors of recomputed "
            "regions are assumed freed at the end of the region's forward (an overestimate)"
        )
        record = None
    num_fwd = len(fwd_events)
    # entries allocated in forward: match to recorded storages by (alloc event, bytes)
    info: dict[int, _EntryInfo] = {}
    pool: dict[tuple[int, int], list[StorageRecord]] = {}
    if record is not None:
        for s in record.storages:
            pool.setdefault((s.alloc_event, s.nbytes), []).append(s)
    for i, e in enumerate(plain.entries):
        if e.alloc_event is None or e.alloc_event >= num_fwd:
            continue
        recs = pool.get((e.alloc_event, e.nbytes))
        if recs:
            s = recs.pop(0)
            info[i] = _EntryInfo(s.savers, s.unsaved_free_event)
    paths = _module_ranges(events)
    tops = _top_level(model, paths)
    cands: list[Candidate] = []
    inputs: dict[str, tuple[int, ...]] = {}
    positions: list[str] = []
    for top in tops:
        whole = _candidate(plain, record, info, top, "full", len(positions), paths)
        if whole is None or whole.saved_bytes == 0:
            continue
        pos = len(positions)
        positions.append(top)
        cands.append(whole)
        selective = _candidate(plain, record, info, top, "selective", pos, paths)
        if selective is not None and selective.saved_bytes and selective.seconds < whole.seconds:
            cands.append(selective)
        for child_name, _child in model.get_submodule(top).named_children():
            path = f"{top}.{child_name}"
            c = _candidate(plain, record, info, path, "full", pos, paths)
            if c is not None and c.saved_bytes >= min_share * whole.saved_bytes:
                cands.append(c)
    for c in cands:
        inputs[c.region.path] = _inputs_of(plain, record, c)
    return Candidates(plain, record, tuple(cands), tuple(positions), info, inputs, tuple(notes))


def _module_ranges(events: Sequence[Event]) -> dict[str, dict[str, list[int]]]:
    """Per module path (and every ancestor), its forward and backward event indices."""
    out: dict[str, dict[str, list[int]]] = {}
    for ev in events:
        if ev.phase not in ("forward", "backward") or not ev.module or ev.module.startswith("("):
            continue
        parts = ev.module.split(".")
        for k in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:k]), {"forward": [], "backward": []})[ev.phase].append(ev.index)
    return out


def _top_level(model: nn.Module, paths: dict[str, dict[str, list[int]]]) -> list[str]:
    """Children of repeated containers (ModuleList, a Sequential of blocks) and other direct children, in
    forward order."""
    tops: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) >= 2:
                visit(path, child)
            elif isinstance(child, nn.Sequential) and any(next(c.children(), None) is not None for c in child):
                visit(path, child)  # a Sequential of blocks; a Sequential of single layers is one block
            elif path in paths and paths[path]["forward"]:
                tops.append(path)

    root = model
    while len(list(root.children())) == 1 and not isinstance(root, (nn.ModuleList, nn.Sequential)):
        root = next(root.children())  # a wrapper around the real model
    prefix = next((n for n, m in model.named_modules() if m is root), "")
    visit(prefix, root)
    return sorted(tops, key=lambda p: paths[p]["forward"][0])


def _candidate(
    plain: Ledger,
    record: ForwardRecord | None,
    info: dict[int, _EntryInfo],
    path: str,
    policy: Policy,
    position: int,
    paths: dict[str, dict[str, list[int]]],
) -> Candidate | None:
    r = paths.get(path)
    if r is None or not r["forward"] or not r["backward"]:
        return None
    f0, f1 = r["forward"][0], r["forward"][-1]
    if len(r["forward"]) != f1 - f0 + 1:  # called more than once, or interleaved with other modules
        return None
    t0, t1 = r["backward"][0], r["backward"][-1]
    saved_in = _saved_inside(plain, info, path, f0, f1, t0)
    if not saved_in:
        return None
    # Early stop: the recomputation ends inside the save of the last tensor the region saved (its own
    # outputs, its inputs or its weights): the op dispatched just before that save is the last that runs.
    stop = max(plain.entries[i].alloc_event for i in saved_in)  # type: ignore[type-var]
    if record is not None and record.packs:
        stop = max([stop, *(f for f, m in record.packs if f0 <= f <= f1 and _subtree(path, m))])
    early = [i for i in saved_in if not _cached(plain, i, policy)]
    saved_bytes = sum(plain.entries[i].nbytes for i in early if not _mixed(info, i, path))
    if policy == "selective":  # non-saved matmul outputs are held by the cache until recomputation
        saved_bytes -= sum(
            e.nbytes
            for i, e in enumerate(plain.entries)
            if e.alloc_event is not None
            and f0 <= e.alloc_event <= f1
            and _cached(plain, i, policy)
            and i not in saved_in
            and (e.free_event is not None and e.free_event < t0)
        )
    recomputed = [
        f for f in range(f0, stop + 1) if not (policy == "selective" and plain.events[f].op in SAVED_OP_NAMES)
    ]
    flops = sum(record.flops[f] for f in recomputed) if record is not None else 0
    seconds = sum(record.seconds[f] for f in recomputed) if record is not None else float(len(recomputed))
    covers = frozenset(m for m in paths if _subtree(path, m) and paths[m]["forward"])
    return Candidate(Region(path, policy), position, (f0, f1), (t0, t1), stop, saved_bytes, flops, seconds, covers)


def _saved_inside(plain: Ledger, info: dict[int, _EntryInfo], path: str, f0: int, f1: int, t0: int) -> list[int]:
    """Entries allocated in the region's forward that the region's own ops save for its backward."""
    out = []
    for i, e in enumerate(plain.entries):
        if e.alloc_event is None or not f0 <= e.alloc_event <= f1 or e.category != Category.ACTIVATIONS:
            continue
        if e.free_event is None or e.free_event <= t0:
            continue
        inf = info.get(i)
        if inf is not None and not any(_subtree(path, s) for s in inf.savers):
            continue
        out.append(i)
    return out


def _mixed(info: dict[int, _EntryInfo], i: int, path: str) -> bool:
    inf = info.get(i)
    return inf is not None and any(not _subtree(path, s) for s in inf.savers)


def _cached(plain: Ledger, i: int, policy: Policy) -> bool:
    e = plain.entries[i]
    return policy == "selective" and e.alloc_event is not None and plain.events[e.alloc_event].op in SAVED_OP_NAMES


def _inputs_of(plain: Ledger, record: ForwardRecord | None, c: Candidate) -> tuple[int, ...]:
    if record is None:
        return ()
    f0, f1 = c.fwd
    reads = {a for f in range(f0, f1 + 1) for a in record.inputs[f] if a < f0}
    return tuple(i for i, e in enumerate(plain.entries) if e.alloc_event is not None and e.alloc_event in reads)


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
        chosen: candidate indices (compatible: no two covering the same module).
        phantoms: candidates whose recomputation points are laid out on the clock (default: ``chosen``);
            laying out every candidate's gives every plan the same points (the linear model's).
    """
    plain = cs.plain
    lay = _layout(cs, chosen if phantoms is None else phantoms)
    new = lay.new

    def nw(i: int | None) -> int | None:
        return None if i is None else int(new[i])

    touched: dict[int, Entry] = {}
    extra: list[Entry] = []
    for j in chosen:
        c = cs.candidates[j]
        _replay_one(cs, j, c, lay, touched, extra)
    out: list[Entry] = []
    for i, e in enumerate(plain.entries):
        if i in touched:
            out.append(touched[i])
        else:
            out.append(_moved(e, nw(e.alloc_event), nw(e.free_event)))
    out.extend(extra)
    return Ledger(
        tuple(out),
        lay.events,
        evidence=plain.evidence,
        device=plain.device,
        notes=(*plain.notes, *cs.notes),
        meta={**plain.meta, "recomputed": [cs.candidates[j].name for j in chosen]},
    )


def _moved(e: Entry, alloc: int | None, free: int | None, **kw: Any) -> Entry:
    last = e.last_use_event
    return Entry(
        name=kw.get("name", e.name),
        category=kw.get("category", e.category),
        role=kw.get("role", e.role),
        dtype=e.dtype,
        numel=e.numel,
        nbytes=e.nbytes,
        device=e.device,
        owner=e.owner,
        alloc_event=alloc,
        free_event=free,
        evidence=e.evidence,
        shape=e.shape,
        aliases=e.aliases,
        last_use_event=kw.get("last_use_event", last),
    )


def _replay_one(cs: Candidates, j: int, c: Candidate, lay: _Layout, touched: dict[int, Entry], extra: list) -> None:
    plain = cs.plain
    new = lay.new
    f0, f1 = c.fwd
    t0, t1 = c.bwd
    s = c.stop
    start = lay.start[j]

    def ph(f: int) -> int:  # new index of the recomputation of forward event f
        return start + (f - f0)

    rec_end = ph(s) + 1  # the recomputation is over (early stop): its temporaries are gone
    path, policy = c.region.path, c.region.policy
    saved_in = set(_saved_inside(plain, cs.info, path, f0, f1, t0))
    for i, e in enumerate(plain.entries):
        a = e.alloc_event
        if a is None or not f0 <= a <= f1:
            continue
        inf = cs.info.get(i)
        uf = inf.unsaved_free if inf is not None else f1 + 1
        free_old = int(new[e.free_event]) if e.free_event is not None else None
        if _cached(plain, i, policy):  # selective: kept by the cache, not recomputed
            if i in saved_in:
                continue  # held from forward to its last use, as in the plain step
            if a <= s:
                end = ph(uf) if uf <= s else rec_end
            else:  # never consumed by the recomputation: held until the region's backward is over
                end = int(new[t1]) + 1
            free = end if free_old is None else max(end, free_old)
            touched[i] = _moved(e, int(new[a]), free)
            continue
        if i in saved_in:
            if _mixed(cs.info, i, path):  # also saved outside: held until the recomputation (upper bound)
                fwd_free = lay.start[j]
            else:
                fwd_free = int(new[max(a + 1, min(uf, f1 + 1))])
            touched[i] = _moved(e, int(new[a]), fwd_free, category=Category.WORKSPACE, role="forward_temporary")
            extra.append(
                _moved(e, ph(a), free_old, name=f"{e.name}@recompute", role="recomputed", category=Category.ACTIVATIONS)
            )
        elif a <= s:  # recomputed but not saved: a temporary of the recomputation
            end = ph(uf) if uf <= s else rec_end
            extra.append(
                _moved(
                    e,
                    ph(a),
                    max(end, ph(a) + 1),
                    name=f"{e.name}@recompute",
                    role="recompute_temporary",
                    category=Category.WORKSPACE,
                    last_use_event=None,
                )
            )
    keep_until = int(new[t1]) + 1
    for i in cs.inputs.get(path, ()):  # the region's inputs are kept by the checkpoint until its backward ends
        if i in touched:
            continue
        e = plain.entries[i]
        free_old = int(new[e.free_event]) if e.free_event is not None else None
        if free_old is not None and free_old < keep_until:
            touched[i] = _moved(e, int(new[e.alloc_event]) if e.alloc_event is not None else None, keep_until)


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
            b = num_points if old.free_event is None else int(lay.new[old.free_event])
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
    costs = np.array([float(c.seconds if cost == "seconds" else c.flops) for c in cs.candidates])
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


def iter_candidate_rows(cs: Candidates, model: LinearModel | None = None) -> Iterator[dict[str, Any]]:
    """One row per candidate; with the linear ``model``, also its recomputation's transient: the most it
    adds above the plain step at any instant (while its forward runs again)."""
    for j, c in enumerate(cs.candidates):
        row = {
            "path": c.region.path,
            "policy": c.region.policy,
            "saved_bytes": c.saved_bytes,
            "recompute_flops": c.flops,
            "recompute_seconds": c.seconds,
            "forward_events": list(c.fwd),
            "early_stop_event": c.stop,
        }
        if model is not None:
            row["recompute_transient_bytes"] = int(max(0, model.delta[j].max(initial=0)))
        yield row
