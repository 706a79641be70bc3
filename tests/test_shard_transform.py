"""The sharding transform and communication model, checked against hand arithmetic and the ZeRO paper."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainledger.declared import StateSpec, declared_ledger
from trainledger.errors import InputError
from trainledger.ledger import Category, Entry, Event, Evidence, Ledger
from trainledger.shard import (
    Collective,
    ShardConfig,
    estimate_time,
    greedy_owners,
    infer_units,
    parse_strategy,
    shard,
    shard_rows,
    wire_bytes,
)

PSI = 7_500_000_000
GB = 10**9


def paper_ledger() -> Ledger:
    """Rajbhandari et al. 2019, Fig. 1: 7.5B parameters, mixed-precision Adam (K = 12)."""
    return declared_ledger(StateSpec(num_params=PSI, weights="fp16", master="fp32", moments="fp32", grads="fp16"))


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (0, 16 * PSI),  # (2 + 2 + K) Ψ = 120 GB
        (1, 2 * PSI + 2 * PSI + 12 * PSI // 64),  # 31.4 GB
        (2, 2 * PSI + (2 + 12) * PSI // 64),  # 16.6 GB
        (3, 16 * PSI // 64),  # 1.9 GB
    ],
)
def test_zero_paper_model_states(stage, expected):
    res = shard(paper_ledger(), world_size=64, strategy=f"zero{stage}")
    assert res.model_state_bytes() == expected
    assert round(res.model_state_bytes() / GB, 1) == {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}[stage]
    # a single instant of state: no peak claimed, and what is left out is named
    assert any("excluded" in n for n in res.ranks[0].notes)


def test_zero_paper_communication_volumes():
    """§7: DP and stages 1–2 move 2Ψ per rank, stage 3 moves 3Ψ (in fp16 elements, ring algorithms)."""
    led = paper_ledger()
    n = 64
    for stage, factor in ((0, 2), (1, 2), (2, 2), (3, 3)):
        res = shard(led, world_size=n, strategy=f"zero{stage}")
        wire = sum(c.wire_bytes for c in res.collectives)
        assert wire == round(factor * 2 * PSI * (n - 1) / n), stage


def test_wire_bytes_formulas():
    assert wire_bytes("all_reduce", 1000, 4) == 1500  # 2(N-1)/N
    assert wire_bytes("reduce_scatter", 1000, 4) == 750
    assert wire_bytes("all_gather", 1000, 4) == 750
    assert wire_bytes("all_reduce", 1000, 1) == 0
    with pytest.raises(InputError, match="unknown collective"):
        wire_bytes("all_to_all", 1, 2)  # type: ignore[arg-type]


def test_shard_rows_padding():
    # 10 rows over 4 ranks: chunks of 3 rows, the last rank has 1 real row, all hold 3 (padded)
    assert [shard_rows(20, (10, 2), 4, r, "dim0") for r in range(4)] == [(6, 6), (6, 6), (6, 6), (6, 2)]
    # 2 rows over 4 ranks: ranks 2 and 3 hold padding only
    assert [shard_rows(6, (2, 3), 4, r, "dim0") for r in range(4)] == [(3, 3), (3, 3), (3, 0), (3, 0)]
    assert [shard_rows(10, (10,), 4, r, "flat") for r in range(4)] == [(3, 3), (3, 3), (3, 3), (3, 1)]


def test_greedy_partition_matches_torch_rule():
    # largest first, ties in order, to the least-loaded (lowest) rank
    assert greedy_owners([4, 4, 2, 1, 1], 2) == [0, 1, 0, 1, 1]
    assert greedy_owners([1, 1, 1], 4) == [0, 1, 2]


def test_infer_units_and_parse_strategy():
    names = ["wte.weight", "blocks.0.attn.w", "blocks.0.mlp.w", "blocks.1.attn.w", "blocks.10.x", "ln.w"]
    assert infer_units(names) == ("blocks.0", "blocks.1", "blocks.10")
    assert infer_units(["a.weight", "b.weight"]) == ()
    # a model that is itself an nn.Sequential: its children, as when another module holds it
    assert infer_units(["0.weight", "1.0.weight", "1.2.weight", "2.0.weight", "4.bias"]) == ("0", "1", "2", "4")
    assert infer_units(["inner.0.weight", "inner.1.0.weight"]) == ("inner.0", "inner.1")
    assert parse_strategy(0) == "zero0" and parse_strategy("SHARD_GRAD_OP") == "shard_grad_op"
    with pytest.raises(InputError, match="unknown stage '4'"):
        parse_strategy("4")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"world_size": 0}, "world size \\(ranks\\) 0 must be at least 1"),
        ({"world_size": 4, "strategy": "zero9"}, "unknown strategy"),
        ({"world_size": 4, "engine": "megatron"}, "unknown engine"),
        ({"world_size": 6, "strategy": "hybrid_shard", "num_nodes": 4}, "4 nodes do not divide the world of 6"),
        ({"world_size": 2, "backward_prefetch": -1}, "prefetch"),
    ],
)
def test_bad_config(kwargs, fragment):
    with pytest.raises(InputError, match=fragment):
        ShardConfig(**kwargs)


# --- a hand-built traced step: two units plus a root ------------------------------------------------


def _traced() -> Ledger:
    """Root param r (4 rows × 2, fp32); unit h.0 param a (5×2), unit h.1 param b (6×2); Adam moments.

    Events: 0 root fwd, 1–2 h.0 fwd, 3–4 h.1 fwd, 5–6 h.1 bwd, 7–8 h.0 bwd, 9 root bwd, 10 optimizer.
    An activation of 100 bytes is live over [1, 8).
    """
    mods = ["(root)", "h.0", "h.0", "h.1", "h.1", "h.1", "h.1", "h.0", "h.0", "(root)", ""]
    phases = ["forward"] * 5 + ["backward"] * 5 + ["optimizer"]
    events = tuple(Event(i, ph, "op", m) for i, (ph, m) in enumerate(zip(phases, mods, strict=True)))
    entries = []
    for name, rows in (("r", 4), ("h.0.a", 5), ("h.1.b", 6)):
        n = rows * 2
        entries.append(Entry(name, Category.WEIGHTS, "param", "float32", n, 4 * n, shape=(rows, 2)))
        for role in ("exp_avg", "exp_avg_sq"):
            entries.append(Entry(f"optimizer.{name}.{role}", Category.OPTIMIZER, role, "float32", n, 4 * n))
        entries.append(Entry(f"optimizer.{name}.step", Category.OPTIMIZER, "step", "float32", 1, 4))
    # gradients: produced in backward by their unit, freed at zero_grad (after the step: None)
    for name, rows, born in (("h.1.b", 6, 5), ("h.0.a", 5, 7), ("r", 4, 9)):
        n = rows * 2
        entries.append(Entry(f"{name}.grad", Category.GRADIENTS, "grad", "float32", n, 4 * n, alloc_event=born))
    entries.append(Entry("act", Category.ACTIVATIONS, "saved", "float32", 25, 100, alloc_event=1, free_event=8))
    return Ledger(tuple(entries), events, evidence=Evidence.TRACED)


def test_traced_units_found_from_events():
    res = shard(_traced(), world_size=2, strategy="full_shard")
    assert res.units == ("h.0", "h.1")


def test_full_shard_timeline_by_hand():
    """World 2, FSDP2 per-parameter dim-0 shards: r 2 rows, a 3 rows (rank 1: 2 real), b 3 rows.

    FSDP's hooks become events of their own. The new clock (old events in brackets):
    0 gather root, 1 [0], 2 gather h.0, 3 [1], 4 [2], 5 gather h.1, 6 [3], 7 [4],
    8 gather root (bwd), 9 prefetch, 10 gather h.1 (bwd), 11 prefetch, 12 [5], 13 [6],
    14 copy-in h.1, 15 reduce-scatter h.1, 16 gather h.0 (bwd), 17 prefetch, 18 [7], 19 [8],
    20 copy-in h.0, 21 reduce-scatter h.0, 22 [9], 23 copy-in root, 24 reduce-scatter root, 25 [10].
    """
    led = _traced()
    res = shard(led, world_size=2, strategy="full_shard", backward_prefetch=1)
    r0, r1 = res.ranks
    assert r0.num_events == 26
    assert [ev.op for ev in r0.events[14:17]] == [
        "fsdp.reduce_scatter_copy_in",
        "fsdp.reduce_scatter",
        "fsdp.all_gather",
    ]
    # persistent sharded weights (padded): (2 + 3 + 3) rows × 2 × 4 bytes on both ranks
    w = [sum(e.nbytes for e in r.entries if e.category == Category.WEIGHTS and e.role == "param") for r in (r0, r1)]
    assert w == [(2 + 3 + 3) * 8] * 2
    # optimizer state holds the real (unpadded) rows: rank 1 has 2 rows of a, 3 of b, 2 of r
    opt1 = sum(e.nbytes for e in r1.entries if e.category == Category.OPTIMIZER)
    assert opt1 == 2 * (2 + 2 + 3) * 8 + 3 * 4
    life = {e.name: (e.alloc_event, e.free_event, e.nbytes) for e in r0.entries if e.owner == "shard"}
    # forward: each flat all-gather buffer lives until the next unit's copy-out; params until post-forward
    assert life["all-gather output <root> (forward)"] == (0, 3, 32)
    assert life["gathered params <root> (forward)"] == (0, 8, 32)
    assert life["all-gather output h.0 (forward)"] == (2, 6, 48)
    assert life["gathered params h.0 (forward)"] == (2, 5, 48)
    assert life["all-gather output h.1 (forward)"] == (5, 8, 48)
    # backward: h.0 is prefetched after h.1's copy-out and copied out at its own pre-backward
    assert life["gathered params <root> (backward)"] == (8, 23, 32)
    assert life["all-gather output h.1 (backward)"] == (9, 11, 48)
    assert life["gathered params h.1 (backward)"] == (10, 14, 48)
    assert life["all-gather output h.0 (backward)"] == (11, 17, 48)
    assert life["gathered params h.0 (backward)"] == (16, 20, 48)
    # one reduce-scatter input in flight: each lives until the next unit's copy-in
    assert life["reduce-scatter input h.1"] == (14, 20, 48)
    assert life["reduce-scatter input h.0"] == (20, 23, 48)
    assert life["reduce-scatter input <root>"] == (23, 25, 32)
    grads = {e.name: (e.alloc_event, e.free_event, e.nbytes) for e in r0.entries if e.category == Category.GRADIENTS}
    # each unit's only (so last) gradient outlives the copy-in until its post-backward returns
    assert grads["h.1.b.grad"] == (12, 16, 48) and grads["h.1.b.grad (shard)"] == (15, None, 24)
    assert grads["r.grad (shard)"] == (24, None, 16)
    persistent = (2 + 3 + 3) * 8 + 2 * (2 + 3 + 3) * 8 + 3 * 4  # sharded weights, rank 0's moments and steps
    # at event 13 (old 6, h.1's backward, h.0 prefetched): root and h.1 gathered, h.0's buffer, h.1's gradient
    assert r0.totals()[13] == persistent + 32 + 48 + 48 + 48 + 100
    # at h.1's reduce-scatter: root gathered, h.0's buffer, the input, h.1's gradient and shard, the activation
    assert r0.totals()[15] == persistent + 32 + 48 + 48 + 48 + 24 + 100
    # gloo reduce-scatters a full-size copy of its input: 48 more bytes for that one event
    gloo = shard(led, world_size=2, strategy="full_shard", reduce_scatter_copy=True).ranks[0]
    assert gloo.totals()[15] == r0.totals()[15] + 48 and gloo.totals()[16] == r0.totals()[16]


def test_shard_grad_op_keeps_params_from_forward_to_backward():
    res = shard(_traced(), world_size=2, strategy="shard_grad_op")
    led = res.ranks[0]
    # no gathers in backward: 0 gather root, 1 [0], 2 gather h.0, …, 10 copy-in h.1, 11 reduce-scatter h.1,
    # 12 [7], 13 [8], 14 copy-in h.0
    assert led.num_events == 11 + 3 + 3 * 2
    g = {e.name: (e.alloc_event, e.free_event) for e in led.entries if e.role == "gathered"}
    assert g["gathered params h.0 (forward to backward)"] == (2, 14)
    assert not any("(backward)" in k for k in g)
    kinds = [(c.kind, c.phase) for c in res.collectives]
    assert kinds.count(("all_gather", "forward")) == 3 and ("all_gather", "backward") not in kinds


def test_fsdp_collectives_per_unit():
    res = shard(_traced(), world_size=2, strategy="full_shard")
    ag = [(c.phase, c.label, c.payload_bytes) for c in res.collectives if c.kind == "all_gather"]
    assert ag[:3] == [
        ("forward", "params of <root>", 32),
        ("forward", "params of h.0", 48),
        ("forward", "params of h.1", 48),
    ]
    assert len(ag) == 6  # FULL_SHARD gathers again for backward
    rs = {c.label: c.payload_bytes for c in res.collectives if c.kind == "reduce_scatter"}
    assert rs == {"grads of h.1": 48, "grads of h.0": 48, "grads of <root>": 32}


def test_hybrid_shard_adds_cross_node_all_reduce():
    res = shard(_traced(), world_size=4, strategy="hybrid_shard", num_nodes=2)
    ar = [c for c in res.collectives if c.kind == "all_reduce"]
    assert ar and all(c.group_size == 2 for c in ar)
    # shards within a node of 2: the same per-rank weights as full_shard on 2 ranks
    full2 = shard(_traced(), world_size=2, strategy="full_shard")
    assert res.ranks[3].peak().bytes == full2.ranks[1].peak().bytes


def test_torch_zero1_greedy_optimizer_partition():
    res = shard(_traced(), world_size=2, strategy="zero1", engine="torch")
    # sizes 8 (r), 10 (a), 12 (b): b → rank 0, a → rank 1, r → rank 1
    owned = [sorted({e.name.split(".")[1] for e in r.entries if e.category == Category.OPTIMIZER}) for r in res.ranks]
    assert owned == [["h"], ["h", "r"]]
    opt = [sum(e.nbytes for e in r.entries if e.category == Category.OPTIMIZER) for r in res.ranks]
    assert opt == [2 * 48 + 4, 2 * (40 + 32) + 8]
    # DDP's buckets copy every gradient: 120 bytes of communication buffers, live the whole step
    comm = [e for e in res.ranks[0].entries if e.category == Category.COMMUNICATION]
    assert [(e.nbytes, e.alloc_event) for e in comm] == [(120, None)]
    kinds = {c.kind: c.payload_bytes for c in res.collectives}
    assert kinds == {"all_reduce": 120, "broadcast": 120}


def test_world_one_is_the_input():
    led = _traced()
    res = shard(led, world_size=1, strategy="zero0")
    assert res.ranks[0].peak().bytes == led.peak().bytes and res.collectives == ()


def test_frozen_weights_sharded_but_never_reduced():
    base = declared_ledger(StateSpec(num_params=1000, weights="bf16", frozen_params=4000))
    res = shard(base, world_size=4, strategy="zero3")
    frozen = sum(e.nbytes for e in res.ranks[0].entries if e.category == Category.FROZEN)
    assert frozen == 4000 * 2 // 4
    rs = [c for c in res.collectives if c.kind == "reduce_scatter"]
    assert sum(c.payload_bytes for c in rs) == 1000 * 2  # gradients of trainable weights only
    assert shard(base, world_size=4, strategy="zero2").model_state_bytes() > res.model_state_bytes()


def test_time_estimate_and_exposure():
    cs = [
        Collective("all_gather", "forward", "u0", 10**9, 2),
        Collective("all_gather", "forward", "u1", 10**9, 2),
        Collective("reduce_scatter", "backward", "u1", 2 * 10**9, 2),
    ]
    # 8 Gbit/s = 1e9 bytes/s; wire bytes: 0.5e9, 0.5e9, 1e9
    t = estimate_time(cs, link_gbps=8.0, compute_seconds={"forward": 10.0, "backward": 10.0})
    assert t.total_seconds == pytest.approx(2.0)
    # forward exposes its first gather (0.5 s), backward its last reduce-scatter (1 s)
    assert t.exposed_seconds == pytest.approx(1.5)
    slow = estimate_time(cs, link_gbps=8.0, compute_seconds={"forward": 0.1, "backward": 0.0})
    # forward: first gather 0.5 s + the rest (0.5 s) beyond 0.1 s of compute = 0.9 s; backward all 1 s
    assert slow.exposed_seconds == pytest.approx(1.9)
    assert estimate_time(cs, link_gbps=8.0).exposed_seconds == pytest.approx(2.0)
    with pytest.raises(InputError, match="link bandwidth 0 must be a finite number above 0"):
        estimate_time(cs, link_gbps=0)


def test_ddp_broadcasts_buffers_every_forward():
    """DDP (broadcast_buffers=True) sends rank 0's buffers before each forward, one call per dtype."""
    entries = (
        Entry("w", Category.WEIGHTS, "param", "float32", 10, 40),
        Entry("w.grad", Category.GRADIENTS, "grad", "float32", 10, 40),
        Entry("bn.running_mean", Category.OTHER, "buffer", "float32", 4, 16),
        Entry("bn.num_batches_tracked", Category.OTHER, "buffer", "int64", 1, 8),
    )
    res = shard(Ledger(entries), world_size=2, strategy="zero0", engine="torch")
    assert [(c.kind, c.payload_bytes, c.num_calls) for c in res.collectives] == [
        ("broadcast", 24, 2),
        ("all_reduce", 40, 1),
    ]
    # DeepSpeed's engine does not broadcast buffers
    assert {c.kind for c in shard(Ledger(entries), world_size=2, strategy="zero0").collectives} == {"all_reduce"}


