"""``fit``: which configurations of a step fit a device, best first (no torch).

For each precision recipe, ZeRO stage and rematerialization policy, micro-batches are tried in increasing
order until one overflows (the peak grows with the micro-batch). Each configuration gets the analytic
peak of rank 0 and a relative step cost per token: compute (``6·N·P``-style matmul FLOPs at a sustained
rate), recomputation, and the communication not hidden behind compute (the sharding transform's
collectives timed at the link's bandwidth, :func:`trainledger.shard.estimate_time`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from trainledger.allocator import predict_reserved
from trainledger.analytic._arch import ArchSpec
from trainledger.analytic._config import arch_from_config
from trainledger.analytic._model import analytic_ledger, compact, step_flops
from trainledger.analytic._params import num_params
from trainledger.analytic._setup import RECIPES, REMATS, Setup, setup_from_dict, setup_to_dict
from trainledger.checks import MAX_BYTES, MAX_MICRO_BATCH, MAX_WORLD, instance_of, one_of, positive_number, whole_number
from trainledger.errors import InputError
from trainledger.ledger import Ledger


@dataclass(frozen=True, kw_only=True)
class FitOptions:
    """What to search and the machine to fit."""

    device_memory: int
    """Bytes of one device's memory."""
    world: int = 1
    """Data-parallel ranks."""
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Micro-batch sizes tried, in increasing order."""
    stages: tuple[str, ...] = ("zero0", "zero1", "zero2", "zero3")
    remats: tuple[str, ...] = REMATS
    recipes: tuple[str, ...] = ("bf16-master", "bf16")
    tflops: float = 400.0
    """Sustained matmul throughput of one device (10^12 FLOP/s), for the relative step cost."""
    link_gbps: float = 400.0
    """Per-rank data-parallel bandwidth (10^9 bit/s), for the exposed communication."""
    reserve_bytes: int = 0
    """Memory kept free on the device (allocator caching, CUDA context, fragmentation)."""
    budget_on: Literal["allocated", "reserved"] = "allocated"
    """What must fit the usable memory: the ledger's peak (``allocated``), or what PyTorch's caching allocator
    would reserve for it (``reserved``: the step replayed through :mod:`trainledger.allocator`; a configuration
    fits when no allocation fails there, cache flushes and retries included)."""

    def __post_init__(self) -> None:
        whole_number(self.device_memory, "device memory (bytes)", limit=MAX_BYTES)
        whole_number(self.reserve_bytes, "reserve (bytes)", minimum=0, limit=MAX_BYTES)
        if self.device_memory <= self.reserve_bytes:
            raise InputError(
                f"device memory {self.device_memory:,} bytes leaves nothing after the reserve of "
                f"{self.reserve_bytes:,} bytes; give a reserve below the device memory"
            )
        whole_number(self.world, "world size (data-parallel ranks)", limit=MAX_WORLD)
        for what, values, accepted in (
            ("ZeRO stage", self.stages, ("zero0", "zero1", "zero2", "zero3")),
            ("rematerialization policy", self.remats, REMATS),
            ("precision recipe", self.recipes, RECIPES),
        ):
            if not isinstance(values, tuple) or not values:
                raise InputError(f"{what}s {values!r} must be a non-empty tuple; accepted: {', '.join(accepted)}")
            for v in values:
                one_of(v, what, accepted)
        if not isinstance(self.micro_batches, tuple) or not self.micro_batches:
            raise InputError(f"micro-batches {self.micro_batches!r} must be a non-empty tuple of whole numbers")
        for mb in self.micro_batches:
            whole_number(mb, "micro-batch (sequences)", limit=MAX_MICRO_BATCH)
        positive_number(self.tflops, "throughput", unit="TFLOP/s")
        positive_number(self.link_gbps, "link bandwidth", unit="gigabits per second")
        one_of(self.budget_on, "budget on", ("allocated", "reserved"))


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration with its predicted peak and relative cost."""

    micro_batch: int
    stage: str
    remat: str
    recipe: str
    peak_bytes: int
    peak_phase: str
    by_category: dict[str, int]
    fits: bool
    overflow_bytes: int
    """How far the peak is above the usable memory (0 when it fits)."""
    compute_seconds: float
    recompute_seconds: float
    exposed_comm_seconds: float
    seconds_per_token: float
    largest_entry: tuple[str, int] = ("", 0)
    """The largest array live at the peak: what to act on."""
    relative_cost: float | None = None
    """Step time per token relative to the best configuration that fits (1.0 = best); ``None`` for one
    that does not fit (nothing to compare it with)."""
    reserved_bytes: int | None = None
    """Predicted ``max_memory_reserved`` (``budget_on="reserved"``); ``None``: not predicted."""
    traced_peak_bytes: int | None = None
    """Rank 0's peak of the step traced at full size on fake tensors and sharded as this configuration says
    (evidence traced); ``None`` where it was not traced. Where present, it decides whether the configuration
    fits and orders equal costs."""

    @property
    def key(self) -> tuple[int, str, str, str]:
        """``(micro_batch, stage, remat, recipe)``: the configuration, without its figures."""
        return self.micro_batch, self.stage, self.remat, self.recipe

    @property
    def ranked_peak_bytes(self) -> int:
        """The peak the ranking uses: the traced one where it exists, the analytic one otherwise."""
        return self.peak_bytes if self.traced_peak_bytes is None else self.traced_peak_bytes

    @property
    def largest_at_peak(self) -> tuple[str, int]:
        return max(self.by_category.items(), key=lambda kv: kv[1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch": self.micro_batch,
            "stage": self.stage,
            "remat": self.remat,
            "recipe": self.recipe,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "by_category": self.by_category,
            "fits": self.fits,
            "overflow_bytes": self.overflow_bytes,
            "compute_seconds": self.compute_seconds,
            "recompute_seconds": self.recompute_seconds,
            "exposed_comm_seconds": self.exposed_comm_seconds,
            "seconds_per_token": self.seconds_per_token,
            "relative_cost": self.relative_cost,
            "reserved_bytes": self.reserved_bytes,
            "traced_peak_bytes": self.traced_peak_bytes,
            "largest_at_peak": {"name": self.largest_entry[0], "bytes": self.largest_entry[1]},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        fields = {k: v for k, v in data.items() if k != "largest_at_peak"}
        largest = data["largest_at_peak"]
        return cls(**fields, largest_entry=(str(largest["name"]), int(largest["bytes"])))


@dataclass(frozen=True)
class FitResult:
    """Configurations that fit (best first) and the smallest ones that do not, with what overflows."""

    source: str
    options: FitOptions
    base: Setup
    num_params: int
    fitting: tuple[Candidate, ...]
    overflowing: tuple[Candidate, ...]
    config: dict[str, Any]
    """The validated Hugging Face config the search ran on."""
    notes: tuple[str, ...] = ()
    """How the traced peaks were obtained, and which configurations could not be traced and why."""

    def to_dict(self) -> dict[str, Any]:
        """The best fitting configuration's ledger keys at the top, then every candidate."""
        best = self.fitting[0] if self.fitting else (self.overflowing[0] if self.overflowing else None)
        out: dict[str, Any] = {}
        if best is not None:
            setup = replace(self.base, micro_batch=best.micro_batch, remat=best.remat, recipe=best.recipe)  # type: ignore[arg-type]
            out = _ledger_of(self, setup, best.stage).to_dict(entries=False)
        out.update(
            {
                "source": self.source,
                "num_params": self.num_params,
                "device_memory_bytes": self.options.device_memory,
                "usable_bytes": self.options.device_memory - self.options.reserve_bytes,
                "world": self.options.world,
                "result": "fit",
                "options": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.options).items()},
                "base_setup": setup_to_dict(self.base),
                "config": self.config,
                "fits": [c.to_dict() for c in self.fitting],
                "does_not_fit": [c.to_dict() for c in self.overflowing],
                "notes": list(self.notes),
                "cost_model": {
                    "tflops": self.options.tflops,
                    "link_gbps": self.options.link_gbps,
                    "meaning": "seconds per token = (compute + recompute + exposed communication) / tokens; "
                    "relative to the best configuration that fits",
                },
            }
        )
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FitResult:
        """Read ``to_dict()`` back (``trainledger report``): every candidate is saved with its figures."""
        options = FitOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
        return cls(
            source=str(data["source"]),
            options=options,
            base=setup_from_dict(data["base_setup"]),
            num_params=int(data["num_params"]),
            fitting=tuple(Candidate.from_dict(c) for c in data["fits"]),
            overflowing=tuple(Candidate.from_dict(c) for c in data["does_not_fit"]),
            config=dict(data["config"]),
            notes=tuple(data.get("notes", ())),
        )


