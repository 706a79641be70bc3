"""Sharding as a transform of a ledger: ZeRO stages 0–3 and FSDP, one ledger per rank.

Pure arithmetic on ledgers, no torch. Given the ledger of one process's step (traced, or a single
instant from an inventory or a declared format) and a :class:`ShardConfig`, :func:`shard` returns each
rank's ledger and the collectives of the step:

- optimizer state (moments, master copies) divided from stage 1, gradients from stage 2, parameters
  from stage 3 (Rajbhandari et al. 2019, "ZeRO", §5); FSDP's strategies shard parameters at rest;
- padding for uneven shards, as each engine pads (see ``engine``);
- for stage 3 and FSDP, the parameters gathered for each unit while it runs, in forward and again in
  backward (with the prefetch depth), found from the trace's per-event ``module``;
- gradient buckets, reduce-scatter and all-gather buffers (category ``communication``);
- frozen parameters: sharded with their unit under stage 3/FSDP, never reduced, no optimizer state.

Activations, workspace and inputs stay as they are on every rank: data parallelism splits the batch,
not the model, and the per-rank batch is the micro-batch the ledger was traced with.

Engines (the padding and buffers differ; the arithmetic of the paper is the same):

- ``deepspeed``: partitions of the flattened parameters, each rank holding ``ceil(numel / N)``
  elements; one reduce bucket of ``reduce_bucket_numel`` elements (DeepSpeed's ``reduce_bucket_size``
  default 5e8); volumes as the ZeRO paper counts them (reduce-scatter + all-gather for stages 1–2).
- ``torch``: what PyTorch's own engines do, as ``trainledger shard --run`` runs them — stage 0 is
  ``DistributedDataParallel`` (gradient buckets covering every gradient, ``gradient_as_bucket_view``
  off), stage 1 adds ``ZeroRedundancyOptimizer`` (whole parameters assigned greedily, largest first,
  to the least-loaded rank; parameters broadcast from their owners after the step), stages 2 and 3 are
  FSDP2 ``fully_shard`` with ``reshard_after_forward`` off and on (each parameter split on dim 0 into
  ``ceil(d0 / N)`` rows, padded; one all-gather and one reduce-scatter per unit).

Known limitations: allocator rounding is not modelled; optimizer-phase workspace is scaled by the
fraction of optimizer state a rank keeps, except under FSDP2, whose per-shard temporaries are sized
exactly (see ``_optimizer.optimizer_workspace``); DeepSpeed's parameter persistence threshold and
live-parameter limit (stage 3) are not modelled.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, overload

from trainledger.checks import instance_of, one_of, whole_number
from trainledger.errors import InputError
from trainledger.ledger import Category, Entry, Evidence, Ledger
from trainledger.shard._collectives import step_collectives
from trainledger.shard._fsdp import fsdp_rank_timeline, order_of
from trainledger.shard._optimizer import optimizer_workspace, resequence_optimizer
from trainledger.shard._partition import greedy_owners, rank_boundaries, resized, shard_rows
from trainledger.shard._units import in_model, infer_units, unit_of
from trainledger.shard.comm import Collective

if TYPE_CHECKING:
    from trainledger.shard._summary import ShardSummary
from trainledger.units import dtype_bytes

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
        whole_number(self.world_size, "world size (ranks)")
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
class _Plan:
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


def plan_for(config: ShardConfig) -> _Plan:
    s, n = config.strategy, config.world_size
    torch = config.engine == "torch"
    if torch and s == "zero2":
        s = "shard_grad_op"
    if torch and s == "zero3":
        s = "full_shard"
    if s in ("zero0", "zero1"):
        return _Plan(
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
        return _Plan(True, True, s == "zero3", s == "zero3", "flat", "bucket", n, 1, f"ZeRO stage {s[-1]}")
    shard = n // config.num_nodes if s == "hybrid_shard" else n
    return _Plan(
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


# --- the transform -------------------------------------------------------------------------------------


class RankLedgers(Sequence[Ledger]):
    """Every rank's ledger, computed once per class of identical ranks.

    Ranks differ only where a partition is uneven (the last ranks hold fewer real elements, possibly
    none) or where whole parameters are assigned to ranks; all the others hold the same. So the work
    and memory of a transform grow with the number of *distinct* ranks (a few per parameter shape at
    most), never with the world size: ``ranks[r]`` is the ledger of ``r``'s class, ``len(ranks)`` the
    world size, and :meth:`classes` lists each class once.
    """

    def __init__(self, world_size: int, group_size: int, starts: Sequence[int], ledgers: Sequence[Ledger]) -> None:
        self.world_size, self.group_size = world_size, group_size
        self.starts, self.ledgers = tuple(starts), tuple(ledgers)
        """``starts[k]``: the first rank (within a shard group of ``group_size``) of class ``k``."""

    def __len__(self) -> int:
        return self.world_size

    @overload
    def __getitem__(self, index: int) -> Ledger: ...
    @overload
    def __getitem__(self, index: slice) -> list[Ledger]: ...
    def __getitem__(self, index: int | slice) -> Ledger | list[Ledger]:
        if isinstance(index, slice):
            return [self[i] for i in range(self.world_size)[index]]
        if index < 0:
            index += self.world_size
        if not 0 <= index < self.world_size:
            raise IndexError(f"rank {index} out of range for {self.world_size} ranks")
        return self.ledgers[bisect.bisect_right(self.starts, index % self.group_size) - 1]

    def classes(self) -> list[tuple[int, int, int, Ledger]]:
        """``(first rank, last rank, number of ranks, ledger)`` per class; first and last are within the
        first shard group (hybrid sharding repeats the classes in every group)."""
        ends = [*self.starts[1:], self.group_size]
        replicas = self.world_size // self.group_size
        return [
            (first, end - 1, (end - first) * replicas, led)
            for first, end, led in zip(self.starts, ends, self.ledgers, strict=True)
        ]


@dataclass(frozen=True)
class ShardResult:
    """Per-rank ledgers and the collectives of one sharded step."""

    config: ShardConfig
    label: str
    source: Ledger
    ranks: Sequence[Ledger]
    """Every rank's ledger (a :class:`RankLedgers`: identical ranks share one)."""
    collectives: tuple[Collective, ...]
    """Per rank (every rank runs the same collectives)."""
    units: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def rank_classes(self) -> list[tuple[int, int, int, Ledger]]:
        """``(first rank, last rank, number of ranks, ledger)`` for each class of identical ranks."""
        if isinstance(self.ranks, RankLedgers):
            return self.ranks.classes()
        return [(r, r, 1, led) for r, led in enumerate(self.ranks)]

    def model_state_bytes(self, rank: int = 0) -> int:
        """Weights, frozen weights, gradients and optimizer state held on ``rank``, persistent ones only
        (the ZeRO paper's "model states"); gathered parameters and buffers are not included."""
        return sum(
            e.nbytes
            for e in self.ranks[rank].entries
            if e.category in _MODEL_STATE and e.role != "gathered" and e.alloc_event is None
        )

    def summary(self) -> ShardSummary:
        """What the reports print of this result: rank 0's tables, each class of identical ranks' peak, the
        collectives."""
        from trainledger.shard._summary import ShardSummary

        return ShardSummary.of(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: rank 0's ledger keys at the top, each class of identical ranks under ``ranks``."""
        return self.summary().to_dict()


_MODEL_STATE = (Category.WEIGHTS, Category.FROZEN, Category.GRADIENTS, Category.OPTIMIZER)


def shard(ledger: Ledger, config: ShardConfig | None = None, **kwargs: Any) -> ShardResult:
    """Each rank's ledger when ``ledger``'s step is sharded as ``config`` says.

    Arguments:
        ledger: one process's step — traced (entries with lifetimes, events with modules) or a single
            instant (inventoried or declared state).
        config: a :class:`ShardConfig`, or its fields as keyword arguments.

    Returns:
        A :class:`ShardResult`: one ledger per rank (evidence as the input's; a traced input gives
        predicted timelines, not traces) and the per-rank collectives.

    Example:
        >>> from trainledger.declared import StateSpec, declared_ledger
        >>> led = declared_ledger(StateSpec(num_params=7_500_000_000, weights="fp16", master="fp32", grads="fp16"))
        >>> [shard(led, world_size=64, strategy=f"zero{s}").model_state_bytes() for s in range(4)]
        [120000000000, 31406250000, 16640625000, 1875000000]
    """
    instance_of(
        ledger, Ledger, "shard()'s ledger", "give a trainledger.Ledger (from trace, inventory or a declared format)"
    )
    if config is None:
        config = ShardConfig(**kwargs)
    else:
        instance_of(config, ShardConfig, "shard()'s config", "give a trainledger.ShardConfig or its fields as keywords")
        if kwargs:
            config = replace(config, **kwargs)
    plan = plan_for(config)
    params = [e for e in ledger.entries if e.category == Category.WEIGHTS or _shardable_frozen(e)]
    names = [e.name for e in params]
    units = config.units if config.units is not None else infer_units(names)
    if config.world_size == 1:  # one rank: nothing divided, nothing sent
        note = "world size 1: no data parallelism, the rank holds the step as traced (wrapper buffers not modelled)"
        single = ledger.with_entries(ledger.entries, notes=(*ledger.notes, note), meta={**ledger.meta, "rank": 0})
        return ShardResult(config, plan.label, ledger, (single,), (), tuple(units), (note,))
    ctx = _Context(ledger, config, plan, units)
    starts = ctx.rank_classes()
    ranks = RankLedgers(config.world_size, plan.shard_size, starts, [ctx.rank_ledger(r) for r in starts])
    if len(starts) < config.world_size:
        ctx.notes.append(
            f"{len(starts)} distinct rank(s) of {config.world_size:,} computed; the others hold exactly what "
            "the first rank of their class holds (even partitions make ranks identical)"
        )
    collectives = tuple(ctx.collectives())
    return ShardResult(config, plan.label, ledger, ranks, collectives, tuple(units), tuple(dict.fromkeys(ctx.notes)))


def _shardable_frozen(e: Entry) -> bool:
    """Frozen weights of the wrapped model (a LoRA base) are sharded with it; a reference model is not."""
    return e.category == Category.FROZEN and e.role != "reference"


_SUFFIX_RE = re.compile(r"^(optimizer\.)")


class _Context:
    """Shared lookups for building every rank's ledger of one transform."""

    def __init__(self, ledger: Ledger, config: ShardConfig, plan: _Plan, units: Sequence[str]) -> None:
        self.ledger, self.config, self.plan, self.units = ledger, config, plan, tuple(units)
        self.notes: list[str] = []
        self.class_end: dict[int, int] = {}
        """First rank of a class of identical ranks -> one past its last (see :meth:`rank_classes`)."""
        self.traced = ledger.num_events > 1 or ledger.events[0].phase != "state"
        self.params = [e for e in ledger.entries if e.category == Category.WEIGHTS or _shardable_frozen(e)]
        self.param_by_name: dict[str, Entry] = {}
        for p in self.params:
            for n in (p.name, *p.aliases):
                self.param_by_name.setdefault(n, p)
        # the model's parameter order (``named_parameters()``), which the engines follow; a traced ledger
        # records it, others list their parameters in that order
        order = ledger.meta.get("parameter_order") or [p.name for p in self.params]
        self.param_order: dict[str, int] = {name: i for i, name in enumerate(order)}
        trainable = sorted(
            (p for p in self.params if p.category == Category.WEIGHTS), key=lambda p: self.param_order.get(p.name, -1)
        )
        self.owner = dict(
            zip((p.name for p in trainable), greedy_owners([p.numel for p in trainable], plan.shard_size), strict=True)
        )
        # each rank's optimizer steps its parameters in the order they were given to it: largest first
        by_size = sorted(trainable, key=lambda p: -p.numel)
        # (only ranks that own a parameter are listed: a world of a trillion ranks has few owners)
        self.rank_order: dict[int, list[str]] = {}
        for p in by_size:
            self.rank_order.setdefault(self.owner[p.name], []).append(p.name)
        self.spans = self._spans() if self.traced else {}
        phases = [ev.phase for ev in ledger.events]
        self.last_backward = max((i for i, ph in enumerate(phases) if ph == "backward"), default=None)

    # --- lookups ---

    def param_of(self, e: Entry) -> Entry | None:
        """The parameter an optimizer or gradient entry belongs to (by name: ``optimizer.<param>.<slot>``)."""
        for text in (e.owner, e.name):
            s = _SUFFIX_RE.sub("", text)
            while s:
                if s in self.param_by_name:
                    return self.param_by_name[s]
                s = s.rpartition(".")[0]
        return None

    def _spans(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``(unit, phase) -> (first event, last event)`` of each unit's ops; the root spans the model's ops.

        Ops outside the model — a loss computed by ``loss_fn`` (module ``""`` in forward, ``(loss)`` in
        backward) and the seed of backward (``ones_like``, module ``""``) — belong to no unit: the root's
        forward hook runs when the model returns, before them, and its pre-backward hook when the gradient
        reaches the model's output, after them. A ledger whose ops name no module at all keeps the root
        spanning each phase.
        """
        spans: dict[tuple[str, str], tuple[int, int]] = {}
        whole: dict[str, tuple[int, int]] = {}

        def widen(table: dict[Any, tuple[int, int]], key: Any, index: int) -> None:
            lo, hi = table.get(key, (index, index))
            table[key] = (min(lo, index), max(hi, index))

        reference = any(e.role == "reference" for e in self.ledger.entries)
        for ev in self.ledger.events:
            if ev.phase not in ("forward", "backward"):
                continue
            widen(whole, ev.phase, ev.index)
            if in_model(ev.module, reference=reference):
                widen(spans, (unit_of(ev.module, self.units), ev.phase), ev.index)
                widen(spans, ("", ev.phase), ev.index)
        for phase, span in whole.items():
            spans.setdefault(("", phase), span)
        return spans

    def unit_params(self) -> dict[str, list[Entry]]:
        out: dict[str, list[Entry]] = {u: [] for u in ("", *self.units)}
        for p in self.params:
            out[unit_of(p.name, self.units)].append(p)
        return {u: ps for u, ps in out.items() if ps}

    def rank_classes(self) -> tuple[int, ...]:
        """The first rank of each class of identical ranks within a shard group, in order (0 first).

        A rank's ledger depends on its rank only through :func:`shard_rows` of each array (uneven
        partitions) and, for whole-parameter partitions, the parameters it owns: the boundaries of both
        are found without visiting every rank.
        """
        n, plan = self.plan.shard_size, self.plan
        starts = {0}
        if not (plan.shard_optimizer or plan.shard_grads or plan.shard_params):  # plain data parallelism
            self.class_end = {0: n}
            return (0,)
        unmatched = [
            e
            for e in self.ledger.entries
            if e.category in (Category.OPTIMIZER, Category.GRADIENTS) and self.param_of(e) is None
        ]
        for e in (*self.params, *unmatched):
            starts.update(rank_boundaries(e.numel, e.shape, n, plan.partition))
        if plan.partition == "greedy" and self.owner:  # owners are ranks 0..k-1; the rest own nothing
            starts.update(range(1, min(n, max(self.owner.values()) + 2)))
        self.class_end = dict(itertools.pairwise([*sorted(starts), n]))
        return tuple(sorted(starts))

    def _who(self, rank: int) -> str:
        """``rank 3`` or ``ranks 1-6 (identical)``, as the rank's ledger is computed for."""
        end = self.class_end.get(rank, rank + 1)
        who = f"rank {rank}" if end == rank + 1 else f"ranks {rank}-{end - 1} (identical)"
        if self.plan.replicas > 1:
            who += f" of each group of {self.plan.shard_size}"
        return who

    def held(self, e: Entry, like: Entry, rank: int, *, real: bool = False) -> int:
        """Elements of ``e`` held on ``rank``, sharded the way its parameter ``like`` is."""
        # state that is not the parameter's length is kept whole: step counters, and a 0-dim counter of a
        # one-element parameter (its rank may hold no real row of the parameter, but holds the counter)
        if e.numel != like.numel or (e.numel == 1 and not e.shape and like.shape):
            return e.numel
        held, actual = shard_rows(like.numel, like.shape, self.plan.shard_size, rank, self.plan.partition)
        return actual if real else held

    # --- one rank ---

    def rank_ledger(self, rank: int) -> Ledger:
        plan, srank = self.plan, rank % self.plan.shard_size
        fsdp_timeline = plan.buffers == "fsdp" and self.traced
        out: list[Entry] = []
        opt_full = opt_kept = 0
        for e in self.ledger.entries:
            cat = e.category
            if cat == Category.OPTIMIZER and plan.shard_optimizer:
                p = self.param_of(e)
                opt_full += e.nbytes
                if plan.partition == "greedy" and p is not None and p.name in self.owner:
                    if self.owner[p.name] != srank:
                        continue
                    out.append(e)
                else:  # FSDP2's optimizer sees the unpadded local shard; DeepSpeed's partitions are padded
                    like = p if p is not None else e
                    out.append(resized(e, self.held(e, like, srank, real=plan.partition == "dim0")))
                opt_kept += out[-1].nbytes
            elif cat == Category.GRADIENTS and plan.shard_grads:
                if not fsdp_timeline:
                    out.extend(self._sharded_grad(e, srank))
                elif e.role != "grad":  # the optimizer's own (a master copy's), made from the rank's shard
                    like = self.param_of(e) or e
                    out.append(resized(e, self.held(e, like, srank, real=True)))
                # the model's gradients: the FSDP timeline places them
            elif plan.shard_params and (cat == Category.WEIGHTS or _shardable_frozen(e)):
                out.append(resized(e, self.held(e, e, srank), role_suffix=""))
            else:
                out.append(e)
        if opt_full and opt_kept != opt_full and self.traced:
            out = optimizer_workspace(self, out, opt_kept, opt_full, srank)
        events = self.ledger.events
        if plan.partition == "greedy" and plan.shard_optimizer and self.traced:
            events, out = resequence_optimizer(events, out, self.rank_order.get(srank, []))
        if fsdp_timeline:
            events, out = fsdp_rank_timeline(self, srank, out)
        else:
            out.extend(self._buffers(srank))
            if plan.shard_params:
                out.extend(self._gathered(srank))
        notes = [f"{self._who(rank)} of {self.config.world_size:,}, {plan.label}: predicted by the sharding transform"]
        return self.ledger.with_entries(
            out,
            events=events,
            notes=(*self.ledger.notes, *notes),
            meta={**self.ledger.meta, "rank": rank, "world_size": self.config.world_size},
        )

    def _sharded_grad(self, e: Entry, srank: int) -> list[Entry]:
        p = self.param_of(e)
        like = p if p is not None else e
        shard_numel = self.held(e, like, srank)
        if not self.traced:
            return [resized(e, shard_numel)]
        if self.plan.buffers == "fsdp":
            # FSDP2: the unsharded gradient lives until its unit's post-backward, which copies it into the
            # reduce-scatter input; the sharded output then lives until zero_grad.
            unit = unit_of(like.name, self.units)
            span = self.spans.get((unit, "backward"))
            done = (span[1] + 1) if span else (e.alloc_event or 0) + 1
        else:  # DeepSpeed copies each gradient into the reduce bucket as soon as it is produced
            done = (e.alloc_event or 0) + 1
        start = e.alloc_event if e.alloc_event is not None else 0
        done = max(start, min(done, e.free_event if e.free_event is not None else self.ledger.num_events))
        full = replace(e, free_event=done)
        part = replace(
            resized(e, shard_numel), name=f"{e.name} (shard)", alloc_event=done, role=e.role, last_use_event=None
        )
        return [full, part]

    def _grad_dtype_bytes(self) -> tuple[str, int]:
        grads = [e for e in self.ledger.entries if e.category == Category.GRADIENTS and e.role == "grad"]
        ref = grads[0] if grads else (self.params[0] if self.params else None)
        dtype = ref.dtype if ref is not None else "float32"
        return dtype, dtype_bytes(dtype)

    def _buffers(self, srank: int) -> list[Entry]:
        """Communication buffers that exist for the whole step (DDP buckets, DeepSpeed's reduce bucket)."""
        plan = self.plan
        trainable = [p for p in self.params if p.category == Category.WEIGHTS]
        if not trainable or (self.config.world_size == 1 and plan.buffers != "ddp"):
            return []
        dtype, size = self._grad_dtype_bytes()
        numel = sum(p.numel for p in trainable)
        if plan.buffers == "ddp":
            # DDP's buckets hold a copy of every gradient (gradient_as_bucket_view=False, the default)
            return self._state_only([_buffer("DDP gradient buckets", "ddp_bucket", dtype, numel, size)])
        if plan.buffers == "bucket":
            n = min(numel, self.config.reduce_bucket_numel)
            return self._state_only([_buffer("reduce bucket", "reduce_bucket", dtype, n, size)])
        return []  # FSDP's buffers live on its own clock (see _fsdp.py)

    def _state_only(self, buffers: list[Entry]) -> list[Entry]:
        """Buffers are part of a traced step; a single-instant ledger of model state names them instead."""
        if self.traced:
            return buffers
        for b in buffers:
            self.notes.append(f"excluded: {b.name} {b.nbytes:,} bytes per rank (communication buffer)")
        return []

    def _gathered(self, srank: int) -> list[Entry]:
        """Parameters gathered for each unit while it runs (stage 3, FSDP)."""
        plan, n = self.plan, self.plan.shard_size
        groups = self.unit_params()
        if not self.traced:
            largest = max(groups.values(), key=lambda ps: sum(p.nbytes for p in ps))
            self.notes.append(
                "excluded: parameters gathered for the running unit (stage 3/FSDP), up to "
                f"{sum(p.nbytes for p in largest):,} bytes for the largest unit (the whole model when no "
                "units are known; DeepSpeed caps it with stage3_max_live_parameters)"
            )
            return []
        out: list[Entry] = []
        forward = [u for u in order_of(self.spans, "forward") if u in groups]
        backward = [u for u in order_of(self.spans, "backward") if u in groups]
        for unit, ps in groups.items():
            if plan.partition == "dim0":
                full = {p.name: shard_rows(p.numel, p.shape, n, srank, "dim0")[0] * n for p in ps}
            else:
                full = {p.name: p.numel for p in ps}
            by_dtype: dict[str, int] = {}
            for p in ps:
                by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + full[p.name]
            windows = self._windows(unit, forward, backward)
            for phase, (start, stop) in windows:
                for dtype, numel in by_dtype.items():
                    size = dtype_bytes(dtype)
                    label = unit or "<root>"
                    out.append(_gathered_entry(f"gathered params {label} ({phase})", dtype, numel, size, start, stop))
        return out

    def _windows(self, unit: str, forward: list[str], backward: list[str]) -> list[tuple[str, tuple[int, int]]]:
        """When a unit's gathered parameters are live: ``(phase, (alloc, free))``."""
        cfg = self.config
        fwd, bwd = self.spans.get((unit, "forward")), self.spans.get((unit, "backward"))

        def start(order: list[str], phase: str, depth: int) -> int:
            i = order.index(unit)
            earlier = order[max(0, i - depth)]
            return min(self.spans[(earlier, phase)][0], self.spans[(unit, phase)][0])

        out: list[tuple[str, tuple[int, int]]] = []
        if fwd is not None:
            f0 = start(forward, "forward", cfg.forward_prefetch)
            if self.plan.regather_backward or bwd is None:
                out.append(("forward", (f0, fwd[1] + 1)))
            else:  # SHARD_GRAD_OP: kept gathered from forward to the end of the unit's backward
                out.append(("forward to backward", (f0, bwd[1] + 1)))
        if bwd is not None and (self.plan.regather_backward or fwd is None):
            out.append(("backward", (start(backward, "backward", cfg.backward_prefetch), bwd[1] + 1)))
        return out

    def collectives(self) -> list[Collective]:
        return step_collectives(self)


def _buffer(name: str, role: str, dtype: str, numel: int, size: int, at: int | None = None) -> Entry:
    """A communication buffer: persistent (``at=None``) or live for the one event ``at``."""
    return Entry(
        name=name,
        category=Category.COMMUNICATION,
        role=role,
        dtype=dtype,
        numel=numel,
        nbytes=numel * size,
        owner="shard",
        alloc_event=at,
        free_event=None if at is None else at + 1,
        evidence=Evidence.ANALYTIC,
    )


def _gathered_entry(name: str, dtype: str, numel: int, size: int, start: int, stop: int) -> Entry:
    return Entry(
        name=name,
        category=Category.WEIGHTS,
        role="gathered",
        dtype=dtype,
        numel=numel,
        nbytes=numel * size,
        owner="shard",
        alloc_event=start,
        free_event=stop,
        evidence=Evidence.ANALYTIC,
    )
