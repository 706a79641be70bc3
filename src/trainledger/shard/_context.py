"""What every step of one transform looks up: the parameters, their units and owners, each unit's span of
events, how an array is divided on a rank. Pure, no torch.

One :class:`Context` is made per call of :func:`~trainledger.shard.shard`; the modules that build a rank's
ledger (its optimizer step, FSDP's timeline, the collectives) read it and never change it, except
:attr:`Context.notes`, where they say what they leave out (:meth:`Context.rank_classes` records the classes
it finds, which :meth:`Context.who` names).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

from trainledger.ledger import Category, Entry, Evidence, Ledger
from trainledger.shard._config import Plan, ShardConfig
from trainledger.shard._partition import greedy_owners, rank_boundaries, shard_rows
from trainledger.shard._units import in_model, unit_of
from trainledger.units import dtype_bytes


def shardable_frozen(e: Entry) -> bool:
    """Frozen weights of the wrapped model (a LoRA base) are sharded with it; a reference model is not."""
    return e.category == Category.FROZEN and e.role != "reference"


_SUFFIX_RE = re.compile(r"^(optimizer\.)")


class Context:
    """Shared lookups for building every rank's ledger of one transform."""

    def __init__(self, ledger: Ledger, config: ShardConfig, plan: Plan, units: Sequence[str]) -> None:
        self.ledger, self.config, self.plan, self.units = ledger, config, plan, tuple(units)
        self.notes: list[str] = []
        self.class_end: dict[int, int] = {}
        """First rank of a class of identical ranks -> one past its last (see :meth:`rank_classes`)."""
        self.traced = traced_step(ledger)
        self.params = [e for e in ledger.entries if e.category == Category.WEIGHTS or shardable_frozen(e)]
        self.param_by_name: dict[str, Entry] = {}
        for p in self.params:
            for n in (p.name, *p.aliases):
                self.param_by_name.setdefault(n, p)
        # the model's parameter order (``named_parameters()``), which the engines follow; a traced ledger
        # records it, others list their parameters in that order
        order = ledger.meta.get("parameter_order") or [p.name for p in self.params]
        self.param_order: dict[str, int] = {name: i for i, name in enumerate(order)}
        trainable = sorted(
            (p for p in self.params if p.category == Category.WEIGHTS), key=lambda p: self.param_order.get(p.name, -1)
        )
        self.owner = dict(
            zip((p.name for p in trainable), greedy_owners([p.numel for p in trainable], plan.shard_size), strict=True)
        )
        # each rank's optimizer steps its parameters in the order they were given to it: largest first
        by_size = sorted(trainable, key=lambda p: -p.numel)
        # (only ranks that own a parameter are listed: a world of a trillion ranks has few owners)
        self.rank_order: dict[int, list[str]] = {}
        for p in by_size:
            self.rank_order.setdefault(self.owner[p.name], []).append(p.name)
        self.spans = self._spans() if self.traced else {}
        self._given_gradients = {
            p.name
            for e in ledger.entries
            if e.category == Category.GRADIENTS and e.role == "grad" and (p := self.param_of(e)) is not None
        }
        phases = [ev.phase for ev in ledger.events]
        self.last_backward = max((i for i, ph in enumerate(phases) if ph == "backward"), default=None)

    # --- lookups ---

    def param_of(self, e: Entry) -> Entry | None:
        """The parameter an optimizer or gradient entry belongs to (by name: ``optimizer.<param>.<slot>``)."""
        for text in (e.owner, e.name):
            s = _SUFFIX_RE.sub("", text)
            while s:
                if s in self.param_by_name:
                    return self.param_by_name[s]
                s = s.rpartition(".")[0]
        return None

    def _spans(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``(unit, phase) -> (first event, last event)`` of each unit's ops; the root spans the model's ops.

        Ops outside the model — a loss computed by ``loss_fn`` (module ``""`` in forward, ``(loss)`` in
        backward) and the seed of backward (``ones_like``, module ``""``) — belong to no unit: the root's
        forward hook runs when the model returns, before them, and its pre-backward hook when the gradient
        reaches the model's output, after them. A ledger whose ops name no module at all keeps the root
        spanning each phase.
        """
        spans: dict[tuple[str, str], tuple[int, int]] = {}
        whole: dict[str, tuple[int, int]] = {}

        def widen(table: dict[Any, tuple[int, int]], key: Any, index: int) -> None:
            lo, hi = table.get(key, (index, index))
            table[key] = (min(lo, index), max(hi, index))

        reference = any(e.role == "reference" for e in self.ledger.entries)
        for ev in self.ledger.events:
            if ev.phase not in ("forward", "backward"):
                continue
            widen(whole, ev.phase, ev.index)
            if in_model(ev.module, reference=reference):
                widen(spans, (unit_of(ev.module, self.units), ev.phase), ev.index)
                widen(spans, ("", ev.phase), ev.index)
        for phase, span in whole.items():
            spans.setdefault(("", phase), span)
        return spans

    def reduced(self, p: Entry) -> bool:
        """Whether FSDP reduces ``p``'s gradient: a trainable parameter, which got one in the traced step (a
        parameter whose use backward never reaches, behind ``no_grad`` or a detach, is left out of its unit's
        reduce-scatter)."""
        return p.category == Category.WEIGHTS and (not self.traced or p.name in self._given_gradients)

    def unit_params(self) -> dict[str, list[Entry]]:
        """The parameters of each unit that holds any (the root ``""`` first), in the ledger's order."""
        out: dict[str, list[Entry]] = {u: [] for u in ("", *self.units)}
        for p in self.params:
            out[unit_of(p.name, self.units)].append(p)
        return {u: ps for u, ps in out.items() if ps}

    def units_in_order(self, phase: str) -> list[str]:
        """The units that hold parameters, in the order they start in ``phase`` of the trace."""
        groups = self.unit_params()
        return [u for u in order_of(self.spans, phase) if u in groups]

    def rank_classes(self) -> tuple[int, ...]:
        """The first rank of each class of identical ranks within a shard group, in order (0 first).

        A rank's ledger depends on its rank only through :func:`shard_rows` of each array (uneven
        partitions) and, for whole-parameter partitions, the parameters it owns: the boundaries of both
        are found without visiting every rank.
        """
        n, plan = self.plan.shard_size, self.plan
        starts = {0}
        if not (plan.shard_optimizer or plan.shard_grads or plan.shard_params):  # plain data parallelism
            self.class_end = {0: n}
            return (0,)
        unmatched = [
            e
            for e in self.ledger.entries
            if e.category in (Category.OPTIMIZER, Category.GRADIENTS) and self.param_of(e) is None
        ]
        for e in (*self.params, *unmatched):
            starts.update(rank_boundaries(e.numel, e.shape, n, plan.partition))
        if plan.partition == "greedy" and self.owner:  # owners are ranks 0..k-1; the rest own nothing
            starts.update(range(1, min(n, max(self.owner.values()) + 2)))
        self.class_end = dict(itertools.pairwise([*sorted(starts), n]))
        return tuple(sorted(starts))

    def who(self, rank: int) -> str:
        """``rank 3`` or ``ranks 1-6 (identical)``, as the rank's ledger is computed for."""
        end = self.class_end.get(rank, rank + 1)
        who = f"rank {rank}" if end == rank + 1 else f"ranks {rank}-{end - 1} (identical)"
        if self.plan.replicas > 1:
            who += f" of each group of {self.plan.shard_size}"
        return who

    def held(self, e: Entry, like: Entry, rank: int, *, real: bool = False) -> int:
        """Elements of ``e`` held on ``rank``, sharded the way its parameter ``like`` is."""
        # state that is not the parameter's length is kept whole: step counters, and a 0-dim counter of a
        # one-element parameter (its rank may hold no real row of the parameter, but holds the counter)
        if e.numel != like.numel or (e.numel == 1 and not e.shape and like.shape):
            return e.numel
        held, actual = shard_rows(like.numel, like.shape, self.plan.shard_size, rank, self.plan.partition)
        return actual if real else held

    def unit_grad_dtype(self, unit: str) -> str:
        """The dtype of ``unit``'s gradients, what its reduce-scatter carries (a bf16 unit of an fp32 model reduces
        bf16); the model's (:meth:`grad_dtype_bytes`) where the ledger names none of them."""
        trained = {f"{p.name}.grad" for p in self.unit_params().get(unit, ()) if p.category == Category.WEIGHTS}
        own = [e.dtype for e in self.ledger.entries if e.category == Category.GRADIENTS and e.name in trained]
        return own[0] if own else self.grad_dtype_bytes()[0]

    def gradient_bytes_by_dtype(self) -> dict[str, int]:
        """Bytes of the trainable parameters' gradients per dtype, each in its parameter's dtype (DDP keeps a
        bucket per dtype)."""
        out: dict[str, int] = {}
        for p in self.params:
            if p.category == Category.WEIGHTS:
                out[p.dtype] = out.get(p.dtype, 0) + p.numel * dtype_bytes(p.dtype)
        return out

    def grad_dtype_bytes(self) -> tuple[str, int]:
        """``(dtype, bytes per element)`` of the model's gradients (of its parameters when none is listed)."""
        grads = [e for e in self.ledger.entries if e.category == Category.GRADIENTS and e.role == "grad"]
        ref = grads[0] if grads else (self.params[0] if self.params else None)
        dtype = ref.dtype if ref is not None else "float32"
        return dtype, dtype_bytes(dtype)


def traced_step(ledger: Ledger) -> bool:
    """Whether ``ledger`` is a step's timeline (events, lifetimes), not a single instant of model state."""
    return ledger.num_events > 1 or ledger.events[0].phase != "state"


def order_of(spans: dict[tuple[str, str], tuple[int, int]], phase: str) -> list[str]:
    """Units in the order they start in ``phase`` (the root first: its hooks run before its children's)."""
    units = [(span[0], unit != "", unit) for (unit, ph), span in spans.items() if ph == phase]
    return [u for _, _, u in sorted(units)]


def added_entry(
    name: str, category: Category, role: str, dtype: str, nbytes: int, start: int | None, stop: int | None
) -> Entry:
    """An array the engine adds to the step (a buffer, gathered parameters): ``nbytes`` of ``dtype``, live from
    event ``start`` up to ``stop`` (both ``None``: for the whole step)."""
    return Entry(
        name=name,
        category=category,
        role=role,
        dtype=dtype,
        numel=nbytes // dtype_bytes(dtype),
        nbytes=nbytes,
        owner="shard",
        alloc_event=start,
        free_event=stop,
        evidence=Evidence.ANALYTIC,
    )
