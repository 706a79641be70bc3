"""The collectives a sharded step issues, per rank: kind, phase, payload, calls.

Pure arithmetic, no torch. Payloads are what each call is handed (all-gather: its output,
reduce-scatter: its input), so they can be compared with what a wrapper around the calls counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainledger.ledger import Category
from trainledger.shard._fsdp import order_of
from trainledger.shard._partition import shard_rows
from trainledger.shard.comm import Collective
from trainledger.units import dtype_bytes

if TYPE_CHECKING:
    from trainledger.shard.transform import _Context

DDP_BROADCAST_BUCKET_BYTES = 250 * 2**20
"""DDP broadcasts module buffers before every forward in coalesced buckets of 250 MiB
(``DistributedDataParallel.broadcast_bucket_size``)."""


def step_collectives(ctx: _Context) -> list[Collective]:
    """The collectives of one step, per rank, as the plan's engine issues them."""
    plan, cfg = ctx.plan, ctx.config
    n = plan.shard_size
    trainable = [p for p in ctx.params if p.category == Category.WEIGHTS]
    gdtype, gsize = ctx._grad_dtype_bytes()
    if cfg.world_size == 1:
        return []
    if plan.buffers in ("ddp", "bucket"):
        grad_numel = sum(p.numel for p in trainable)
        if plan.partition == "flat" and plan.shard_optimizer:
            grad_numel = -(-grad_numel // n) * n  # padded to equal partitions
        bucket = cfg.ddp_bucket_bytes if plan.buffers == "ddp" else cfg.reduce_bucket_numel * gsize
        calls = max(1, -(-grad_numel * gsize // bucket))
        kind = "all_reduce" if not plan.shard_optimizer or plan.buffers == "ddp" else "reduce_scatter"
        out = [Collective(kind, "backward", "gradients", grad_numel * gsize, n, calls)]
        by_dtype: dict[str, int] = {}
        for e in ctx.ledger.entries:
            if e.category == Category.OTHER and e.role == "buffer":
                by_dtype[e.dtype] = by_dtype.get(e.dtype, 0) + e.nbytes
        if plan.buffers == "ddp" and by_dtype:  # broadcast_buffers: rank 0's buffers before every forward,
            # coalesced per dtype into buckets
            calls = sum(-(-b // DDP_BROADCAST_BUCKET_BYTES) for b in by_dtype.values())
            label = "buffers from rank 0"
            out.insert(0, Collective("broadcast", "forward", label, sum(by_dtype.values()), n, calls))
        if plan.shard_optimizer and not plan.shard_params:
            if plan.partition == "greedy":  # each owner broadcasts its updated parameters
                w = sum(p.nbytes for p in trainable)
                label = "parameters from their owners"
                out.append(Collective("broadcast", "optimizer", label, w, n, len(trainable)))
            else:
                w = -(-sum(p.numel for p in trainable) // n) * n * dtype_bytes(trainable[0].dtype)
                out.append(Collective("all_gather", "optimizer", "updated parameters", w, n))
        if plan.shard_params:  # DeepSpeed stage 3: gathers in forward and backward
            w = sum(p.nbytes for p in ctx.params)
            out.insert(0, Collective("all_gather", "forward", "parameters", w, n))
            out.insert(1, Collective("all_gather", "backward", "parameters", w, n))
        return out
    out = []
    groups = ctx.unit_params()
    names = list(groups)
    if ctx.traced:
        fwd_order = [u for u in order_of(ctx.spans, "forward") if u in groups]
        names = fwd_order + [u for u in names if u not in fwd_order]

    def gather(unit: str, phase: str) -> None:
        w = sum(shard_rows(p.numel, p.shape, n, 0, "dim0")[0] * n * dtype_bytes(p.dtype) for p in groups[unit])
        out.append(Collective("all_gather", phase, f"params of {unit or '<root>'}", w, n))

    def reduce(unit: str) -> None:
        tr = [p for p in groups[unit] if p.category == Category.WEIGHTS]
        if not tr:
            return
        label = unit or "<root>"
        g = sum(shard_rows(p.numel, p.shape, n, 0, "dim0")[0] * n for p in tr) * gsize
        out.append(Collective("reduce_scatter", "backward", f"grads of {label}", g, n))
        if plan.replicas > 1:
            out.append(Collective("all_reduce", "backward", f"grad shards of {label}", g // n, plan.replicas))

    for unit in names:
        gather(unit, "forward")
    # backward: the root's hooks run first (gather) and last (reduce); children in reverse order
    backward = [u for u in names[::-1] if u] + [u for u in names if not u]
    regather = [u for u in backward if not ctx.traced or (u, "backward") in ctx.spans]
    if plan.regather_backward and "" in regather:
        gather("", "backward")
    for unit in backward:
        if unit and plan.regather_backward and unit in regather:
            gather(unit, "backward")
        reduce(unit)
    return out
