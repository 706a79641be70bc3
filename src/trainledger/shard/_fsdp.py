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
  own pre-backward's copy-out). FSDP2's default prefetch takes the unit that finished forward just
  before this one; when that unit has no backward (frozen and fed the batch, or run under ``no_grad``)
  its ``F`` is never copied out and lives until backward's final callback (``finalize_backward``);
- a unit with no backward is resharded only in that final callback (at its turn, in module order): at
  SHARD_GRAD_OP its parameters stay gathered from its forward until then;
- post-backward: ``P_u`` freed (reshard), the previous unit's reduce-scatter input freed (FSDP2 keeps
  one in flight), the new input ``R_u`` (``G_u``: padded gradients times ``N``) allocated and the
  gradients copied in; then the unsharded gradients are freed (all but the unit's last, which a loop
  variable holds until the hook returns) and the sharded output (``G_u / N``, the rank's gradients
  until ``zero_grad``) allocated; ``R_u`` lives until the next post-backward or
  the end of backward. With ``reduce_scatter_copy`` (gloo), the reduce-scatter works on a full-size
  copy of its input for the duration of the call.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from trainledger.declared import RNG_STATE_ROLE
from trainledger.ledger import ROOT_SCOPE, Category, Entry, Event, Ledger
from trainledger.shard._context import Context, added_entry
from trainledger.shard._partition import resized, shard_rows
from trainledger.shard._units import fsdp_cannot_shard, unit_of
from trainledger.units import dtype_bytes

_COMM, _WEIGHTS = Category.COMMUNICATION, Category.WEIGHTS
HOOK_OP_PREFIX = "fsdp."
"""``Event.op`` of every event FSDP's hooks add to the clock."""


def fsdp_rank_timeline(ctx: Context, srank: int, base: list[Entry]) -> tuple[tuple[Event, ...], list[Entry]]:
    """Events with FSDP's hooks inserted, and the rank's entries on that clock.

    ``base`` holds the rank's entries other than gradients, gathered parameters and buffers (sharded
    weights, optimizer state, activations…), on the original clock.
    """
    sizes = _unit_sizes(ctx, srank)
    forward, backward = ctx.units_in_order("forward"), ctx.units_in_order("backward")
    clock = _clock(ctx, _hooks(ctx, forward, backward, sizes))
    # what the caller of backward holds through the final callback's reduce-scatters (the loss, the seed)
    held = {(name, event) for name, event in ctx.ledger.meta.get("freed_after_backward", ())}
    # checkpoint() keeps the RNG state before it calls the unit, so before FSDP's pre-forward hook runs
    out = [
        clock.remap(e, after_hooks=(e.name, e.free_event) in held, before_hooks=e.role == RNG_STATE_ROLE) for e in base
    ]
    out += _forward_buffers(ctx, clock, sizes, forward)
    if ctx.plan.regather_backward:
        out += _backward_buffers(ctx, clock, sizes, backward)
    out += _reduce_scatter_buffers(ctx, clock, sizes)
    out += _gradients(ctx, clock, srank)
    return clock.events, out


def fsdp_notes(ctx: Context) -> list[str]:
    """What the timeline leaves out: a unit called more than once in one forward, which FSDP2 gathers at every call;
    and what FSDP2 would refuse to run (a 0-dim parameter, one shared by two units)."""
    calls = Counter(c.path for c in ctx.ledger.calls if c.path in ctx.units)
    # a traced entry's shape is its tensor's; one of an unknown shape is taken as 0-dim only if it holds one element
    params = [((p.name, *p.aliases), p.shape or ((p.numel,) if p.numel != 1 else ())) for p in ctx.params]
    refused = [f"FSDP2 would not run this model: it {problem}" for problem in fsdp_cannot_shard(params, ctx.units)]
    return refused + [
        f"unit {unit} runs {n} times in one forward: FSDP2 gathers it again at each call, and again in backward when "
        "a later call's gradient reaches it after its reshard; the prediction gathers a unit once per phase (off by "
        "up to its gathered size and calls per phase)"
        for unit, n in sorted(calls.items())
        if n > 1
    ]