def test_units_without_input_grads_are_reduced_at_the_end():
    """A unit fed the batch (no input requires grad) is resharded and reduced in FSDP's final callback,
    after the root: its gathered parameters and full gradients live until then."""
    res = shard(_traced(), world_size=2, strategy="full_shard", late_units=("h.0",))
    led = res.ranks[0]
    ops = [(ev.op, ev.module) for ev in led.events[21:25]]
    assert ops == [
        ("fsdp.reduce_scatter_copy_in", "(root)"),
        ("fsdp.reduce_scatter", "(root)"),
        ("fsdp.reduce_scatter_copy_in", "h.0"),
        ("fsdp.reduce_scatter", "h.0"),
    ]
    life = {e.name: (e.alloc_event, e.free_event) for e in led.entries}
    assert life["gathered params h.0 (backward)"] == (16, 23)
    assert life["h.0.a.grad"] == (18, 25)  # its unit's last gradient: until the hook returns
    assert life["reduce-scatter input <root>"] == (21, 23)
    assert life["reduce-scatter input h.0"] == (23, 25)


def test_loss_outside_the_model_runs_between_the_roots_hooks():
    """``Workload(loss_fn=...)``: the loss's forward runs after the root's post-forward, and its backward
    (and the seed of backward) before the root's pre-backward, which fires when the gradient reaches the
    model's output. Old events: 0 root, 1–2 h.0, 3–4 h.1, 5 the loss (module ""); backward: 6 the seed
    (""), 7 the loss (``(loss)``), 8–9 h.1, 10–11 h.0, 12 root; 13 optimizer."""
    base = _traced()
    mods = ["(root)", "h.0", "h.0", "h.1", "h.1", "", "", "(loss)", "h.1", "h.1", "h.0", "h.0", "(root)", ""]
    phases = ["forward"] * 6 + ["backward"] * 7 + ["optimizer"]
    events = tuple(Event(i, ph, "op", m) for i, (ph, m) in enumerate(zip(phases, mods, strict=True)))
    moved = {5: 8, 7: 10, 9: 12, 1: 1, 8: 11, 10: 13}  # old event of _traced() -> here
    entries = tuple(
        e if e.alloc_event is None else replace(e, alloc_event=moved[e.alloc_event], free_event=moved.get(e.free_event))
        for e in base.entries
    )
    logits = Entry("logits", Category.ACTIVATIONS, "saved", "float32", 250, 1000, alloc_event=4, free_event=8)
    led = Ledger((*entries, logits), events, evidence=Evidence.TRACED)
    r0 = shard(led, world_size=2, strategy="full_shard").ranks[0]
    # new clock: 0 gather root, 1 [0], 2 gather h.0, 3 [1], 4 [2], 5 gather h.1, 6 [3], 7 [4], 8 [5],
    # 9 [6], 10 [7], 11 gather root (bwd), 12 prefetch, 13 gather h.1 (bwd), 14 prefetch, 15 [8], …
    assert [(ev.op, ev.module) for ev in r0.events[8:12]] == [
        ("op", ""),
        ("op", ""),
        ("op", "(loss)"),
        ("fsdp.all_gather", "(root)"),
    ]
    life = {e.name: (e.alloc_event, e.free_event) for e in r0.entries if e.owner == "shard"}
    # the root's post-forward, before the loss: its parameters and the last unit's flat buffer are freed
    assert life["gathered params <root> (forward)"] == (0, 8)
    assert life["all-gather output h.1 (forward)"] == (5, 8)
    assert life["gathered params <root> (backward)"] == (11, 26)
    # nothing FSDP gathers is live while the loss runs, forward or backward
    assert not [e.name for e in r0.entries if e.owner == "shard" and any(e.live_at(i) for i in (8, 9, 10))]


