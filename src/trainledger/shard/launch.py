"""Run a sharded step for real: ranks on ``torch.distributed``, each traced, compared with the prediction.

``run(RunConfig(model="gpt-tiny", world_size=2, strategy="zero3"))`` starts ``world_size`` processes on
this machine (gloo on CPU, NCCL when every rank has a GPU), each of which:

1. joins the process group through a TCP store the parent holds on a free loopback port;
2. builds the workload (built-in examples are seeded, so every rank builds the same model; every rank
   uses the workload's whole batch as its micro-batch — the same data on every rank);
3. wraps it with PyTorch's own engine: ``DistributedDataParallel`` (stage 0), plus
   ``ZeroRedundancyOptimizer`` (stage 1), or FSDP2 ``fully_shard`` on every repeated block and on the
   root with ``reshard_after_forward`` off (stage 2) or on (stage 3);
4. runs a warm-up step, then a timed step during which every ``c10d`` op is counted (payload bytes,
   calls, and wall time spent in them and in waiting on their results), then traces a step with
   :func:`trainledger.trace.trace`;
5. sends its ledger, as ``to_dict()`` JSON bytes (never pickle), to rank 0 with ``gather``; rank 0
   writes them for the parent.

The parent traces the same workload in one process, shards that ledger with
:func:`trainledger.shard.shard` (``engine="torch"``) and reports predicted against traced peaks.

Faults: when a rank raises, every rank is stopped and the error names the rank and its exception;
when ranks do not finish within the timeout, they are stopped and the error names each one and the
step it was in. No child process is left behind.

Known limitations: FSDP2 keeps parameters as ``DTensor`` wrappers and frees gathered parameters with
``untyped_storage().resize_(0)``; the tracer sees storages, so the launcher registers the local shards
and the gathered storages' resizes with it (see :func:`trainledger.trace.fsdp_storages`).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainledger.checks import instance_of, one_of, positive_number, whole_number
from trainledger.devices import Device, KernelKind
from trainledger.errors import InputError
from trainledger.ledger import Ledger
from trainledger.shard import Collective, ShardConfig, ShardResult, Strategy, infer_units, parse_strategy, shard
from trainledger.shard._observe import SETTLE_SECONDS, CollectiveCounter, settled_collectives
from trainledger.shard._units import fsdp_cannot_shard

RUN_STRATEGIES: tuple[Strategy, ...] = ("zero0", "zero1", "zero2", "zero3")
RANKS_PER_CPU = 4
"""gloo ranks allowed per CPU core: CPU processes can share cores (slowly); more than this is refused."""
WARMUP_STEPS = 2
"""Steps a rank runs before its timed step: DDP rebuilds its buckets at the second."""
STEPS_BEFORE_TRACE = WARMUP_STEPS + 1
"""Steps every rank, and the single-process reference, runs before ``trace`` (which adds its own warm-up;
a rank that traces again, see ``_trace_settled``, is a step or two further on)."""


class RankError(InputError):
    """A rank raised or did not finish: the message names the rank and what happened."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A real sharded run."""

    model: str
    """A built-in example name or ``path/to/file.py:factory`` (called in every rank)."""
    world_size: int
    """Ranks to start on this machine."""
    strategy: Strategy = "zero3"
    """``zero0``–``zero3`` (DDP, +ZeroRedundancyOptimizer, FSDP2 without/with resharding after forward)."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """``gloo`` on CPU; ``nccl`` puts rank ``r`` on GPU ``r``."""
    timeout_seconds: float = 300.0
    """Every rank must finish within this; otherwise all are stopped."""
    trace: bool = True
    """Trace each rank's step (off: only time it and count its collectives)."""

    def __post_init__(self) -> None:
        instance_of(self.model, str, "the model to run", "give a built-in example's name or 'path/to/file.py:factory'")
        whole_number(self.world_size, "world size (ranks)")
        if self.strategy not in RUN_STRATEGIES:
            raise InputError(
                f"a real run supports stages 0, 1, 2, 3 (DDP, ZeroRedundancyOptimizer, FSDP2); got {self.strategy!r}"
            )
        one_of(self.backend, "backend", ("gloo", "nccl"))
        limit = max_ranks(self.backend)
        if self.world_size > limit:
            raise InputError(
                f"world size {self.world_size} is more ranks than this machine can run with {self.backend} "
                f"(at most {limit}: "
                + (f"{RANKS_PER_CPU} per CPU core" if self.backend == "gloo" else "one per GPU")
                + "); lower the world size, or predict the sharding instead of running it"
            )
        positive_number(self.timeout_seconds, "timeout", unit="seconds")
        if not isinstance(self.trace, bool):
            raise InputError(f"trace {self.trace!r} must be True or False")