def _ledger_of(result: FitResult, setup: Setup, stage: str) -> Any:
    from trainledger.analytic._estimate import shard_ledger

    spec = arch_from_config(result.config)
    led, _ = shard_ledger(analytic_ledger(spec, setup), result.options.world, stage)
    return led


def fit(config: str | Path | dict[str, Any], options: FitOptions, base: Setup | None = None) -> FitResult:
    """Search micro-batch × ZeRO stage × rematerialization × precision for what fits ``options.device_memory``.

    Example:
        >>> cfg = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12}
        >>> r = fit(cfg, FitOptions(device_memory=16 * 2**30, world=8, micro_batches=(1, 2)), Setup(seq_len=1024))
        >>> r.fitting[0].relative_cost
        1.0
    """
    from trainledger.analytic._estimate import check_positions, check_setup, read_config
    from trainledger.shard import parse_strategy

    instance_of(options, FitOptions, "fit options", "give a trainledger.FitOptions(device_memory=..., ...)")
    base = check_setup(base)
    raw = read_config(config)
    spec = arch_from_config(raw)
    check_positions(spec, base)
    stages = [parse_strategy(s) for s in options.stages]
    notes: tuple[str, ...] = ()
    if options.world == 1 and len(stages) > 1:
        # one rank holds every shard: each stage's rows would repeat the first's
        notes = (
            "one data-parallel rank: every ZeRO stage holds the whole state there, so only ZeRO stage "
            f"{stages[0][-1]} was tried (--world N compares stages)",
        )
        stages = stages[:1]
    fitting: list[Candidate] = []
    overflowing: list[Candidate] = []
    steps: dict[Setup, Ledger] = {}  # a step's ledger is the same under every ZeRO stage: built once
    for recipe in options.recipes:
        for remat in _remats(options, base):
            for stage in stages:
                for mb in sorted(options.micro_batches):
                    setup = replace(base, micro_batch=mb, remat=remat, recipe=recipe)  # type: ignore[arg-type]
                    if setup not in steps:
                        steps[setup] = compact(analytic_ledger(spec, setup))
                    cand = _candidate(spec, setup, stage, options, steps[setup])
                    if cand.fits:
                        fitting.append(cand)
                    else:
                        overflowing.append(cand)
                        break  # larger micro-batches only need more
    overflowing.sort(key=lambda c: (c.overflow_bytes, c.micro_batch))
    return FitResult(
        source="config" if isinstance(config, dict) else str(config),
        options=options,
        base=base,
        num_params=num_params(spec),
        fitting=_best_first(fitting),
        overflowing=tuple(overflowing),
        config=raw,
        notes=notes,
    )