def test_fsdp_optimizer_temporaries_have_the_ranks_real_rows():
    """FSDP2's optimizer updates each parameter's local shard: a temporary shaped like a parameter has that
    shape's real rows on the rank (a: 5 rows, rank 0 holds 3, rank 1 holds 2), a scalar stays whole."""
    led = _traced()
    temps = (
        Entry("sqrt", Category.WORKSPACE, "optimizer_temporary", "float32", 10, 40, alloc_event=10, shape=(5, 2)),
        Entry("bias_correction", Category.WORKSPACE, "optimizer_temporary", "float32", 1, 4, alloc_event=10, shape=()),
    )
    led = led.with_entries((*led.entries, *temps))
    ranks = shard(led, world_size=2, strategy="full_shard").ranks
    sizes = [{e.name: e.nbytes for e in r.entries if e.role == "optimizer_temporary"} for r in ranks]
    assert sizes == [{"sqrt": 3 * 2 * 4, "bias_correction": 4}, {"sqrt": 2 * 2 * 4, "bias_correction": 4}]


def test_fsdp_keeps_a_units_last_gradient_through_its_reduce_scatter():
    """``foreach_reduce``'s loop variable holds the unit's last gradient (in the model's parameter order)
    until the post-backward hook returns; the others are dropped after the copy-in."""
    led = _traced()
    c = Entry("h.1.c", Category.WEIGHTS, "param", "float32", 4, 16, shape=(2, 2))
    c_grad = Entry("h.1.c.grad", Category.GRADIENTS, "grad", "float32", 4, 16, alloc_event=6)
    for order, kept in (
        (["r", "h.0.a", "h.1.b", "h.1.c"], "h.1.c.grad"),
        (["r", "h.0.a", "h.1.c", "h.1.b"], "h.1.b.grad"),
    ):
        ranked = led.with_entries((*led.entries, c, c_grad), meta={"parameter_order": order})
        r0 = shard(ranked, world_size=2, strategy="full_shard").ranks[0]
        # h.1's post-backward: copy-in at 14, reduce-scatter at 15
        free = {e.name: e.free_event for e in r0.entries if e.name in ("h.1.b.grad", "h.1.c.grad")}
        assert free == {"h.1.b.grad": 15, "h.1.c.grad": 15, kept: 16}


