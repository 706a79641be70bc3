"""Record the user's own training loop: every storage of every step, as the loop runs, unchanged.

``record(model, optimizer)`` is a context manager (and a decorator) around any training code. It traces
the steps inside with the same tracer as :func:`trainledger.trace` and finds the phases itself:

- **a step** runs from the return of one ``optimizer.step()`` (or from entering ``record``) to the return
  of the next; with several optimizers, until each has stepped. So ``zero_grad``, the scheduler's step and
  a GradScaler's ``update()`` that follow an optimizer step open the next step (phase ``zero_grad``), and
  gradient accumulation's micro-batches all fall inside the step whose optimizer step they feed;
- **forward**: ops inside a call of any module of the model, and the loss computed from its output;
- **backward**: ops autograd's engine runs (recomputations of checkpointed regions included);
- **optimizer**: ops inside ``optimizer.step()``, and those between backward and it (a GradScaler's
  ``unscale_``, gradient clipping).

Nothing the loop computes changes: the tracer only watches (same kernels, same random numbers); weights,
optimizer state and RNG after ``record`` are bitwise what the loop alone makes.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(8, 4)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with record(model, opt) as rec:
    ...     for _ in range(3):
    ...         model(torch.randn(2, 8)).square().mean().backward()
    ...         opt.step()
    ...         opt.zero_grad()
    >>> rec.steps, rec.ledger(step=1).evidence.value
    ((0, 1, 2), 'traced')

Under FSDP2 (``fully_shard``), the gathered parameters that FSDP2 frees and re-grows by resizing their
storages are followed as they are (see :func:`trainledger.trace.fsdp_storages`).

A step a GradScaler skips (infs or NaNs in the gradients: ``scaler.step(optimizer)`` returns without calling
``optimizer.step()``) ends where the scaler decides, as its own step: its ledger has ``meta["skipped"]`` true
and says so in its notes.

Known limitations:
    - Tensors that exist when a step begins count when an op of the step uses them or when the loop holds
      them (found among Python's objects); tensors held only inside C++ objects (a retained autograd graph)
      are not seen.
    - A ``torch.compile``-d module runs compiled in a traced step too (the tracer steps aside for its calls),
      but dispatch cannot see inside: each call and its compiled backward is one event, what it returns and
      saves is traced from there, its buffers inside are measured (CPU: the profiler, so not under a profiler
      the user runs; CUDA: the peak counter, reset for each call). A module compiled after the step began runs
      eagerly in that step, and its ledger says so: compile before ``record``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import os
import time
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from trainledger.checks import describe, instance_of
from trainledger.errors import InputError
from trainledger.inventory import iter_state, storage_key, trained_outside, trains_none_of
from trainledger.ledger import ROOT_SCOPE, Category, Entry, Ledger, Peak
from trainledger.record._compiled import (
    CompiledRegions,
    compiled_modules,
    compiled_note,
    dynamo_skipped,
    eager_functions_note,
    eager_note,
    optimized_module_type,
)
from trainledger.record._scaler import SKIPPED_NOTE, watching_skipped_steps
from trainledger.trace import (
    ModuleScopes,
    SparseStepTracer,
    StepTracer,
    fsdp_storages,
    has_sparse_gradients,
    mark_optimizer_outputs,
    rng_states_seen,
    traced_ledger,
    with_kernel_workspace,
)
from trainledger.units import counted
from trainledger.workload import iter_tensors

_current_node = torch._C._current_autograd_node


_OUTSIDE = {"forward": "forward", "backward": "optimizer", "optimizer": "optimizer"}
"""The phase of an op between the model's modules and outside the optimizer step, by the last phase seen."""


