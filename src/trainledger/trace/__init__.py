"""Trace one training step: every storage's lifetime on the event clock, and the true simultaneous peak.

Example:
    >>> from trainledger.examples import gpt_tiny
    >>> led = trace(gpt_tiny())
    >>> led.evidence.value, led.peak().phase in ("forward", "backward", "optimizer")
    ('traced', True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from trainledger.devices import Device, KernelKind, SdpaCall, sdpa_backend
from trainledger.errors import InputError
from trainledger.inventory import iter_state, iter_state_tensors, optimizers_within, trained_outside
from trainledger.ledger import LOSS_SCOPE, REFERENCE_SCOPE, Category, Evidence, Ledger
from trainledger.trace._blocks import blocks_differ
from trainledger.trace._cuda import (
    DISPATCH_SUBSTITUTES,
    CudaFacts,
    CudaKernels,
    cublas_copies,
    cuda_device,
    cuda_ledger,
    use_foreach,
)
from trainledger.trace._fake import (
    FAKE_SUBSTITUTES,
    SMALL_BUFFER_BYTES,
    EmptyWeights,
    MetaKernelFailures,
    fake_workload,
)
from trainledger.trace._fsdp import fsdp_storages
from trainledger.trace._kernels import (
    KERNEL_INTERNAL,
    MATMUL_OPERANDS,
    PROBED_OPS,
    KernelCall,
    KernelCounts,
    kernel_entries,
)
from trainledger.trace._kernels import internal_bytes as kernel_internal_bytes
from trainledger.trace._native import ready as compiled_tracer_ready
from trainledger.trace._native import status as compiled_tracer
from trainledger.trace._record import ForwardRecord, StorageRecord, record_forward
from trainledger.trace._report import MeasuredStep, TraceReport
from trainledger.trace._restore import RESTORED_NOTE, TrainingState
from trainledger.trace._rngstate import RNG_STATE_ROLE, rng_states_seen
from trainledger.trace._scopes import ModuleScopes
from trainledger.trace._sparse import SparseStepTracer, has_sparse_gradients
from trainledger.trace._stack import NotRepeating, extend, find_stack, first_difference
from trainledger.trace._tracer import ProgressFn, StepTracer, active_tracer
from trainledger.workload import Workload, iter_tensors, quiet_gc, require_workload, run_step, user_errors

__all__ = [
    "CALLERS_PROFILER_NOTE",
    "KERNEL_INTERNAL",
    "PROBED_OPS",
    "RESTORED_NOTE",
    "RNG_STATE_ROLE",
    "SMALL_BUFFER_BYTES",
    "CudaKernels",
    "EmptyWeights",
    "ForwardRecord",
    "KernelCall",
    "MeasuredStep",
    "ModuleScopes",
    "SdpaCall",
    "SparseStepTracer",
    "StepTracer",
    "StorageRecord",
    "TraceReport",
    "TrainingState",
    "active_tracer",
    "compiled_tracer",
    "compiled_tracer_ready",
    "cuda_device_of",
    "fsdp_storages",
    "has_sparse_gradients",
    "kernel_internal_bytes",
    "mark_optimizer_outputs",
    "record_forward",
    "rng_states_seen",
    "sdpa_backend",
    "trace",
    "trace_stacked",
    "traced_ledger",
    "with_kernel_workspace",
]

LIMITATIONS = (
    "traced bytes are tensor storages as the allocator is asked for them; excluded: memory kernels "
    "allocate and free internally (see `--measure`), allocator rounding, caching and fragmentation, "
    "Python and autograd graph objects"
)


def _kernel_note(num_entries: int, counts: KernelCounts) -> str:
    num_measured = num_entries - counts.num_estimated
    if num_entries:
        inside = (
            f", plus {num_measured} buffers that CPU kernels allocate and free inside one op (workspace, role "
            f"kernel_internal, evidence measured: each kernel run alone on this machine, on {torch.get_num_threads()} "
            "intra-op threads, which some kernels' buffers depend on)"
        )
    else:
        inside = (
            " (none of this step's kernels is one known to allocate inside an op: convolution, BatchNorm, "
            "LayerNorm's and GroupNorm's backward, the LSTM, linear algebra, losses such as BCE with logits, "
            "upsampling, sorting, a matrix product with an operand BLAS cannot read in place)"
        )
    if counts.num_estimated:
        inside += (
            f", and {counts.num_estimated} of convolutions too slow to run whole here (evidence estimated: a "
            "small instance of the call measured, and scaled by the sizes its buffers were measured to grow with)"
        )
    skipped = (
        f"; {counts.num_skipped} kernel calls that could not be run here (too large or too slow and not "
        "scalable, or inputs fake tensors cannot size) are not included"
        if counts.num_skipped
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
    workload: Workload,
    *,
    fake: bool = False,
    kernel_workspace: bool = True,
    progress: ProgressFn | None = None,
    device: str = "cpu",
    kernel_kind: KernelKind = "cpu",
    cuda_device: str | Device | None = None,
    world_size: int = 1,
) -> Ledger:
    """Trace one steady-state training step of ``workload`` (evidence ``traced``).

    A warm-up step runs first, so lazily created optimizer state exists; then one step is traced:
    forward, loss, backward, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``. Both steps
    are undone afterwards: the weights, buffers, gradients, optimizer state and random-number state are
    what they were before the call (the ledger's notes say so). Every
    dispatched op is an event with its phase, op name and module (in backward: the module whose
    gradient is being computed). Every storage allocated during the step is an entry with its
    allocation and free events; tensors that existed before and take part are entries alive from
    before the step.

    Arguments:
        workload: the step's ingredients.
        fake: run under ``FakeTensorMode``: same ops and shapes, nothing allocated. The model's
            parameters are swapped for fake ones during the trace and restored afterwards.
        kernel_workspace: also measure the buffers that CPU kernels (convolutions, BatchNorm's and
            LayerNorm's backward, the LSTM, losses and resampling that run a composite inside one kernel,
            :data:`PROBED_OPS`; a matrix product copying an operand BLAS cannot read in place)
            allocate and free inside one op, by running each distinct call once more alone, and add them as
            workspace entries at that op's event (evidence ``measured``). Without it the ledger holds tensor
            storages only.
        progress: called as ``progress(phase, num_events)`` every thousand events.
        device: with ``fake``, the device that tensors on ``meta`` are traced as (a model built with
            ``torch.device("meta")`` or accelerate's ``init_empty_weights()``); a real trace refuses them.
        kernel_kind: ``cpu`` (the kernels that run here) or ``cuda``: the step as PyTorch's CUDA kernels
            would run it (the SDPA backend CUDA picks and what it saves, fused dropout, fp32 normalization
            statistics, the foreach optimizer, the cuBLAS workspace; see ``trace/_cuda.py``). There are no
            CUDA kernels here, so a CUDA-kind trace always runs on fake tensors (a note says so when the model
            is real); kernel-internal buffers are not probed (the CPU's are not CUDA's), except the copies
            cuBLAS makes of an operand it cannot read in place, from its rule (evidence ``analytic``).
        cuda_device: with ``cuda``, the card from the device table (its compute capability decides the SDPA
            backend and the cuBLAS workspace); default an H100 (sm90).
        world_size: with ``cuda``, data-parallel ranks: above 1, NCCL's buffers are stated beside the ledger.

    Returns:
        The traced ledger; ``meta`` holds the model name, events per phase and the traced step's time.
    """
    require_workload(workload, "trace")
    if not isinstance(fake, bool):
        raise InputError(f"trace(fake=...) is {fake!r}; give True or False")
    if progress is not None and not callable(progress):
        raise InputError(f"trace(progress=...) is {progress!r}; give None or a function progress(phase, num_events)")
    gpu = cuda_device_of(kernel_kind, cuda_device)
    was_fake = fake
    fake = fake or gpu is not None
    ledger, kernels = _trace_step(
        workload, fake=fake, progress=progress, device=_meta_device(workload, fake, device), cuda=gpu
    )
    if gpu is not None:
        ledger = _as_cuda(ledger, world_size, kernels if kernel_workspace else [])
        if not was_fake:
            ledger = ledger.with_entries(ledger.entries, notes=(*ledger.notes, FAKE_FOR_CUDA_NOTE))
        return ledger
    return with_kernel_workspace(ledger, kernels) if kernel_workspace else ledger


def cuda_device_of(kernel_kind: str, name: str | Device | None) -> Device | None:
    """The card a ``kernel_kind`` of ``cuda`` assumes (``None`` for ``cpu``); see :func:`trace`."""
    if kernel_kind not in ("cpu", "cuda"):
        raise InputError(f"kernel kind {kernel_kind!r} is not one of cpu, cuda")
    if kernel_kind == "cpu":
        if name is not None:
            raise InputError("a CUDA device applies to kernel_kind='cuda': give it, or drop the device")
        return None
    return cuda_device(name)


FAKE_FOR_CUDA_NOTE = (
    "traced on fake tensors: a CUDA-kind trace cannot run the model's real values through CUDA kernels on this "
    "machine, so the same step ran on fake tensors of the same shapes (weights and optimizer untouched)"
)


def _meta_device(workload: Workload, fake: bool, device: str) -> str:
    """``device`` checked; a real trace of a model with weights on ``meta`` is refused (they hold no values)."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise InputError(f"trace(device=...) is {device!r}; give a device such as 'cpu' or 'cuda'") from None
    if kind not in ("cpu", "cuda") or (kind == "cuda" and not torch.backends.cuda.is_built()):
        # fake tensors of a device this build has no guard for abort the process (a C++ error, no exception)
        raise InputError(
            f"trace(device=...) is {device!r}, which this PyTorch build cannot trace as; give 'cpu'"
            + ("" if kind == "cuda" else " or 'cuda'")
        )
    if not fake and any(t.is_meta for t in workload.model.parameters()):
        raise InputError("the model's parameters are on the meta device, which holds no values: trace it with --fake")
    return device


def _trace_step(
    workload: Workload, *, fake: bool, progress: ProgressFn | None, device: str = "cpu", cuda: Device | None = None
) -> tuple[Ledger, list[tuple[int, str, str, KernelCall | None]]]:
    """The traced ledger without kernel-internal buffers, and the kernel calls that may hold some; with
    ``cuda``, the CUDA kernels substituted and their facts in ``meta["cuda_facts"]``."""
    if fake:
        with fake_workload(workload, device) as (twin, mode), mode, MetaKernelFailures() as refused:
            try:
                ledger, kernels = _trace(twin, progress, fake=True, cuda=cuda)
            except InputError as exc:
                if refused.ops:
                    raise InputError(
                        f"{str(exc).rstrip('.')}; PyTorch's fake-tensor kernel of {refused.ops[-1]} refused these "
                        "inputs (its real kernel may accept them): trace it without --fake, or in a dtype that kernel "
                        "takes"
                    ) from exc
                if "DynamicOutputShape" in str(exc) or "DataDependentOutput" in str(exc):
                    fix = (
                        "a CUDA-kind trace runs on fake tensors only: trace it with --device-kind cpu"
                        if cuda is not None
                        else "trace it without --fake"
                    )
                    raise InputError(
                        f"the step has data-dependent shapes, which fake tensors cannot run ({exc}); {fix}"
                    ) from exc
                if "Couldn't swap" in str(exc):
                    # Module.to() on a fake parameter swaps the tensors, which fake tensors' weak references forbid
                    raise InputError(
                        f"{str(exc).rstrip('.')}: the model moves or casts a module inside its forward "
                        "(Module.to()), which PyTorch cannot do to fake parameters; trace it without --fake "
                        "(a config small enough to build)"
                    ) from exc
                raise
        return ledger.with_entries(ledger.entries, meta={**ledger.meta, "fake": True}), kernels
    roots = [m for m in (workload.model, workload.reference) if m is not None]
    found = TrainingState.of(roots, optimizers_within(workload.get_optimizer()))
    try:
        ledger, kernels = _trace(workload, progress)
    finally:
        found.restore()  # the warm-up and traced steps are undone: training goes on from where it was
    return ledger.with_entries(ledger.entries, notes=(*ledger.notes, RESTORED_NOTE)), kernels


def trace_stacked(
    build: Callable[[int], Workload],
    num_blocks: int,
    *,
    fake: bool = True,
    kernel_workspace: bool = True,
    depths: Sequence[int] = (3, 4),
    differs: str | None = None,
    progress: ProgressFn | None = None,
    kernel_kind: KernelKind = "cpu",
    cuda_device: str | Device | None = None,
    world_size: int = 1,
    skeleton: Callable[[int], torch.nn.Module] | None = None,
) -> Ledger:
    """Trace a model of ``num_blocks`` identical blocks by tracing a few of them and extending the ledger.

    The step is traced at each of ``depths`` blocks (few blocks trace quickly); the ledger of the first
    depth is extended to the others and must equal their traces entry for entry, event for event and call
    for call; then it is extended to ``num_blocks`` (the blocks' events, entries and module calls repeated,
    renumbered and shifted on the event clock). Where the blocks do not repeat exactly, or ``num_blocks``
    is no deeper than the traces, the model is traced whole instead. Either way the evidence is ``traced``,
    the first note says which was done, and ``meta["blocks"]`` holds ``total``, ``traced`` (the depths
    traced) and ``extended``.

    Arguments:
        build: ``build(d)`` returns the workload with ``d`` blocks: a Hugging Face config with
            ``num_hidden_layers=d``, any model whose depth is a constructor argument.
        num_blocks: the depth to report.
        fake, kernel_workspace, progress, kernel_kind, cuda_device, world_size: as for :func:`trace` (``cuda`` traces
            on fake tensors).
        depths: the depths traced, each at least 3; the first is extended, the others check it.
        differs: why the blocks are known to differ (per-layer settings): then every block is traced, and
            the note gives this reason.
        skeleton: ``skeleton(d)``, the model with ``d`` blocks on the meta device: its blocks at full depth
            are compared with the traced ones they are made from, so that a pattern the traced depths cannot
            show (every sixth layer global) is traced whole (``trace/_blocks.py``).

    Example:
        >>> from trainledger.examples import gpt_tiny
        >>> led = trace_stacked(lambda d: gpt_tiny(n_layer=d, n_embd=8, n_head=2, seq_len=4, batch_size=1), 6)
        >>> led.meta["blocks"], led.notes[0][:31]
        ({'total': 6, 'traced': [3, 4], 'extended': True}, 'traced 3 of 6 blocks, extended:')
    """
    depths = list(depths)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise InputError(f"number of blocks {num_blocks!r} must be a whole number of at least 1")
    if len(depths) < 2 or sorted(set(depths)) != depths or depths[0] < 3:
        raise InputError(f"depths {depths} must be two or more increasing depths of at least 3 blocks")
    gpu = cuda_device_of(kernel_kind, cuda_device)
    whole = partial(
        _whole_stack,
        build,
        num_blocks,
        fake=fake,
        kernel_workspace=kernel_workspace,
        progress=progress,
        cuda=gpu,
        world_size=world_size,
    )
    why = _known_to_differ(num_blocks, depths, differs, skeleton)
    if why is not None:
        return whole(why)
    fake = fake or gpu is not None
    # On fake tensors the collector only walks the hundreds of thousands of objects torch and transformers
    # made at import, a third of the time of a 405B step's builds, traces and extension; nothing it could
    # free holds memory. The traced steps pause it anyway (quiet_gc), so their ledgers are the same.
    with quiet_gc(generation=0) if fake else contextlib.nullcontext():
        traced = {d: _trace_step(build(d), fake=fake, progress=progress, cuda=gpu) for d in depths}
        facts = {d: led.meta.pop("cuda_facts", None) for d, (led, _) in traced.items()}  # counts grow with depth
        try:
            ledger, kernels = _extended(traced, depths, num_blocks)
        except NotRepeating as exc:
            why = str(exc)
        else:
            if gpu is None:
                return with_kernel_workspace(ledger, kernels) if kernel_workspace else ledger
            grown = _extend_facts(facts[depths[0]], facts[depths[1]], depths, num_blocks)
            ledger = ledger.with_entries(ledger.entries, meta={**ledger.meta, "cuda_facts": grown})
            return _as_cuda(ledger, world_size, kernels if kernel_workspace else [])
    return whole(why)


def _known_to_differ(
    num_blocks: int, depths: list[int], differs: str | None, skeleton: Callable[[int], torch.nn.Module] | None
) -> str | None:
    """Why the model is traced whole before any trace is made: blocks known to differ, a model no deeper than
    the traces, one that cannot be built as shallow as the traces (a config whose other settings name every
    layer, as GPT-Neo's ``attention_types``), or a skeleton whose blocks at full depth are unlike the traced
    ones."""
    if differs is not None:
        return differs
    if num_blocks <= depths[-1]:
        return f"{num_blocks} blocks are no deeper than the traces"
    if skeleton is None:
        return None
    try:
        shallow = skeleton(depths[0])
    except InputError as exc:
        return f"it cannot be built {depths[0]} blocks deep: {exc}"
    return blocks_differ(skeleton(num_blocks), shallow, num_blocks, depths[0])


def _extend_facts(base: CudaFacts, next_: CudaFacts, depths: list[int], num_blocks: int) -> CudaFacts:
    """The CUDA facts' counts (SDPA calls, dropouts, autocast casts) at ``num_blocks``: each block adds what one
    block added between the first two depths traced."""
    per = num_blocks - depths[0]
    blocks = depths[1] - depths[0]

    def grow(a: int, b: int) -> int:
        return a + per * (b - a) // blocks

    backends = {k: grow(base.backends.get(k, 0), next_.backends.get(k, 0)) for k in {*base.backends, *next_.backends}}
    amp = None if base.autocast_calls is None else grow(base.autocast_calls, next_.autocast_calls or 0)
    return dataclasses.replace(
        base, backends=backends, dropouts=grow(base.dropouts, next_.dropouts), autocast_calls=amp
    )


def _extended(
    traced: dict[int, tuple[Ledger, list[tuple[int, str, str, KernelCall | None]]]], depths: list[int], num_blocks: int
) -> tuple[Ledger, list[tuple[int, str, str, KernelCall | None]]]:
    """The first depth's trace extended to ``num_blocks``, checked against the other depths' traces (raises
    :class:`NotRepeating` where the blocks do not repeat exactly), with the note that says so."""
    base = traced[depths[0]]
    stack = find_stack({d: led.calls for d, (led, _) in traced.items()})
    for d in depths[1:]:
        why = first_difference(extend(*base, stack, base_depth=depths[0], depth=d), traced[d])
        if why is not None:
            raise NotRepeating(f"extended to {d} blocks, the ledger differs from the trace: {why}")
    ledger, kernels = extend(*base, stack, base_depth=depths[0], depth=num_blocks)
    note = (
        f"traced {depths[0]} of {num_blocks} blocks, extended: the block stack ({stack.prefix}) repeated to full "
        f"depth, exact against traces of {', '.join(map(str, depths[1:]))} blocks"
    )
    meta = {**ledger.meta, "blocks": {"total": num_blocks, "traced": depths, "extended": True}}
    meta.pop("traced_step_seconds", None)  # no step of this depth ran
    return ledger.with_entries(ledger.entries, notes=(note, *ledger.notes), meta=meta), kernels


def _whole_stack(
    build: Callable[[int], Workload],
    num_blocks: int,
    why: str,
    *,
    fake: bool,
    kernel_workspace: bool,
    progress: ProgressFn | None,
    cuda: Device | None,
    world_size: int,
) -> Ledger:
    ledger = trace(
        build(num_blocks),
        fake=fake,
        kernel_workspace=kernel_workspace,
        progress=progress,
        kernel_kind="cuda" if cuda is not None else "cpu",
        cuda_device=cuda,
        world_size=world_size,
    )
    note = f"traced all {num_blocks} blocks (not extended: {why})"
    meta = {**ledger.meta, "blocks": {"total": num_blocks, "traced": [num_blocks], "extended": False}}
    return ledger.with_entries(ledger.entries, notes=(note, *ledger.notes), meta=meta)


CALLERS_PROFILER_NOTE = (
    "the buffers CPU kernels allocate inside one op are not counted: a profiler of the caller's was running, and "
    "measuring them starts one of trainledger's, which would end it (PyTorch's profilers do not nest); the peak "
    "may be below the allocator's by those buffers"
)


def with_kernel_workspace(ledger: Ledger, kernels: list[tuple[int, str, str, KernelCall | None]]) -> Ledger:
    """``ledger`` with the buffers the kernels of ``kernels`` (a tracer's ``kernel_calls``) allocate inside one
    op, each measured by running the call once more alone (evidence ``measured``). Under a profiler of the
    caller's they are not measured, and a note says so: PyTorch's profilers do not nest, and starting one to
    measure would end the caller's and lose what it recorded."""
    if kernels and torch._C._autograd._profiler_enabled():
        return ledger.with_entries(ledger.entries, notes=(*ledger.notes, CALLERS_PROFILER_NOTE))
    entries, counts = kernel_entries(kernels)
    notes = tuple(_kernel_note(len(entries), counts) if n == LIMITATIONS else n for n in ledger.notes)
    return ledger.with_entries((*ledger.entries, *entries), notes=notes)


def _warm_up(workload: Workload, kernels: CudaKernels | None, *, fake: bool) -> bool:
    """Run the warm-up step; returns whether it made sparse gradients (see ``_sparse``), which a step on fake
    tensors cannot size."""
    sparse = False

    def on_phase(phase: str) -> None:
        nonlocal sparse
        if phase == "optimizer":
            sparse = has_sparse_gradients(workload.model)
        if kernels is not None:
            kernels.on_phase(phase)

    with user_errors("the warm-up step"), kernels or contextlib.nullcontext():
        run_step(workload, on_phase=on_phase)
    if sparse and fake:
        raise InputError(
            "the step's gradients are sparse (an nn.Embedding or nn.EmbeddingBag with sparse=True): their size is "
            "how many rows the batch reads, which fake tensors do not know; trace it with real tensors (no --fake, "
            "no --device-kind cuda)"
        )
    return sparse


def _trace(
    workload: Workload, progress: ProgressFn | None, *, fake: bool = False, cuda: Device | None = None
) -> tuple[Ledger, list[tuple[int, str, str, KernelCall | None]]]:
    model, reference = workload.model, workload.reference
    optimizer = workload.get_optimizer()
    kernels = CudaKernels(cuda, autocast=workload.autocast_dtype is not None) if cuda is not None else None
    foreach_groups = use_foreach(optimizer) if cuda is not None else 0  # the fake twin's optimizer
    sparse = _warm_up(workload, kernels, fake=fake or cuda is not None)

    roots = [("", model)] + ([(REFERENCE_SCOPE, reference)] if reference is not None else [])
    scopes = ModuleScopes(roots, outside=LOSS_SCOPE)
    substitutes = {**(FAKE_SUBSTITUTES if fake else {}), **(DISPATCH_SUBSTITUTES if cuda else {})}
    # only a step with sparse gradients pays for following them (see ``_sparse``)
    tracer = (SparseStepTracer if sparse else StepTracer)(scopes, fake=fake, progress=progress, substitutes=substitutes)
    for t, owner in iter_state(model, optimizer, reference=reference):
        tracer.known(t, owner.name, owner.category, owner.role)
    for i, t in enumerate(iter_tensors(workload.batch)):
        tracer.known(t, f"batch[{i}]", Category.INPUTS, "batch")

    # listed once (a walk of the modules costs more than a phase's marking), with what is trained beside the model
    named = list(model.named_parameters()) + trained_outside(model, optimizer)
    parameters = [p for _, p in named]

    zero_grad_began = 0  # the event zero_grad began at

    def on_phase(phase: str) -> None:
        nonlocal zero_grad_began
        if phase == "optimizer":  # gradients exist now: name them before the optimizer runs
            for name, p in named:
                if p.grad is not None:
                    tracer.mark(p.grad, Category.GRADIENTS, "grad", f"{name}.grad")
        elif phase == "backward":
            scopes.backward_begins()
        elif phase == "zero_grad" or (phase == "end" and tracer.num_events > zero_grad_began):
            # masters' gradients, any state the step made (at the end only if zero_grad ran an op: else it made none)
            mark_optimizer_outputs(tracer, model, optimizer, parameters=parameters)
            zero_grad_began = tracer.num_events
        if phase != "end":
            tracer.phase = phase
        if kernels is not None:
            kernels.on_phase(phase)

    scopes.open()
    try:
        if kernels is not None:  # count the traced step's calls only
            kernels.reset()
        with quiet_gc(generation=1), tracer, torch.autograd.graph.saved_tensors_hooks(*tracer.saved_tensor_hooks()):
            on_cpu = cuda is None and all(p.device.type == "cpu" for p in parameters)  # else host memory
            with (
                user_errors("the traced step"),
                kernels or contextlib.nullcontext(),
                rng_states_seen(tracer, enabled=on_cpu),
            ):
                start = time.perf_counter()
                run_step(workload, on_phase=on_phase)
                seconds = time.perf_counter() - start
    finally:
        scopes.close()
        tracer.stop()
    if not tracer.num_events:
        raise InputError("the step dispatched no tensor operations; nothing to trace")

    # CUDA's kernels return the sizes their meta kernels declare; the CPU's are measured
    resized = tracer.size_outputs_as_the_real_kernels() if fake and kernels is None else 0
    facts = None
    if kernels is not None:
        amp = kernels.autocast.num_calls if kernels.autocast is not None else None
        facts = CudaFacts(cuda, dict(kernels.backends), kernels.dropouts, foreach_groups, _cublas_config(), amp)
    ledger = traced_ledger(
        tracer,
        name=workload.name,
        seconds=seconds,
        optimizers=[optimizer],
        parameter_order=[name for name, _ in named],
        notes=(_resized_note(resized),) if resized else (),
        meta={"cuda_facts": facts} if facts is not None else None,
    )
    # CUDA's kernels are not CPU's: only matrix products, whose copies follow cuBLAS's rule (``cublas_copies``)
    calls = tracer.kernel_calls if kernels is None else [k for k in tracer.kernel_calls if k[1] in MATMUL_OPERANDS]
    return ledger, calls


def _cublas_config() -> str | None:
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG") or None


def _as_cuda(ledger: Ledger, world_size: int, kernels: list[tuple[int, str, str, KernelCall | None]]) -> Ledger:
    """A traced ledger whose ``meta`` holds the CUDA facts, as the CUDA step's ledger (``cuda_ledger``), with the
    copies cuBLAS makes inside the matrix products among ``kernels``."""
    facts = ledger.meta["cuda_facts"]
    ledger = ledger.with_entries(ledger.entries, meta={k: v for k, v in ledger.meta.items() if k != "cuda_facts"})
    ledger = cuda_ledger(ledger, facts, world_size=world_size)
    copies = cublas_copies(kernels)
    if not copies:
        return ledger
    note = (
        f"traced bytes are tensor storages as the allocator is asked for them, plus {len(copies)} copies cuBLAS makes "
        "inside a matrix product of an operand it cannot read in place (workspace, role kernel_internal, evidence "
        "analytic: cuBLAS's rule); excluded: other memory kernels allocate and free internally, allocator rounding, "
        "caching and fragmentation, Python and autograd graph objects"
    )
    notes = tuple(note if n == LIMITATIONS else n for n in ledger.notes)
    return ledger.with_entries((*ledger.entries, *copies), notes=notes)


def traced_ledger(
    tracer: StepTracer,
    *,
    name: str,
    seconds: float,
    optimizers: list[torch.optim.Optimizer],
    parameter_order: list[str],
    notes: tuple[str, ...] = (),
    meta: dict[str, object] | None = None,
) -> Ledger:
    """The ledger of what ``tracer`` saw (call after ``tracer.stop()``): its entries, events and module calls,
    the limitations every trace states, ``notes`` after them, and ``meta`` added to the standard keys."""
    entries = tracer.entries()
    devices = Counter(e.device for e in entries if e.category in (Category.WEIGHTS, Category.ACTIVATIONS))
    events = tracer.events()
    return Ledger(
        tuple(entries),
        tuple(events),
        evidence=Evidence.TRACED,
        device=devices.most_common(1)[0][0] if devices else "cpu",
        notes=(LIMITATIONS, *_elsewhere_note(tracer.frees_elsewhere), *notes),
        calls=tracer.module_calls(),
        meta={
            "model": name,
            "events_per_phase": dict(Counter(ev.phase for ev in events)),
            "traced_step_seconds": seconds,
            "optimizer": "+".join(type(o).__name__ for o in optimizers),
            "parameter_order": parameter_order,
            **({"frees_on_other_threads": len(tracer.frees_elsewhere)} if tracer.frees_elsewhere else {}),
            **({"frees_while_settling": len(tracer.frees_settled)} if tracer.frees_settled else {}),
            **({"freed_after_backward": after_backward} if (after_backward := _held_through_backward(tracer)) else {}),
            **({"recomputed_modules": tracer.scopes.recomputed_modules()} if tracer.scopes.recomputed else {}),
            **(meta or {}),
        },
    )


def _held_through_backward(tracer: StepTracer) -> list[list[object]]:
    """``[name, free event]`` of the entries the caller of ``backward()`` held through its final callbacks
    (the loss, the seed); the event tells them from others of the same name (an op's other outputs)."""
    return sorted(map(list, {(r.name, r.free_event) for r in tracer.freed_after_backward if r.merged_into is None}))


def _elsewhere_note(names: list[str]) -> tuple[str, ...]:
    if not names:
        return ()
    return (
        f"{len(names)} storage(s) were freed by another thread (a collective library's worker letting go "
        f"after the step had dropped them), so their free events can vary between runs: {', '.join(names[:5])}",
    )


def mark_optimizer_outputs(
    tracer: StepTracer,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    parameters: Sequence[torch.Tensor] | None = None,
) -> None:
    """Name the gradients and optimizer state a step created (lazily made moments, masters' gradients).

    With ``parameters`` (the model's, listed once by the caller), a step that created none — every
    gradient and state tensor already named, as in a steady-state step — costs no walk of the model's
    modules: the names ``iter_state`` gives are only needed for a storage still unnamed.
    """
    if parameters is not None and not tracer.any_unnamed(_gradients_and_state(parameters, optimizer)):
        return
    for t, owner in iter_state(model, optimizer):
        if owner.category in (Category.OPTIMIZER, Category.GRADIENTS):
            tracer.mark(t, owner.category, owner.role, owner.name)


def _gradients_and_state(
    parameters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
) -> Iterator[torch.Tensor]:
    """Every tensor ``iter_state`` may name a gradient or optimizer state: the parameters' gradients, the
    optimizer's parameters (master copies) and their gradients, and its state tensors."""
    for p in parameters:
        if p.grad is not None:
            yield p.grad
    for opt in optimizers_within(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
    yield from iter_state_tensors(optimizer)