def test_a_one_element_parameters_step_counter_is_kept_whole():
    """A (1,)-shaped parameter over 2 ranks: rank 1 holds no real row, yet its optimizer keeps the 0-dim
    step counter (4 bytes); the moment, shaped like the parameter, has no real element there."""
    entries = (
        Entry("g", Category.WEIGHTS, "param", "float32", 1, 4, shape=(1,)),
        Entry("optimizer.g.exp_avg", Category.OPTIMIZER, "exp_avg", "float32", 1, 4, shape=(1,)),
        Entry("optimizer.g.step", Category.OPTIMIZER, "step", "float32", 1, 4, shape=()),
    )
    ranks = shard(Ledger(entries), world_size=2, strategy="full_shard", engine="torch").ranks
    opt = [{e.role: e.nbytes for e in r.entries if e.category == Category.OPTIMIZER} for r in ranks]
    assert opt == [{"exp_avg": 4, "step": 4}, {"exp_avg": 0, "step": 4}]


def _single_tensor_step() -> Ledger:
    """Parameters a (10), b (4), c (6), Adam-like moments; the optimizer updates one after another.

    Events: 0 forward, 1 backward, optimizer 2–4 a, 5–7 b, 8–10 c (sqrt, div, addcdiv each, attributed
    to the parameter they update), 11 zero_grad. Each parameter's ``sqrt`` lives within its segment; its
    ``denom`` (the div) lives until the next parameter's division is done (two events into the next
    segment), the last one's until the step returns.
    """
    events = [Event(0, "forward", "mm", "(root)"), Event(1, "backward", "mm", "(root)")]
    entries = []
    sizes = {"a": 10, "b": 4, "c": 6}
    for k, (name, n) in enumerate(sizes.items()):
        s = 2 + 3 * k
        events += [
            Event(s + i, "optimizer", op, name) for i, op in enumerate(("aten.sqrt", "aten.div", "aten.addcdiv_"))
        ]
        entries.append(Entry(name, Category.WEIGHTS, "param", "float32", n, 4 * n, shape=(n,)))
        entries.append(Entry(f"optimizer.{name}.exp_avg", Category.OPTIMIZER, "exp_avg", "float32", n, 4 * n))
        temp = Category.WORKSPACE, "optimizer_temporary", "float32", n, 4 * n
        entries.append(Entry(f"sqrt {name}", *temp, owner=name, alloc_event=s, free_event=s + 2, shape=(n,)))
        denom_free = s + 3 + 2 if k < 2 else 11
        entries.append(Entry(f"denom {name}", *temp, owner=name, alloc_event=s + 1, free_event=denom_free, shape=(n,)))
    events.append(Event(11, "zero_grad", "detach", ""))
    return Ledger(tuple(entries), tuple(events), evidence=Evidence.TRACED)


