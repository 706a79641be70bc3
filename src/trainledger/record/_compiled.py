"""Compiled regions of a recorded model: which modules ``torch.compile`` wraps, and how a traced step runs them.

While a dispatch mode that traces is on the stack, dynamo does not run compiled code: it skips every frame
("non-infra torch dispatch mode present") and the module would run eagerly, op by op — with inductor, other
kernels and other random numbers (a compiled dropout draws its own), so the training would change. So
:class:`CompiledRegions` runs each call of a compiled module as it runs without ``record``: the tracer's mode
popped off the stack and its module hooks taken off (dynamo would trace them into the graph), so dynamo finds
the same state and runs the same compiled graph. Dispatch cannot see inside that call, so the ledger covers it
as one event (op ``compiled:PATH``; in backward, AOT autograd's compiled backward is one event too):

- the storages the call returns (its outputs; in backward, the gradients) and those it saves for backward
  (seen through the saved-tensor hooks) are *traced* from that event on, freed when they really are;
- the buffers it allocates and frees inside are *measured*: the allocator's peak during the call (CUDA:
  ``max_memory_allocated`` reset before it; CPU: ``torch.profiler``'s allocation events), less what it
  returned or saved, is one ``workspace`` entry (role ``compiled_internal``, evidence ``measured``) live at
  that event. Under a profiler the user already runs, a CPU region cannot be measured (profilers do not nest):
  the ledger says so.

Inside the tracer's dispatch handler the mode is off the stack, so dynamo, still watching frames below the
compiled module's call, would compile the tracer's own code: :func:`dynamo_skipped` keeps it out.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from trainledger.inventory import storage_key
from trainledger.ledger import Category, Entry, Evidence
from trainledger.workload import iter_tensors

COMPILED_INTERNAL = "compiled_internal"
_WINDOW = "trainledger.compiled#"
_UNKNOWN_BLOCK = "Memory block of unknown size"


def compiled_modules(model: nn.Module, wrappers: Iterable[Any] | None = None) -> list[str]:
    """Paths of the modules of ``model`` that run compiled: ``module.compile()``-d ones, and those an
    ``OptimizedModule`` (``torch.compile(module)``) wraps, found among Python's objects ("(root)" for
    ``model`` itself). ``wrappers``: the process's ``OptimizedModule`` objects where the caller has walked
    Python's objects already (see :func:`optimized_module_type`)."""
    paths = _paths(model)
    found = {paths[id(m)] for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None}
    found |= {paths[id(m)] for m in model.modules() if id(getattr(m, "_orig_mod", None)) in paths}
    optimized = optimized_module_type()
    if optimized is None:  # nothing was compiled in this process (and importing dynamo costs seconds)
        return sorted(found)
    if wrappers is None:
        wrappers = [obj for obj in gc.get_objects() if type(obj) is optimized]
    found |= {paths[id(obj._orig_mod)] for obj in wrappers if id(obj._orig_mod) in paths}
    return sorted(found)


def optimized_module_type() -> type | None:
    """``torch.compile``'s wrapper class, ``None`` while dynamo is not imported (so nothing is compiled)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return None if dynamo is None else dynamo.OptimizedModule


def _paths(model: nn.Module) -> dict[int, str]:
    return {id(m): n or "(root)" for n, m in model.named_modules()}


@dataclasses.dataclass
class Region:
    """One compiled call in a traced step."""

    event: int
    op: str
    module: str
    made_bytes: int
    """Bytes of the storages it returned or saved for backward (traced from ``event`` on)."""
    freed_bytes: int
    """Bytes of traced storages it freed (no longer live at ``event``; a compiled backward frees what its
    forward saved as it goes)."""
    peak_bytes: int | None
    """The allocator's peak during the call above what was allocated as it began; ``None``: not measured."""
    window: str = ""
    """The profiler window (``record_function``) of the call, whose peak is read when the step ends."""

    def entry(self, device: str) -> Entry | None:
        """Its buffers inside, measured: what its peak held beyond the storages the ledger counts at its event
        (at ``event`` the ledger then holds what was live as the call began, plus its peak)."""
        if self.peak_bytes is None:
            return None
        nbytes = self.peak_bytes + self.freed_bytes - self.made_bytes
        if nbytes <= 0:
            return None
        return Entry(
            name=f"{self.op}#{self.event}:internal",
            category=Category.WORKSPACE,
            role=COMPILED_INTERNAL,
            dtype="uint8",
            numel=nbytes,
            nbytes=nbytes,
            device=device,
            owner=self.module,
            alloc_event=self.event,
            free_event=self.event + 1,
            evidence=Evidence.MEASURED,
            shape=(nbytes,),
        )


