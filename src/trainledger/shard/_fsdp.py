"""FSDP's timeline on a traced step: the hooks it runs between ops, and what each one allocates and frees.

Pure arithmetic, no torch. The single-process trace has one event per op; FSDP adds work *between*
ops — a unit's pre-forward and pre-backward gather its parameters, its post-backward reduces its
gradients. This module inserts one event per hook into the clock (two for a post-backward: copy-in,
then reduce-scatter) and places each buffer on it, as FSDP2 (``fully_shard``, PyTorch 2.6+) does:

- pre-forward of unit ``u``: all-gather into a flat buffer ``F_u`` (``S_u`` bytes: every parameter's
  padded shard times ``N``), copied out into the unsharded parameters ``P_u`` (``S_u`` again). In
  forward ``F_u`` is kept until the next unit's copy-out (``AllGatherState``), the last one until the
  root's post-forward (when the model returns: a loss computed outside it runs after);
- post-forward: ``P_u`` freed when resharding after forward (stage 3 / FULL_SHARD);
- pre-backward (two events): gather again (unless prefetched) and copy out, freeing ``F_u`` at once;
  then prefetch the next ``backward_prefetch`` units in backward order (their ``F`` live until their
  own pre-backward's copy-out);
- post-backward: ``P_u`` freed (reshard), the previous unit's reduce-scatter input freed (FSDP2 keeps
  one in flight), the new input ``R_u`` (``G_u``: padded gradients times ``N``) allocated and the
  gradients copied in; then the unsharded gradients are freed (all but the unit's last, which a loop
  variable holds until the hook returns) and the sharded output (``G_u / N``, the rank's gradients
  until ``zero_grad``) allocated; ``R_u`` lives until the next post-backward or
  the end of backward. With ``reduce_scatter_copy`` (gloo), the reduce-scatter works on a full-size
  copy of its input for the duration of the call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from trainledger.ledger import ROOT_SCOPE, Category, Entry, Event, Evidence
from trainledger.shard._partition import shard_rows
from trainledger.shard._units import unit_of
from trainledger.units import dtype_bytes

if TYPE_CHECKING:
    from trainledger.shard.transform import _Context


@dataclass(frozen=True)
class _Hook:
    kind: str  # pre_forward, pre_backward, post_backward
    unit: str


def fsdp_rank_timeline(ctx: _Context, srank: int, base: list[Entry]) -> tuple[tuple[Event, ...], list[Entry]]:
    """Events with FSDP's hooks inserted, and the rank's entries on that clock.

    ``base`` holds the rank's entries other than gradients, gathered parameters and buffers (sharded
    weights, optimizer state, activations…), on the original clock.
    """
    led, plan, cfg = ctx.ledger, ctx.plan, ctx.config
    n = plan.shard_size
    groups = ctx.unit_params()
    num_old = led.num_events
    spans = ctx.spans
    fwd = [u for u in order_of(spans, "forward") if u in groups]
    bwd = [u for u in order_of(spans, "backward") if u in groups]

    def padded_full(p: Entry) -> int:
        return shard_rows(p.numel, p.shape, n, srank, "dim0")[0] * n

    gdtype, gsize = ctx._grad_dtype_bytes()
    s_bytes = {u: sum(padded_full(p) * dtype_bytes(p.dtype) for p in ps) for u, ps in groups.items()}
    pdtype = {u: ps[0].dtype for u, ps in groups.items()}
    g_numel = {u: sum(padded_full(p) for p in ps if p.category == Category.WEIGHTS) for u, ps in groups.items()}

    # --- the hooks, placed in the gap before each old event (index num_old: after the last) ---
    before: dict[int, list[_Hook]] = {}
    regather = plan.regather_backward
    for u in fwd:
        before.setdefault(spans[(u, "forward")][0], []).append(_Hook("pre_forward", u))
    phases_old = [ev.phase for ev in led.events]
    last_bwd = max((i for i, ph in enumerate(phases_old) if ph == "backward"), default=num_old - 1)
    late = {"", *cfg.late_units}  # reduced in FSDP's final callback, at the end of backward
    module_order = {u: k for k, u in enumerate(("", *ctx.units))}
    for u in bwd:
        b0, b1 = spans[(u, "backward")]
        if regather:
            before.setdefault(b0, []).append(_Hook("pre_backward", u))
        if g_numel[u]:
            before.setdefault(last_bwd + 1 if u in late else b1 + 1, []).append(_Hook("post_backward", u))

    def post_key(h: _Hook) -> tuple[int, int]:
        # hooked units fire inside autograd (innermost first), then the final callback in module order
        return (1, module_order.get(h.unit, 0)) if h.unit in late else (0, -len(h.unit))

    events: list[Event] = []
    new_of = [0] * (num_old + 1)
    gap_start = [0] * (num_old + 1)
    at: dict[tuple[str, str], int] = {}  # (kind, unit) -> index of its (first) hook event
    for i in range(num_old + 1):
        gap_start[i] = len(events)
        hooks = before.get(i, [])
        posts = sorted((h for h in hooks if h.kind == "post_backward"), key=post_key)
        pres = sorted((h for h in hooks if h.kind != "post_backward"), key=lambda h: len(h.unit))
        for h in (*posts, *pres):
            at[(h.kind, h.unit)] = len(events)
            label = h.unit or ROOT_SCOPE  # as the tracer names the root module
            if h.kind == "post_backward":
                events.append(Event(len(events), "backward", "fsdp.reduce_scatter_copy_in", label))
                events.append(Event(len(events), "backward", "fsdp.reduce_scatter", label))
            elif h.kind == "pre_forward":
                events.append(Event(len(events), "forward", "fsdp.all_gather", label))
            else:  # gather and copy out, then prefetch the next units
                events.append(Event(len(events), "backward", "fsdp.all_gather", label))
                events.append(Event(len(events), "backward", "fsdp.prefetch", label))
        if i < num_old:
            new_of[i] = len(events)
            events.append(replace(led.events[i], index=len(events)))
    new_of[num_old] = len(events)
    total = len(events)
    # the root's post-forward (when the model returns, before a loss computed outside it) frees the last
    # unit's flat buffer
    root_fwd = spans.get(("", "forward"))
    first_after = next((i for i, ph in enumerate(phases_old) if ph != "forward"), num_old)
    end_forward = gap_start[root_fwd[1] + 1 if root_fwd else first_after]
    end_backward = max([gap_start[min(last_bwd + 1, num_old)]] + [at[k] + 2 for k in at if k[0] == "post_backward"])

    def remap(e: Entry) -> Entry:
        return replace(
            e,
            alloc_event=None if e.alloc_event is None else new_of[e.alloc_event],
            free_event=None if e.free_event is None else gap_start[e.free_event],
            last_use_event=None if e.last_use_event is None else new_of[min(e.last_use_event, num_old - 1)],
        )

    out = [remap(e) for e in base]

    def buf(name: str, role: str, cat: Category, dtype: str, nbytes: int, start: int, stop: int | None) -> None:
        stop = total if stop is None else stop
        if nbytes and stop > start:
            size = dtype_bytes(dtype)
            out.append(
                Entry(
                    name=name,
                    category=cat,
                    role=role,
                    dtype=dtype,
                    numel=nbytes // size,
                    nbytes=nbytes,
                    owner="shard",
                    alloc_event=start,
                    free_event=min(stop, total),
                    evidence=Evidence.ANALYTIC,
                )
            )

    comm, weights = Category.COMMUNICATION, Category.WEIGHTS
    # --- forward: gather, copy out; keep the flat buffer until the next copy-out ---
    for k, u in enumerate(fwd):
        label, g = u or "<root>", at[("pre_forward", u)]
        depth = cfg.forward_prefetch
        start = at[("pre_forward", fwd[max(0, k - depth)])] if depth else g
        if depth:
            f_stop = g + 1
        else:
            f_stop = at[("pre_forward", fwd[k + 1])] + 1 if k + 1 < len(fwd) else end_forward
        buf(f"all-gather output {label} (forward)", "all_gather_output", comm, pdtype[u], s_bytes[u], start, f_stop)
        f1 = spans[(u, "forward")][1]
        if regather or (u, "backward") not in spans:
            p_stop = gap_start[f1 + 1]
            name = f"gathered params {label} (forward)"
        else:
            post = at.get(("post_backward", u))
            p_stop = post if post is not None else gap_start[spans[(u, "backward")][1] + 1]
            name = f"gathered params {label} (forward to backward)"
        buf(name, "gathered", weights, pdtype[u], s_bytes[u], g, p_stop)
    # --- backward: gather (or take the prefetched buffer), copy out, prefetch the next ones ---
    if regather:
        for k, u in enumerate(bwd):
            label, g = u or "<root>", at[("pre_backward", u)]
            depth = cfg.backward_prefetch
            # prefetched by the unit `depth` earlier, after that unit's own copy-out
            start = at[("pre_backward", bwd[k - min(depth, k)])] + 1 if depth and k else g
            buf(f"all-gather output {label} (backward)", "all_gather_output", comm, pdtype[u], s_bytes[u], start, g + 1)
            post = at.get(("post_backward", u), end_backward)
            buf(f"gathered params {label} (backward)", "gathered", weights, pdtype[u], s_bytes[u], g, post)
    # --- post-backward: reduce-scatter input (one in flight), sharded output, gloo's copy ---
    order = [u for u in sorted(groups, key=lambda u: at.get(("post_backward", u), total)) if ("post_backward", u) in at]
    for k, u in enumerate(order):
        label, c = u or "<root>", at[("post_backward", u)]
        nxt = at[("post_backward", order[k + 1])] if k + 1 < len(order) else end_backward
        buf(f"reduce-scatter input {label}", "reduce_scatter_input", comm, gdtype, g_numel[u] * gsize, c, nxt)
        if cfg.reduce_scatter_copy:
            copy = f"reduce-scatter copy {label}"
            buf(copy, "reduce_scatter_copy", comm, gdtype, g_numel[u] * gsize, c + 1, c + 2)
    # --- gradients: unsharded until their unit's reduce-scatter, then the rank's shard ---
    grads = [e for e in ctx.ledger.entries if e.category == Category.GRADIENTS and e.role == "grad"]
    kept = _kept_to_the_end(ctx, grads)
    for e in grads:
        p = ctx.param_of(e)
        like = p if p is not None else e
        unit = unit_of(like.name, ctx.units)
        r = remap(e)
        post = at.get(("post_backward", unit))
        if post is None:
            out.append(r)
            continue
        rs = post + 1
        # the copied-in gradients are dropped before the reduce-scatter, except the one ``foreach_reduce``'s
        # loop variable still holds: it goes when the hook returns, after the reduce-scatter
        drop = rs + 1 if e.name in kept else rs
        full = replace(
            r, free_event=max(r.alloc_event or 0, min(drop, total if r.free_event is None else r.free_event))
        )
        shard_numel = ctx.held(e, like, srank)
        size = e.nbytes // e.numel if e.numel else gsize
        part = replace(
            r,
            name=f"{e.name} (shard)",
            numel=shard_numel,
            nbytes=shard_numel * size,
            shape=(),
            alloc_event=rs,
            last_use_event=None,
        )
        out += [full, part]
    return tuple(events), out


def order_of(spans: dict[tuple[str, str], tuple[int, int]], phase: str) -> list[str]:
    """Units in the order they start in ``phase`` (the root first: its hooks run before its children's)."""
    units = [(span[0], unit != "", unit) for (unit, ph), span in spans.items() if ph == phase]
    return [u for _, _, u in sorted(units)]


def _kept_to_the_end(ctx: _Context, grads: list[Entry]) -> set[str]:
    """The gradient of each unit that lives until its post-backward hook returns.

    FSDP2's ``foreach_reduce`` walks the unit's gradients in a ``for`` loop before the copy-in; the loop
    variable keeps the last one (in the unit's parameter order, the model's ``named_parameters()``)
    alive after ``unsharded_grads.clear()``, through the reduce-scatter, until the function returns.
    """
    last: dict[str, tuple[int, str]] = {}
    for e in grads:
        p = ctx.param_of(e)
        if p is None or p.category != Category.WEIGHTS:
            continue
        unit = unit_of(p.name, ctx.units)
        rank = ctx.param_order.get(p.name, -1)
        if unit not in last or rank > last[unit][0]:
            last[unit] = (rank, e.name)
    return {name for _, name in last.values()}