def test_zero1_rank_steps_its_own_parameters_in_its_own_order():
    """ZeroRedundancyOptimizer: a (10) to rank 0, c (6) then b (4) to rank 1, whose optimizer updates c
    first: c's denom is alive while b's temporaries are made, not b's while c's are."""
    res = shard(_single_tensor_step(), world_size=2, strategy="zero1", engine="torch")
    r0, r1 = res.ranks
    assert [ev.module for ev in r1.events if ev.phase == "optimizer"] == ["c"] * 3 + ["b"] * 3
    assert r1.events[-1].phase == "zero_grad" and r1.num_events == 9
    life = {e.name: (e.alloc_event, e.free_event) for e in r1.entries if e.category == Category.WORKSPACE}
    assert life == {"sqrt c": (2, 4), "denom c": (3, 7), "sqrt b": (5, 7), "denom b": (6, 8)}
    weights, moments, buckets = 4 * (10 + 4 + 6), 4 * (6 + 4), 4 * (10 + 4 + 6)  # DDP's buckets copy every grad
    # the rank's optimizer peak: c's denom, b's sqrt and denom (in the reference order, b then c, it would be
    # b's denom with c's sqrt and denom: 8 bytes more)
    assert max(r1.totals()[2:8]) == weights + moments + buckets + 4 * (6 + 4 + 4)
    # rank 0 updates a alone: its sqrt and denom, nothing of b or c
    assert {e.name for e in r0.entries if e.category == Category.WORKSPACE} == {"sqrt a", "denom a"}
    assert [ev.module for ev in r0.events if ev.phase == "optimizer"] == ["a"] * 3