class CompiledRegions:
    """While entered, every call of a compiled module of ``model`` runs compiled even in a traced step, and
    enters itself into that step's tracer (see the module's docstring).

    Arguments:
        model: the recorded model.
        tracer: returns the tracer of the step being traced now (``None`` between traced steps). The tracer
            has ``passthrough`` (run ops unseen) and ``saved_in_region`` (``None``, or a list its pack hook
            appends unseen saved tensors to).
    """

    def __init__(self, model: nn.Module, tracer: Callable[[], Any]) -> None:
        self._model = weakref.ref(model)  # a recording kept after its loop must not keep the model alive
        self.tracer = tracer
        self.regions: list[Region] = []
        self._paths = _paths(model)
        self._patched: list[tuple[Any, str, Any]] = []
        self._profiler: Any = None
        self.eager_functions = 0
        """Calls of compiled functions (``torch.compile(fn)``, not of a module) in the step traced now: they ran
        eagerly under the tracer."""

    @property
    def model(self) -> nn.Module:
        model = self._model()
        assert model is not None, "used only while its recording runs, which holds the model"
        return model

    def __enter__(self) -> CompiledRegions:
        self.patch()
        return self

    def patch(self) -> None:
        """Route the compiled calls through :meth:`_call`: every ``OptimizedModule``'s (once dynamo is loaded:
        before, none exists), and each ``module.compile()``-d module's of the model not yet routed."""
        done = {(id(owner), attr) for owner, attr, _ in self._patched}
        dynamo = sys.modules.get("torch._dynamo.eval_frame")
        if dynamo is not None and (id(dynamo.OptimizedModule), "__call__") not in done:
            wrapper_call = dynamo.OptimizedModule.__call__

            def call(wrapper: Any, *args: Any, **kwargs: Any) -> Any:
                path = self._paths.get(id(wrapper._orig_mod))
                return self._call(path, functools.partial(wrapper_call, wrapper), *args, **kwargs)

            self._route(dynamo.OptimizedModule, "__call__", call)
        if dynamo is not None and (id(dynamo), "_maybe_set_eval_frame") not in done:
            set_eval_frame = dynamo._maybe_set_eval_frame

            def watched(callback: Any) -> Any:
                # a compiled function (not a module, whose calls ``_call`` runs with the tracer's mode off the
                # stack) switching dynamo on below the tracer: dynamo skips its frames (a dispatch mode is on
                # the stack), so they run eagerly; dynamo is left off for the call, or it would compile the
                # tracer's own frames, which run with the mode off the stack
                tracer = self.tracer()
                if callback and tracer is not None and _get_current_dispatch_mode() is tracer:
                    self.eager_functions += 1
                    callback = None
                return set_eval_frame(callback)

            self._route(dynamo, "_maybe_set_eval_frame", watched)
        for m in self.model.modules():
            compiled = m.__dict__.get("_compiled_call_impl")
            if compiled is not None and (id(m), "_compiled_call_impl") not in done:
                self._route(m, "_compiled_call_impl", functools.partial(self._call, self._paths[id(m)], compiled))

    def unrouted(self) -> list[str]:
        """Paths of the model's compiled modules whose calls are not routed (compiled after the step began, or
        with dynamo loaded since): if the step called them, they ran eagerly under the tracer."""
        routed = {id(owner) for owner, _, _ in self._patched}
        paths = {self._paths[id(m)] for m in self.model.modules() if id(m) in routed}
        if not any(attr == "__call__" for _, attr, _ in self._patched):  # no wrapper is routed
            return sorted(set(compiled_modules(self.model)) - paths)
        compiled = [m for m in self.model.modules() if m.__dict__.get("_compiled_call_impl") is not None]
        return sorted(self._paths[id(m)] for m in compiled if id(m) not in routed)

    def _route(self, owner: Any, attr: str, call: Any) -> None:
        self._patched.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, call)

    def __exit__(self, *_exc: object) -> None:
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched = []

    def _start_profiler(self) -> bool:
        """On the CPU, the profiler whose allocation events measure the compiled calls runs from a traced step's
        first compiled call to the step's end (not under the user's own: profilers do not nest). It spans the
        calls, not each call, so that frees inside a call of what the step allocated after the first one began
        (a compiled backward frees its forward's saved tensors as it goes) are seen too."""
        if self._profiler is None and not torch._C._autograd._profiler_enabled():
            from torch.profiler import ProfilerActivity, profile

            # the allocator warns at every free of a block allocated before the profiler started; a warning turned
            # into an error there (``-W error``) is raised inside a free, and the process crashes
            warnings.filterwarnings("ignore", message=_UNKNOWN_BLOCK)
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self._profiler is not None

    def take(self) -> tuple[list[Region], int, int]:
        """The regions of the step that ends now, measured, how many could not be, and how many compiled
        functions ran eagerly in it; starts the next."""
        prof, self._profiler = self._profiler, None
        regions, self.regions = self.regions, []
        eager_functions, self.eager_functions = self.eager_functions, 0
        if prof is not None:
            prof.__exit__(None, None, None)
            peaks = window_peaks(prof, _WINDOW)
            prof.profiler = None  # its results now, not in a later garbage collection (which crashed)
            warnings.filters[:] = [f for f in warnings.filters if getattr(f[1], "pattern", None) != _UNKNOWN_BLOCK]
            regions = [dataclasses.replace(r, peak_bytes=peaks.get(r.window)) if r.window else r for r in regions]
        return regions, sum(1 for r in regions if r.peak_bytes is None), eager_functions

    @contextlib.contextmanager
    def _measured(self, device: torch.device) -> Iterator[Callable[[], int | str | None]]:
        """Measure a compiled call: yields a function giving, once the block is done, its peak (CUDA), the name
        of its profiler window (CPU; read as the step ends), or ``None`` (not measurable)."""
        if device.type == "cuda":
            with _cuda_peak(device) as peak:
                yield peak
        elif device.type == "cpu" and self._start_profiler():
            name = f"{_WINDOW}{len(self.regions)}"
            with torch.profiler.record_function(name):
                yield lambda: name
        else:
            yield lambda: None

    def _call(self, path: str | None, compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        tracer = self.tracer()
        if path is None or tracer is None or _get_current_dispatch_mode() is not tracer:
            return compiled(*args, **kwargs)
        tracer.saved_in_region = []
        tracer.phase = tracer.after = "forward"
        num_freed = len(tracer.finished)
        try:
            with tracer.scopes.paused(), _pop_mode_temporarily(), self._measured(_device_of(args, kwargs)) as peak:
                out = compiled(*args, **kwargs)
            saved = tracer.saved_in_region
        finally:
            tracer.saved_in_region = None
        outputs = list(iter_tensors(out))
        self._enter(tracer, f"compiled:{path}", [*outputs, *saved], peak(), saved, num_freed)
        for node in {id(t.grad_fn): t.grad_fn for t in outputs if t.grad_fn is not None}.values():
            if type(node).__name__ == "CompiledFunctionBackward":
                self._watch_backward(node, path)
        return out

    def _watch_backward(self, node: Any, path: str) -> None:
        """AOT autograd's compiled backward runs in the autograd engine under the tracer: its ops pass unseen
        (its buffers never reach dispatch) and its call is one event, measured."""
        running: list[Any] = []

        def before(_grad_outputs: Any) -> None:
            tracer = self.tracer()
            if tracer is not None:
                tracer.passthrough = True
                stack = contextlib.ExitStack()
                peak = stack.enter_context(self._measured(_device_of(_grad_outputs, {})))
                running.append((tracer, stack, peak, len(tracer.finished)))

        def after(grad_inputs: Any, _grad_outputs: Any) -> None:
            if not running:
                return
            tracer, stack, peak, num_freed = running.pop()
            stack.close()
            tracer.passthrough = False
            tracer.phase = "backward"
            made = list(iter_tensors(grad_inputs))
            self._enter(tracer, f"compiled:{path}.backward", made, peak(), [], num_freed)

        node.register_prehook(before)
        node.register_hook(after)

    def _enter(
        self, tracer: Any, op: str, made: list[torch.Tensor], peak: int | str | None, saved: Any, num_freed: int
    ) -> None:
        freed_bytes = sum(r.nbytes for r in tracer.finished[num_freed:])
        event = tracer.outside_dispatch(op, made)
        for t in saved:
            tracer.pack(t)  # now that it is tracked: saved for backward
        storages = {storage_key(t): t.untyped_storage().nbytes() for t in made if t.layout is torch.strided}
        module = tracer.ops[event][2]
        made_bytes = sum(storages.values())
        window = peak if isinstance(peak, str) else ""
        self.regions.append(Region(event, op, module, made_bytes, freed_bytes, None if window else peak, window))


def _device_of(args: Any, kwargs: Any) -> torch.device:
    return next((t.device for t in iter_tensors((args, kwargs))), torch.device("cpu"))


@contextlib.contextmanager
def _cuda_peak(device: torch.device) -> Iterator[Callable[[], int | str | None]]:
    """The CUDA allocator's peak above its level at entry while the block runs (its peak counter is reset)."""
    result: list[int | None] = [None]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield lambda: result[0]
    finally:
        torch.cuda.synchronize(device)
        result[0] = torch.cuda.max_memory_allocated(device) - base


def window_peaks(prof: Any, prefix: str) -> dict[str, int]:
    """For each ``record_function`` window whose name starts with ``prefix``: the largest running sum of the
    profiler's CPU allocation events inside it, above the running sum as it opened."""
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type().name == "CPU")
    times = [t for t, _ in mem]
    running = list(itertools.accumulate((n for _, n in mem), initial=0))  # running[i]: before event i
    peaks = {}
    for e in events:
        if e.name().startswith(prefix):
            lo = bisect.bisect_left(times, e.start_ns())
            hi = bisect.bisect_right(times, e.start_ns() + e.duration_ns())
            peaks[e.name()] = max(running[lo : hi + 1]) - running[lo]
    return peaks


