"""Record the step's forward op by op with autograd's saving switched off.

What activation checkpointing's candidates (:mod:`trainledger.remat`) need beyond the trace: when each
saved tensor would be freed if autograd kept nothing (Python references only), which module's ops save it,
which op a recomputation stops after (the last save), and each op's FLOPs (``torch.utils.flop_counter``)
and measured time.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainledger.inventory import storage_key
from trainledger.trace._restore import GeneratorStates
from trainledger.trace._scopes import ModuleScopes
from trainledger.workload import Workload, autocast, call_model, compute_loss, intra_op_threads


@dataclass(frozen=True)
class StorageRecord:
    """A storage allocated by a forward op, as seen with autograd's saving switched off."""

    alloc_event: int
    nbytes: int
    unsaved_free_event: int
    """First forward event at which it is gone when autograd keeps nothing (Python references only)."""
    savers: frozenset[int]
    """Module calls (positions in the trace's ``Ledger.calls``) whose ops save it for backward; ``-1``: an op
    outside every module (the loss)."""


@dataclass(frozen=True)
class ForwardRecord:
    """The step's forward (model and loss), op by op, aligned with the trace's forward events."""

    ops: tuple[str, ...]
    modules: tuple[str, ...]
    flops: tuple[int, ...]
    """Per op, by ``torch.utils.flop_counter``'s formulas (0 for ops it has no formula for)."""
    seconds: tuple[float, ...]
    """Per op, median over repeated runs."""
    inputs: tuple[tuple[int, ...], ...]
    """Per op, the alloc events of the forward-allocated storages it reads."""
    storages: tuple[StorageRecord, ...]
    packs: tuple[tuple[int, int], ...] = ()
    """Every tensor autograd saved: (the last op dispatched before the save, the module call then running).
    A region's recomputation stops inside its last save, so that op is the last one it runs."""
    calls: tuple[tuple[str, int], ...] = ()
    """Every module call, as (path, call number): the trace's calls, when the forward lines up."""
    call_args: tuple[tuple[int, ...], ...] = ()
    """Per call of ``calls``, the alloc events of the forward-allocated storages among its tensor arguments
    (positional and keyword): what a checkpoint of the call keeps until its backward, used by its ops or not
    (a Hugging Face decoder layer's ``cache_position``)."""
    writes: tuple[tuple[int, ...], ...] = ()
    """Per op, the alloc events of the forward-allocated storages it writes in place (``x += y``, ``relu_``)."""
    private_rng: tuple[int, ...] = ()
    """The ops that draw from a ``torch.Generator`` of their own, not a default one: checkpointing keeps and
    restores only the default generators' state, so a recomputation of such an op draws other numbers."""