# --- what each unit gathers and reduces ----------------------------------------------------------------


@dataclass(frozen=True)
class _UnitSizes:
    """Per unit, on this rank: what its all-gather produces and its reduce-scatter takes."""

    gathered_bytes: dict[str, int]
    """``S_u``: every parameter's padded shard times ``N``, in bytes (the unsharded parameters)."""
    flat_bytes: dict[str, int]
    """The all-gather's flat output: ``S_u``; none on one rank, where FSDP2 copies each shard straight into
    its unsharded parameter and calls no collective."""
    dtype: dict[str, str]
    """The dtype the unit's gathered buffers are counted in (its first parameter's)."""
    grad_numel: dict[str, int]
    """``G_u``: the padded gradients the unit reduces (:meth:`Context.reduced`) times ``N``, in elements."""


def _unit_sizes(ctx: Context, srank: int) -> _UnitSizes:
    n, groups = ctx.plan.shard_size, ctx.unit_params()

    def padded_full(p: Entry) -> int:
        return shard_rows(p.numel, p.shape, n, srank, "dim0")[0] * n

    gathered = {u: sum(padded_full(p) * dtype_bytes(p.dtype) for p in ps) for u, ps in groups.items()}
    return _UnitSizes(
        gathered_bytes=gathered,
        flat_bytes=gathered if n > 1 else dict.fromkeys(gathered, 0),
        dtype={u: ps[0].dtype for u, ps in groups.items()},
        grad_numel={u: sum(padded_full(p) for p in ps if ctx.reduced(p)) for u, ps in groups.items()},
    )


# --- the clock with FSDP's hooks -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Hook:
    kind: str  # pre_forward, pre_backward, post_backward
    unit: str


def _last_backward(ctx: Context) -> int:
    return ctx.last_backward if ctx.last_backward is not None else ctx.ledger.num_events - 1


def _late(ctx: Context) -> set[str]:
    """Units reduced in FSDP's final callback, at the end of backward: the root, and units whose forward
    inputs need no gradient (see ``ShardConfig.late_units``)."""
    return {"", *ctx.config.late_units}


def _hooks(ctx: Context, forward: list[str], backward: list[str], sizes: _UnitSizes) -> dict[int, list[_Hook]]:
    """The hooks that run in the gap before each old event (index ``num_events``: after the last)."""
    spans, late = ctx.spans, _late(ctx)
    before: dict[int, list[_Hook]] = {}
    for u in forward:
        before.setdefault(spans[(u, "forward")][0], []).append(_Hook("pre_forward", u))
    for u in backward:
        b0, b1 = spans[(u, "backward")]
        if ctx.plan.regather_backward:
            before.setdefault(b0, []).append(_Hook("pre_backward", u))
        if sizes.grad_numel[u]:
            before.setdefault(_last_backward(ctx) + 1 if u in late else b1 + 1, []).append(_Hook("post_backward", u))
    return before


def _module_order(ctx: Context) -> dict[str, int]:
    """Each unit's place in module order, the root first: the order backward's final callback walks them in."""
    return {u: k for k, u in enumerate(("", *ctx.units))}


def _in_gap_order(ctx: Context, hooks: Sequence[_Hook]) -> list[_Hook]:
    """Hooks of one gap in the order they run: post-backwards first — hooked units inside autograd
    (innermost first), then the final callback's in module order — then the pre-hooks, outermost first."""
    if not hooks:
        return []
    late, module_order = _late(ctx), _module_order(ctx)

    def post_key(h: _Hook) -> tuple[int, int]:
        return (1, module_order.get(h.unit, 0)) if h.unit in late else (0, -len(h.unit))

    posts = sorted((h for h in hooks if h.kind == "post_backward"), key=post_key)
    pres = sorted((h for h in hooks if h.kind != "post_backward"), key=lambda h: len(h.unit))
    return [*posts, *pres]