def max_ranks(backend: str) -> int:
    """Ranks this machine can run: ``RANKS_PER_CPU`` per core with gloo, one per GPU with NCCL."""
    if backend == "nccl":
        return torch.cuda.device_count()
    return RANKS_PER_CPU * (os.cpu_count() or 1)


@dataclass(frozen=True)
class RankReport:
    """What one rank measured and traced."""

    rank: int
    step_seconds: float
    """Wall time of one untraced steady-state step."""
    wait_seconds: float
    """Part of it spent inside collectives and waiting for their results."""
    collectives: tuple[Collective, ...]
    """What the collectives moved, counted at each ``c10d`` call of the timed step."""
    ledger: Ledger | None
    """The traced step of this rank (``None`` when tracing was off)."""

    @property
    def collective_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.collectives)

    @property
    def traced_peak_bytes(self) -> int | None:
        return self.ledger.peak().bytes if self.ledger is not None else None


@dataclass(frozen=True)
class RunResult:
    """Predicted against traced, per rank."""

    config: RunConfig
    prediction: ShardResult
    reference: Ledger
    """The single-process trace the prediction was made from."""
    ranks: tuple[RankReport, ...]
    notes: tuple[str, ...] = field(default=())

    def relative_error(self, rank: int) -> float | None:
        traced = self.ranks[rank].traced_peak_bytes
        if not traced:
            return None
        return self.prediction.ranks[rank].peak().bytes / traced - 1

    def to_dict(self) -> dict[str, Any]:
        first = self.ranks[0].ledger
        out = (first if first is not None else self.prediction.ranks[0]).to_dict(entries=False)
        out["result"] = "shard-run"
        out["run"] = {
            "model": self.config.model,
            "world_size": self.config.world_size,
            "strategy": self.config.strategy,
            "engine": self.prediction.label,
            "backend": self.config.backend,
        }
        out["ranks"] = [
            {
                "rank": r.rank,
                "predicted_peak_bytes": self.prediction.ranks[r.rank].peak().bytes,
                "traced_peak_bytes": r.traced_peak_bytes,
                "relative_error": self.relative_error(r.rank),
                "collective_bytes": r.collective_bytes,
                "predicted_collective_bytes": sum(c.payload_bytes for c in self.prediction.collectives),
                "collectives": _by_kind(r.collectives),
                "predicted_collectives": _by_kind(self.prediction.collectives),
                "step_seconds": r.step_seconds,
                "wait_seconds": r.wait_seconds,
                "traced_peak": r.ledger.to_dict(entries=False)["peak"] if r.ledger is not None else None,
                "predicted_peak": self.prediction.ranks[r.rank].to_dict(entries=False)["peak"],
            }
            for r in self.ranks
        ]
        out["notes"] = [*out["notes"], *self.notes]
        out["run_notes"] = list(self.notes)
        return out