class _Recorder(TorchDispatchMode):
    def __init__(
        self, scopes: ModuleScopes, flop_registry: dict[Any, Any], substitutes: dict[Any, Any] | None = None
    ) -> None:
        super().__init__()
        self.scopes = scopes
        self.registry = flop_registry
        self.substitutes = substitutes or {}
        """Ops whose outputs CUDA's kernels make otherwise (as the tracer's ``substitutes``)."""
        self.ops: list[str] = []
        self.modules: list[str] = []
        self.flops: list[int] = []
        self.seconds: list[float] = []
        self.inputs: list[tuple[int, ...]] = []
        self.writes: list[tuple[int, ...]] = []
        self.private_rng: list[int] = []
        self.alloc: dict[int, int] = {}  # storage key -> alloc event
        self.nbytes: dict[int, int] = {}
        self.freed: dict[int, int] = {}  # alloc event index of record -> free event
        self.records: list[list[Any]] = []  # [alloc_event, nbytes, free_event, savers]
        self.by_key: dict[int, int] = {}
        self.packs: list[tuple[int, int]] = []
        self.pending: list[tuple[int, int]] = []  # (last op, module call) of packs since the last op
        self.call_args: dict[int, tuple[int, ...]] = {}  # module call -> alloc events of its tensor arguments
        self._refs: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "prim":
            return func(*args, **kwargs)
        index = len(self.ops)
        reads = self._forward_allocated((args, kwargs))
        written = self._forward_allocated(_written(func, args, kwargs))
        if _draws_from_a_private_generator(kwargs):
            self.private_rng.append(index)
        self.settle()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        if func in self.substitutes:
            out = self.substitutes[func](out, args)
        self.ops.append(str(func).removesuffix(".default"))
        self.modules.append(self.scopes.current)
        self.inputs.append(tuple(sorted(set(reads))))
        self.writes.append(tuple(sorted(set(written))))
        fn = self.registry.get(func._overloadpacket)
        self.flops.append(int(fn(*args, **kwargs, out_val=out)) if fn is not None else 0)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                key = storage_key(t)
                if key not in self.by_key:
                    st = t.untyped_storage()
                    i = len(self.records)
                    self.records.append([index, st.nbytes(), None, set()])
                    self.by_key[key] = i
                    self._refs.append(weakref.ref(st, self._freed(key, i)))
        return out

    def _forward_allocated(self, values: Any) -> list[int]:
        """The alloc events of the forward-allocated storages among the tensors in ``values``."""
        found = []
        for t in tree_leaves(values):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                rec = self.by_key.get(storage_key(t))
                if rec is not None:
                    found.append(self.records[rec][0])
        return found

    def settle(self) -> None:
        """Attribute the packs made since the last op. Autograd saves an op's inputs just before the op
        runs and its outputs just after; either way, when a recomputation's last save happens, the op
        dispatched last is the last one that ran (the early stop is raised inside the save)."""
        for last, module in self.pending:
            self.packs.append((last, module))
        self.pending.clear()

    def _freed(self, key: int, i: int) -> Any:
        def cb(_ref: Any) -> None:
            if self.records[i][2] is None:
                self.records[i][2] = len(self.ops)
            if self.by_key.get(key) == i:
                del self.by_key[key]

        return cb

    def arguments(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward pre-hook (with keyword arguments): note the call's forward-allocated tensor arguments."""
        self.call_args[self.scopes.current_call] = tuple(sorted(set(self._forward_allocated((args, kwargs)))))

    def pack(self, t: torch.Tensor) -> None:
        call = self.scopes.current_call
        self.pending.append((len(self.ops) - 1, call))
        if t.layout == torch.strided:
            rec = self.by_key.get(storage_key(t))
            if rec is not None:
                self.records[rec][3].add(call)
        return None  # keep nothing: tensors live only as long as Python holds them


def record_forward(
    workload: Workload,
    *,
    repeats: int = 7,
    fake: bool = False,
    kernel_kind: str = "cpu",
    cuda_device: Any = None,
) -> ForwardRecord:
    """Run the step's forward (model and loss) ``repeats + 1`` times with autograd saving nothing.

    The first run warms up; per-op times are medians of the others. Nothing is updated (no backward, no
    optimizer step); BatchNorm running statistics are restored afterwards.

    ``fake``: run once on fake tensors (as ``trace(fake=True)``): lifetimes, savers and FLOPs are exact,
    the times are those of fake kernels (nothing is computed) and mean nothing.

    ``kernel_kind``, ``cuda_device``: as for :func:`trainledger.trace.trace`; with ``cuda`` the forward runs on
    fake tensors with CUDA's kernels substituted, so that it lines up op for op with a CUDA-kind trace.
    """
    if kernel_kind == "cuda":
        return _record_cuda(workload, cuda_device)
    if fake:
        from trainledger.trace._fake import fake_workload

        with fake_workload(workload) as (twin, mode), mode:
            return record_forward(twin, repeats=0)
    model = workload.model
    buffers = {k: v.clone() for k, v in model.state_dict().items() if not isinstance(v, nn.Parameter)}
    roots = [("", model)] + ([("reference", workload.reference)] if workload.reference is not None else [])
    runs: list[_Recorder] = []
    # One intra-op thread while timing: on a busy machine, waiting for a descheduled worker thread makes
    # single ops 100x slower at random; one thread gives stable relative costs, which is what the
    # solvers need (absolute times are those of one thread).
    with intra_op_threads(1):
        _record_runs(workload, roots, runs, repeats)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k in buffers:
                v.copy_(buffers[k])
    return _combine(runs)


def _record_cuda(workload: Workload, name: Any) -> ForwardRecord:
    """The forward on fake tensors under CUDA's kernels (:mod:`trainledger.trace._cuda`), recorded once."""
    from trainledger.trace._cuda import DISPATCH_SUBSTITUTES, CudaKernels, cuda_device
    from trainledger.trace._fake import fake_workload

    with fake_workload(workload) as (twin, mode), mode:
        roots = [("", twin.model)] + ([("reference", twin.reference)] if twin.reference is not None else [])
        runs: list[_Recorder] = []
        with CudaKernels(cuda_device(name), autocast=twin.autocast_dtype is not None):
            _record_runs(twin, roots, runs, 0, substitutes=DISPATCH_SUBSTITUTES)
        return _combine(runs[-1:])


def _flop_registry() -> dict[Any, Any]:
    """``torch.utils.flop_counter``'s formulas, with what PyTorch 2.13 has none for and a CPU step runs:

    - the CPU's flash attention, counted as CUDA's: recomputing a CPU step's attention would cost nothing
      (its two matmuls, ``4·B·H·T·S·d``, are the same on either kernel);
    - oneDNN's recurrent layer (``nn.LSTM``, ``nn.GRU`` on the CPU): per time step and sequence, the input's
      and the hidden state's matmuls with every gate, ``2·T·B·(G·I + G·H)``; recomputing an LSTM cost 0.
    """
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    registry = dict(flop_registry)
    cpu_flash = aten._scaled_dot_product_flash_attention_for_cpu
    if cpu_flash not in registry and aten._scaled_dot_product_flash_attention in registry:
        registry[cpu_flash] = registry[aten._scaled_dot_product_flash_attention]
    rnn_layer = getattr(aten, "mkldnn_rnn_layer", None)
    if rnn_layer is not None and rnn_layer not in registry:
        registry[rnn_layer] = _rnn_layer_flops
    return registry


def _rnn_layer_flops(x: torch.Tensor, w_input: torch.Tensor, w_hidden: torch.Tensor, *_: Any, **__: Any) -> int:
    """``aten.mkldnn_rnn_layer``: ``x`` is (time, batch, input) or batch first; ``w_input`` is (gates x hidden,
    input) and ``w_hidden`` (gates x hidden, hidden)."""
    steps_by_batch = x.numel() // x.shape[-1]
    return 2 * steps_by_batch * (w_input.numel() + w_hidden.numel())


def _record_runs(
    workload: Workload,
    roots: list[tuple[str, nn.Module]],
    runs: list[_Recorder],
    repeats: int,
    substitutes: dict[Any, Any] | None = None,
) -> None:
    registry = _flop_registry()
    model = workload.model
    # torch's, Python's, NumPy's and the modules' own (wav2vec2's adapter drops layers by np.random.random())
    before = GeneratorStates.of([model])
    start: GeneratorStates | None = None
    for run in range(max(1, repeats) + 1):
        # The first run warms up, as the trace's warm-up step does, from the generators' state now; every other run
        # starts where that one left them, as the traced step's forward does (its backward and optimizer step draw
        # nothing): a model that draws its path (LayerDrop, stochastic depth) takes the traced step's path each time.
        if run == 1:
            start = GeneratorStates.of([model])
        if start is not None:
            start.restore()
        scopes = ModuleScopes(roots)
        rec = _Recorder(scopes, registry, substitutes)
        scopes.clock = lambda rec=rec: len(rec.ops)
        scopes.open()  # (its global pre-hook runs before each module's own: the call is known in ``arguments``)
        hooks = [m.register_forward_pre_hook(rec.arguments, with_kwargs=True) for _, r in roots for m in r.modules()]
        try:
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda _x: None), rec, autocast(workload):
                output = call_model(model, workload.batch)
                loss = compute_loss(workload, output)
                del output, loss
        finally:
            scopes.close()
            for h in hooks:
                h.remove()
        rec.settle()
        for r in rec.records:
            if r[2] is None:
                r[2] = len(rec.ops)
        runs.append(rec)
    before.restore()  # as it was: recording the forward draws nothing the loop would see


def _draws_from_a_private_generator(kwargs: dict[str, Any]) -> bool:
    gen = kwargs.get("generator")
    if not isinstance(gen, torch.Generator) or gen is torch.default_generator:
        return False
    cuda_defaults = torch.cuda.default_generators if torch.cuda.is_available() else ()
    return not any(gen is d for d in cuda_defaults)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an op writes in place, as its schema marks them (``Tensor(a!)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i])
    return out


def _combine(runs: list[_Recorder]) -> ForwardRecord:
    first = runs[-1]
    timed = runs[1:] if len(runs) > 1 else runs
    seconds = tuple(statistics.median(r.seconds[i] for r in timed) for i in range(len(first.ops)))
    storages = tuple(StorageRecord(r[0], r[1], r[2], frozenset(r[3])) for r in first.records)
    return ForwardRecord(
        tuple(first.ops),
        tuple(first.modules),
        tuple(first.flops),
        seconds,
        tuple(first.inputs),
        storages,
        tuple(first.packs),
        tuple((c.path, c.index) for c in first.scopes.calls),
        tuple(first.call_args.get(k, ()) for k in range(len(first.scopes.calls))),
        tuple(first.writes),
        tuple(first.private_rng),
    )
