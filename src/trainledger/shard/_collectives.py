"""The collectives a sharded step issues, per rank: kind, phase, payload, calls.

Pure arithmetic, no torch. Payloads are what each call is handed (all-gather: its output,
reduce-scatter: its input), so they can be compared with what a wrapper around the calls counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainledger.ledger import Category, Entry
from trainledger.shard._comm import Collective
from trainledger.shard._context import Context
from trainledger.shard._fsdp import unused_backward_prefetches
from trainledger.shard._partition import shard_rows
from trainledger.units import dtype_bytes

DDP_FIRST_BUCKET_BYTES = 2**20
"""DDP's first gradient bucket holds about 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``), so the first
gradients of backward are sent early; the others take ``bucket_cap_mb`` (25 MiB)."""
DDP_BROADCAST_BUCKET_BYTES = 250 * 2**20
"""DDP broadcasts module buffers before every forward in coalesced buckets of 250 MiB
(``DistributedDataParallel.broadcast_bucket_size``)."""


def step_collectives(ctx: Context) -> list[Collective]:
    """The collectives of one step, per rank, as the plan's engine issues them."""
    plan, cfg = ctx.plan, ctx.config
    n = plan.shard_size
    trainable = [p for p in ctx.params if p.category == Category.WEIGHTS]
    gdtype, gsize = ctx.grad_dtype_bytes()
    if cfg.world_size == 1 and (cfg.engine != "torch" or plan.buffers == "fsdp"):
        return []  # nothing sent; DDP on one rank still calls its all-reduce (and ZeRO its broadcasts)
    if plan.buffers in ("ddp", "bucket"):
        grad_numel = sum(p.numel for p in trainable)
        if plan.partition == "flat" and plan.shard_optimizer:
            grad_numel = -(-grad_numel // n) * n  # padded to equal partitions
        grad_bytes = grad_numel * gsize
        if plan.buffers == "ddp":
            calls = len(ddp_buckets(_ready_order(ctx, trainable), cfg.ddp_bucket_bytes))
            grad_bytes = sum(ctx.gradient_bytes_by_dtype().values())  # each in its own dtype
        else:
            calls = max(1, -(-grad_numel * gsize // (cfg.reduce_bucket_numel * gsize)))
        kind = "all_reduce" if not plan.shard_optimizer or plan.buffers == "ddp" else "reduce_scatter"
        out = [Collective(kind, "backward", "gradients", grad_bytes, n, calls)]
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
        fwd_order = ctx.units_in_order("forward")
        names = fwd_order + [u for u in names if u not in fwd_order]

    def gather(unit: str, phase: str) -> None:
        w = sum(shard_rows(p.numel, p.shape, n, 0, "dim0")[0] * n * dtype_bytes(p.dtype) for p in groups[unit])
        out.append(Collective("all_gather", phase, f"params of {unit or '<root>'}", w, n))

    def reduce(unit: str) -> None:
        tr = [p for p in groups[unit] if ctx.reduced(p)]
        if not tr:
            return
        label = unit or "<root>"
        g = sum(shard_rows(p.numel, p.shape, n, 0, "dim0")[0] * n for p in tr) * dtype_bytes(ctx.unit_grad_dtype(unit))
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
    unused = dict(unused_backward_prefetches(ctx)) if ctx.traced else {}
    for unit in backward:
        if unit and plan.regather_backward and unit in regather:
            gather(unit, "backward")
        if unit in unused:  # prefetched for a unit that runs no backward
            gather(unused[unit], "backward")
        reduce(unit)
    return out


def ddp_buckets(grads: Sequence[tuple[str, int]], bucket_bytes: int) -> list[int]:
    """Bytes of each of DDP's gradient buckets, given ``(dtype, bytes)`` of the gradients in the order
    they become ready in backward.

    After its first step DDP rebuilds its buckets in that order, one run per dtype: a bucket closes once
    it holds at least its limit (``DDP_FIRST_BUCKET_BYTES`` for a dtype's first, ``bucket_bytes`` after),
    so the gradient that crosses the limit is the bucket's last (``compute_bucket_assignment_by_size``).

    Example:
        >>> ddp_buckets([("float32", 700_000), ("float32", 700_000), ("float32", 300_000)], 25 * 2**20)
        [1400000, 300000]
    """
    sizes: list[int] = []
    open_bucket: dict[str, int] = {}  # dtype -> index in sizes of its bucket being filled
    limit: dict[str, int] = {}
    for dtype, nbytes in grads:
        if dtype not in open_bucket:
            open_bucket[dtype] = len(sizes)
            sizes.append(0)
        k = open_bucket[dtype]
        sizes[k] += nbytes
        if sizes[k] >= limit.setdefault(dtype, DDP_FIRST_BUCKET_BYTES):
            limit[dtype] = bucket_bytes
            del open_bucket[dtype]
    return sizes


def _ready_order(ctx: Context, trainable: list[Entry]) -> list[tuple[str, int]]:
    """``(dtype, bytes)`` of each trainable parameter's gradient in the order backward produces them (the
    traced gradients' allocation events; the reverse of the parameter order without a trace)."""
    born: dict[str, int] = {}
    for e in ctx.ledger.entries:
        if e.category == Category.GRADIENTS and e.role == "grad" and e.alloc_event is not None:
            p = ctx.param_of(e)
            if p is not None:
                born.setdefault(p.name, e.alloc_event)
    order = sorted(trainable, key=lambda p: -ctx.param_order.get(p.name, 0))
    if all(p.name in born for p in trainable):
        order = sorted(trainable, key=lambda p: born[p.name])
    return [(p.dtype, p.nbytes) for p in order]