def test_fsdp_master_gradients_are_the_optimizers_own():
    """A master-weight optimizer casts each gradient onto an fp32 copy in its step: that copy is made from
    the rank's shard (its real rows) when the step runs, not placed on FSDP's backward timeline."""
    led = _traced()
    master_grad = Entry("h.0.a.master.grad", Category.GRADIENTS, "master_grad", "float32", 10, 40, alloc_event=10)
    led = led.with_entries((*led.entries, master_grad))
    ranks = shard(led, world_size=2, strategy="full_shard").ranks
    got = [[(e.nbytes, r.events[e.alloc_event].phase) for e in r.entries if e.role == "master_grad"] for r in ranks]
    assert got == [[(3 * 2 * 4, "optimizer")], [(2 * 2 * 4, "optimizer")]]


def test_a_reference_model_called_by_the_loss_is_outside_the_root():
    """A frozen reference model run inside the loss (DPO, a proximal term) runs after the model returns:
    the root's post-forward comes before its ops. Old events: 0 root, 1–2 h.0, 3–4 h.1, 5 reference.0."""
    base = _traced()
    mods = ["(root)", "h.0", "h.0", "h.1", "h.1", "reference.0", "h.1", "h.1", "h.0", "h.0", "(root)", ""]
    phases = ["forward"] * 6 + ["backward"] * 5 + ["optimizer"]
    events = tuple(Event(i, ph, "op", m) for i, (ph, m) in enumerate(zip(phases, mods, strict=True)))
    moved = {1: 1, 5: 6, 7: 8, 8: 9, 9: 10}
    entries = tuple(
        e if e.alloc_event is None else replace(e, alloc_event=moved[e.alloc_event], free_event=moved.get(e.free_event))
        for e in base.entries
    )
    reference = Entry("reference.0.w", Category.FROZEN, "reference", "float32", 4, 16)
    led = Ledger((*entries, reference), events, evidence=Evidence.TRACED)
    r0 = shard(led, world_size=2, strategy="full_shard").ranks[0]
    # new clock: 0 gather root, 1 [0], 2 gather h.0, 3 [1], 4 [2], 5 gather h.1, 6 [3], 7 [4], 8 [5] …
    life = {e.name: (e.alloc_event, e.free_event) for e in r0.entries if e.owner == "shard"}
    assert life["gathered params <root> (forward)"] == (0, 8)
    assert life["all-gather output h.1 (forward)"] == (5, 8)
    assert r0.events[8].module == "reference.0"
    # DDP alone (stage 0): every rank steps every parameter, in the model's order
    ddp = shard(_single_tensor_step(), world_size=2, strategy="zero0", engine="torch").ranks[1]
    assert ddp.events == _single_tensor_step().events
    assert {e.name for e in ddp.entries if e.category == Category.WORKSPACE} == {
        f"{k} {p}" for k in ("sqrt", "denom") for p in "abc"
    }