def _hook_events(h: _Hook, first: int) -> list[Event]:
    """The events of one hook, from index ``first`` (two for a post-backward and a pre-backward)."""
    label = h.unit or ROOT_SCOPE  # as the tracer names the root module
    if h.kind == "post_backward":
        ops = [("backward", "reduce_scatter_copy_in"), ("backward", "reduce_scatter")]
    elif h.kind == "pre_forward":
        ops = [("forward", "all_gather")]
    else:  # gather and copy out, then prefetch the next units
        ops = [("backward", "all_gather"), ("backward", "prefetch")]
    return [Event(first + k, phase, HOOK_OP_PREFIX + op, label) for k, (phase, op) in enumerate(ops)]


def totals_on_step_clock(rank: Ledger) -> list[int]:
    """A rank's live bytes at each event of the unsharded step: the most live at the event or at any FSDP
    hook in the gap before it (hooks after the last event count at the last). ZeRO stages keep the clock,
    so their totals are returned as they are.

    Example:
        >>> mm, gather = Event(0, "forward", "aten.mm"), Event(1, "forward", HOOK_OP_PREFIX + "all_gather")
        >>> w = Entry("w", Category.WEIGHTS, "param", "float32", 2, 8, alloc_event=0, free_event=3)
        >>> f = Entry("F", _COMM, "buffer", "float32", 1, 4, alloc_event=1, free_event=2)
        >>> totals_on_step_clock(Ledger((w, f), events=(mm, gather, replace(mm, index=2))))
        [8, 12]
    """
    out: list[int] = []
    gap = 0
    for event, live in zip(rank.events, rank.totals(), strict=True):
        if event.op.startswith(HOOK_OP_PREFIX):
            gap = max(gap, live)
        else:
            out.append(max(gap, live))
            gap = 0
    if gap and out:
        out[-1] = max(out[-1], gap)
    return out


@dataclass(frozen=True)
class _Clock:
    """The step's events with FSDP's hook events inserted between them, and where old points land."""

    events: tuple[Event, ...]
    new_of: list[int]
    """Old event index -> its new index (``num_events`` -> the new end)."""
    gap_start: list[int]
    """Old event index -> the first new event of the gap before it (hooks, if any, then the event)."""
    at: dict[tuple[str, str], int]
    """``(kind, unit)`` -> the new index of that hook's first event."""
    end_forward: int
    """The root's post-forward: the model has returned (a loss computed outside it runs after)."""
    end_backward: int
    """After the last post-backward hook, or the end of backward."""

    @property
    def total(self) -> int:
        return len(self.events)

    def remap(self, e: Entry, *, after_hooks: bool = False, before_hooks: bool = False) -> Entry:
        """An entry of the old clock on this one: allocated at its event (``before_hooks``: in the gap before it,
        ahead of the hooks there, as what a caller makes before it calls the unit), freed in the gap before its
        free (``after_hooks``: after the gap's hooks, as what the caller of backward holds through its final
        callback)."""
        last = len(self.new_of) - 2  # the last old event
        freed = self.new_of if after_hooks else self.gap_start
        born = self.gap_start if before_hooks else self.new_of
        return replace(
            e,
            alloc_event=None if e.alloc_event is None else born[e.alloc_event],
            free_event=None if e.free_event is None else freed[e.free_event],
            last_use_event=None if e.last_use_event is None else self.new_of[min(e.last_use_event, last)],
        )

    def window(
        self, name: str, category: Category, role: str, dtype: str, nbytes: int, start: int, stop: int
    ) -> list[Entry]:
        """An FSDP buffer live from ``start`` up to ``stop``, or nothing when it is empty."""
        if not nbytes or stop <= start:
            return []
        return [added_entry(name, category, role, dtype, nbytes, start, min(stop, self.total))]


