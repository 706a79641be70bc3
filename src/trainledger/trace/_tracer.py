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

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainledger.inventory import dtype_name, storage_key, storage_parts
from trainledger.ledger import Category, Entry, Event, Evidence, ModuleCall
from trainledger.trace import _native
from trainledger.trace._kernels import (
    CONDITIONAL_PROBES,
    NEEDS_REAL_INPUTS,
    PROBED_OPS,
    REAL_STORAGE_OPS,
    KernelCall,
    blas_copies,
    casts_an_operand,
    casts_to_its_dtype,
    index_copies,
    reads_a_copy,
    real_output_bytes,
    strides_differ,
)
from trainledger.trace._scopes import NO_CALL, ModuleScopes

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
    shape: tuple[int, ...]  # a ``torch.Size`` while tracing (a tuple already; ``tuple()`` costs per storage)
    alloc_event: int | None
    phase: str
    first_seen: int = 0
    free_event: int | None = None
    saved: bool = False
    last_use_event: int | None = None
    aliases: tuple[str, ...] = ()
    merged_into: _Storage | None = None  # an accumulation the engine would have done in place
    parameter: str | None = None  # _parameter_of(self), kept until ``mark`` renames the storage


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a storage that carries its key and record to the callback, so that a free needs
    no lookup by the reference's id."""

    __slots__ = ("key", "rec")
    key: int
    rec: _Storage | None


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
    native_phases: dict[str, str] | None = None
    """For a subclass whose ``__torch_dispatch__`` only sets ``phase``, ``after`` and ``closure_forward`` by record's
    rule for the user's own loop (``record._loop``) before calling this class's: the phase an op between modules
    takes after each phase, so that the compiled path can apply the same rule."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo, a Python frame
        # and two eval-frame switches per op; the tracer is never compiled, so the wrapper is pure cost.
        return False

    def __init__(
        self,
        scopes: ModuleScopes,
        *,
        fake: bool = False,
        progress: ProgressFn | None = None,
        substitutes: dict[Any, Callable[[Any, tuple[Any, ...]], Any]] | None = None,
    ) -> None:
        super().__init__()
        self.substitutes = substitutes or {}
        """Per op overload, a function of its outputs and arguments returning what the kernel the trace stands
        for returns instead (a CUDA-kind trace's normalization statistics, a real kernel's strides where a fake
        tensor's meta kernel lays its output out otherwise)."""
        global _NO_STORAGE
        _NO_STORAGE = _dtensor_types()
        self.fake = fake
        self.scopes = scopes
        self.phase = "forward"
        # per event: phase, op, module, and the module call it ran in (NO_CALL: none); one list, appended to
        # once per op (Events are made at the end)
        self.ops: list[tuple[str, str, str, int]] = []
        scopes.clock = self.ops.__len__  # the event clock, read twice per module call: no Python frame
        self.writes: list[tuple[int, _Storage]] = []  # in-place writes in forward: (event, storage)
        self.kernel_calls: list[tuple[int, str, str, KernelCall | None]] = []  # kernels holding buffers inside
        self.resized: list[tuple[KernelCall, list[_Storage | None]]] = []  # fake outputs the real kernel sizes
        self.storages: dict[int, _Storage] = {}  # live storages by key
        self.finished: list[_Storage] = []  # storages freed during the step
        self._refs: dict[int, _StorageRef] = {}  # by storage key: the weak references that report frees
        self._on_free = self._freed  # bound once, not per storage
        self._accumulations: list[_Accumulation] = []
        self._active = True
        self._progress = progress
        self._thread = threading.get_ident()
        self.frees_elsewhere: list[str] = []
        """Storages whose last reference was dropped by another thread (a collective library's worker):
        their free event is when that thread let go, which can vary from run to run."""
        self.frees_settled: list[str] = []
        """Storages another thread freed while the traced thread paused for it (``letting_go``)."""
        self._pauses = 0
        self.freed_after_backward: list[_Storage] = []
        """Storages freed after a backward's final callbacks ran and before the next op: what the caller of
        ``backward()`` held through it (the loss, the gradient seed), not what autograd's nodes let go of.
        Both are freed at the same event; an engine whose hooks run in the final callback (FSDP's root
        reduce-scatter) runs between them (see ``_backward_ended``)."""
        self._end_queued = False
        self._backward_ended_at = -1  # ``len(self.ops)`` when the last backward's final callbacks ran
        self._native = False  # the compiled path records this tracer's ordinary ops (see ``_native``)
        self.native_events = 0
        """Events the compiled path recorded (the others went through ``__torch_dispatch__``)."""

    # --- the compiled per-op path (``_native``) -----------------------------------------------------------

    def __enter__(self) -> StepTracer:
        super().__enter__()
        self._native = _attach_native(self)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._native:
                self.native_events += _native_module().detach(self)
                self._native = False
                self._on_free = self._freed
                del self.__dict__["__torch_dispatch__"]
        finally:
            super().__exit__(*exc)

    @contextlib.contextmanager
    def letting_go(self) -> Iterator[None]:
        """While active, the traced thread is in a call that waits for other threads (a collective library's
        workers) to finish and let go of what the step has dropped. A free they make meanwhile lands within
        that call, not at whatever event the step reaches later, so it is counted in ``frees_settled``, not
        in ``frees_elsewhere``."""
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1

    @property
    def num_events(self) -> int:
        return len(self.ops)

    def events(self) -> list[Event]:
        return [Event(i, phase, op, module) for i, (phase, op, module, _) in enumerate(self.ops)]

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
                rec.aliases = (*rec.aliases, name)
            return
        self._track(t, key, name, category, role, None, name, self._last_event())

    def _last_event(self) -> int:
        return len(self.ops) - 1 if self.ops else 0

    def _track(
        self,
        t: torch.Tensor,
        key: int,
        name: str,
        category: Category | None,
        role: str,
        alloc_event: int | None,
        owner: str,
        first_seen: int,
    ) -> _Storage:
        """A record for ``t``'s storage, whose ``storage_key`` is ``key`` (the caller has it: it looked the
        storage up), and the weak reference that reports its free."""
        st = t.untyped_storage()
        dtype = t.dtype
        rec = _Storage(
            name,
            category,
            role,
            _DTYPE_NAMES.get(dtype) or _dtype_name(dtype),
            st.nbytes(),
            # ``t.device`` makes a device object to hash: a CPU tensor (fake ones too) answers ``is_cpu`` without
            "cpu" if t.is_cpu else str(t.device),
            owner,
            _shape(t, st),
            alloc_event,
            self.phase,
            first_seen,
        )
        self.storages[key] = rec
        ref = _StorageRef(st, self._on_free)
        ref.key, ref.rec = key, rec
        self._refs[key] = ref
        return rec

    def _freed(self, ref: _StorageRef) -> None:
        rec = ref.rec
        if rec is None or not self._active:
            return
        key = ref.key
        ref.rec = None
        # live through the last event that ran; no longer live from the next one
        rec.free_event = len(self.ops)
        if rec.free_event == self._backward_ended_at:  # after backward's final callbacks, before any op
            self.freed_after_backward.append(rec)
        if _get_ident() != self._thread:
            (self.frees_settled if self._pauses else self.frees_elsewhere).append(rec.name)
        if self.storages.get(key) is rec:
            # the dead reference stays in ``_refs`` until a new storage at this address replaces it or
            # ``stop`` clears them: one dictionary operation less per free
            del self.storages[key]
        self.finished.append(rec)

    # --- storages that change size outside dispatch ------------------------------------------------------

    def allocated_outside_dispatch(self, t: torch.Tensor, name: str, category: Category, role: str) -> None:
        """A storage grown by ``untyped_storage().resize_()`` (no op shows it): a new allocation now.

        FSDP2 frees and re-grows a unit's gathered parameters this way; its hooks report them here.
        """
        self.freed_outside_dispatch(t)  # the same storage grown again is a new allocation
        index = len(self.ops)
        self._track(t, storage_key(t), name, category, role, index, self.scopes.current, self._last_event())

    def freed_outside_dispatch(self, t: torch.Tensor) -> None:
        """A storage shrunk to nothing by ``untyped_storage().resize_(0)``: freed after the last event."""
        key = storage_key(t)
        rec = self.storages.pop(key, None)
        if rec is not None:
            rec.free_event = len(self.ops)
            ref = self._refs.pop(key, None)
            if ref is not None:
                ref.rec = None
            self.finished.append(rec)

    def outside_dispatch(self, op: str, outputs: list[torch.Tensor]) -> int:
        """An event for work that ran out of this mode's sight (a compiled module's call), the storages among
        ``outputs`` not seen before allocated by it; returns the event's index."""
        index = len(self.ops)
        module, call = self.scopes.forward_scope() if self.phase == "forward" else self.scopes.backward_scope()
        self.ops.append((self.phase, op, module, call))
        self._outputs(op, index, module, (), outputs)
        return index

    # --- the dispatch hook -------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        # Runs for every op of the step: what an op overload needs is read from its schema once (_OpInfo,
        # found by the overload's id: hashing an OpOverload runs a Python ``__hash__``), each tensor's
        # storage is looked up once, and the common cases (tensors passed flat, one tensor returned, none of
        # the rarer facts in ``_before_op`` and ``_after_op``) take no helper call and build no list.
        info = _OPS.get(id(func), _UNSEEN)
        if info is _UNSEEN:
            info = _op_info(func)
        if info is None:  # not work on tensors: a metadata query, a profiler annotation
            return func(*args, **kwargs) if kwargs else func(*args)
        op = info.name
        ops = self.ops
        index = len(ops)
        phase = self.phase
        inputs = args if info.flat and not kwargs else _inputs(info, args, kwargs)
        untracked = None
        if phase == "forward":
            module, call = self.scopes.scope
        else:
            module, call = self.scopes.backward_scope()
            if phase == "optimizer":  # the parameter this op updates, when it is one
                module, untracked = self._optimizer_inputs(inputs)
        ops.append((phase, op, module, call))
        storages = self.storages
        for t in inputs if untracked is None else untracked:
            if (
                isinstance(t, _Tensor)
                and t.layout is _STRIDED
                and not isinstance(t, _NO_STORAGE)
                and (key := _storage_address(t)) not in storages
            ):
                # existed before the step without being declared: captured in a closure, RNG state…
                name = f"captured:{op}#{index}"
                self._track(t, key, name, Category.OTHER, "captured", None, module, index)
        if info.before:
            self._before_op(func, info, index, module, args, kwargs or {})
        out = info.call(*args, **kwargs) if kwargs else info.call(*args)
        if self.substitutes:
            substitute = self.substitutes.get(func)
            if substitute is not None:
                out = substitute(out, args)
        if info.allocates or _NO_STORAGE:
            if (
                isinstance(out, _Tensor)
                and not (_NO_STORAGE and isinstance(out, _NO_STORAGE))
                and not (info.foreach and phase == "optimizer")
            ):
                if out.layout is not _STRIDED:  # a sparse tensor: its parts' storages
                    self._outputs(op, index, module, args, out)
                elif (key := _storage_address(out)) not in storages:
                    self._track(out, key, f"{op}#{index}", None, "", index, module, index)
            else:
                self._outputs(op, index, module, args, out)
        if info.after:
            self._after_op(func, info, index, args, kwargs or {}, out)
        if self._progress is not None and index % 1000 == 0:
            self._progress(phase, index)
        return out

    def _before_op(
        self, func: Any, info: _OpInfo, index: int, module: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """What an op that may hold buffers inside, or writes in place, needs recorded before it runs."""
        op = info.name
        when = info.when
        if info.probed and (when is None or when[0](when[1], args, kwargs)):
            kernel = None if self.fake and op in NEEDS_REAL_INPUTS else KernelCall.of(func, args, kwargs)
            self.kernel_calls.append((index, op, module, kernel))
        if info.written and self.phase == "forward":
            storages = self.storages
            for t in _written(info.written, args, kwargs):
                rec = storages.get(storage_key(t)) if _has_storage(t) else None
                if rec is not None:
                    self.writes.append((index, rec))

    def _after_op(
        self, func: Any, info: _OpInfo, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """What an op whose real kernel sizes its outputs otherwise, or that may be an accumulation of two
        gradients, needs recorded after it ran."""
        storages = self.storages
        if self.fake and info.real_storage:
            kernel = KernelCall.of(func, args, kwargs)
            if kernel is not None:
                outputs = [storages.get(storage_key(t)) if _has_storage(t) else None for t in tensors_of(out)]
                self.resized.append((kernel, outputs))
        # the engine accumulates with grad mode off (in place only then); a checkpoint's recomputation runs
        # with it on: its adds are the forward's, run again
        if info.accumulation and self.phase != "forward" and not torch.is_grad_enabled() and _same_meta(args, out):
            a, b = args[0], args[1]
            self._accumulations.append(
                _Accumulation(
                    index,
                    (storages.get(storage_key(a)), storages.get(storage_key(b))),
                    (_dense(a), _dense(b)),
                    storages.get(storage_key(out)),
                )
            )

    def _outputs(self, op: str, index: int, module: str, args: tuple[Any, ...], out: Any) -> None:
        """Track each output storage not seen before as allocated by this event (a sparse output's: its parts',
        which a sparse kernel such as ``coalesce`` makes out of this mode's sight)."""
        outputs = [out] if isinstance(out, torch.Tensor) else tensors_of(out)
        owners = self._output_owners(op, args, module, len(outputs)) if self.phase == "optimizer" else None
        for j, t in enumerate(outputs):
            self._output(t, op, index, module if owners is None else owners[j])

    def _output(self, t: torch.Tensor, op: str, index: int, owner: str) -> None:
        """One output of the op at ``index``: its storage, or a sparse tensor's parts', tracked where new. The
        compiled path (``_native``) calls this for outputs that are not plain dense tensors."""
        storages = self.storages
        if isinstance(t, _NO_STORAGE):
            # a DTensor's own ops run below this mode, out of sight: its bytes are its local tensor's,
            # new when the op made it (an FSDP rank's optimizer temporaries)
            t = t._local_tensor  # type: ignore[attr-defined]
        if t.layout is _STRIDED:
            if (key := _storage_address(t)) not in storages:
                self._track(t, key, f"{op}#{index}", None, "", index, owner, index)
        else:
            for part in storage_parts(t):
                if part.layout is _STRIDED and (key := _storage_address(part)) not in storages:
                    self._track(part, key, f"{op}#{index}", None, "", index, owner, index)

    # --- the optimizer step, parameter by parameter ---------------------------------------------------

    def _parameter(self, t: torch.Tensor) -> str:
        """The parameter a tensor belongs to: itself, its gradient, its optimizer state or master copy, or
        a temporary the optimizer made for it; ``""`` for anything else."""
        if isinstance(t, _NO_STORAGE):
            t = t._local_tensor  # type: ignore[attr-defined]
        rec = self.storages.get(_storage_address(t)) if t.layout is _STRIDED else None
        if rec is None:
            return ""
        name = rec.parameter
        if name is None:  # asked for every op of the optimizer step: string work once per storage
            name = rec.parameter = _parameter_of(rec)
        return name

    def _optimizer_inputs(self, inputs: Iterable[Any]) -> tuple[str, list[torch.Tensor]]:
        """The one parameter an optimizer op works on (``""`` for none, or several: a foreach op), and its
        tensors whose storage is not tracked yet; ``inputs`` are its tensors, or its flat arguments. One pass
        over them: two fifths of a step's ops are the optimizer's."""
        storages = self.storages
        found = ""
        several = False
        untracked = []
        for t in inputs:
            if not isinstance(t, _Tensor):
                continue
            if isinstance(t, _NO_STORAGE):
                name = self._parameter(t)  # its local shard's
            elif t.layout is not _STRIDED:
                continue
            else:
                rec = storages.get(_storage_address(t))
                if rec is None:
                    untracked.append(t)
                    continue
                name = rec.parameter
                if name is None:  # string work once per storage
                    name = rec.parameter = _parameter_of(rec)
            if name and name != found:
                several = several or bool(found)
                found = name
        return ("" if several else found), untracked

    def _output_owners(self, op: str, args: tuple[Any, ...], module: str, num_outputs: int) -> list[str]:
        """Owner of each output: the event's module, or in the optimizer step the parameter each output
        is for (a foreach op's ``j``-th output is for its first list's ``j``-th tensor)."""
        if self.phase != "optimizer" or not op.startswith(_FOREACH) or not args:
            return [module] * num_outputs
        first = args[0] if isinstance(args[0], (list, tuple)) else ()
        return [self._parameter(first[j]) if j < len(first) else "" for j in range(num_outputs)]

    # --- saved tensors -------------------------------------------------------------------------------

    def saved_tensor_hooks(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """``(pack, unpack)`` for ``torch.autograd.graph.saved_tensors_hooks``: these methods, or while the compiled
        path records this tracer (inside ``with tracer``), its versions of them."""
        if self._native:
            return _native_module().saved_hooks(self, self.storages, self.ops)
        return self.pack, self.unpack

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout is _STRIDED and not isinstance(t, _NO_STORAGE):
            rec = self.storages.get(_storage_address(t))
            if rec is not None:
                rec.saved = True
        return t if t.grad_fn is None else self._detached(t)

    def _detached(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` without its autograd history, made out of this mode's sight, for a saved-tensor hook to keep.

        What the hook keeps must not hold ``grad_fn``: an output its own node saves (tanh's, softmax's) would hold
        the node that holds it, a cycle through C++ objects that no collector frees. Backward breaks it by
        releasing what it saved; a graph dropped without backward (an unused head, a detached GAN sample, a
        validation loss outside ``no_grad``) would live on, in the trace and in the process after it. PyTorch keeps
        such outputs without their history itself (``tensor_data()``), and on unpack autograd gives it back."""
        if type(t) in _PLAIN:
            with _DisableTorchDispatch():  # no event: the alias is the hook's, not the step's
                return t.detach()
        # a subclass (a fake tensor, a DTensor) detaches through its own dispatch, below this mode
        depth = _dispatch_stack_depth()
        if depth and _dispatch_mode_at(depth - 1) is self:
            _pop_dispatch_mode(None)
            try:
                return t.detach()
            finally:
                _push_dispatch_mode(self)
        return t.detach()

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout is _STRIDED and not isinstance(t, _NO_STORAGE):
            rec = self.storages.get(_storage_address(t))
            if rec is not None:
                rec.last_use_event = len(self.ops) - 1 if self.ops else 0
        if not self._end_queued:
            self._queue_backward_end()
        return t

    def _queue_backward_end(self) -> None:
        """In a backward (a saved tensor is unpacked): have the engine tell when its final callbacks run."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        except RuntimeError:  # unpacked outside a backward (a saved tensor read by hand): nothing to wait for
            return
        self._end_queued = True

    def _backward_ended(self) -> None:
        self._end_queued = False
        self._backward_ended_at = len(self.ops)

    # --- finishing ---------------------------------------------------------------------------------

    def mark(self, t: torch.Tensor, category: Category, role: str, name: str) -> None:
        """Name a storage allocated during the step that turned out to be a gradient or optimizer state (a
        sparse gradient: each of its parts), or a step's input (one the loop held from before, too)."""
        t = local_tensor(t)
        if t.layout is not _STRIDED:
            for part in storage_parts(t):
                if part.layout is _STRIDED:
                    self.mark(part, category, role, name)
            return
        rec = self.storages.get(storage_key(t))
        if rec is None:
            return
        if rec.category is None:
            rec.category, rec.role, rec.name = category, role, name
            rec.parameter = None
        elif rec.role == "held" and category is Category.INPUTS:
            # a tensor the loop held from before the step (a batch already in memory) and called the model with
            rec.category, rec.role, rec.name = category, role, name
        elif rec.role == "captured" and category is Category.OPTIMIZER:
            # optimizer state made during the step without an op (AdamW's step counter, ``torch.tensor(0.0)``
            # on the first step), first met as an op's input: state existing before the step was declared
            # (``known``), so this was made at that event, for the parameter its name gives
            rec.category, rec.role, rec.name, rec.alloc_event = category, role, name, rec.first_seen
            rec.parameter = None
            rec.owner = _parameter_of(rec)

    def any_unnamed(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` uses a storage allocated during the step and not named yet (one
        ``mark`` would name)."""
        storages = self.storages
        for t in tensors:  # every gradient and state tensor, twice a step: no helper calls for plain ones
            if t.layout is not _STRIDED:  # a sparse gradient
                if self.any_unnamed(p for p in storage_parts(local_tensor(t)) if p.layout is _STRIDED):
                    return True
                continue
            rec = storages.get(_storage_address(t if type(t) in _PLAIN else local_tensor(t)))
            if rec is not None and (rec.category is None or rec.role == "captured"):
                return True
        return False

    def stop(self) -> None:
        """Stop listening for frees; storages still alive outlive the step."""
        self._active = False
        self._refs.clear()

    def size_outputs_as_the_real_kernels(self) -> int:
        """Fake traces: give outputs of :data:`REAL_STORAGE_OPS` the storage size their CPU kernel returns.
        Returns how many storages changed."""
        changed = 0
        for kernel, outputs in self.resized:
            sizes = real_output_bytes(kernel)
            if sizes is None or len(sizes) != len(outputs):
                continue
            for rec, nbytes in zip(outputs, sizes, strict=True):
                if rec is not None and rec.nbytes != nbytes:
                    rec.nbytes = nbytes
                    changed += 1
        return changed

    def module_calls(self) -> tuple[ModuleCall, ...]:
        """Every module call of the step, with its backward span and the older state it wrote in place."""
        writes = [(e, rec.alloc_event, rec.name) for e, rec in self.writes]
        calls = [call for _, _, _, call in self.ops]
        return self.scopes.module_calls(calls, [phase for phase, _, _, _ in self.ops], writes)

    def entries(self, evidence: Evidence = Evidence.TRACED) -> list[Entry]:
        self._fold_accumulations()
        records = sorted((r for r in [*self.finished, *self.storages.values()] if r.merged_into is None), key=_order)
        return [_entry(r, evidence) for r in records]

    def _fold_accumulations(self) -> None:
        """Undo a tracing artefact: gradient accumulation that the engine does in place.

        When two gradients flow into one tensor, autograd's input buffer adds the one that came second into
        the one that came first, *in place*, if it holds the only reference to that first one
        (``InputBuffer::accumulate``: ``old_var.add_(var)``, else ``old_var + var``); it never adds into the
        second. Under any Python dispatch mode each output carries a Python wrapper, the reference checks
        fail, and the engine falls back to the out-of-place ``add``: one allocation more than the untraced
        step makes. An ``add`` in backward whose first operand is a dense backward temporary, not saved,
        freed right after the add, with the output's shape and dtype, is such an accumulation: the output is
        folded into that operand, which lives on as long as the output did. When the first is not dense (a
        view: a gradient through ``view``), the untraced step allocates the sum as well.
        """
        for acc in self._accumulations:
            out = acc.out
            if out is None or out.alloc_event != acc.event or out.merged_into is not None or not acc.dense[0]:
                continue
            # the first operand may itself be an earlier accumulation, already folded: the residual stream's
            # gradient is added to once per block, and all of it is the one buffer the engine adds into
            rec = acc.operands[0]
            while rec is not None and rec.merged_into is not None:
                rec = rec.merged_into
            if (
                rec is not None
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


def _shape(t: torch.Tensor, storage: torch.UntypedStorage) -> tuple[int, ...]:
    """``t``'s shape; a nested tensor (``torch.nested``, ``nn.TransformerEncoder``'s fast path with a padding mask)
    has none, only a buffer of its components: that buffer's length."""
    try:
        return tuple(t.shape)
    except RuntimeError:
        return (storage.nbytes() // t.element_size(),)


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


def _order(r: _Storage) -> tuple[int, str, str]:
    # the owner orders a foreach op's outputs (one event, one name, one per parameter) as the extension does
    return (-1 if r.alloc_event is None else r.alloc_event, r.name, r.owner)


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
    itemsize = _ITEMSIZE.get(r.dtype) or _itemsize(r.dtype)
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
        shape=tuple(r.shape),
        aliases=r.aliases,
        last_use_event=r.last_use_event if r.saved else None,
    )


_ITEMSIZE: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE[dtype] = getattr(torch, dtype).itemsize
    return size


_ADD = torch.ops.aten.add.Tensor
_FOREACH = "aten._foreach_"
# Dispatched but not work on tensors: metadata queries (prim.device) and profiler annotations
# (``record_function`` inside ``optimizer.step`` and ``zero_grad``).
_NOT_OPS = frozenset({"prim", "profiler"})


def _same_meta(args: tuple[Any, ...], out: Any) -> bool:
    if len(args) < 2 or not all(isinstance(t, torch.Tensor) for t in (args[0], args[1], out)):
        return False
    a, b = args[0], args[1]
    return (
        a.layout is b.layout is out.layout is _STRIDED
        and a.shape == b.shape == out.shape
        and a.dtype == b.dtype == out.dtype
    )


def _dense(t: torch.Tensor) -> bool:
    """Whether the engine could add into ``t`` in place: it holds its storage alone (``can_accumulate_inplace``
    in autograd's input buffer asks for one reference to the storage; a view shares its base's, so a gradient
    that is a view, as a weight's transposed matrix product is, is added out of place)."""
    return (
        t._base is None and t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
    )


def _inputs(info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Iterable[Any]:
    """An op's tensors among other values: its arguments as they are when no argument is a list of tensors
    (the caller skips what is not a tensor), else found by a walk."""
    if info.flat:
        return (*args, *kwargs.values()) if kwargs else args
    return tensors_of(args, kwargs)


def tensors_of(*objs: Any) -> list[torch.Tensor]:
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
                    found.extend(tensors_of(y))
        elif isinstance(x, dict):
            found.extend(tensors_of(*x.values()))
    return found


@dataclass(frozen=True, slots=True)
class _OpInfo:
    """What the tracer needs to know about one op overload, read from its schema once."""

    name: str
    probed: bool
    """Its kernel allocates buffers inside (:data:`PROBED_OPS`), or may (``when``)."""
    when: tuple[Callable[..., bool], Any] | None
    """``(test, its first argument)`` of an op probed only where its arguments make it hold buffers
    (:data:`CONDITIONAL_PROBES`: a matrix product's operand BLAS cannot read, operands of two dtypes)."""
    real_storage: bool
    """Its CPU kernel returns another storage size than its meta kernel (:data:`REAL_STORAGE_OPS`)."""
    written: tuple[tuple[int, str], ...]
    """Arguments it writes in place: ``(position, name)``."""
    flat: bool
    """No argument is a list of tensors: its tensors are found without a recursive walk."""
    allocates: bool
    """Whether an output can have a storage not seen before (see ``_may_allocate``)."""
    accumulation: bool
    """``aten.add.Tensor``, which may be autograd accumulating two gradients (see ``_fold_accumulations``)."""
    foreach: bool
    """An ``aten._foreach_`` op: in the optimizer step, its ``j``-th output is for its first list's ``j``-th
    tensor's parameter (see ``_output_owners``); any other op's outputs are for the event's parameter."""
    before: bool
    """``probed`` or ``written``: ``_before_op`` has something to record (one test per op for both)."""
    after: bool
    """``real_storage`` or ``accumulation``: ``_after_op`` has something to record."""
    call: Callable[..., Any]
    """What runs the op: an ``OpOverload``'s builtin (its ``__call__`` is a Python frame that only calls
    it), else the operator itself."""


_OPS: dict[int, _OpInfo | None] = {}  # per op overload's id; None for what is not work on tensors
_OP_OBJECTS: list[Any] = []  # the overloads ``_OPS`` holds ids of, kept alive so that no id is reused
_UNSEEN = object()


# Ops that update running statistics in place although their schema does not say so (``Tensor?`` without
# ``(a!)``): BatchNorm's legacy kernels, in training mode (argument 5, ``training``).
_UNANNOTATED_WRITES = frozenset({"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"})
_RUNNING_STATS = ((3, "running_mean"), (4, "running_var"))


def _op_info(func: Any) -> _OpInfo | None:
    info = None
    if func.namespace not in _NOT_OPS:
        name = str(func).removesuffix(".default")
        schema = getattr(func, "_schema", None)  # higher-order operators have none
        arguments = schema.arguments if schema is not None else None
        returns = schema.returns if schema is not None else None
        when = CONDITIONAL_PROBES.get(name)
        probed = name in PROBED_OPS or when is not None
        written = _write_positions(schema) if schema is not None else ()
        real_storage, accumulation = name in REAL_STORAGE_OPS, func is _ADD
        info = _OpInfo(
            name=name,
            probed=probed,
            when=when,
            real_storage=real_storage,
            written=written,
            flat=arguments is not None
            and all(str(a.type) in _SINGLE_TENSOR or "Tensor" not in str(a.type) for a in arguments),
            allocates=returns is None or _may_allocate(schema),
            accumulation=accumulation,
            foreach=name.startswith(_FOREACH),
            before=probed or bool(written),
            after=real_storage or accumulation,
            call=func._op if type(func) is torch._ops.OpOverload else func,
        )
    _OPS[id(func)] = info
    _OP_OBJECTS.append(func)
    return info


# --- what the compiled path (``_native``) is told -------------------------------------------------------------

# The kernel tests of ``_kernels`` that ``_native.cpp`` has a port of, by the number it knows each by; an op probed by
# any other test goes through ``__torch_dispatch__`` every time.
_NATIVE_TESTS: dict[Callable[..., bool], int] = {
    blas_copies: 1,
    casts_an_operand: 2,
    casts_to_its_dtype: 3,
    reads_a_copy: 4,
    strides_differ: 5,
    index_copies: 6,
}


def _native_plan(qualified: str, overload: str) -> tuple[Any, ...] | None:
    """What the compiled path needs of an aten op, from its ``_OpInfo``: ``(name, allocates, foreach, positions of
    the arguments it writes, accumulation, test, test's first argument)``; ``None`` where every call must go through
    ``__torch_dispatch__`` (not work on tensors, a kernel probed at every call, BatchNorm's unannotated writes)."""
    packet = getattr(torch.ops.aten, qualified.removeprefix("aten::"))
    func = getattr(packet, overload or "default")
    info = _OPS.get(id(func), _UNSEEN)
    if info is _UNSEEN:
        info = _op_info(func)
    if info is None or (info.probed and info.when is None) or info.written is _RUNNING_STATS:
        return None
    test, first = (None, None) if info.when is None else info.when
    number = 0 if test is None else _NATIVE_TESTS.get(test)
    if number is None:
        return None
    written = tuple(i for i, _ in info.written)
    return (info.name, info.allocates, info.foreach, written, info.accumulation, number, first)


_native_configured = False


def _native_module() -> Any:
    global _native_configured
    native = _native.module()
    if native is not None and not _native_configured:
        native.configure(
            {
                "storage_type": _Storage,
                "storage_fields": [
                    (f.name, None if f.default is MISSING else f.default, f.default is not MISSING)
                    for f in fields(_Storage)
                ],
                "ref_type": _StorageRef,
                "accumulation_type": _Accumulation,
                "category_other": Category.OTHER,
                "weights": Category.WEIGHTS,
                "frozen": Category.FROZEN,
                "gradients": Category.GRADIENTS,
                "optimizer_state": Category.OPTIMIZER,
                "detach": torch.ops.aten.detach.default,
                "python_hook": StepTracer.__torch_dispatch__,
                "zero_grad": "zero_grad",
                "python_pack": StepTracer.pack,
                "python_unpack": StepTracer.unpack,
                "python_detached": StepTracer._detached,
                "parameter_type": torch.nn.Parameter,
                "describe": _native_plan,
                "dtype_name": _dtype_name,
                "parts_outputs": StepTracer._output,
                "forward": "forward",
                "backward": "backward",
                "optimizer": "optimizer",
                "no_call": NO_CALL,
            }
        )
        _native_configured = True
    return native


def _attach_native(tracer: StepTracer) -> bool:
    """Have the compiled path record ``tracer``'s ordinary ops, where it can: a real (not fake) trace, with no op's
    outputs substituted, by this class's hook, or by a subclass's that only works out each op's phase by the rule
    the compiled path knows (``native_phases``)."""
    if tracer.fake or tracer.substitutes or not _hook_is_known(type(tracer)):
        return False
    native = _native_module()
    if native is None:
        return False
    native.attach(
        tracer,
        {
            "ops": tracer.ops,
            "storages": tracer.storages,
            "refs": tracer._refs,
            "scopes": tracer.scopes,
            "progress": tracer._progress,
            "writes": tracer.writes,
            "accumulations": tracer._accumulations,
            "finished": tracer.finished,
            "freed_after_backward": tracer.freed_after_backward,
            "frees_settled": tracer.frees_settled,
            "frees_elsewhere": tracer.frees_elsewhere,
            "thread": tracer._thread,
            "python_hook": type(tracer).__torch_dispatch__,
            "loop_phases": type(tracer).native_phases,
        },
    )
    tracer._on_free = native.free_callback(tracer)  # every free while attached recorded by the same code
    # what PyTorch asks of the mode itself (a tensor's detach) goes through the compiled path too
    tracer.__dict__["__torch_dispatch__"] = native.dispatch_method(tracer)
    return True


def _hook_is_known(kind: type) -> bool:
    """Whether every ``__torch_dispatch__`` on ``kind``'s way to :class:`StepTracer`'s is the class's that declares
    ``native_phases`` (a rule for each op's phase, then this class's hook), so that the compiled path does what the
    hook would."""
    for cls in kind.__mro__:
        if cls is StepTracer:
            return True
        if "__torch_dispatch__" in cls.__dict__ and not ("native_phases" in cls.__dict__ and cls.native_phases):
            return False
    return False


_SINGLE_TENSOR = frozenset({"Tensor", "Optional[Tensor]"})
# In-place ops that point their argument at another storage: ``set_()`` gives it a new, empty one.
_STORAGE_SWAPS = frozenset({"aten::set_"})


def _may_allocate(schema: Any) -> bool:
    """Whether an op's outputs can use a storage that none of its inputs uses. Not when every tensor it
    returns aliases an argument (a view ``Tensor(a)``, or the argument an in-place op wrote,
    ``Tensor(a!)``): its storage is the argument's, already tracked. Nor when it returns no tensor at all
    (``_local_scalar_dense``, in-place ``_foreach`` ops). A third of a training step's ops are such."""
    if schema.name in _STORAGE_SWAPS:
        return True
    return any("Tensor" in str(r.type) and r.alias_info is None for r in schema.returns)


def _write_positions(schema: Any) -> tuple[tuple[int, str], ...]:
    if schema.name in _UNANNOTATED_WRITES:
        return _RUNNING_STATS
    return tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )


def _written(where: tuple[tuple[int, str], ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensors the op writes in place: arguments its schema marks ``Tensor(a!)``, and the running
    statistics of BatchNorm's kernels in training."""
    if where is _RUNNING_STATS and not (args[5] if len(args) > 5 else kwargs.get("training", False)):
        return []
    return tensors_of(*(args[i] if i < len(args) else kwargs.get(name) for i, name in where))


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


def _dtensor_types() -> tuple[type, ...]:
    """``(DTensor,)`` once ``torch.distributed.tensor`` is imported, else ``()``: no DTensor can exist before
    then, and importing it here would cost a second of start-up for every trace."""
    module = sys.modules.get("torch.distributed.tensor")
    return (module.DTensor,) if module is not None else ()


_get_ident = threading.get_ident  # asked at every free: bound once
_DisableTorchDispatch = torch._C._DisableTorchDispatch
_dispatch_stack_depth = torch._C._len_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_pop_dispatch_mode = torch._C._pop_torch_dispatch_stack
_push_dispatch_mode = torch._C._push_on_torch_dispatch_stack
_STRIDED = torch.strided
_Tensor = torch.Tensor
# The storage's identity, as ``storage_key`` (``untyped_storage()._cdata``) gives it, without making the
# Python storage object: half the cost, for every tensor of every op.
_storage_address = torch._C._storage_address
# Sparse and nested tensors have no single storage; a DTensor wrapper holds no bytes of its own (its local
# shard does, and the shard's own ops are dispatched separately). Refreshed when a tracer starts.
_NO_STORAGE: tuple[type, ...] = ()


def _has_storage(t: torch.Tensor) -> bool:
    return t.layout is _STRIDED and not isinstance(t, _NO_STORAGE)


def _is_dtensor(t: torch.Tensor) -> bool:
    types = _dtensor_types()
    return bool(types) and isinstance(t, types)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds this rank's bytes: a DTensor's local shard, else ``t`` itself."""
    if type(t) in _PLAIN:  # asked for every parameter and state tensor of a trace: no module lookup for these
        return t
    return t._local_tensor if _is_dtensor(t) else t  # type: ignore[attr-defined]


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def active_tracer() -> StepTracer | None:
    """The step tracer currently on the dispatch mode stack, if any (for hooks of distributed engines)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, StepTracer)), None)