def test_ddp_first_bucket_is_small():
    """DDP's first bucket closes at 1 MiB, the next ones at 25 MiB: 1.93 MB of gradients (unet-small) are
    two all-reduce calls, 0.88 MB (gpt-tiny) one."""
    entries = []
    for k, n in enumerate((300_000, 200_000, 100_000)):  # float32: 1.2 MB, 0.8 MB, 0.4 MB
        entries.append(Entry(f"w{k}", Category.WEIGHTS, "param", "float32", n, 4 * n))
        # backward produces the last layer's gradient first
        entries.append(Entry(f"w{k}.grad", Category.GRADIENTS, "grad", "float32", n, 4 * n, alloc_event=3 - k))
    events = tuple(Event(i, ph, "op", "(root)") for i, ph in enumerate(("forward",) + ("backward",) * 3))
    res = shard(
        Ledger(tuple(entries), events, evidence=Evidence.TRACED), world_size=2, strategy="zero0", engine="torch"
    )
    (ar,) = [c for c in res.collectives if c.kind == "all_reduce"]
    # ready order w2 (0.4 MB), w1 (0.8 MB): 1.2 MB >= 1 MiB closes the first bucket; w0 the second
    assert (ar.payload_bytes, ar.num_calls) == (2_400_000, 2)


