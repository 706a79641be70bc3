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
from typing import Any

from trainledger.analytic._config import arch_from_config, load_config_file
from trainledger.analytic._model import analytic_ledger, compact, step_flops
from trainledger.analytic._params import num_params
from trainledger.analytic._setup import REMATS, Setup, setup_from_dict, setup_to_dict
from trainledger.errors import InputError


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
    relative_cost: float = 0.0
    """Step time per token relative to the best configuration that fits (1.0 = best)."""

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
    from trainledger.analytic._estimate import shard_ledger
    from trainledger.shard import ShardConfig, estimate_time, parse_strategy, shard

    raw = dict(config) if isinstance(config, dict) else load_config_file(config)
    spec = arch_from_config(raw)
    base = base or Setup()
    if options.device_memory <= options.reserve_bytes:
        raise InputError(
            f"--device-memory {options.device_memory} leaves nothing after the reserve {options.reserve_bytes}"
        )
    if options.world < 1:
        raise InputError(f"--world {options.world} must be at least 1")
    if not options.tflops > 0 or not options.link_gbps > 0:
        raise InputError("--tflops and --link-gbps must be positive")
    stages = [parse_strategy(s) for s in options.stages]
    usable = options.device_memory - options.reserve_bytes
    fitting: list[Candidate] = []
    overflowing: list[Candidate] = []
    remats = list(options.remats)
    if base.attn_impl == "sdpa" and "selective" in remats and "none" in remats:
        # with fused attention nothing T×T is saved: selective recomputation saves no memory, only adds time
        remats.remove("selective")
    for recipe in options.recipes:
        for remat in remats:
            for stage in stages:
                for mb in sorted(options.micro_batches):
                    setup = replace(base, micro_batch=mb, remat=remat, recipe=recipe)  # type: ignore[arg-type]
                    led = compact(analytic_ledger(spec, setup))
                    collectives: tuple[Any, ...] = ()
                    if options.world > 1:
                        res = shard(led, ShardConfig(world_size=options.world, strategy=stage, engine="deepspeed"))
                        rank0, collectives = res.ranks[0], res.collectives
                    else:
                        rank0, _ = shard_ledger(led, 1, stage)
                    pk = rank0.peak()
                    fwd_flops, re_flops = step_flops(spec, setup)
                    rate = options.tflops * 1e12
                    compute = 3 * fwd_flops / rate
                    recompute = re_flops / rate
                    exposed = 0.0
                    if collectives:
                        t = estimate_time(
                            collectives,
                            link_gbps=options.link_gbps,
                            compute_seconds={"forward": fwd_flops / rate, "backward": 2 * fwd_flops / rate + recompute},
                        )
                        exposed = t.exposed_seconds
                    tokens = mb * setup.seq_len
                    top = max(rank0.live_at(pk.event), key=lambda e: e.nbytes)
                    cand = Candidate(
                        micro_batch=mb,
                        stage=stage,
                        remat=remat,
                        recipe=recipe,
                        peak_bytes=pk.bytes,
                        peak_phase=pk.phase,
                        by_category=dict(pk.by_category),
                        fits=pk.bytes <= usable,
                        overflow_bytes=max(0, pk.bytes - usable),
                        compute_seconds=compute,
                        recompute_seconds=recompute,
                        exposed_comm_seconds=exposed,
                        seconds_per_token=(compute + recompute + exposed) / tokens,
                        largest_entry=(top.name, top.nbytes),
                    )
                    if cand.fits:
                        fitting.append(cand)
                    else:
                        overflowing.append(cand)
                        break  # larger micro-batches only need more
    best = min((c.seconds_per_token for c in fitting), default=None)
    if best:
        fitting = [replace(c, relative_cost=c.seconds_per_token / best) for c in fitting]
    fitting.sort(key=lambda c: (c.relative_cost, c.peak_bytes))
    overflowing.sort(key=lambda c: (c.overflow_bytes, c.micro_batch))
    result = FitResult(
        source="config" if isinstance(config, dict) else str(config),
        options=options,
        base=base,
        num_params=num_params(spec),
        fitting=tuple(fitting),
        overflowing=tuple(overflowing),
        config=raw,
    )
    return result
