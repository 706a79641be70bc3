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

from dataclasses import replace
from typing import Any

from trainledger.checks import instance_of
from trainledger.ledger import Category, Entry, Ledger
from trainledger.shard._collectives import step_collectives
from trainledger.shard._config import ShardConfig, plan_for
from trainledger.shard._context import Context, added_entry, shardable_frozen, traced_step
from trainledger.shard._fsdp import fsdp_notes, fsdp_rank_timeline
from trainledger.shard._optimizer import optimizer_workspace, resequence_optimizer
from trainledger.shard._partition import resized, shard_rows
from trainledger.shard._result import RankLedgers, ShardResult
from trainledger.shard._units import infer_units, unit_of
from trainledger.units import dtype_bytes


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
    params = [e for e in ledger.entries if e.category == Category.WEIGHTS or shardable_frozen(e)]
    names = [e.name for e in params]
    units = config.units if config.units is not None else infer_units(names)
    if config.world_size == 1 and not (config.engine == "torch" and traced_step(ledger)):
        # one rank: nothing divided, nothing sent (PyTorch's wrappers on one rank are modelled from a trace)
        note = "world size 1: no data parallelism, the rank holds the step as traced (wrapper buffers not modelled)"
        single = ledger.with_entries(ledger.entries, notes=(*ledger.notes, note), meta={**ledger.meta, "rank": 0})
        return ShardResult(config, plan.label, ledger, (single,), (), tuple(units), (note,))
    ctx = Context(ledger, config, plan, units)
    if plan.buffers == "fsdp" and ctx.traced:
        ctx.notes += fsdp_notes(ctx)
    starts = ctx.rank_classes()
    ranks = RankLedgers(config.world_size, plan.shard_size, starts, [rank_ledger(ctx, r) for r in starts])
    if len(starts) < config.world_size:
        ctx.notes.append(
            f"{len(starts)} distinct rank(s) of {config.world_size:,} computed; the others hold exactly what "
            "the first rank of their class holds (ranks differ only where a partition is uneven)"
        )
    collectives = tuple(step_collectives(ctx))
    return ShardResult(config, plan.label, ledger, ranks, collectives, tuple(units), tuple(dict.fromkeys(ctx.notes)))


# --- one rank ------------------------------------------------------------------------------------------


def rank_ledger(ctx: Context, rank: int) -> Ledger:
    """The ledger of ``rank`` (computed on its own: :func:`shard` calls it once per class of identical ranks)."""
    plan, srank = ctx.plan, rank % ctx.plan.shard_size
    fsdp_timeline = plan.buffers == "fsdp" and ctx.traced
    out: list[Entry] = []
    opt_full = opt_kept = 0
    for e in ctx.ledger.entries:
        cat = e.category
        # the optimizer's own gradients (a master copy's) are made by the rank's optimizer for its own share
        if plan.shard_optimizer and (cat == Category.OPTIMIZER or (cat == Category.GRADIENTS and e.role != "grad")):
            p = ctx.param_of(e)
            opt_full += e.nbytes
            if plan.partition == "greedy" and p is not None and p.name in ctx.owner:
                if ctx.owner[p.name] != srank:
                    continue
                out.append(e)
            else:  # FSDP2's optimizer sees the unpadded local shard; DeepSpeed's partitions are padded
                like = p if p is not None else e
                out.append(resized(e, ctx.held(e, like, srank, real=plan.partition == "dim0")))
            opt_kept += out[-1].nbytes
        elif cat == Category.GRADIENTS and plan.shard_grads:
            if not fsdp_timeline:
                out.extend(_sharded_grad(ctx, e, srank))
            elif e.role != "grad":  # the optimizer's own (a master copy's), made from the rank's shard
                like = ctx.param_of(e) or e
                out.append(resized(e, ctx.held(e, like, srank, real=True)))
            # the model's gradients: the FSDP timeline places them
        elif plan.shard_params and (cat == Category.WEIGHTS or shardable_frozen(e)):
            out.append(resized(e, ctx.held(e, e, srank), role_suffix=""))
        else:
            out.append(e)
    if opt_full and opt_kept != opt_full and ctx.traced:
        out = optimizer_workspace(ctx, out, opt_kept, opt_full, srank)
    events = ctx.ledger.events
    if plan.partition == "greedy" and plan.shard_optimizer and ctx.traced:
        out += _master_grads_of_the_last_step(ctx, out)
        events, out = resequence_optimizer(events, out, ctx.rank_order.get(srank, []))
    if fsdp_timeline:
        events, out = fsdp_rank_timeline(ctx, srank, out)
    else:
        out.extend(_buffers(ctx))
        if plan.shard_params:
            out.extend(_gathered(ctx, srank))
    notes = [f"{ctx.who(rank)} of {ctx.config.world_size:,}, {plan.label}: predicted by the sharding transform"]
    return ctx.ledger.with_entries(
        out,
        events=events,
        notes=(*ctx.ledger.notes, *notes),
        meta={**ctx.ledger.meta, "rank": rank, "world_size": ctx.config.world_size},
    )


def _master_grads_of_the_last_step(ctx: Context, entries: list[Entry]) -> list[Entry]:
    """``ZeroRedundancyOptimizer.zero_grad`` clears the model's gradients, never those of its local optimizer's own
    parameters: the gradient a master copy got in the last step lives on until this step's replaces it."""
    held = {e.name for e in entries if e.role == "master_grad" and e.alloc_event is None}
    phases = [ev.phase for ev in ctx.ledger.events]
    return [
        replace(e, name=f"{e.name} (last step's)", alloc_event=None, free_event=e.alloc_event + 1, last_use_event=None)
        for e in entries
        if e.role == "master_grad"
        and e.alloc_event is not None
        and phases[e.alloc_event] == "optimizer"
        and e.name not in held
    ]