def _remats(options: FitOptions, base: Setup) -> list[str]:
    """The recomputation policies worth trying."""
    remats = list(options.remats)
    if base.attn_impl == "sdpa" and "selective" in remats and "none" in remats:
        # with fused attention nothing T×T is saved: selective recomputation saves no memory, only adds time
        remats.remove("selective")
    return remats


def _candidate(spec: ArchSpec, setup: Setup, stage: str, options: FitOptions, led: Ledger) -> Candidate:
    """One configuration: rank 0's analytic peak, what is largest then, and the step's cost per token, from
    ``led``, the step's (compacted) analytic ledger."""
    from trainledger.analytic._estimate import shard_ledger
    from trainledger.shard import ShardConfig, shard

    collectives: tuple[Any, ...] = ()
    if options.world > 1:
        res = shard(led, ShardConfig(world_size=options.world, strategy=stage, engine="deepspeed"))  # type: ignore[arg-type]
        rank0, collectives = res.ranks[0], res.collectives
    else:
        rank0, _ = shard_ledger(led, 1, stage)
    pk = rank0.peak()
    compute, recompute, exposed = _step_seconds(spec, setup, options, collectives)
    top = max(rank0.live_at(pk.event), key=lambda e: e.nbytes)
    usable = options.device_memory - options.reserve_bytes
    fits, need, reserved = pk.bytes <= usable, pk.bytes, None
    if options.budget_on == "reserved":
        pred = predict_reserved(rank0, kernel_kind=setup.device, capacity_bytes=usable)
        fits, need = bool(pred.fits), pred.max_reserved_bytes
        reserved = pred.reserved_under_limit_bytes if fits else need
    return Candidate(
        micro_batch=setup.micro_batch,
        stage=stage,
        remat=setup.remat,
        recipe=setup.recipe,
        peak_bytes=pk.bytes,
        peak_phase=pk.phase,
        by_category=dict(pk.by_category),
        fits=fits,
        overflow_bytes=0 if fits else max(0, need - usable),
        compute_seconds=compute,
        recompute_seconds=recompute,
        exposed_comm_seconds=exposed,
        seconds_per_token=(compute + recompute + exposed) / (setup.micro_batch * setup.seq_len),
        largest_entry=(top.name, top.nbytes),
        reserved_bytes=reserved,
    )


