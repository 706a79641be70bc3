"""The ledger: one data model for every byte of a training step.

Every stored array is an :class:`Entry` with a category, a role, its real dtype and byte count, an owner,
and a lifetime on the step's event clock. Inventory, tracing, measurement, sharding and the analytic
estimator all produce a :class:`Ledger`; reports, planners and searches consume it.

This module imports no torch and nothing else of ours, so everything that works on ledgers (the sharding
transform, the solvers, the analytic model) is testable in milliseconds.

The event clock
---------------
Events are numbered ``0 .. num_events-1``; in a traced ledger each dispatched op is one event. An entry
is live at event ``e`` when ``alloc_event <= e < free_event``. ``alloc_event=None`` means the array
existed before the step (weights, optimizer state, the batch); ``free_event=None`` means it outlives the
step. A ledger with no trace (declared or inventoried) has a single event, ``state``, at which everything
is live.

Peak is taken at one instant (the seed's rule): ``peak()`` returns the largest live total over events
and the breakdown *at that event*. ``category_maxima()`` and their sum are reported beside it, labelled
as such, because maxima that never coincide overstate the peak when summed.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any

SCHEMA = "trainledger.ledger/1"


class Category(str, enum.Enum):
    """What an array is for. A fixed vocabulary used by every producer and consumer."""

    WEIGHTS = "weights"  # trainable parameters
    FROZEN = "frozen"  # weights that get no gradient: a reference model, a LoRA base
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"  # moments, master copies, step counters (role says which)
    ACTIVATIONS = "activations"  # saved for backward
    WORKSPACE = "workspace"  # temporaries that are not saved for backward
    INPUTS = "inputs"  # the batch
    COMMUNICATION = "communication"  # collective buffers
    OTHER = "other"  # buffers (BatchNorm statistics), anything else

    def __str__(self) -> str:
        return self.value


CATEGORY_ORDER: tuple[Category, ...] = tuple(Category)


class Evidence(str, enum.Enum):
    """How a number was obtained. A *peak* is claimed only from ``traced`` or ``measured``."""

    DECLARED = "declared"  # arithmetic on a stated format
    INVENTORIED = "inventoried"  # bytes of real tensors that exist
    TRACED = "traced"  # a lifetime trace of a real step, on real or fake tensors
    MEASURED = "measured"  # allocator or heap counters from running the step
    ANALYTIC = "analytic"  # a closed-form model
    ESTIMATED = "estimated"  # a measurement scaled from smaller instances of the same thing

    def __str__(self) -> str:
        return self.value


# The weakest evidence wins when entries of several kinds are combined into one figure.
_EVIDENCE_STRENGTH = {
    Evidence.ANALYTIC: 0,
    Evidence.ESTIMATED: 1,
    Evidence.DECLARED: 2,
    Evidence.INVENTORIED: 3,
    Evidence.TRACED: 4,
    Evidence.MEASURED: 5,
}


def weakest_evidence(evidences: Iterable[Evidence | str]) -> Evidence:
    """The weakest of several evidence labels (analytic < estimated < declared < inventoried < traced <
    measured)."""
    kinds = [Evidence(e) for e in evidences]
    if not kinds:
        raise ValueError("no evidence given")
    return min(kinds, key=_EVIDENCE_STRENGTH.__getitem__)


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored array (one storage: views and tied aliases are not separate entries)."""

    name: str
    """A readable, unique-enough name: ``fc1.weight``, ``optimizer.fc1.weight.exp_avg``, ``aten.mm#12``."""
    category: Category
    role: str
    """Finer than the category: ``param``, ``buffer``, ``grad``, ``exp_avg``, ``master``, ``step``, ``saved``…"""
    dtype: str
    """The stored precision, as torch names it without the prefix: ``float32``, ``bfloat16``."""
    numel: int
    nbytes: int
    """Bytes of the storage (integer, exact)."""
    device: str = "cpu"
    owner: str = ""
    """Parameter name, optimizer slot, or the module path whose op allocated the array."""
    alloc_event: int | None = None
    """First event at which the array is live; ``None``: it existed before the step."""
    free_event: int | None = None
    """First event at which it is no longer live; ``None``: it outlives the step."""
    evidence: Evidence = Evidence.INVENTORIED
    shape: tuple[int, ...] = ()
    aliases: tuple[str, ...] = ()
    """Other names of the same storage (tied weights): counted once, listed for the reader."""
    last_use_event: int | None = None
    """For activations saved for backward: the event of their last use in backward."""
    kernel: str = ""
    """Where the entry differs from what the CPU kernels make, why (a CUDA-kind trace: ``cuda: flash attention
    ...``); ``""`` when it does not. Left out of the JSON when empty."""

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.numel < 0:
            raise ValueError(f"entry {self.name!r} holds {self.nbytes} bytes in {self.numel} elements, below 0")
        if self.alloc_event is not None and self.free_event is not None and self.free_event < self.alloc_event:
            raise ValueError(f"entry {self.name!r} is freed at event {self.free_event}, before it is allocated")

    @property
    def persistent(self) -> bool:
        """Spans the whole step: existed before it and outlives it."""
        return self.alloc_event is None and self.free_event is None

    def live_at(self, event: int) -> bool:
        return (self.alloc_event is None or self.alloc_event <= event) and (
            self.free_event is None or event < self.free_event
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (plain values; ``from_dict`` reads it back)."""
        d = asdict(self)
        d["category"] = str(self.category)
        d["evidence"] = str(self.evidence)
        d["shape"] = list(self.shape)
        d["aliases"] = list(self.aliases)
        if not self.kernel:
            del d["kernel"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Entry:
        d = dict(data)
        d["category"] = Category(d["category"])
        d["evidence"] = Evidence(d["evidence"])
        d["shape"] = tuple(d.get("shape", ()))
        d["aliases"] = tuple(d.get("aliases", ()))
        return cls(**d)


@dataclass(frozen=True, slots=True)
class Event:
    """One tick of the step's clock: an op in a trace, or the single ``state`` instant of an inventory."""

    index: int
    phase: str
    """``forward``, ``backward``, ``optimizer``, ``zero_grad``, or ``state`` for untraced ledgers."""
    op: str = ""
    module: str = ""
    """Module path whose forward (or whose gradient, in backward) the op belongs to: ``(root)`` for the
    root module's own ops, ``(loss)`` in backward for a loss computed outside the model, ``""`` for ops
    outside every module (a ``loss_fn``'s forward, the seed of backward). In the optimizer step, the name
    of the one parameter the op updates (``""`` when none, or several: a foreach op)."""


ROOT_SCOPE = "(root)"
"""``Event.module`` of ops in the root module's own forward and their backward."""
LOSS_SCOPE = "(loss)"
"""``Event.module`` of the backward of a loss computed outside the model (``Workload.loss_fn``)."""
REFERENCE_SCOPE = "reference"
"""Module paths of a frozen reference model (``Workload.reference``) start with this, as its weights' names do."""

STATE_EVENT = Event(index=0, phase="state")


@dataclass(frozen=True, slots=True)
class ModuleCall:
    """One call of a module's ``forward`` during the step, located on the event clock.

    A module called several times in one step (a shared block, a policy run on two batches) has one
    record per call; a container that is never called (a ``ModuleList``) has none.
    """

    path: str
    """Module path as ``named_modules()`` names it (``(root)`` for the model itself)."""
    index: int
    """Which call of this module it is in the step, counted from 0 in forward order."""
    parent: int | None
    """Position in ``Ledger.calls`` of the call it ran inside, or ``None`` at the top."""
    start: int
    """First forward event inside the call."""
    stop: int
    """One past the last forward event inside the call (``start == stop``: it dispatched no op)."""
    backward_start: int | None = None
    """First backward event of the autograd nodes this call created (``None``: none ran)."""
    backward_stop: int | None = None
    """One past the last such backward event."""
    grad: bool = True
    """Whether autograd was recording when it was called (``False`` under ``no_grad``)."""
    writes: tuple[str, ...] = ()
    """Entries that existed before the call and that ops inside it wrote in place (a BatchNorm's running
    statistics, an input modified in place): what running the call again would change a second time."""


@dataclass(frozen=True, slots=True)
class Peak:
    """The largest live total and the breakdown at that same event."""

    bytes: int
    event: int
    phase: str
    op: str
    module: str
    by_category: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "event": self.event,
            "phase": self.phase,
            "op": self.op,
            "module": self.module,
            "by_category": dict(self.by_category),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Peak:
        return cls(
            _whole(data["bytes"], "peak bytes"),
            _whole(data["event"], "peak event"),
            str(data["phase"]),
            str(data.get("op", "")),
            str(data.get("module", "")),
            {str(k): _whole(v, f"peak bytes of {k}") for k, v in dict(data["by_category"]).items()},
        )


@dataclass(frozen=True)
class LedgerSummary:
    """The figures every command's JSON holds at its top level: a ledger without its entries.

    ``Ledger.summary()`` makes one; ``to_dict()`` is ``Ledger.to_dict(entries=False)``, and ``from_dict``
    reads the top level of any command's JSON back (``trainledger report``).

    Example:
        >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 10, 40)
        >>> s = Ledger((w,)).summary()
        >>> LedgerSummary.from_dict(s.to_dict()) == s, s.peak.bytes
        (True, 40)
    """

    evidence: Evidence
    device: str
    peak: Peak
    """The largest simultaneous live total and the breakdown at that event."""
    category_maxima: dict[str, int]
    """Each category's own maximum over the step (they need not coincide)."""
    num_events: int
    notes: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def sum_of_category_maxima(self) -> int:
        """An *overestimate* of the peak whenever the maxima do not coincide."""
        return sum(self.category_maxima.values())

    @property
    def single_instant(self) -> bool:
        """A ledger of one instant (inventoried or declared state): its total is not a peak."""
        return self.num_events == 1 and self.peak.phase == "state"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "evidence": str(self.evidence),
            "device": self.device,
            "peak": self.peak.to_dict(),
            "category_maxima": dict(self.category_maxima),
            "sum_of_category_maxima": self.sum_of_category_maxima,
            "num_events": self.num_events,
            "notes": list(self.notes),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LedgerSummary:
        """Read the top level of a command's JSON (any schema that carries these keys)."""
        maxima = {str(k): _whole(v, f"maximum of {k}") for k, v in dict(data["category_maxima"]).items()}
        return cls(
            evidence=Evidence(data["evidence"]),
            device=str(data["device"]),
            peak=Peak.from_dict(data["peak"]),
            category_maxima=maxima,
            num_events=_whole(data.get("num_events", 1), "num_events"),
            notes=tuple(str(n) for n in data.get("notes", ())),
            meta=dict(data.get("meta") or {}),
        )


@dataclass(frozen=True, slots=True)
class EntryGroup:
    """The entries of one category, role and dtype, summed (a row of the category tables)."""

    category: str
    role: str
    dtype: str
    num_arrays: int
    numel: int
    nbytes: int
    evidence: tuple[str, ...]
    """Every evidence label among the group's entries, sorted."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "role": self.role,
            "dtype": self.dtype,
            "arrays": self.num_arrays,
            "elements": self.numel,
            "bytes": self.nbytes,
            "evidence": list(self.evidence),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EntryGroup:
        return cls(
            str(data["category"]),
            str(data["role"]),
            str(data["dtype"]),
            _whole(data["arrays"], "arrays"),
            _whole(data["elements"], "elements"),
            _whole(data["bytes"], "bytes"),
            tuple(str(e) for e in data["evidence"]),
        )


def _whole(value: Any, what: str) -> int:
    """An integer read from JSON (a byte count, an event): bools and fractions are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a whole number, not {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class PayloadRow:
    """One full-length array of the seed's payload formula: ``b_k`` bytes per parameter."""

    label: str
    bytes_per_param: Fraction
    bytes: int


@dataclass(frozen=True, slots=True)
class Payload:
    """``B_payload = P · Σ b_k`` over the listed full-length arrays (the seed's formula)."""

    num_params: int
    rows: tuple[PayloadRow, ...]
    bytes: int
    excluded: tuple[str, ...]
    """Entries present in the ledger but not full-length arrays (step counters, buffers, factored state)."""
    outside: tuple[str, ...] = ()
    """Full-length arrays that are not training state of the ``P`` trainable parameters (frozen weights: a
    reference model, a LoRA base), so not terms of the formula; listed beside it."""

    def running_totals(self) -> list[tuple[str, int]]:
        """Cumulative bytes as rows are added, as the seed states them (3384, 10152, 13536)."""
        total, out = 0, []
        for row in self.rows:
            total += row.bytes
            out.append((row.label, total))
        return out


@dataclass(frozen=True)
class Ledger:
    """Entries on an event clock. Immutable; transforms return new ledgers.

    Example:
        >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 10, 40)
        >>> a = Entry("a", Category.ACTIVATIONS, "saved", "float32", 5, 20, alloc_event=0, free_event=2)
        >>> events = (Event(0, "forward", "mm"), Event(1, "backward", "mm"), Event(2, "optimizer", "add_"))
        >>> led = Ledger((w, a), events, evidence=Evidence.TRACED)
        >>> led.peak().bytes, led.peak().event
        (60, 0)
    """

    entries: tuple[Entry, ...]
    events: tuple[Event, ...] = (STATE_EVENT,)
    evidence: Evidence = Evidence.INVENTORIED
    device: str = "cpu"
    notes: tuple[str, ...] = ()
    """What the figures exclude or assume, stated for the reader."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Producer-specific facts (model name, graph node count, step time…); plain JSON-able values."""
    calls: tuple[ModuleCall, ...] = ()
    """Every module call of a traced step, in the order the calls began (empty for untraced ledgers)."""

    def __post_init__(self) -> None:
        if not self.events:
            raise ValueError("a ledger needs at least one event")
        n = len(self.events)
        for e in self.entries:
            if e.alloc_event is not None and not 0 <= e.alloc_event <= n:
                raise ValueError(f"entry {e.name!r} allocated at event {e.alloc_event}, clock has {n}")
            if e.free_event is not None and not 0 <= e.free_event <= n:
                raise ValueError(f"entry {e.name!r} freed at event {e.free_event}, clock has {n}")
        for c in self.calls:
            if not 0 <= c.start <= c.stop <= n or (c.backward_stop is not None and c.backward_stop > n):
                raise ValueError(f"call of {c.path!r} spans events {c.start}..{c.stop}, clock has {n}")

    # --- queries ---------------------------------------------------------------------------------

    @property
    def num_events(self) -> int:
        return len(self.events)

    def live_at(self, event: int) -> list[Entry]:
        """Entries live at ``event``."""
        return [e for e in self.entries if e.live_at(event)]

    def largest_live(self, event: int, *, limit: int = 10) -> tuple[Entry, ...]:
        """The ``limit`` largest entries live at ``event``, largest first."""
        return tuple(sorted(self.live_at(event), key=lambda e: -e.nbytes)[:limit])

    def live_bytes(self, event: int) -> int:
        return sum(e.nbytes for e in self.entries if e.live_at(event))

    def timeline(self) -> dict[str, list[int]]:
        """Live bytes per category at every event (difference arrays: O(entries + events·categories))."""
        n = self.num_events
        diffs = {c.value: [0] * (n + 1) for c in CATEGORY_ORDER}
        for e in self.entries:
            d = diffs[Category(e.category).value]
            start = 0 if e.alloc_event is None else e.alloc_event
            stop = n if e.free_event is None else e.free_event
            if stop > start:
                d[start] += e.nbytes
                d[stop] -= e.nbytes
        out: dict[str, list[int]] = {}
        for cat, d in diffs.items():
            run, series = 0, []
            for i in range(n):
                run += d[i]
                series.append(run)
            out[cat] = series
        return out

    def totals(self) -> list[int]:
        """Live bytes (all categories) at every event."""
        series = self.timeline().values()
        return [sum(col) for col in zip(*series, strict=True)]

    def peak(self) -> Peak:
        """The largest simultaneous live total; the breakdown is taken at that same event."""
        return self._peak(self.timeline())

    def _peak(self, tl: dict[str, list[int]]) -> Peak:
        totals = [sum(col) for col in zip(*tl.values(), strict=True)]
        best = max(range(len(totals)), key=lambda i: (totals[i], -i))  # first event reaching the max
        ev = self.events[best]
        by_cat = {cat: series[best] for cat, series in tl.items() if series[best]}
        return Peak(totals[best], best, ev.phase, ev.op, ev.module, by_cat)

    def summary(self) -> LedgerSummary:
        """The top-level figures without the entries (what every command's JSON holds)."""
        tl = self.timeline()  # once: a 7B trace's clock has ~11k events
        maxima = _maxima(tl)
        return LedgerSummary(self.evidence, self.device, self._peak(tl), maxima, self.num_events, self.notes, self.meta)

    def groups(self) -> tuple[EntryGroup, ...]:
        """Entries summed by category, role and dtype, in the fixed category order, then role and dtype.

        Example:
            >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 10, 40)
            >>> [(g.category, g.num_arrays, g.nbytes) for g in Ledger((w, w)).groups()]
            [('weights', 2, 80)]
        """
        sums: dict[tuple[str, str, str], list[int]] = {}
        evidence: dict[tuple[str, str, str], set[str]] = {}
        for e in self.entries:
            key = (str(e.category), e.role, e.dtype)
            g = sums.setdefault(key, [0, 0, 0])
            g[0] += 1
            g[1] += e.numel
            g[2] += e.nbytes
            evidence.setdefault(key, set()).add(str(e.evidence))
        order = {c.value: i for i, c in enumerate(CATEGORY_ORDER)}
        return tuple(
            EntryGroup(*key, *sums[key], tuple(sorted(evidence[key])))
            for key in sorted(sums, key=lambda k: (order[k[0]], k[1], k[2]))
        )

    def category_maxima(self) -> dict[str, int]:
        """Each category's own maximum over the step: these need not coincide in time."""
        return _maxima(self.timeline())

    def sum_of_category_maxima(self) -> int:
        """Sum of per-category maxima: an *overestimate* of the peak whenever the maxima do not coincide."""
        return sum(self.category_maxima().values())

    def bytes_by(self, *keys: str, entries: Iterable[Entry] | None = None) -> dict[tuple[str, ...], int]:
        """Total bytes grouped by entry attributes, e.g. ``bytes_by("category", "role", "dtype")``."""
        out: dict[tuple[str, ...], int] = {}
        for e in self.entries if entries is None else entries:
            key = tuple(str(getattr(e, k)) for k in keys)
            out[key] = out.get(key, 0) + e.nbytes
        return out

    def select(self, *, category: Category | str | None = None, role: str | None = None) -> list[Entry]:
        return [
            e
            for e in self.entries
            if (category is None or e.category == Category(category)) and (role is None or e.role == role)
        ]

    def num_params(self) -> int:
        """Trainable parameters ``P``: elements of the ``weights`` category."""
        return sum(e.numel for e in self.select(category=Category.WEIGHTS))

    def payload(self, arrays: Sequence[tuple[str, str | None]] | None = None) -> Payload:
        """The seed's ``B_payload = P · Σ b_k`` over full-length arrays.

        Arguments:
            arrays: ``(category, role)`` pairs to list, in order (``role=None``: every role of the
                category). By default: weights, master copies, each full-length optimizer array, gradients.

        A listed group counts only when its elements number exactly ``P`` (a full-length array); the
        others (step counters, factored Adafactor state, buffers) are named in ``excluded``, and full-length
        groups that are not listed (frozen weights) in ``outside``.
        """
        P = self.num_params()
        if arrays is None:
            opt_roles = sorted({e.role for e in self.select(category=Category.OPTIMIZER)}, key=_role_order)
            arrays = [("weights", None)] + [("optimizer", r) for r in opt_roles] + [("gradients", None)]
        rows, used = [], set()
        for cat, role in arrays:
            group = self.select(category=cat, role=role)
            if not group:
                continue
            numel = sum(e.numel for e in group)
            if P == 0 or numel != P:
                continue
            nbytes = sum(e.nbytes for e in group)
            label = cat if role is None else f"{cat}:{role}"
            rows.append(PayloadRow(label, Fraction(nbytes, P), nbytes))
            used.update(id(e) for e in group)
        rest: dict[str, int] = {}
        for e in self.entries:
            if id(e) not in used:
                key = f"{e.category}:{e.role}"
                rest[key] = rest.get(key, 0) + e.numel
        outside = sorted(k for k, numel in rest.items() if numel == P and P)
        excluded = sorted(k for k in rest if k not in outside)
        return Payload(P, tuple(rows), sum(r.bytes for r in rows), tuple(excluded), tuple(outside))

    # --- transforms ------------------------------------------------------------------------------

    def with_entries(self, entries: Iterable[Entry], **changes: Any) -> Ledger:
        return replace(self, entries=tuple(entries), **changes)

    # --- serialisation -----------------------------------------------------------------------------

    def to_dict(self, *, entries: bool = True) -> dict[str, Any]:
        """The JSON form: the top-level keys every command prints, plus entries and events."""
        out = self.summary().to_dict()
        if entries:
            out["entries"] = [e.to_dict() for e in self.entries]
            out["events"] = [asdict(ev) for ev in self.events]
            if self.calls:
                out["calls"] = [{**asdict(c), "writes": list(c.writes)} for c in self.calls]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"unknown ledger schema {data.get('schema')!r}; expected {SCHEMA!r}")
        entries = tuple(Entry.from_dict(d) for d in data["entries"])
        events = tuple(Event(**ev) for ev in data["events"])
        return cls(
            entries,
            events,
            evidence=Evidence(data["evidence"]),
            device=data["device"],
            notes=tuple(data.get("notes", ())),
            meta=dict(data.get("meta", {})),
            calls=tuple(ModuleCall(**{**c, "writes": tuple(c.get("writes", ()))}) for c in data.get("calls", ())),
        )

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)


def _maxima(timeline: dict[str, list[int]]) -> dict[str, int]:
    return {cat: top for cat, series in timeline.items() if (top := max(series))}


_ROLE_ORDER = ["master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"]


def _role_order(role: str) -> tuple[int, str]:
    return (_ROLE_ORDER.index(role) if role in _ROLE_ORDER else len(_ROLE_ORDER), role)