def _sharded_grad(ctx: Context, e: Entry, srank: int) -> list[Entry]:
    p = ctx.param_of(e)
    like = p if p is not None else e
    shard_numel = ctx.held(e, like, srank)
    if not ctx.traced:
        return [resized(e, shard_numel)]
    if ctx.plan.buffers == "fsdp":
        # FSDP2: the unsharded gradient lives until its unit's post-backward, which copies it into the
        # reduce-scatter input; the sharded output then lives until zero_grad.
        unit = unit_of(like.name, ctx.units)
        span = ctx.spans.get((unit, "backward"))
        done = (span[1] + 1) if span else (e.alloc_event or 0) + 1
    else:  # DeepSpeed copies each gradient into the reduce bucket as soon as it is produced
        done = (e.alloc_event or 0) + 1
    start = e.alloc_event if e.alloc_event is not None else 0
    done = max(start, min(done, e.free_event if e.free_event is not None else ctx.ledger.num_events))
    full = replace(e, free_event=done)
    part = replace(
        resized(e, shard_numel), name=f"{e.name} (shard)", alloc_event=done, role=e.role, last_use_event=None
    )
    return [full, part]


def _buffers(ctx: Context) -> list[Entry]:
    """Communication buffers that exist for the whole step (DDP buckets, DeepSpeed's reduce bucket)."""
    plan = ctx.plan
    trainable = [p for p in ctx.params if p.category == Category.WEIGHTS]
    if not trainable or (ctx.config.world_size == 1 and plan.buffers != "ddp"):
        return []
    dtype, size = ctx.grad_dtype_bytes()
    numel = sum(p.numel for p in trainable)
    comm = Category.COMMUNICATION
    if plan.buffers == "ddp":
        # DDP's buckets hold a copy of every gradient (gradient_as_bucket_view=False, the default), a bucket per
        # dtype: each gradient in its parameter's dtype
        by_dtype = ctx.gradient_bytes_by_dtype()
        name = "DDP gradient buckets"
        return _state_only(
            ctx,
            [
                added_entry(name if len(by_dtype) == 1 else f"{name} ({d})", comm, "ddp_bucket", d, b, None, None)
                for d, b in by_dtype.items()
            ],
        )
    if plan.buffers == "bucket":
        n = min(numel, ctx.config.reduce_bucket_numel)
        return _state_only(ctx, [added_entry("reduce bucket", comm, "reduce_bucket", dtype, n * size, None, None)])
    return []  # FSDP's buffers live on its own clock (see _fsdp.py)


def _state_only(ctx: Context, buffers: list[Entry]) -> list[Entry]:
    """Buffers are part of a traced step; a single-instant ledger of model state names them instead."""
    if ctx.traced:
        return buffers
    for b in buffers:
        ctx.notes.append(f"excluded: {b.name} {b.nbytes:,} bytes per rank (communication buffer)")
    return []


def _gathered(ctx: Context, srank: int) -> list[Entry]:
    """Parameters gathered for each unit while it runs (stage 3, FSDP)."""
    plan, n = ctx.plan, ctx.plan.shard_size
    groups = ctx.unit_params()
    if not ctx.traced:
        largest = max(groups.values(), key=lambda ps: sum(p.nbytes for p in ps))
        ctx.notes.append(
            "excluded: parameters gathered for the running unit (stage 3/FSDP), up to "
            f"{sum(p.nbytes for p in largest):,} bytes for the largest unit (the whole model when no "
            "units are known; DeepSpeed caps it with stage3_max_live_parameters)"
        )
        return []
    out: list[Entry] = []
    forward, backward = ctx.units_in_order("forward"), ctx.units_in_order("backward")
    for unit, ps in groups.items():
        if plan.partition == "dim0":
            full = {p.name: shard_rows(p.numel, p.shape, n, srank, "dim0")[0] * n for p in ps}
        else:
            full = {p.name: p.numel for p in ps}
        by_dtype: dict[str, int] = {}
        for p in ps:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + full[p.name]
        for phase, (start, stop) in _windows(ctx, unit, forward, backward):
            for dtype, numel in by_dtype.items():
                name = f"gathered params {unit or '<root>'} ({phase})"
                out.append(
                    added_entry(name, Category.WEIGHTS, "gathered", dtype, numel * dtype_bytes(dtype), start, stop)
                )
    return out


def _windows(ctx: Context, unit: str, forward: list[str], backward: list[str]) -> list[tuple[str, tuple[int, int]]]:
    """When a unit's gathered parameters are live: ``(phase, (alloc, free))``."""
    cfg, spans = ctx.config, ctx.spans
    fwd, bwd = spans.get((unit, "forward")), spans.get((unit, "backward"))

    def start(order: list[str], phase: str, depth: int) -> int:
        i = order.index(unit)
        earlier = order[max(0, i - depth)]
        return min(spans[(earlier, phase)][0], spans[(unit, phase)][0])

    out: list[tuple[str, tuple[int, int]]] = []
    if fwd is not None:
        f0 = start(forward, "forward", cfg.forward_prefetch)
        if ctx.plan.regather_backward or bwd is None:
            out.append(("forward", (f0, fwd[1] + 1)))
        else:  # SHARD_GRAD_OP: kept gathered from forward to the end of the unit's backward
            out.append(("forward to backward", (f0, bwd[1] + 1)))
    if bwd is not None and (ctx.plan.regather_backward or fwd is None):
        out.append(("backward", (start(backward, "backward", cfg.backward_prefetch), bwd[1] + 1)))
    return out