def test_units_are_the_modules_that_run_and_a_unit_called_twice_is_named():
    """A repeated container (an ``nn.ModuleList`` of layers, a parameter holder with no ``forward``) is never
    called and FSDP refuses to wrap it: its called submodules are the units, a holder with none leaves its
    parameters to the root. A unit run twice in one forward is gathered at each call: the prediction says it
    leaves that out."""
    import torch
    from torch import nn

    from trainledger.shard.launch import units_of
    from trainledger.trace import trace
    from trainledger.workload import Workload

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.g = nn.Parameter(torch.ones(4))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList(nn.ModuleList(nn.Linear(4, 4) for _ in range(2)) for _ in range(2))
            self.gains = nn.ModuleList(Holder() for _ in range(2))

        def forward(self, x):
            for stage in self.stages:
                for layer in stage:
                    x = layer(x) * self.gains[0].g
            return self.stages[0][0](x).square().mean()  # the first layer again

    assert units_of(Model()) == ("stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1")
    led = trace(Workload(Model(), torch.randn(3, 4)))
    res = shard(led, ShardConfig(world_size=2, strategy="zero3", engine="torch", units=units_of(Model())))
    assert any("unit stages.0.0 runs 2 times in one forward" in n for n in res.notes)
    assert not any("stages.0.1 runs" in n for n in res.notes)


def test_a_prediction_fsdp2_would_not_run_says_so():
    """A parameter two units share, or a 0-dim one: FSDP2 would not run the model (``shard --run`` refuses it
    before any rank starts); the prediction says so, naming the parameter by every name it goes by."""
    import torch
    from torch import nn

    from trainledger.shard.launch import units_of
    from trainledger.trace import trace
    from trainledger.workload import Workload

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = nn.Linear(6, 6)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), shared) for _ in range(3))
            self.gain = nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return (x * self.gain).square().mean()

    model = Model()
    led = trace(Workload(model, torch.randn(5, 6)))
    res = shard(led, ShardConfig(world_size=2, strategy="zero3", engine="torch", units=units_of(model)))
    (scalar,) = [n for n in res.notes if "0-dim" in n]
    assert "has 1 (gain)" in scalar
    (shared,) = [n for n in res.notes if "shared by" in n]  # weight and bias, each under all three units
    assert "and 1 more are shared by layers.0 and layers.1 and layers.2 (as layers.0.1." in shared
    plain = Workload(
        nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1)), torch.randn(5, 6), loss_fn=lambda o, _b: o.sum()
    )
    res = shard(trace(plain), ShardConfig(world_size=2, strategy="zero3", engine="torch"))
    assert not any("would not run" in n for n in res.notes)