class _LoopTracer(StepTracer):
    """The step tracer, with the phase taken from where each op runs (the loop is the user's, so no
    caller can announce the phases)."""

    native_phases = _OUTSIDE  # the compiled path applies __torch_dispatch__'s rule itself

    def __init__(self, scopes: ModuleScopes) -> None:
        super().__init__(scopes)
        self.phase = "zero_grad"
        self.after = ""  # the last of forward / backward / optimizer this step has seen
        self.in_optimizer = False
        self.optimizer_ended = 0  # the number of events when an optimizer's step last returned
        self.closure_forward = False  # the model ran inside optimizer.step(closure) (Lightning's automatic loop)
        self.passthrough = False  # a compiled backward runs: its ops are not the step's to see one by one
        self.saved_in_region: list[torch.Tensor] | None = None  # saved by a compiled call, not yet tracked

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self.passthrough:
            return func(*args, **(kwargs or {}))
        if _current_node() is not None:
            self.phase = self.after = "backward"
        elif self.scopes.stack:  # before the optimizer test: Lightning runs forward inside step(closure)
            self.phase = self.after = "forward"
            self.closure_forward = self.in_optimizer
        elif self.in_optimizer and not (self.closure_forward and self.after == "forward"):
            self.phase = "optimizer"  # not the loss a closure computes from the model's output
        else:  # between modules: the loss after forward; unscale_ and clipping after backward
            self.phase = _OUTSIDE.get(self.after, "zero_grad")
        return super().__torch_dispatch__(func, types, args, kwargs)

    def made_by_a_module(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was made during the step inside one of the model's modules (an output of the
        generator handed to the discriminator), not by the loop."""
        rec = self.storages.get(storage_key(t)) if t.layout is torch.strided else None
        return rec is not None and rec.alloc_event is not None and rec.owner not in ("", ROOT_SCOPE)

    def mark_prepared(self) -> None:
        """As the model is called: name each storage the loop made since the last op that ran in forward (a
        module's, or the loss's) or in backward, and still holds, as the step's input (role ``loop_input``), up to
        the call of a module around the model (DDP's wrapper).
        Between those ops runs only the loop's own code: loading the next micro-batch, ``zero_grad``; not what
        an optimizer's step makes between the calls its closure makes (L-BFGS's history)."""
        if self.in_optimizer:
            return
        ops = self.ops
        began = len(ops)
        while began > self.optimizer_ended and ops[began - 1][0] not in ("forward", "backward"):
            began -= 1
        # what a module around the model made once it was called (DDP's gradient buckets) is that module's
        ended = self.scopes.outer_call_began if self.scopes.outer_call_began >= began else len(ops)
        for rec in self.storages.values():
            if rec.category is None and rec.alloc_event is not None and began <= rec.alloc_event < ended:
                rec.category, rec.role = Category.INPUTS, "loop_input"

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.saved_in_region is not None and t.layout is torch.strided and storage_key(t) not in self.storages:
            self.saved_in_region.append(t)
        return super().pack(t)


def _no_grad_calls_note(tracer: StepTracer) -> tuple[str, ...]:
    """A note when the model ran under ``no_grad`` in the step (an evaluation between two steps, targets computed by
    the model itself): what those calls made is counted with the step's forward."""
    calls = [c for c in tracer.module_calls() if c.path == ROOT_SCOPE]
    quiet = sum(not c.grad for c in calls)
    if not quiet:
        return ()
    return (
        f"the model ran {counted(quiet, 'time')} under no_grad in this step (of {len(calls)} calls): what those calls "
        "made (an evaluation's activations and temporaries) is counted in this step's forward phase",
    )