def _by_kind(collectives: tuple[Collective, ...]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for c in collectives:
        d = out.setdefault(c.kind, {"payload_bytes": 0, "calls": 0})
        d["payload_bytes"] += c.payload_bytes
        d["calls"] += c.num_calls
    return out


# --- the parent ---------------------------------------------------------------------------------------


def run(config: RunConfig) -> RunResult:
    """Start the ranks, wait for them (or stop them all on a fault), and compare with the prediction.

    Example (not run here: it starts processes)::

        result = run(RunConfig(model="gpt-tiny", world_size=2, strategy="zero3"))
        [r["traced_peak_bytes"] for r in result.to_dict()["ranks"]]
    """
    from trainledger.sources import load_workload
    from trainledger.trace import trace
    from trainledger.workload import intra_op_threads, run_step

    _check_model_spec(config.model)  # bad specs fail here, in one line, before any process starts
    if parse_strategy(config.strategy) in ("zero2", "zero3"):
        with as_rank_zero():
            _refuse_what_fsdp_cannot_run(config.model)
    with tempfile.TemporaryDirectory(prefix="trainledger-shard-") as tmp:
        reports = _launch(config, Path(tmp))
    ranks = tuple(_report_from_dict(d) for d in reports)
    # the reference step is taken at the ranks' point in training: what a data-dependent model (MoE
    # routing) allocates depends on its weights
    with as_rank_zero():
        single = load_workload(config.model)
        with intra_op_threads(rank_threads(config.world_size)):  # a kernel's buffers inside follow the count
            for _ in range(STEPS_BEFORE_TRACE):
                run_step(single)
            reference = trace(single)
        workload = load_workload(config.model)
    units = units_of(workload.model)
    prediction = shard(
        reference,
        ShardConfig(
            world_size=config.world_size,
            strategy=config.strategy,
            engine="torch",
            units=units,
            late_units=late_units(workload, units),
            reduce_scatter_copy=config.backend == "gloo",
        ),
    )
    notes = (
        "every rank runs the workload's whole batch as its micro-batch (the same data on each rank)",
        "collective bytes: payload handed to each c10d call of one untraced step (all-gather: output, "
        "reduce-scatter: input), counted on each rank",
    )
    return RunResult(config, prediction, reference, ranks, notes)


def rank_threads(world_size: int) -> int:
    """The intra-op threads each CPU rank runs on: this machine's cores shared out among the ranks. What a
    CPU kernel allocates inside an op depends on the count (oneDNN's convolutions keep scratch per thread),
    so a prediction traces the step on the same count."""
    return max(1, (os.cpu_count() or 1) // world_size)


def late_units(workload: Any, units: tuple[str, ...]) -> tuple[str, ...]:
    """Units none of whose forward calls gets an input that requires grad (FSDP reduces them at the end
    of backward), found by running the workload's forward once with pre-hooks on the units."""
    from trainledger.workload import call_model, iter_tensors

    seen: dict[str, bool] = {u: False for u in units}
    handles = []
    for unit in units:

        def hook(_module: nn.Module, args: Any, kwargs: Any, unit: str = unit) -> None:
            seen[unit] |= any(t.requires_grad for t in iter_tensors((args, kwargs)))

        handles.append(workload.model.get_submodule(unit).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.enable_grad():
            call_model(workload.model, workload.batch)
    finally:
        for h in handles:
            h.remove()
    return tuple(u for u in units if not seen[u])


@contextlib.contextmanager
def as_rank_zero() -> Iterator[None]:
    """Inside, this process is rank 0 of a process group of its own (unless it is in one already), so that a
    factory that asks for its rank (to seed by it) builds here what rank 0 builds. The prediction takes every
    rank to run the workload's whole batch: a factory that divides the data by the world size builds all of it
    here."""
    if not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _refuse_what_fsdp_cannot_run(spec: str) -> None:
    """Before any rank starts, refuse in terms of the model what FSDP2 would fail on in the middle of the step.

    The workload is built here, outside any process group: a factory or a forward that fails here (one that asks
    for its rank) is left to the ranks, which say what is wrong."""
    from trainledger.sources import load_workload

    try:
        workload = load_workload(spec)
    except Exception:
        return
    refuse_parameters_fsdp_cannot_shard(workload.model, units_of(workload.model))
    refuse_outputs_fsdp_cannot_see(workload)


def refuse_parameters_fsdp_cannot_shard(model: nn.Module, units: tuple[str, ...]) -> None:
    """What FSDP2 refuses, or fails on in the middle of the step, among the model's parameters
    (:func:`~trainledger.shard._units.fsdp_cannot_shard`), refused in one line."""
    names: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        shapes[id(p)] = tuple(p.shape)
    problems = fsdp_cannot_shard([(names[k], shapes[k]) for k in names], units)
    if problems:
        raise InputError(f"FSDP (stages 2 and 3) {problems[0]}, or run stage 0 or 1 (DDP)")


def refuse_outputs_fsdp_cannot_see(workload: Any) -> None:
    """FSDP runs its root's pre-backward from hooks on the tensors it finds in the model's output (tensors in
    tuples, lists, dicts, dataclasses, ``ModelOutput``): an output that hides them (an object of another class
    with a ``.loss``) leaves the root's parameters sharded in backward, where PyTorch fails on an empty storage.
    A forward that fails here is left to the ranks."""
    from torch.utils._pytree import tree_leaves

    from trainledger.workload import call_model

    try:
        with torch.no_grad():
            out = call_model(workload.model, workload.batch)
    except Exception:
        return
    if not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(out)):
        raise InputError(
            f"FSDP (stages 2 and 3) gathers the root's parameters for backward from hooks on the tensors in the "
            f"model's output, and this model returns an object of class {type(out).__name__}, whose tensors it cannot "
            "see: return the loss or logits (or a tuple, dict or dataclass holding them), or run stage 0 or 1 (DDP)"
        )


def _check_model_spec(spec: str) -> None:
    """A built-in name, or an existing ``file.py:factory`` (the factory itself runs in the ranks)."""
    from trainledger.examples import EXAMPLES
    from trainledger.sources import load_workload

    path, _, factory = spec.rpartition(":")
    if spec in EXAMPLES or (path and Path(path).is_file() and factory.isidentifier()):
        return
    load_workload(spec)  # raises the one-line error that names what is wrong


def refuse_sparse_gradients(model: nn.Module) -> None:
    """Sparse gradients are not sharded: FSDP refuses them, and DDP exchanges index and value lists whose length
    is the batch's, which the prediction (dense gradients, dense buckets) does not model."""
    from trainledger.trace import has_sparse_gradients

    if has_sparse_gradients(model):
        raise InputError(
            "the model has sparse gradients (an nn.Embedding or nn.EmbeddingBag with sparse=True): FSDP does not "
            "shard them and the prediction models dense gradients; shard it with sparse=False, or trace it "
            "(trainledger trace) on one process"
        )


def units_of(model: nn.Module) -> tuple[str, ...]:
    """The units FSDP wraps (each repeated block; the root takes the rest), as :func:`run` wraps them.

    A repeated block that is only a container (an ``nn.ModuleList`` of layers, a module that holds parameters
    and has no ``forward``) is never called, and FSDP refuses to wrap it: its submodules that run are the
    units instead, and a holder with none leaves its parameters to the root.
    """
    names = [n for n, _ in model.named_parameters()]
    return tuple(u for unit in infer_units(names) for u in _called_units(model, unit))


def _called_units(model: nn.Module, path: str) -> list[str]:
    module = model.get_submodule(path)
    if type(module).forward is not nn.Module.forward:
        return [path]
    return [u for name, _ in module.named_children() for u in _called_units(model, f"{path}.{name}")]


@dataclass(frozen=True, slots=True)
class PhaseSeconds:
    """Wall time of each phase of one untraced step: the compute that collectives can hide behind."""

    forward: float | None
    backward: float | None
    optimizer: float | None
    zero_grad: float | None
    """``None``: the phase was not measured (the step did not run it)."""

    def measured(self) -> dict[str, float]:
        """``phase -> seconds`` of the phases measured, in step order (as ``estimate_time`` takes them)."""
        phases = {"forward": self.forward, "backward": self.backward, "optimizer": self.optimizer}
        return {k: v for k, v in {**phases, "zero_grad": self.zero_grad}.items() if v is not None}


@dataclass(frozen=True)
class ReferenceStep:
    """One process's step of a workload, as a prediction of its sharded run needs it."""

    ledger: Ledger
    """The traced step."""
    units: tuple[str, ...]
    """FSDP's units (see :func:`units_of`)."""
    late_units: tuple[str, ...]
    """Units FSDP reduces at the end of backward (see :func:`late_units`)."""
    phase_seconds: PhaseSeconds | None
    """Each phase's wall time in one untraced step; ``None``: not measured (not asked for)."""


def reference_step(
    model: str,
    *,
    time_phases: bool = False,
    kernel_kind: KernelKind = "cpu",
    cuda_device: str | Device | None = None,
    world_size: int = 1,
) -> ReferenceStep:
    """Trace ``model``'s step in one process and find its FSDP units (and, with ``time_phases``, time each
    phase of one more step on this machine's kernels).

    With ``kernel_kind="cuda"`` the step is traced as PyTorch's CUDA kernels would run it on ``cuda_device``
    (default an H100), on fake tensors (see :func:`trainledger.trace.trace`); ``world_size`` then sizes NCCL's
    buffers, stated beside the ledger. On this machine's kernels the step runs on the intra-op threads each
    of ``world_size`` ranks would have here (:func:`rank_threads`): a kernel's buffers inside follow the count.

    Example (not run here: it builds and traces a model)::

        ref = reference_step("gpt-tiny", kernel_kind="cuda")
        shard(ref.ledger, world_size=4, engine="torch", units=ref.units, late_units=ref.late_units)
    """
    from trainledger.sources import load_workload
    from trainledger.trace import trace
    from trainledger.workload import intra_op_threads

    with as_rank_zero():
        workload = load_workload(model)
    refuse_sparse_gradients(workload.model)
    threads = torch.get_num_threads() if kernel_kind == "cuda" else rank_threads(world_size)
    with intra_op_threads(threads):
        ledger = trace(workload, kernel_kind=kernel_kind, cuda_device=cuda_device, world_size=world_size)
        seconds = _phase_seconds(workload) if time_phases else None
    units = units_of(workload.model)
    return ReferenceStep(ledger, units, late_units(workload, units), seconds)


def _phase_seconds(workload: Any) -> PhaseSeconds:
    from trainledger.workload import run_step

    marks: list[tuple[str, float]] = []
    run_step(workload, on_phase=lambda phase: marks.append((phase, time.perf_counter())))
    seconds = {phase: t1 - t0 for (phase, t0), (_, t1) in itertools.pairwise(marks)}
    return PhaseSeconds(*(seconds.get(phase) for phase in ("forward", "backward", "optimizer", "zero_grad")))


def _launch(config: RunConfig, tmp: Path) -> list[dict[str, Any]]:
    store = dist.TCPStore("127.0.0.1", 0, config.world_size + 1, is_master=True, wait_for_workers=False)
    (tmp / "config.json").write_text(json.dumps(_config_dict(config)))
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + config.timeout_seconds
    try:
        for rank in range(config.world_size):
            argv = [sys.executable, "-m", "trainledger.shard.launch", str(rank), str(config.world_size)]
            argv += [str(store.port), str(tmp), str(os.getpid())]
            with (tmp / f"rank{rank}.stderr").open("wb") as err:  # the child keeps its own handle
                # Each rank leads a process group of its own: a Ctrl-C at the terminal reaches the parent
                # alone, which stops every rank (and anything a rank started) the same way for every signal.
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        start_new_session=True,
                    )
                )
        while True:
            failed = [r for r in range(config.world_size) if (tmp / f"rank{r}.error").exists()]
            if failed:
                raise RankError(_failure_message(tmp, failed))
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            dead = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if dead:
                time.sleep(0.5)  # give its error file a moment to land
                failed = [r for r in range(config.world_size) if (tmp / f"rank{r}.error").exists()]
                if failed:
                    raise RankError(_failure_message(tmp, failed))
                raise RankError(
                    f"rank {dead[0]} exited with status {codes[dead[0]]}: {_last_line(tmp, dead[0])}; "
                    "every rank was stopped"
                )
            if time.monotonic() > deadline:
                stuck = [f"rank {r} in {_stage(tmp, r)}" for r, c in enumerate(codes) if c is None]
                raise RankError(
                    f"ranks did not finish within {config.timeout_seconds:g} s and were stopped: "
                    + "; ".join(stuck)
                    + " (a rank that hangs leaves the others waiting in a collective)"
                )
            time.sleep(0.05)
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RankError(f"rank {bad[0]} exited with status {procs[bad[0]].returncode}")
        return json.loads((tmp / "ranks.json").read_text())
    finally:
        _stop(procs)
        del store


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate, then kill, the process group of every rank still running; reap them all."""
    for p in procs:
        if p.poll() is None:  # a group is signalled only while its leader is ours and unreaped
            _signal_group(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait(timeout=3)


def _signal_group(p: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(p.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:  # not a group of ours after all: the rank itself, then
        p.send_signal(signum)


def _failure_message(tmp: Path, failed: list[int]) -> str:
    rank = min(failed)
    text = (tmp / f"rank{rank}.error").read_text().strip()
    return f"rank {rank} raised {text}; every rank was stopped"


def _last_line(tmp: Path, rank: int) -> str:
    """The last line the rank wrote to stderr (a crash below Python leaves no exception to report)."""
    path = tmp / f"rank{rank}.stderr"
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return lines[-1][:300] if lines else "no message"


def _stage(tmp: Path, rank: int) -> str:
    path = tmp / f"rank{rank}.stage"
    return path.read_text() if path.exists() else "starting"


def _config_dict(config: RunConfig) -> dict[str, Any]:
    return {
        "model": config.model,
        "strategy": config.strategy,
        "backend": config.backend,
        "timeout_seconds": config.timeout_seconds,
        "trace": config.trace,
    }


def _report_from_dict(d: dict[str, Any]) -> RankReport:
    return RankReport(
        rank=d["rank"],
        step_seconds=d["step_seconds"],
        wait_seconds=d["wait_seconds"],
        collectives=tuple(Collective(**c) for c in d["collectives"]),
        ledger=Ledger.from_dict(d["ledger"]) if d.get("ledger") is not None else None,
    )


# --- one rank -----------------------------------------------------------------------------------------


def exit_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (the launcher) dies, however it dies (even by SIGKILL, which
    runs no cleanup): a rank left alone would otherwise wait in a collective forever.

    On Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` has the kernel do it the instant the parent goes, at no
    cost; the parent may already have gone before the call, so the parent's pid is checked after it.
    Elsewhere a daemon thread polls ``os.getppid()`` twice a second (a rank is reparented when its
    parent dies).
    """
    if os.getppid() != parent_pid:
        os._exit(1)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="trainledger-parent-watch", daemon=True).start()
        return
    if os.getppid() != parent_pid:  # it died between the first check and the prctl
        os._exit(1)


