"""Trace one training step: every storage's lifetime on the event clock, and the true simultaneous peak.

Example:
    >>> from trainledger.examples import gpt_tiny
    >>> led = trace(gpt_tiny())
    >>> led.evidence.value, led.peak().phase in ("forward", "backward", "optimizer")
    ('traced', True)
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator

import torch

from trainledger.errors import InputError
from trainledger.inventory import iter_state
from trainledger.ledger import LOSS_SCOPE, REFERENCE_SCOPE, Category, Evidence, Ledger
from trainledger.trace._fake import fake_workload
from trainledger.trace._kernels import KERNEL_INTERNAL, PROBED_OPS, KernelCall, kernel_entries
from trainledger.trace._kernels import internal_bytes as kernel_internal_bytes
from trainledger.trace._record import ForwardRecord, StorageRecord, record_forward
from trainledger.trace._report import MeasuredStep, TraceReport
from trainledger.trace._scopes import ModuleScopes, label_graph
from trainledger.trace._tracer import ProgressFn, StepTracer, active_tracer
from trainledger.workload import Workload, iter_tensors, quiet_gc, require_workload, run_step

__all__ = [
    "KERNEL_INTERNAL",
    "PROBED_OPS",
    "ForwardRecord",
    "KernelCall",
    "MeasuredStep",
    "StorageRecord",
    "TraceReport",
    "active_tracer",
    "kernel_internal_bytes",
    "record_forward",
    "trace",
]

LIMITATIONS = (
    "traced bytes are tensor storages as the allocator is asked for them; excluded: memory kernels "
    "allocate and free internally (see `--measure`), allocator rounding, caching and fragmentation, "
    "Python and autograd graph objects"
)


def _kernel_note(num_measured: int, num_skipped: int) -> str:
    if num_measured:
        inside = (
            f", plus {num_measured} buffers that CPU kernels allocate and free inside one op (workspace, role "
            "kernel_internal, evidence measured: each kernel run alone on this machine)"
        )
    else:
        inside = (
            " (none of this step's kernels is one known to allocate inside an op: convolution, BatchNorm, "
            "LayerNorm's backward, the LSTM)"
        )
    skipped = (
        f"; {num_skipped} kernel calls that could not be run here (too large, or inputs fake tensors cannot "
        "size) are not included"
        if num_skipped
        else ""
    )
    return (
        f"traced bytes are tensor storages as the allocator is asked for them{inside}{skipped}; excluded: "
        "allocator rounding, caching and fragmentation, Python and autograd graph objects"
    )


def _resized_note(num: int) -> str:
    return (
        f"fake tensors: {num} outputs of ops whose CPU kernel returns a storage of another size than its meta "
        "kernel declares (mse_loss's result, the LSTM's workspace) are sized by running the kernel on zeros"
    )


def trace(
    workload: Workload, *, fake: bool = False, kernel_workspace: bool = True, progress: ProgressFn | None = None
) -> Ledger:
    """Trace one steady-state training step of ``workload`` (evidence ``traced``).

    A warm-up step runs first, so lazily created optimizer state exists; then one step is traced:
    forward, loss, backward, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``. Every
    dispatched op is an event with its phase, op name and module (in backward: the module whose
    gradient is being computed). Every storage allocated during the step is an entry with its
    allocation and free events; tensors that existed before and take part are entries alive from
    before the step.

    Arguments:
        workload: the step's ingredients.
        fake: run under ``FakeTensorMode``: same ops and shapes, nothing allocated. The model's
            parameters are swapped for fake ones during the trace and restored afterwards.
        kernel_workspace: also measure the buffers that CPU kernels (convolutions, BatchNorm's and
            LayerNorm's backward, the LSTM) allocate and free inside one op, by running each distinct
            call once more alone, and add them as workspace entries at that op's event (evidence
            ``measured``). Without it the ledger holds tensor storages only.
        progress: called as ``progress(phase, num_events)`` every thousand events.

    Returns:
        The traced ledger; ``meta`` holds the model name, events per phase and the traced step's time.
    """
    require_workload(workload, "trace")
    if not isinstance(fake, bool):
        raise InputError(f"trace(fake=...) is {fake!r}; give True or False")
    if progress is not None and not callable(progress):
        raise InputError(f"trace(progress=...) is {progress!r}; give None or a function progress(phase, num_events)")
    if fake:
        with fake_workload(workload) as (twin, mode), mode:
            try:
                ledger, kernels = _trace(twin, progress, fake=True)
            except InputError as exc:
                if "DynamicOutputShape" in str(exc) or "DataDependentOutput" in str(exc):
                    raise InputError(
                        f"the step has data-dependent shapes, which fake tensors cannot run ({exc}); "
                        "trace it without --fake"
                    ) from exc
                raise
        ledger = ledger.with_entries(ledger.entries, meta={**ledger.meta, "fake": True})
    else:
        ledger, kernels = _trace(workload, progress)
    return _with_kernel_workspace(ledger, kernels) if kernel_workspace else ledger


def _with_kernel_workspace(ledger: Ledger, kernels: list[tuple[int, str, str, KernelCall | None]]) -> Ledger:
    entries, skipped = kernel_entries(kernels)
    notes = tuple(_kernel_note(len(entries), skipped) if n == LIMITATIONS else n for n in ledger.notes)
    return ledger.with_entries((*ledger.entries, *entries), notes=notes)


def _trace(
    workload: Workload, progress: ProgressFn | None, *, fake: bool = False
) -> tuple[Ledger, list[tuple[int, str, str, KernelCall | None]]]:
    model, reference = workload.model, workload.reference
    optimizer = workload.get_optimizer()
    with _user_errors("the warm-up step"):
        run_step(workload)

    roots = [("", model)] + ([(REFERENCE_SCOPE, reference)] if reference is not None else [])
    scopes = ModuleScopes(roots)
    tracer = StepTracer(scopes, fake=fake, progress=progress)
    for t, owner in iter_state(model, optimizer, reference=reference):
        tracer.known(t, owner.name, owner.category, owner.role)
    for i, t in enumerate(iter_tensors(workload.batch)):
        tracer.known(t, f"batch[{i}]", Category.INPUTS, "batch")

    def on_phase(phase: str) -> None:
        if phase == "optimizer":  # gradients exist now: name them before the optimizer runs
            for name, p in model.named_parameters():
                if p.grad is not None:
                    tracer.mark(p.grad, Category.GRADIENTS, "grad", f"{name}.grad")
        elif phase in ("zero_grad", "end"):  # masters' gradients and any state the step created
            _mark_optimizer_outputs(tracer, model, optimizer)
        if phase != "end":
            tracer.phase = phase

    scopes.open()
    try:
        with quiet_gc(), torch.autograd.graph.saved_tensors_hooks(tracer.pack, tracer.unpack), tracer:
            with _user_errors("the traced step"):
                start = time.perf_counter()
                run_step(workload, on_phase=on_phase, on_loss=lambda loss: label_graph(loss, LOSS_SCOPE))
                seconds = time.perf_counter() - start
    finally:
        scopes.close()
        tracer.stop()
    if not tracer.num_events:
        raise InputError("the step dispatched no tensor operations; nothing to trace")

    resized = tracer.size_outputs_as_the_real_kernels() if fake else 0
    entries = tracer.entries()
    devices = Counter(e.device for e in entries if e.category in (Category.WEIGHTS, Category.ACTIVATIONS))
    events = tracer.events()
    ledger = Ledger(
        tuple(entries),
        tuple(events),
        evidence=Evidence.TRACED,
        device=devices.most_common(1)[0][0] if devices else "cpu",
        notes=(LIMITATIONS, *_elsewhere_note(tracer.frees_elsewhere)) + ((_resized_note(resized),) if resized else ()),
        calls=tracer.module_calls(),
        meta={
            "model": workload.name,
            "events_per_phase": dict(Counter(ev.phase for ev in events)),
            "traced_step_seconds": seconds,
            "optimizer": type(optimizer).__name__,
            "parameter_order": [name for name, _ in model.named_parameters()],
            **({"frees_on_other_threads": len(tracer.frees_elsewhere)} if tracer.frees_elsewhere else {}),
        },
    )
    return ledger, tracer.kernel_calls


def _elsewhere_note(names: list[str]) -> tuple[str, ...]:
    if not names:
        return ()
    return (
        f"{len(names)} storage(s) were freed by another thread (a collective library's worker letting go "
        f"after the step had dropped them), so their free events can vary between runs: {', '.join(names[:5])}",
    )


def _mark_optimizer_outputs(tracer: StepTracer, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for t, owner in iter_state(model, optimizer):
        if owner.category in (Category.OPTIMIZER, Category.GRADIENTS):
            tracer.mark(t, owner.category, owner.role, owner.name)


@contextlib.contextmanager
def _user_errors(what: str) -> Iterator[None]:
    """Errors raised by the user's model, loss or optimizer become one clear line."""
    try:
        yield
    except InputError:
        raise
    except Exception as exc:
        message = " ".join(str(exc).split())[:300]
        raise InputError(f"{what} raised {type(exc).__name__}: {message}") from exc