def _warn_of_foreign_optimizers(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """An optimizer that trains none of the model's parameters is most likely another model's (``record(m, o2)``
    where the loop steps ``m``'s own): its steps would never end the model's, and every iteration would be one
    step. Said, not refused: prompt tuning trains only what is beside a model whose weights may still ask for
    gradients."""
    for opt in optimizers:
        if trains_none_of(model, opt):
            warnings.warn(
                f"the {type(opt).__name__} given to record() trains none of {type(model).__name__}'s parameters; "
                "if the loop steps another optimizer for this model, give that one (a step ends when each optimizer "
                "given has stepped)",
                stacklevel=4,
            )


_RUNNING: list[Recording] = []  # the record(...) entered now: one at a time (each step's tracer is a mode)


class _SparseLoopTracer(_LoopTracer, SparseStepTracer):
    """The loop's tracer for a model with sparse gradients (see ``trace``'s sparse tracer)."""


@dataclasses.dataclass
class _Live:
    """The step being traced now."""

    index: int
    tracer: _LoopTracer
    hooks: torch.autograd.graph.saved_tensors_hooks
    rng_states: contextlib.AbstractContextManager[None]
    """``rng_states_seen`` of the step: the generator states checkpointing copies, tracked."""
    start: float
    """``time.perf_counter()`` as the step opened."""
    seconds: float = 0.0
    """How long the step ran under the tracer (set as it closes)."""
    skipped: bool = False
    """A GradScaler skipped an optimizer's step in it."""


class Recording(contextlib.ContextDecorator):
    """What :func:`record` returns: enter it (``with``) or decorate a function with it; read it afterwards.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> rec = record(model, opt, steps=[1])
        >>> @rec
        ... def train():
        ...     for _ in range(2):
        ...         model(torch.randn(3, 4)).sum().backward()
        ...         opt.step()
        ...         opt.zero_grad()
        >>> train()
        >>> rec.steps, rec.peak().bytes > 0
        ((1,), True)
    """

    def __init__(
        self,
        model: nn.Module,
        *optimizers: torch.optim.Optimizer,
        steps: int | Iterable[int] | None = None,
        name: str = "",
        kernel_workspace: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InputError(f"record() takes the model first, not {describe(model)}; record(model, optimizer)")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise InputError(
                    f"record() takes the model's optimizers after it, not {describe(opt)}; "
                    "record(model, optimizer) or record(model, opt_a, opt_b)"
                )
        for opt in optimizers:
            if not hasattr(opt, "_optimizer_step_pre_hooks"):  # no step hooks: Optimizer.__init__ never ran
                inner = getattr(opt, "optimizer", None)
                instead = (
                    "give record the optimizer it wraps (its .optimizer): record(model, opt.optimizer)"
                    if isinstance(inner, torch.optim.Optimizer)
                    else "call super().__init__(params, defaults) in its __init__"
                )
                raise InputError(
                    f"record() cannot see {type(opt).__name__}'s steps: it subclasses torch.optim.Optimizer without "
                    f"running Optimizer.__init__, which sets up the step hooks record uses; {instead}"
                )
        if not isinstance(name, str):
            raise InputError(f"record(name=...) names the ledgers: give a string, not {describe(name)}")
        if not optimizers:
            raise InputError("record() needs the optimizer that ends each step: record(model, optimizer)")
        if len({id(opt) for opt in optimizers}) < len(optimizers):
            raise InputError(
                "record() was given the same optimizer twice; give each optimizer once (a step ends when each has "
                "stepped)"
            )
        _warn_of_foreign_optimizers(model, optimizers)
        # held weakly but while the loop runs inside: a recording kept to read its ledgers must not keep the model
        # and its optimizer state alive (on a GPU, all of its memory) once the loop has let go of them
        self._model = weakref.ref(model)
        self._optimizers = tuple(weakref.ref(o) for o in optimizers)
        self._held: tuple[nn.Module, tuple[torch.optim.Optimizer, ...]] | None = None
        self._device = _model_device(model)
        self.selected = _selection(steps)
        self.name = name or type(model).__name__
        self.kernel_workspace = kernel_workspace
        self._ledgers: dict[int, Ledger] = {}
        self._next = 0  # the index of the step open now, or that opens next: the steps ended so far
        self._stepped: set[int] = set()  # optimizers done (stepped or skipped) in the step open now
        self._returned: set[int] = set()  # optimizers whose step() returned since the scaler last asked
        self._live: _Live | None = None
        self._handles: list[Any] = []
        self._watches = contextlib.ExitStack()  # what record follows outside dispatch while it runs
        self._compiled: list[str] = []  # modules that run compiled
        # the regions ask for the tracer through a weak reference: a closure over ``self`` would make a cycle
        # that keeps the model and its optimizers alive after the user lets go of them, until a collection
        self._regions = CompiledRegions(model, functools.partial(_live_tracer, weakref.ref(self)))
        self._entered = False
        self._stranded: _Live | None = None  # a step's tracer left under another dispatch mode (see ``_pop``)
        self._beside: list[tuple[str, torch.Tensor]] = []  # trained by the optimizers, not the model's

    # --- entering and leaving --------------------------------------------------------------------

    def __enter__(self) -> Recording:
        if self._entered:
            raise InputError("this record(...) is already running; it cannot be entered again inside itself")
        if _RUNNING:
            raise InputError(
                f"another record(...) is running (of {_RUNNING[-1].name}); one record runs at a time (each step's "
                "tracer is a dispatch mode): leave it before entering this one"
            )
        model, optimizers = self._model(), tuple(ref() for ref in self._optimizers)
        if model is None or any(o is None for o in optimizers):
            raise InputError(
                "the model or an optimizer this record(...) was made for has been freed; make a new record(model, "
                "optimizer) for the ones the loop trains"
            )
        self._held = (model, optimizers)  # type: ignore[assignment]
        self._device = _model_device(model)
        self._entered = True
        try:
            # what the optimizers train beside the model (a soft prompt): found once, not at every step
            self._beside = [named for opt in self.optimizers for named in trained_outside(self.model, opt)]
            self._handles.append(self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
            if type(self.model).forward is nn.Module.forward:  # a container the loop never calls: its modules
                for child in self.model.children():
                    hook = functools.partial(self._before_forward, from_loop_only=True)
                    self._handles.append(child.register_forward_pre_hook(hook, with_kwargs=True))
            for opt in self.optimizers:
                self._handles.append(opt.register_step_pre_hook(self._before_optimizer))
                self._handles.append(opt.register_step_post_hook(self._after_optimizer))
            self._watches.enter_context(watching_skipped_steps(self._step_returned, self._skipped_optimizer))
            self._watches.enter_context(fsdp_storages(self.model))  # FSDP2's gathered parameters, resized
            self._watches.enter_context(self._regions)
            self._open()
        except BaseException:
            self._leave()  # nothing of a failed entry stays behind: hooks, patches, the running flag
            raise
        _RUNNING.append(self)
        return self

    def __exit__(self, exc_type: object, *_exc: object) -> None:
        try:
            # a step that reached backward and the loop ended normally: record it, as a step; one that did not
            # (nothing, or an evaluation's forward after the last step) is no step, and the next entry's first
            # step takes its index. If the loop raised, only let go (the user's exception is the one to see)
            if exc_type is None and self._live is not None and self._live.tracer.after in ("backward", "optimizer"):
                self._close()
                self._next += 1
            else:
                self._discard()
        finally:
            self._leave()

    def _leave(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._watches.close()
        self._let_go_of_stranded()
        self._entered = False
        if self in _RUNNING:
            _RUNNING.remove(self)
        if self._held is not None:
            self._device = _model_device(self._held[0])
        self._held = None
        self._beside = []
        self._compiled = []

    @property
    def model(self) -> nn.Module:
        """The recorded model (while the loop runs inside ``record``; after, while anything else holds it)."""
        model = self._held[0] if self._held is not None else self._model()
        if model is None:
            raise InputError("the recorded model has been freed; its ledgers are still here (rec.ledger(step))")
        return model

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        if self._held is not None:
            return self._held[1]
        held = tuple(ref() for ref in self._optimizers)
        if any(o is None for o in held):
            raise InputError("an optimizer of this record(...) has been freed; its ledgers are still here")
        return held  # type: ignore[return-value]

    # --- hooks ----------------------------------------------------------------------------------

    def _before_forward(self, _model: nn.Module, args: Any, kwargs: Any, *, from_loop_only: bool = False) -> None:
        """The model's inputs, made during the step (the batch moved to the device) or held by the loop since
        before it (a batch already in memory): inputs, not workspace; and what the loop made since the last op
        of a module, of backward or of the loss and still holds as the model is called (the loss's targets, a
        mask, a diffusion step's noise): the step's inputs too. ``from_loop_only``: a module of a container the
        loop calls by parts (a GAN's generator and discriminator), whose inputs may be another's outputs."""
        if self._live is not None:
            tracer = self._live.tracer
            tensors = list(iter_tensors((args, kwargs)))
            if from_loop_only:
                tensors = [t for t in tensors if not tracer.made_by_a_module(t)]
            for i, t in enumerate(tensors):
                tracer.mark(t, Category.INPUTS, "batch", f"batch[{i}]")
            tracer.mark_prepared()

    def _before_optimizer(self, opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        live = self._live
        if live is None:
            return
        live.tracer.in_optimizer = True
        live.tracer.closure_forward = False
        live.tracer.phase = "optimizer"
        self._name_gradients(live)

    def _name_gradients(self, live: _Live) -> None:
        for pname, p in [*self.model.named_parameters(), *self._beside]:  # gradients exist now: name them
            if p.grad is not None:
                live.tracer.mark(p.grad, Category.GRADIENTS, "grad", f"{pname}.grad")

    def _after_optimizer(self, opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._returned.add(id(opt))
        if self._live is not None:
            self._live.tracer.in_optimizer = False
            self._live.tracer.optimizer_ended = self._live.tracer.num_events
            self._live.tracer.after = "optimizer"
        self._done(opt)

    def _step_returned(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt.step()`` returned since the last time this was asked (the GradScaler's watch asks)."""
        returned = id(opt) in self._returned
        self._returned.discard(id(opt))
        return returned

    def _skipped_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """A GradScaler passed over ``opt.step()``: the step ends here as if it had stepped."""
        if not any(o is opt for o in self.optimizers):
            return
        if self._live is not None:
            self._name_gradients(self._live)
            self._live.skipped = True
            self._live.tracer.after = "optimizer"
        self._done(opt)

    def _done(self, opt: torch.optim.Optimizer) -> None:
        """``opt`` stepped (or was skipped); once every optimizer has, the step ends and the next opens."""
        self._stepped.add(id(opt))
        if len(self._stepped) < len(self.optimizers):
            return
        self._stepped.clear()
        self._close()
        self._next += 1
        self._open()

    # --- one step's tracer ------------------------------------------------------------------------

    def _open(self) -> None:
        index = self._next
        if self.selected is not None and index not in self.selected:
            return
        self._regions.patch()  # modules compiled since the last step
        # one walk of Python's objects (a large process holds millions): the compiled wrappers and the tensors
        objects = _objects_of_types({torch.Tensor, nn.Parameter, optimized_module_type()} - {None})
        self._compiled = compiled_modules(self.model, [o for o in objects if not isinstance(o, torch.Tensor)])
        scopes = ModuleScopes([("", self.model)])
        kind = _SparseLoopTracer if has_sparse_gradients(self.model) else _LoopTracer
        tracer = (dynamo_skipped(kind) if self._compiled else kind)(scopes)
        for opt in self.optimizers:
            for t, owner in iter_state(self.model, opt):
                tracer.known(t, owner.name, owner.category, owner.role)
        devices = {p.device for p in self.model.parameters()}
        for i, t in enumerate(_held_tensors(objects, devices, tracer.storages)):
            tracer.known(t, f"held_by_loop[{i}]", Category.OTHER, "held")
        del objects  # no reference of ours outlives the step's start
        scopes.open()
        hooks = torch.autograd.graph.saved_tensors_hooks(tracer.pack, tracer.unpack)
        # the CPU generator's state checkpointing copies is host memory: counted when the model is on the CPU
        rng_states = rng_states_seen(tracer, enabled=all(d.type == "cpu" for d in devices))
        hooks.__enter__()
        tracer.__enter__()
        rng_states.__enter__()
        self._live = _Live(index, tracer, hooks, rng_states, time.perf_counter())

    def _pop(self) -> _Live | None:
        live, self._live = self._live, None
        if live is None:
            return None
        live.seconds = time.perf_counter() - live.start
        live.rng_states.__exit__(None, None, None)
        top = _get_current_dispatch_mode()
        if top is not live.tracer:
            live.tracer.stop()
            live.tracer.scopes.close()
            self._stranded = live  # under the other mode on the stack: leaving record takes it off, once it can
            raise InputError(
                f"a step ended inside another dispatch mode ({type(top).__name__}) entered after record(); "
                "enter that mode outside record(...), or end it before optimizer.step()"
            )
        live.tracer.__exit__(None, None, None)
        live.hooks.__exit__(None, None, None)
        live.tracer.scopes.close()
        return live

    def _let_go_of_stranded(self) -> None:
        """Take a tracer that a step ended under another dispatch mode off the stack, once that mode has ended
        (otherwise every later op of the process would still pass through it)."""
        live, self._stranded = self._stranded, None
        if live is not None and _get_current_dispatch_mode() is live.tracer:
            live.tracer.__exit__(None, None, None)
            live.hooks.__exit__(None, None, None)

    def _discard(self) -> None:
        live = self._pop()
        if live is not None:
            live.tracer.stop()
            self._regions.take()

    def _close(self) -> None:
        live = self._pop()
        if live is None:
            return
        tracer = live.tracer
        parameters = list(self.model.parameters())  # a steady step, every state named, walks no more
        for opt in self.optimizers:
            mark_optimizer_outputs(tracer, self.model, opt, parameters=parameters)
        tracer.stop()
        regions, unmeasured, eager_calls = self._regions.take()
        eager = self._regions.unrouted()
        if eager_calls:  # training changed: said as it runs, not only in the ledger read afterwards
            warnings.warn(eager_functions_note(eager_calls)[0], stacklevel=2)
        if not tracer.num_events:
            return
        ledger = traced_ledger(
            tracer,
            name=self.name,
            seconds=live.seconds,
            optimizers=list(self.optimizers),
            parameter_order=[n for n, _ in self.model.named_parameters()],
            notes=(
                *compiled_note(self._compiled, unmeasured),
                *eager_note(eager),
                *eager_functions_note(eager_calls),
                *((SKIPPED_NOTE,) if live.skipped else ()),
                *_no_grad_calls_note(tracer),
            ),
            meta={"step": live.index, "recorded": True, **({"skipped": True} if live.skipped else {}), **_rank()},
        )
        device = _model_device(self.model)
        inside = [e for e in (r.entry(device) for r in regions) if e is not None]
        ledger = ledger.with_entries([*_reclassified(ledger, device), *inside])
        if self.kernel_workspace:
            with torch.random.fork_rng(devices=[]):  # running a kernel alone must not move the loop's RNG
                ledger = with_kernel_workspace(ledger, tracer.kernel_calls)
        self._ledgers[live.index] = ledger

    # --- results --------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the loop is inside this ``record`` now."""
        return self._entered

    @property
    def steps(self) -> tuple[int, ...]:
        """The indices of the recorded steps (the first step inside ``record`` is 0)."""
        return tuple(sorted(self._ledgers))

    def ledger(self, step: int | None = None, *, device: str | None = None) -> Ledger:
        """The ledger of recorded step ``step`` (default: the step with the highest peak).

        Arguments:
            step: a step index from :attr:`steps`.
            device: keep only arrays on this device (``"cpu"`` shows activations that
                ``torch.autograd.graph.save_on_cpu`` moved to the host); default: all, or the model's
                device when the step used several (the host's entries are then named in a note).
        """
        if not self._ledgers and self.selected is not None and self._next <= min(self.selected):
            raise InputError(
                f"no step was recorded: steps={sorted(self.selected)} asked for steps the loop never reached "
                f"({self._next} ended inside record, numbered from 0); ask for an earlier step"
            )
        if not self._ledgers:
            raise InputError(
                "no step was recorded: a step ends when optimizer.step() returns "
                f"(steps ended inside record so far: {self._next}); "
                "run the training loop inside `with record(model, optimizer):`"
            )
        if step is None:
            step = max(self._ledgers, key=lambda k: (self._ledgers[k].peak().bytes, -k))
        if step not in self._ledgers or type(step) is not int:  # True and 1.0 are keys equal to 1
            raise InputError(f"step {step!r} was not recorded; recorded steps: {list(self.steps)}")
        led = self._ledgers[step]
        return _on_device(led, self._device if device is None else _named_device(led, device))

    def peak(self) -> Peak:
        """The highest peak over the recorded steps (its ``event`` is on that step's clock; see
        ``ledger().meta["step"]``)."""
        return self.ledger().peak()

    def save(self, path: str | Path, *, step: int | None = None) -> Path:
        """Write a step's ledger (default: the one with the highest peak) as JSON that ``trainledger report``
        reads. Returns the path written."""
        out = Path(instance_of(path, (str, os.PathLike), "the path to save to", "give a file name such as 'step.json'"))
        if out.is_dir():
            raise InputError(f"{str(out)!r} is a folder; give a file name such as {str(out / 'step.json')!r}")
        if out.suffix.lower() != ".json":
            raise InputError(
                f"{str(out)!r}: save writes the ledger as JSON; give a .json name (the page: trainledger report "
                "step.json --html step.html)"
            )
        data = self.ledger(step).to_dict()
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data))
        except OSError as exc:
            raise InputError(f"cannot write {str(out)!r}: {exc.strerror or type(exc).__name__}") from None
        return out


def record(
    model: nn.Module,
    *optimizers: torch.optim.Optimizer,
    steps: int | Iterable[int] | None = None,
    name: str = "",
    kernel_workspace: bool = True,
) -> Recording:
    """Trace the training code run inside, step by step, without changing it.

    Arguments:
        model: the model being trained (its modules name the forward and backward ops).
        optimizers: the optimizers that end each step (one, or several that all step once per step).
        steps: which steps to trace (indices from 0, the first step inside ``record``): ``None`` for all,
            an int for one, or a collection. The others run untraced, at full speed.
        name: the model's name in the ledgers (default: its class name).
        kernel_workspace: also measure the buffers CPU kernels allocate inside one op (as ``trace`` does).

    Returns:
        A :class:`Recording`: use it as ``with record(...) as rec:`` or as a decorator, then read
        ``rec.ledger(step=k)``, ``rec.peak()``, ``rec.save(path)``.
    """
    return Recording(model, *optimizers, steps=steps, name=name, kernel_workspace=kernel_workspace)


def _live_tracer(recording: weakref.ref[Recording]) -> StepTracer | None:
    """The tracer of the step ``recording`` is tracing now, if any."""
    rec = recording()
    return None if rec is None or rec._live is None else rec._live.tracer


def _selection(steps: int | Iterable[int] | None) -> frozenset[int] | None:
    if steps is None:
        return None
    chosen = [steps] if isinstance(steps, int) else steps
    try:
        chosen = list(chosen)  # type: ignore[arg-type]
    except TypeError:
        chosen = [steps]  # type: ignore[list-item]
    bad = [s for s in chosen if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad or not chosen:
        raise InputError(
            f"record(steps=...) is {steps!r}; give None (every step), a step index such as 3, or indices such "
            "as [1, 5] (0 is the first step inside record)"
        )
    return frozenset(chosen)


def _objects_of_types(types: set[Any]) -> list[Any]:
    """Python's objects whose type is one of ``types`` exactly (not ``isinstance``: that asks every object for
    its ``__class__``, and some warn), in one walk."""
    return [obj for obj in gc.get_objects() if type(obj) in types]


def _held_tensors(objects: list[Any], devices: set[torch.device], known: dict[int, Any]) -> list[torch.Tensor]:
    """Tensors on the model's devices that Python objects hold as the step begins (the last batch, output
    and loss the loop's variables still refer to), one per storage, not already declared; ``objects``: the
    process's plain tensors and parameters (and what else the caller's walk found)."""
    found: dict[int, torch.Tensor] = {}
    plain = (torch.Tensor, nn.Parameter)
    for obj in objects:
        if type(obj) in plain and obj.layout is torch.strided and obj.device in devices:
            key = storage_key(obj)
            if key not in known and key not in found and obj.untyped_storage().nbytes():
                found[key] = obj
    return list(found.values())


def _reclassified(ledger: Ledger, device: str) -> list[Entry]:
    """Entries the tracer's rules do not name, named from their lifetimes: a forward allocation not saved
    through autograd's hooks but freed during backward is held for backward (activations):
    ``save_on_cpu``'s host copies (role ``offloaded`` when not on the model's device), tensors a custom
    ``autograd.Function`` keeps on ``ctx``."""
    phases = [ev.phase for ev in ledger.events]
    out = []
    for e in ledger.entries:
        if (
            e.role == "forward_temporary"
            and e.free_event is not None
            and e.free_event < len(phases)
            and phases[e.free_event] == "backward"
        ):
            role = "offloaded" if e.device != device else "held_for_backward"
            e = dataclasses.replace(e, category=Category.ACTIVATIONS, role=role, last_use_event=e.free_event - 1)
        out.append(e)
    return out


def _named_device(ledger: Ledger, device: Any) -> str:
    """The device among ``ledger``'s entries that ``device`` names (``"cuda"`` names ``"cuda:0"``)."""
    instance_of(device, (str, torch.device), "device", "give one such as 'cpu' or 'cuda:0'")
    held = sorted({e.device for e in ledger.entries})
    named = [d for d in held if d == str(device) or d.split(":")[0] == str(device)]
    if len(named) != 1:
        which = "several" if named else "none"
        raise InputError(
            f"device {str(device)!r} names {which} of the devices the step's arrays are on: {', '.join(held)}"
        )
    return named[0]


def _on_device(ledger: Ledger, device: str) -> Ledger:
    devices = {e.device for e in ledger.entries}
    if len(devices) < 2:
        return ledger
    kept = [e for e in ledger.entries if e.device == device]
    others = sorted(devices - {device})
    note = (
        f"{len(ledger.entries) - len(kept)} arrays on {', '.join(others)} (activations offloaded to the host, the "
        f"batch before it is moved) are left out; see ledger(step, device={others[0]!r})"
    )
    return ledger.with_entries(kept, device=device, notes=(*ledger.notes, note))


def _model_device(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return "cpu" if p is None else str(p.device)


def _rank() -> dict[str, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    return {}
