"""What a sharded step is: the strategy, the engine, the world, and what each strategy divides. Pure, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainledger.checks import MAX_WORLD, one_of, whole_number
from trainledger.errors import InputError

Strategy = Literal["zero0", "zero1", "zero2", "zero3", "full_shard", "shard_grad_op", "hybrid_shard"]
STRATEGIES: tuple[Strategy, ...] = (
    "zero0",
    "zero1",
    "zero2",
    "zero3",
    "full_shard",
    "shard_grad_op",
    "hybrid_shard",
)
Engine = Literal["deepspeed", "torch"]
ENGINES: tuple[Engine, ...] = ("deepspeed", "torch")

DEEPSPEED_REDUCE_BUCKET_NUMEL = 500_000_000
"""DeepSpeed's ``zero_optimization.reduce_bucket_size`` default (elements)."""
DDP_BUCKET_BYTES = 25 * 2**20
"""``DistributedDataParallel(bucket_cap_mb=25)``: PyTorch's default bucket size (MiB)."""


def parse_strategy(text: str | int) -> Strategy:
    """``0``–``3`` (ZeRO stages) or an FSDP strategy name, as users type them.

    Example:
        >>> parse_strategy("3"), parse_strategy("FULL_SHARD"), parse_strategy("hybrid-shard")
        ('zero3', 'full_shard', 'hybrid_shard')
    """
    name = str(text).strip().lower().replace("-", "_")
    if name in ("0", "1", "2", "3"):
        name = f"zero{name}"
    if name not in STRATEGIES:
        raise InputError(
            f"unknown stage {text!r}; accepted: 0, 1, 2, 3 (ZeRO stages) or full_shard, shard_grad_op, hybrid_shard"
        )
    return name  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """How the step is sharded across ranks."""

    world_size: int
    """Number of ranks ``N`` (data-parallel degree)."""
    strategy: Strategy = "zero3"
    """ZeRO stage (``zero0`` = plain data parallel … ``zero3``) or an FSDP sharding strategy."""
    engine: Engine = "deepspeed"
    """Whose padding and buffers: ``deepspeed`` (flat partitions) or ``torch`` (DDP, ZeRO optimizer, FSDP2)."""
    num_nodes: int = 1
    """``hybrid_shard``: shard within each of ``num_nodes`` groups, replicate across them."""
    units: tuple[str, ...] | None = None
    """Module paths gathered as one unit each (stage 3/FSDP); ``None``: the repeated blocks found in
    the parameter names (``blocks.0``, ``blocks.1``…), plus the root for the rest."""
    forward_prefetch: int = 0
    """Units gathered ahead in forward (FSDP2's default: none)."""
    backward_prefetch: int = 1
    """Units gathered ahead in backward (FSDP2's default: the next one)."""
    reduce_bucket_numel: int = DEEPSPEED_REDUCE_BUCKET_NUMEL
    """``deepspeed``: elements per gradient reduce bucket."""
    ddp_bucket_bytes: int = DDP_BUCKET_BYTES
    """``torch`` stages 0–1: bytes per DDP gradient bucket (sets the number of all-reduce calls)."""
    late_units: tuple[str, ...] = ()
    """FSDP units whose forward inputs need no gradient (they take the batch, or an index into it): FSDP
    cannot hook their backward, so it reshards and reduces them only at the end of backward, root
    first, then in module order."""
    reduce_scatter_copy: bool = False
    """FSDP on gloo: the reduce-scatter works on a full-size copy of its input while it runs."""

    def __post_init__(self) -> None:
        whole_number(self.world_size, "world size (ranks)", limit=MAX_WORLD)
        one_of(self.strategy, "strategy", STRATEGIES)
        one_of(self.engine, "engine", ENGINES)
        whole_number(self.num_nodes, "number of nodes")
        if self.world_size % self.num_nodes:
            raise InputError(
                f"{self.num_nodes} nodes do not divide the world of {self.world_size} ranks "
                "(hybrid sharding shards within each node and replicates across nodes)"
            )
        whole_number(self.forward_prefetch, "forward prefetch depth (units)", minimum=0)
        whole_number(self.backward_prefetch, "backward prefetch depth (units)", minimum=0)
        whole_number(self.reduce_bucket_numel, "reduce bucket size (elements)")
        whole_number(self.ddp_bucket_bytes, "DDP bucket size (bytes)")
        if self.units is not None and not all(isinstance(u, str) for u in self.units):
            raise InputError(f"units {self.units!r} must be module paths (str), e.g. ('blocks.0', 'blocks.1')")


@dataclass(frozen=True)
class Plan:
    """What a strategy divides, on which engine: derived once from the config."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool
    regather_backward: bool
    """Stage 3 / FULL_SHARD: parameters freed after a unit's forward and gathered again for backward."""
    partition: Literal["flat", "greedy", "dim0"]
    buffers: Literal["ddp", "bucket", "fsdp"]
    shard_size: int
    replicas: int
    label: str


def plan_for(config: ShardConfig) -> Plan:
    s, n = config.strategy, config.world_size
    torch = config.engine == "torch"
    if torch and s == "zero2":
        s = "shard_grad_op"
    if torch and s == "zero3":
        s = "full_shard"
    if s in ("zero0", "zero1"):
        return Plan(
            s == "zero1",
            False,
            False,
            False,
            "greedy" if torch else "flat",
            "ddp" if torch else "bucket",
            n,
            1,
            ("DDP" if s == "zero0" else "DDP + ZeroRedundancyOptimizer") if torch else f"ZeRO stage {s[-1]}",
        )
    if s in ("zero2", "zero3"):
        return Plan(True, True, s == "zero3", s == "zero3", "flat", "bucket", n, 1, f"ZeRO stage {s[-1]}")
    shard = n // config.num_nodes if s == "hybrid_shard" else n
    return Plan(
        True,
        True,
        True,
        s != "shard_grad_op",
        "dim0",
        "fsdp",
        shard,
        n // shard,
        f"FSDP {s.upper()}" + (" (FSDP2 fully_shard)" if torch else ""),
    )