def _step_seconds(
    spec: ArchSpec, setup: Setup, options: FitOptions, collectives: tuple[Any, ...]
) -> tuple[float, float, float]:
    """Compute (forward and backward: three forwards' FLOPs), recomputation, and the communication not
    hidden behind them, at the options' sustained rate and link bandwidth."""
    from trainledger.shard import estimate_time

    fwd_flops, re_flops = step_flops(spec, setup)
    rate = options.tflops * 1e12
    compute = 3 * fwd_flops / rate
    recompute = re_flops / rate
    if not collectives:
        return compute, recompute, 0.0
    t = estimate_time(
        collectives,
        link_gbps=options.link_gbps,
        compute_seconds={"forward": fwd_flops / rate, "backward": 2 * fwd_flops / rate + recompute},
    )
    return compute, recompute, t.exposed_seconds


def _best_first(fitting: list[Candidate]) -> tuple[Candidate, ...]:
    """Cheapest per token first (cost relative to the cheapest), the smaller peak first among equals (the
    traced peak where there is one)."""
    best = min((c.seconds_per_token for c in fitting), default=None)
    if best:
        fitting = [replace(c, relative_cost=c.seconds_per_token / best) for c in fitting]
    return tuple(sorted(fitting, key=lambda c: (c.relative_cost, c.reserved_bytes or c.ranked_peak_bytes)))


def with_traced_peaks(
    result: FitResult, peaks: dict[tuple[int, str, str, str], int], notes: tuple[str, ...] = ()
) -> FitResult:
    """``result`` with traced peaks (keyed by :attr:`Candidate.key`) beside the analytic ones: a configuration
    whose traced peak is above the usable memory moves to the ones that do not fit, and the rest are ranked
    again (costs relative to the best that still fits; the traced peak orders equal costs).

    Example:
        >>> cfg = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12}
        >>> r = fit(cfg, FitOptions(device_memory=16 * 2**30, micro_batches=(1,)), Setup(seq_len=1024))
        >>> best = r.fitting[0]
        >>> with_traced_peaks(r, {best.key: 17 * 2**30}).overflowing[0].key == best.key
        True
    """
    usable = result.options.device_memory - result.options.reserve_bytes
    updated = []
    for c in (*result.fitting, *result.overflowing):
        traced = peaks.get(c.key, c.traced_peak_bytes)
        if traced is not None:
            whole_number(traced, "traced peak (bytes)", minimum=0, limit=MAX_BYTES)
            c = replace(c, traced_peak_bytes=traced, fits=traced <= usable, overflow_bytes=max(0, traced - usable))
        updated.append(c)
    overflowing = sorted(
        (replace(c, relative_cost=None) for c in updated if not c.fits), key=lambda c: (c.overflow_bytes, c.micro_batch)
    )
    fitting = _best_first([c for c in updated if c.fits])
    return replace(result, fitting=fitting, overflowing=tuple(overflowing), notes=(*result.notes, *notes))