_PR_SET_PDEATHSIG = 1
"""``<linux/prctl.h>``: the signal a process gets when its parent dies."""


def _rank_main(rank: int, world_size: int, port: int, tmp: str, parent_pid: int) -> None:
    """A rank's whole life; any exception is written for the parent, which stops every rank."""
    exit_with_parent(parent_pid)
    out = Path(tmp)
    cfg = json.loads((out / "config.json").read_text())

    def stage(text: str) -> None:
        (out / f"rank{rank}.stage").write_text(text)

    try:
        stage("joining the process group")
        torch.set_num_threads(rank_threads(world_size))
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
        timeout = timedelta(seconds=cfg["timeout_seconds"] + 60)  # the parent's deadline comes first
        if cfg["backend"] == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=world_size, timeout=timeout)
        report = rank_step(cfg, stage=stage)
        stage("sending the ledger to rank 0")
        texts = _gather_text(json.dumps(report), rank, world_size, cfg["backend"])
        if rank == 0:
            (out / "ranks.json.part").write_text("[" + ",".join(texts) + "]")
            (out / "ranks.json.part").rename(out / "ranks.json")
        stage("leaving the process group")
        dist.destroy_process_group()
    except BaseException as exc:
        message = " ".join(str(exc).split())[:400]
        (out / f"rank{rank}.traceback").write_text(traceback.format_exc())
        (out / f"rank{rank}.error.part").write_text(f"{type(exc).__name__}: {message}")
        (out / f"rank{rank}.error.part").rename(out / f"rank{rank}.error")
        code = 1
    else:
        code = 0
    # Leave at once: the parent stops the other ranks, and skipping interpreter teardown avoids the
    # communication threads of a group that was not (or could not be) shut down aborting the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_step(cfg: dict[str, Any], *, stage: Any = lambda _s: None) -> dict[str, Any]:
    """In an initialised process group: build, wrap, time, count and trace one step of this rank.

    Usable under ``torchrun`` too: initialise the process group, then call it on every rank.
    """
    from trainledger.sources import load_workload
    from trainledger.workload import run_step

    rank = dist.get_rank()
    stage("building the workload")
    workload = load_workload(cfg["model"])  # here: a factory may ask for its rank
    refuse_sparse_gradients(workload.model)
    if cfg["backend"] == "nccl":  # rank r on GPU r: the model and its batch
        device = torch.device("cuda", torch.cuda.current_device())
        workload.model.to(device)
        workload.batch = _to_device(workload.batch, device)
    stage("wrapping it for sharding")
    _wrap(workload, cfg["strategy"])
    stage("the warm-up steps")
    for _ in range(WARMUP_STEPS):
        with _engine_errors_explained(cfg["strategy"]):
            run_step(workload)
    stage("the timed step")
    counter = CollectiveCounter(dist.get_world_size())
    dist.barrier()
    start = time.perf_counter()
    with counter, counter.waits():
        run_step(workload)
    step_seconds = time.perf_counter() - start
    ledger = None
    if cfg["trace"]:
        stage("the traced step")
        ledger = _trace_settled(workload, cfg["backend"])
        ledger = ledger.with_entries(ledger.entries, meta={**ledger.meta, "rank": rank})
    return {
        "rank": rank,
        "step_seconds": step_seconds,
        "wait_seconds": counter.wait_seconds,
        "collectives": [_collective_dict(c) for c in counter.collectives()],
        "ledger": ledger.to_dict() if ledger is not None else None,
    }