def _clock(ctx: Context, before: dict[int, list[_Hook]]) -> _Clock:
    old = ctx.ledger.events
    num_old = len(old)
    events: list[Event] = []
    new_of, gap_start = [0] * (num_old + 1), [0] * (num_old + 1)
    at: dict[tuple[str, str], int] = {}
    for i in range(num_old + 1):
        gap_start[i] = len(events)
        for h in _in_gap_order(ctx, before.get(i, [])):
            at[(h.kind, h.unit)] = len(events)
            events += _hook_events(h, len(events))
        if i < num_old:
            new_of[i] = len(events)
            events.append(replace(old[i], index=len(events)))
    new_of[num_old] = len(events)
    root_forward = ctx.spans.get(("", "forward"))
    first_after = next((i for i, ev in enumerate(old) if ev.phase != "forward"), num_old)
    end_forward = gap_start[root_forward[1] + 1 if root_forward else first_after]
    posts = [at[k] + 2 for k in at if k[0] == "post_backward"]
    end_backward = max([gap_start[min(_last_backward(ctx) + 1, num_old)], *posts])
    return _Clock(tuple(events), new_of, gap_start, at, end_forward, end_backward)


# --- the buffers and gradients on that clock -----------------------------------------------------------


def _forward_buffers(ctx: Context, clock: _Clock, sizes: _UnitSizes, forward: list[str]) -> list[Entry]:
    """Each unit's pre-forward gathers into a flat buffer, kept until the next unit's copy-out (the last
    one until the root's post-forward), and copies out into the parameters, freed after forward when
    resharding (else after the unit's backward)."""
    at, spans, depth = clock.at, ctx.spans, ctx.config.forward_prefetch
    out: list[Entry] = []
    for k, u in enumerate(forward):
        label, g = u or "<root>", at[("pre_forward", u)]
        dtype, nbytes, flat = sizes.dtype[u], sizes.gathered_bytes[u], sizes.flat_bytes[u]
        start = at[("pre_forward", forward[max(0, k - depth)])] if depth else g
        if depth:
            f_stop = g + 1
        else:
            f_stop = at[("pre_forward", forward[k + 1])] + 1 if k + 1 < len(forward) else clock.end_forward
        out += clock.window(
            f"all-gather output {label} (forward)", _COMM, "all_gather_output", dtype, flat, start, f_stop
        )
        if ctx.plan.regather_backward:
            p_stop = clock.gap_start[spans[(u, "forward")][1] + 1]
            name = f"gathered params {label} (forward)"
        elif (u, "backward") not in spans:  # no pre- or post-backward hook: resharded in the final callback
            p_stop = _final_turn(ctx, clock, u)
            name = f"gathered params {label} (forward to the end of backward)"
        else:
            post = at.get(("post_backward", u))
            p_stop = post if post is not None else clock.gap_start[spans[(u, "backward")][1] + 1]
            name = f"gathered params {label} (forward to backward)"
        out += clock.window(name, _WEIGHTS, "gathered", dtype, nbytes, g, p_stop)
    return out


def _backward_buffers(ctx: Context, clock: _Clock, sizes: _UnitSizes, backward: list[str]) -> list[Entry]:
    """Each unit's pre-backward gathers again (or takes the buffer prefetched by the unit ``depth`` earlier,
    after that unit's own copy-out), copies out, and frees the flat buffer at once; the parameters live
    until the unit's post-backward."""
    at, depth = clock.at, ctx.config.backward_prefetch
    out: list[Entry] = []
    for k, u in enumerate(backward):
        label, g = u or "<root>", at[("pre_backward", u)]
        dtype, nbytes, flat = sizes.dtype[u], sizes.gathered_bytes[u], sizes.flat_bytes[u]
        start = at[("pre_backward", backward[k - min(depth, k)])] + 1 if depth and k else g
        out += clock.window(
            f"all-gather output {label} (backward)", _COMM, "all_gather_output", dtype, flat, start, g + 1
        )
        post = at.get(("post_backward", u), clock.end_backward)
        out += clock.window(f"gathered params {label} (backward)", _WEIGHTS, "gathered", dtype, nbytes, g, post)
    for by, u in unused_backward_prefetches(ctx):
        start, stop = at[("pre_backward", by)] + 1, _final_turn(ctx, clock, u)
        name = f"all-gather output {u or '<root>'} (prefetched, unused)"
        out += clock.window(name, _COMM, "all_gather_output", sizes.dtype[u], sizes.flat_bytes[u], start, stop)
    return out