def compiled_note(paths: list[str], unmeasured: int = 0) -> tuple[str, ...]:
    """The note a traced step of a model with compiled modules carries (none without)."""
    if not paths:
        return ()
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    missing = (
        f"; {unmeasured} calls ran under a profiler already running and are not measured (their buffers inside "
        "are missing)"
        if unmeasured
        else ""
    )
    return (
        f"compiled modules ({shown}) ran compiled, as without record: each call (and its compiled backward) is "
        "one event 'compiled:PATH'; what it returns and saves for backward is traced from there, its buffers "
        f"inside are measured (allocator peak during the call, role {COMPILED_INTERNAL!r}){missing}",
    )


def eager_note(paths: list[str]) -> tuple[str, ...]:
    """The note of a step in which modules were first compiled after it began (none if none were)."""
    if not paths:
        return ()
    return (
        f"modules compiled during this step ({', '.join(paths)}), after record last looked, ran eagerly in it "
        "(dynamo does not run under a tracing dispatch mode): the ledger is their eager step's, and with inductor "
        "this step computed other numbers than it would have; compile before record(...) to keep them compiled",
    )


def eager_functions_note(calls: int) -> tuple[str, ...]:
    """The note of a step in which functions compiled with ``torch.compile`` ran eagerly (none if none did)."""
    if not calls:
        return ()
    return (
        f"{calls} call(s) of a function compiled with torch.compile (not a module) ran eagerly in this step: record "
        "runs a compiled module compiled (torch.compile(model)) but dynamo does not run under its dispatch mode, so "
        "these calls computed eager's numbers (other kernels and random numbers) and training from this step on "
        "differs from the loop without record; compile the module, or record other steps",
    )


@functools.cache
def dynamo_skipped(tracer_class: type) -> type:
    """A subclass of ``tracer_class`` whose ``__torch_dispatch__`` and saved-tensor hooks (and all they call)
    dynamo never compiles: a compiled call saves tensors for backward through the hooks, from inside the frames
    dynamo watches."""
    import torch._dynamo

    class DynamoSkipped(tracer_class):  # type: ignore[misc, valid-type]
        @torch._dynamo.disable(recursive=True)
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            return super().__torch_dispatch__(func, types, args, kwargs)

        @torch._dynamo.disable(recursive=True)
        def pack(self, t: torch.Tensor) -> torch.Tensor:
            return super().pack(t)

        @torch._dynamo.disable(recursive=True)
        def unpack(self, t: torch.Tensor) -> torch.Tensor:
            return super().unpack(t)

    DynamoSkipped.__name__ = DynamoSkipped.__qualname__ = f"DynamoSkipped{tracer_class.__name__}"
    return DynamoSkipped