@contextlib.contextmanager
def _engine_errors_explained(strategy: str) -> Iterator[None]:
    """DDP's error for a parameter that got no gradient, and FSDP's for a sharded parameter used outside the
    model's forward, said in terms of what the user can change here."""
    try:
        yield
    except Exception as exc:
        text = str(exc)
        if "find_unused_parameters" in text:
            raise InputError(
                f"DDP ({strategy}) needs every trainable parameter to get a gradient in each step, and this model "
                "has one that gets none (unused in forward); DDP runs as PyTorch builds it by default: freeze that "
                "parameter (requires_grad_(False)), or run ZeRO stage 2 or 3 (FSDP)"
            ) from None
        if "mixed torch.Tensor and DTensor" in text:
            op = text.split(" got mixed", 1)[0]
            raise InputError(
                f"FSDP ({strategy}) gathers a module's parameters only while the sharded model runs its forward, "
                f"and this workload used a sharded parameter outside it ({op} saw the shard): call the modules "
                "from the model's forward (not from loss_fn or the loop), or run stage 0 or 1 (DDP)"
            ) from None
        if "Sharding propagation failed for" in text or "require placement changes are not supported" in text:
            op = text.split(":", 1)[0] if text.startswith("aten.") else text.split("failed for ", 1)[-1].split("(")[0]
            raise InputError(
                f"FSDP ({strategy}) holds the parameters, their gradients and the optimizer's state as shards "
                f"(DTensor), and this step runs {op} on them, which DTensor cannot run on shards (an optimizer "
                "such as Rprop indexes its state): use an optimizer whose step works element by element (SGD, "
                "Adam, AdamW, ...), or run stage 0 or 1 (DDP)"
            ) from None
        raise