def unused_backward_prefetches(ctx: Context) -> list[tuple[str, str]]:
    """``(unit, target)``: in its pre-backward ``unit`` prefetches ``target``, which runs no backward.

    FSDP2's default backward prefetch (one unit ahead) takes the unit that finished forward just before
    ``unit`` (``post_forward_order``), whatever backward then runs: a unit frozen and fed the batch, or
    run under ``no_grad``, is gathered in backward for nothing, and its buffer waits for the final
    callback. A deeper prefetch is an explicit list of units that run backward, which gathers no such unit.
    """
    if not ctx.plan.regather_backward or ctx.config.backward_prefetch != 1:
        return []
    spans, groups = ctx.spans, ctx.unit_params()
    finished = sorted((span[1], -len(u), u) for (u, phase), span in spans.items() if phase == "forward" and u in groups)
    post_forward = [u for _, _, u in finished]
    return [
        (u, before)
        for before, u in itertools.pairwise(post_forward)
        if (u, "backward") in spans and (before, "backward") not in spans
    ]


def _final_turn(ctx: Context, clock: _Clock, unit: str) -> int:
    """Where backward's final callback reaches ``unit``: it walks the units in module order, the root first,
    reducing the late ones; ``unit`` (which reduces nothing) is resharded and its unused prefetch freed after
    the late units before it."""
    order = _module_order(ctx)
    later = [
        clock.at[("post_backward", u)]
        for u in _late(ctx)
        if ("post_backward", u) in clock.at and order.get(u, 0) > order.get(unit, 0)
    ]
    return min(later, default=clock.end_backward)


def _reduce_scatter_buffers(ctx: Context, clock: _Clock, sizes: _UnitSizes) -> list[Entry]:
    """Each post-backward's reduce-scatter input, one in flight (it lives until the next post-backward or
    the end of backward), and gloo's full-size copy of it during the call."""
    posted = [u for u in ctx.unit_params() if ("post_backward", u) in clock.at]
    order = sorted(posted, key=lambda u: clock.at[("post_backward", u)])
    out: list[Entry] = []
    for k, u in enumerate(order):
        label, c = u or "<root>", clock.at[("post_backward", u)]
        nxt = clock.at[("post_backward", order[k + 1])] if k + 1 < len(order) else clock.end_backward
        dtype = ctx.unit_grad_dtype(u)
        nbytes = sizes.grad_numel[u] * dtype_bytes(dtype)
        out += clock.window(f"reduce-scatter input {label}", _COMM, "reduce_scatter_input", dtype, nbytes, c, nxt)
        if ctx.config.reduce_scatter_copy and ctx.plan.shard_size > 1:  # one rank copies, calls no collective
            out += clock.window(
                f"reduce-scatter copy {label}", _COMM, "reduce_scatter_copy", dtype, nbytes, c + 1, c + 2
            )
    return out


def _gradients(ctx: Context, clock: _Clock, srank: int) -> list[Entry]:
    """The model's gradients: unsharded until their unit's reduce-scatter, then the rank's shard until
    ``zero_grad``. A gradient of a unit with no post-backward stays as traced."""
    grads = [e for e in ctx.ledger.entries if e.category == Category.GRADIENTS and e.role == "grad"]
    kept = _kept_to_the_end(ctx, grads)
    out: list[Entry] = []
    for e in grads:
        like = ctx.param_of(e) or e
        r = clock.remap(e)
        post = clock.at.get(("post_backward", unit_of(like.name, ctx.units)))
        if post is None:
            out.append(r)
            continue
        rs = post + 1
        # the copied-in gradients are dropped before the reduce-scatter, except the one ``foreach_reduce``'s
        # loop variable still holds: it goes when the hook returns, after the reduce-scatter
        drop = rs + 1 if e.name in kept else rs
        freed = min(drop, clock.total if r.free_event is None else r.free_event)
        full = replace(r, free_event=max(r.alloc_event or 0, freed))
        shard = resized(r, ctx.held(e, like, srank))
        out += [full, replace(shard, name=f"{e.name} (shard)", shape=(), alloc_event=rs, last_use_event=None)]
    return out


def _kept_to_the_end(ctx: Context, grads: list[Entry]) -> set[str]:
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
