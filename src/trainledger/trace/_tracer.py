"""The step tracer: every storage's life on the event clock of one training step.

A ``TorchDispatchMode`` sees every aten op below autograd. Each op is one event (phase, op, module).
Each storage an op's outputs use that is not known yet is a new entry allocated at that event; a weak
reference on the storage tells when the allocator gets it back (the free event). Tensors that existed
before the step — parameters, buffers, optimizer state, the batch, tensors captured in closures — are
entries too, alive from before the step. ``saved_tensors_hooks`` tells activations saved for backward
apart from temporaries, and records when backward last unpacks each one.

Known limitations:
    - Memory a kernel allocates and frees internally (no tensor escapes the op) is invisible here; the
      measured mode reports it as workspace not visible as tensors.
    - Allocator rounding and caching are not modelled: bytes are storage bytes.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainledger.inventory import dtype_name, storage_key
from trainledger.ledger import Category, Entry, Event, Evidence
from trainledger.trace._scopes import ModuleScopes

ProgressFn = Callable[[str, int], None]


@dataclass(slots=True)
class _Storage:
    """What the tracer learns about one storage while the step runs."""

    name: str
    category: Category | None  # known for pre-existing state; decided at the end for new storages
    role: str
    dtype: str
    nbytes: int
    device: str
    owner: str
    shape: tuple[int, ...]
    alloc_event: int | None
    phase: str
    first_seen: int = 0
    free_event: int | None = None
    saved: bool = False
    last_use_event: int | None = None
    aliases: list[str] = field(default_factory=list)
    merged_into: _Storage | None = None  # an accumulation the engine would have done in place


@dataclass(slots=True)
class _Accumulation:
    """A backward ``add`` that may be the engine accumulating two gradients (see ``_fold_accumulations``)."""

    event: int
    operands: tuple[_Storage | None, _Storage | None]
    dense: tuple[bool, bool]
    out: _Storage | None


class StepTracer(TorchDispatchMode):
    """Records events and storages; use through :func:`trainledger.trace.trace`."""

    supports_higher_order_operators = True

    def __init__(self, scopes: ModuleScopes, *, progress: ProgressFn | None = None) -> None:
        super().__init__()
        self.scopes = scopes
        self.phase = "forward"
        self.events: list[Event] = []
        self.storages: dict[int, _Storage] = {}  # live storages by key
        self.finished: list[_Storage] = []  # storages freed during the step
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._accumulations: list[_Accumulation] = []
        self._active = True
        self._progress = progress
        self._thread = threading.get_ident()
        self.frees_elsewhere: list[str] = []
        """Storages whose last reference was dropped by another thread (a collective library's worker):
        their free event is when that thread let go, which can vary from run to run."""

    # --- pre-existing state ------------------------------------------------------------------------

    def known(self, t: torch.Tensor, name: str, category: Category, role: str) -> None:
        """Declare a tensor that exists before the step (weights, optimizer state, the batch…).

        A ``DTensor`` (FSDP2's sharded parameters and their state) is declared by its local shard: the
        wrapper reports the global size, the rank holds the shard.
        """
        t = local_tensor(t)
        key = storage_key(t)
        rec = self.storages.get(key)
        if rec is not None:
            if name != rec.name and name not in rec.aliases:
                rec.aliases.append(name)
            return
        self._track(t, key, name, category, role, alloc_event=None, owner=name)

    def _track(
        self,
        t: torch.Tensor,
        key: int,
        name: str,
        category: Category | None,
        role: str,
        *,
        alloc_event: int | None,
        owner: str,
    ) -> _Storage:
        st = t.untyped_storage()
        rec = _Storage(
            name=name,
            category=category,
            role=role,
            dtype=dtype_name(t.dtype),
            nbytes=st.nbytes(),
            device=str(t.device),
            owner=owner,
            shape=tuple(t.shape),
            alloc_event=alloc_event,
            phase=self.phase,
            first_seen=len(self.events) - 1 if self.events else 0,
        )
        self.storages[key] = rec
        self._refs[key] = weakref.ref(st, self._freed_callback(key, rec))
        return rec

    def _freed_callback(self, key: int, rec: _Storage) -> Callable[[Any], None]:
        def freed(_ref: Any) -> None:
            if not self._active:
                return
            # live through the last event that ran; no longer live from the next one
            rec.free_event = len(self.events)
            if threading.get_ident() != self._thread:
                self.frees_elsewhere.append(rec.name)
            if self.storages.get(key) is rec:
                del self.storages[key]
                self._refs.pop(key, None)
            self.finished.append(rec)

        return freed

    # --- storages that change size outside dispatch ------------------------------------------------------

    def allocated_outside_dispatch(self, t: torch.Tensor, name: str, category: Category, role: str) -> None:
        """A storage grown by ``untyped_storage().resize_()`` (no op shows it): a new allocation now.

        FSDP2 frees and re-grows a unit's gathered parameters this way; its hooks report them here.
        """
        key = storage_key(t)
        self.freed_outside_dispatch(t)  # the same storage grown again is a new allocation
        self._track(t, key, name, category, role, alloc_event=len(self.events), owner=self.scopes.current)

    def freed_outside_dispatch(self, t: torch.Tensor) -> None:
        """A storage shrunk to nothing by ``untyped_storage().resize_(0)``: freed after the last event."""
        key = storage_key(t)
        rec = self.storages.pop(key, None)
        if rec is not None:
            rec.free_event = len(self.events)
            self._refs.pop(key, None)
            self.finished.append(rec)

    # --- the dispatch hook -------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _NOT_OPS:
            return func(*args, **kwargs)
        index = len(self.events)
        op = _op_name(func)
        if self.phase == "forward":
            module = self.scopes.current
        elif self.phase == "optimizer":  # the parameter this op updates, when it is one
            module = self._updated_parameter(args, kwargs)
        else:
            module = self.scopes.backward_scope()
        self.events.append(Event(index, self.phase, op, module))
        for t in _tensors(args, kwargs):
            if storage_key(t) not in self.storages and _has_storage(t):
                # existed before the step without being declared: captured in a closure, RNG state…
                self._track(
                    t,
                    storage_key(t),
                    f"captured:{op}#{index}",
                    Category.OTHER,
                    "captured",
                    alloc_event=None,
                    owner=module,
                )
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        owners = self._output_owners(op, args, module, len(outputs))
        for t, owner in zip(outputs, owners, strict=True):
            # a DTensor's own ops run below this mode, out of sight: its bytes are its local tensor's, new
            # when the op made it (an FSDP rank's optimizer temporaries)
            t = local_tensor(t)
            if _has_storage(t):
                key = storage_key(t)
                if key not in self.storages:
                    self._track(t, key, f"{op}#{index}", None, "", alloc_event=index, owner=owner)
        if self.phase == "backward" and func is _ADD and _same_meta(args, out):
            a, b = args[0], args[1]
            self._accumulations.append(
                _Accumulation(
                    index,
                    (self.storages.get(storage_key(a)), self.storages.get(storage_key(b))),
                    (_dense(a), _dense(b)),
                    self.storages.get(storage_key(out)),
                )
            )
        if self._progress is not None and index % 1000 == 0:
            self._progress(self.phase, index)
        return out

    # --- the optimizer step, parameter by parameter ---------------------------------------------------

    def _parameter(self, t: torch.Tensor) -> str:
        """The parameter a tensor belongs to: itself, its gradient, its optimizer state or master copy, or
        a temporary the optimizer made for it; ``""`` for anything else."""
        t = local_tensor(t)
        rec = self.storages.get(storage_key(t)) if _has_storage(t) else None
        return "" if rec is None else _parameter_of(rec)

    def _updated_parameter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The one parameter an optimizer op works on (``""`` for none, or several: a foreach op)."""
        names = {self._parameter(t) for t in _tensors(args, kwargs)}
        names.discard("")
        return names.pop() if len(names) == 1 else ""

    def _output_owners(self, op: str, args: tuple[Any, ...], module: str, num_outputs: int) -> list[str]:
        """Owner of each output: the event's module, or in the optimizer step the parameter each output
        is for (a foreach op's ``j``-th output is for its first list's ``j``-th tensor)."""
        if self.phase != "optimizer" or not op.startswith("aten._foreach_") or not args:
            return [module] * num_outputs
        first = args[0] if isinstance(args[0], (list, tuple)) else ()
        return [self._parameter(first[j]) if j < len(first) else "" for j in range(num_outputs)]

    # --- saved tensors -------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if _has_storage(t):
            rec = self.storages.get(storage_key(t))
            if rec is not None:
                rec.saved = True
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        if _has_storage(t):
            rec = self.storages.get(storage_key(t))
            if rec is not None:
                rec.last_use_event = len(self.events) - 1 if self.events else 0
        return t

    # --- finishing ---------------------------------------------------------------------------------

    def mark(self, t: torch.Tensor, category: Category, role: str, name: str) -> None:
        """Name a storage allocated during the step that turned out to be a gradient or optimizer state."""
        rec = self.storages.get(storage_key(local_tensor(t)))
        if rec is not None and rec.category is None:
            rec.category, rec.role, rec.name = category, role, name

    def stop(self) -> None:
        """Stop listening for frees; storages still alive outlive the step."""
        self._active = False
        self._refs.clear()

    def entries(self, evidence: Evidence = Evidence.TRACED) -> list[Entry]:
        self._fold_accumulations()
        records = sorted((r for r in [*self.finished, *self.storages.values()] if r.merged_into is None), key=_order)
        return [_entry(r, evidence) for r in records]

    def _fold_accumulations(self) -> None:
        """Undo a tracing artefact: gradient accumulation that the engine does in place.

        When two gradients flow into one tensor, autograd's input buffer adds them *in place* into one
        of them if it holds the only reference to it (``InputBuffer::accumulate``). Under any Python
        dispatch mode each output carries a Python wrapper, the reference checks fail, and the engine
        falls back to an out-of-place ``add``: one allocation more than the untraced step makes. An
        ``add`` in backward whose operand is a dense backward temporary, not saved, freed right after
        the add, with the output's shape and dtype, is such an accumulation: the output is folded into
        that operand, which lives on as long as the output did.
        """
        for acc in self._accumulations:
            out = acc.out
            if out is None or out.alloc_event != acc.event or out.merged_into is not None:
                continue
            for rec, dense in zip(acc.operands, acc.dense, strict=True):
                if (
                    rec is not None
                    and dense
                    and not rec.saved
                    and rec.phase == "backward"
                    and rec.category is None
                    and rec.alloc_event is not None
                    and rec.free_event == acc.event + 1
                    and rec.nbytes == out.nbytes
                ):
                    rec.free_event = out.free_event
                    if out.category is not None:
                        rec.category, rec.role, rec.name = out.category, out.role, out.name
                    rec.last_use_event = out.last_use_event
                    rec.saved = out.saved
                    out.merged_into = rec
                    break


def _parameter_of(r: _Storage) -> str:
    """The parameter a storage belongs to, by what it was declared or marked as (see ``iter_state``
    for the names: ``<param>``, ``<param>.grad``, ``optimizer.<param>.<slot>``, ``.master`` copies), or
    the owner of a temporary the optimizer step made for one parameter."""
    if r.category in (Category.WEIGHTS, Category.FROZEN):
        return r.name
    if r.category == Category.GRADIENTS:
        return r.name.removesuffix(".grad").removesuffix(".master")
    if r.category == Category.OPTIMIZER:
        return r.name.removeprefix("optimizer.").rpartition(".")[0].removesuffix(".master")
    return r.owner if r.phase == "optimizer" and r.category is None else ""


def _order(r: _Storage) -> tuple[int, str]:
    return (-1 if r.alloc_event is None else r.alloc_event, r.name)


def _entry(r: _Storage, evidence: Evidence) -> Entry:
    category, role, alloc = r.category, r.role, r.alloc_event
    if role == "captured" and r.free_event is not None:
        # first met as an op's input and freed during the step: a temporary made outside dispatch
        # (a Python scalar wrapped as a tensor), not state that existed before the step
        category, role, alloc = Category.WORKSPACE, "untracked_temporary", r.first_seen
    elif category is None:  # a storage born during the step
        if r.saved and r.phase == "forward":
            category, role = Category.ACTIVATIONS, "saved"
        else:
            category, role = Category.WORKSPACE, f"{r.phase}_temporary"
    itemsize = torch.empty((), dtype=getattr(torch, r.dtype), device="meta").element_size()
    return Entry(
        name=r.name,
        category=category,
        role=role,
        dtype=r.dtype,
        numel=r.nbytes // itemsize,
        nbytes=r.nbytes,
        device=r.device,
        owner=r.owner,
        alloc_event=alloc,
        free_event=r.free_event,
        evidence=evidence,
        shape=r.shape,
        aliases=tuple(r.aliases),
        last_use_event=r.last_use_event if r.saved else None,
    )


_ADD = torch.ops.aten.add.Tensor
# Dispatched but not work on tensors: metadata queries (prim.device) and profiler annotations
# (``record_function`` inside ``optimizer.step`` and ``zero_grad``).
_NOT_OPS = frozenset({"prim", "profiler"})


def _same_meta(args: tuple[Any, ...], out: Any) -> bool:
    if len(args) < 2 or not all(isinstance(t, torch.Tensor) for t in (args[0], args[1], out)):
        return False
    a, b = args[0], args[1]
    return a.shape == b.shape == out.shape and a.dtype == b.dtype == out.dtype


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes


def _tensors(*objs: Any) -> list[torch.Tensor]:
    """Tensors among an op's arguments or outputs (flat, or in lists, tuples and dict values).

    A direct walk: this runs for every op, and a general pytree flatten costs several times more.
    """
    found: list[torch.Tensor] = []
    for x in objs:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, torch.Tensor):
                    found.append(y)
                elif isinstance(y, (list, tuple, dict)):
                    found.extend(_tensors(y))
        elif isinstance(x, dict):
            found.extend(_tensors(*x.values()))
    return found


_OP_NAMES: dict[Any, str] = {}


def _op_name(func: Any) -> str:
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = str(func).removesuffix(".default")
    return name


def _has_storage(t: torch.Tensor) -> bool:
    # Sparse and nested tensors have no single storage; a DTensor wrapper holds no bytes of its own (its
    # local shard does, and the shard's own ops are dispatched separately).
    return t.layout == torch.strided and not _is_dtensor(t)


@functools.cache
def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds this rank's bytes: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if _is_dtensor(t) else t  # type: ignore[attr-defined]


def active_tracer() -> StepTracer | None:
    """The step tracer currently on the dispatch mode stack, if any (for hooks of distributed engines)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, StepTracer)), None)