TRACE_ATTEMPTS = 3
"""Traces of a rank's step tried until no rank had a buffer freed by a communication thread."""


def _trace_settled(workload: Any, backend: str) -> Ledger:
    """Trace the step with FSDP2's storages in view and collectives settled; trace again, every rank
    together, while some rank's trace still had a buffer freed by another thread (its note says so)."""
    from trainledger.trace import fsdp_storages, trace

    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    for attempt in range(TRACE_ATTEMPTS):
        # a loaded machine's worker threads may need longer to let go: each attempt waits four times longer
        with fsdp_storages(workload.model), settled_collectives(SETTLE_SECONDS * 4**attempt):
            ledger = trace(workload)
        unsettled = torch.tensor([ledger.meta.get("frees_on_other_threads", 0)], device=device)
        dist.all_reduce(unsettled, op=dist.ReduceOp.MAX)
        if not unsettled.item():
            break
    return ledger


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _collective_dict(c: Collective) -> dict[str, Any]:
    return {
        "kind": c.kind,
        "phase": c.phase,
        "label": c.label,
        "payload_bytes": c.payload_bytes,
        "group_size": c.group_size,
        "num_calls": c.num_calls,
    }


def _wrap(workload: Any, strategy: str) -> None:
    """Wrap the model (and replace the optimizer) as the strategy's PyTorch engine does."""
    strategy = parse_strategy(strategy)
    optimizer = workload.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(
            "the workload holds an optimizer instance; for a real run give Workload(optimizer=factory) so each "
            "rank can build it over its sharded parameters"
        )
    factory = optimizer or torch.optim.AdamW
    workload._optimizer = None
    if strategy in ("zero0", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        workload.model = DistributedDataParallel(workload.model)
        if strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            probe = factory(params_of(workload.model))
            cls = type(probe)
            accepted = _init_keywords(cls)  # defaults may hold derived keys
            defaults = {k: v for k, v in probe.defaults.items() if k in accepted}
            del probe

            def zero(params: Any) -> torch.optim.Optimizer:
                try:
                    return ZeroRedundancyOptimizer(list(params), optimizer_class=cls, **defaults)
                except Exception as exc:
                    if "same dense type" in str(exc):
                        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params_of(workload.model)})
                        raise InputError(
                            "ZeroRedundancyOptimizer (zero1) needs every trainable parameter in one dtype, and this "
                            f"model trains {', '.join(dtypes)}: run stage 0, 2 or 3"
                        ) from None
                    raise InputError(
                        f"ZeroRedundancyOptimizer (zero1) builds {cls.__name__} itself over each rank's parameter "
                        f"groups (dicts with a 'params' list), and that raised {type(exc).__name__}: {exc}; give an "
                        "optimizer class that takes parameter groups as torch.optim's do, or run another stage"
                    ) from None

            workload.optimizer = zero
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    reshard = strategy == "zero3"
    for unit in units_of(workload.model):
        fully_shard(workload.model.get_submodule(unit), mesh=mesh, reshard_after_forward=reshard)
    fully_shard(workload.model, mesh=mesh, reshard_after_forward=reshard)
    workload.optimizer = factory


def params_of(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the step trains."""
    return [p for p in model.parameters() if p.requires_grad]


def _init_keywords(cls: type) -> set[str]:
    """The keywords ``cls(...)`` takes: its ``__init__``'s, and while that passes ``**kwargs`` on, its bases'."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def _gather_text(text: str, rank: int, world_size: int, backend: str) -> list[str]:
    """Gather one UTF-8 string per rank to rank 0 as byte tensors (no pickle)."""
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world_size)] if rank == 0 else None
    dist.gather(padded, bufs, dst=0)
    if rank != 0:
        return []
    assert bufs is not None
    return [bytes(b[: int(s.item())].cpu().tolist()).decode() for b, s in zip(bufs, sizes, strict=True)]


if __name__ == "__main__":  # one rank, started by _launch: RANK WORLD_SIZE STORE_PORT DIRECTORY PARENT_PID
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
