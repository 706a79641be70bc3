"""The torch-side helpers of the launcher, in one process: which units FSDP reduces late, and which
layer sees the collectives an engine issues."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainledger.examples import gpt_tiny, mlp, moe
from trainledger.shard import shard
from trainledger.shard._observe import CollectiveCounter
from trainledger.shard.launch import late_units, units_of


def test_late_units_are_those_fed_without_grad():
    w = mlp()  # the first layer takes the batch; the others take activations
    assert late_units(w, units_of(w.model)) == ("inner.0",)
    w = gpt_tiny()  # blocks take the embeddings' output
    assert late_units(w, units_of(w.model)) == ()
    w = moe()  # each expert takes x[rows], an index into the batch
    assert late_units(w, units_of(w.model)) == ("experts.0", "experts.1", "experts.2", "experts.3")


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_counter_sees_what_ddp_issues(one_rank_group):
    """DDP's reducer reaches its all-reduce through the dispatcher's c10d ops, so a dispatch mode sees it."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    counter = CollectiveCounter(1)
    with counter:
        model(torch.randn(2, 4)).sum().backward()
    seen = {c.kind: (c.payload_bytes, c.num_calls) for c in counter.collectives()}
    assert seen == {"all_reduce": ((4 * 3 + 3) * 4, 1)}  # one bucket holding every gradient


def test_counter_payload_conventions(one_rank_group):
    """All-gather counts its output, reduce-scatter its input, broadcast its tensor."""
    counter = CollectiveCounter(1)
    with counter:
        out = torch.empty(6)
        dist.all_gather_single(out, torch.ones(6))
        dist.reduce_scatter_single(torch.empty(5), torch.ones(5))
        dist.broadcast(torch.ones(3, dtype=torch.float64), src=0)
    seen = {c.kind: c.payload_bytes for c in counter.collectives()}
    assert seen == {"all_gather": 24, "reduce_scatter": 20, "broadcast": 24}


def test_world_one_keeps_the_ledger():
    from trainledger.declared import StateSpec, declared_ledger

    led = declared_ledger(StateSpec(num_params=1000))
    res = shard(led, world_size=1, strategy="full_shard")
    assert res.ranks[0].entries == led.entries and res.collectives == ()


def _optimizer_temporaries(ledger):
    phases = [ev.phase for ev in ledger.events]
    return sorted(
        e.nbytes
        for e in ledger.entries
        if e.category.value == "workspace" and e.alloc_event is not None and phases[e.alloc_event] == "optimizer"
    )


@pytest.mark.slow  # traces a real model under FSDP2 on a gloo group
def test_fsdp_optimizer_temporaries_are_traced(one_rank_group):
    """FSDP2's optimizer runs on DTensors, whose own ops run below the tracer: their outputs are traced by
    their local tensors. One rank holds everything, so its temporaries are the plain step's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainledger.trace import fsdp_storages, trace

    w = mlp()
    w.optimizer = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # two temporaries per parameter
    plain = trace(w)
    w = mlp()
    w.optimizer = lambda ps: torch.optim.Adam(ps, lr=1e-3)
    fully_shard(w.model, mesh=init_device_mesh("cpu", (1,)))
    with fsdp_storages(w.model):
        sharded = trace(w)
    expected = _optimizer_temporaries(plain)
    assert len(expected) == 2 * 6  # sqrt and div of each of the three layers' weight and bias
    assert _optimizer_temporaries(sharded) == expected


def test_settled_collectives_pause_after_each_wait_and_restore(one_rank_group):
    import time

    from torch._C._distributed_c10d import Work

    from trainledger.shard._observe import settled_collectives

    original = Work.wait
    t = torch.ones(3)
    with settled_collectives(seconds=0.05):
        start = time.perf_counter()
        dist.all_reduce(t, async_op=True).wait()
        assert time.perf_counter() - start >= 0.05
    assert Work.wait is original and t.tolist() == [1.0, 1.0, 1.0]


def test_settled_collectives_pause_after_ddps_buffer_broadcast(one_rank_group, monkeypatch):
    """DDP broadcasts its module buffers through ``_broadcast_coalesced``, which waits inside C++: the traced
    step pauses after it too, and tells the tracer it waits for the workers through the call (gloo's worker
    may be the last to drop a flat buffer); outside, it is the original again."""
    from trainledger.shard._observe import settled_collectives
    from trainledger.trace import StepTracer, trace
    from trainledger.workload import Workload, run_step

    pauses = []
    letting_go = StepTracer.letting_go
    monkeypatch.setattr(StepTracer, "letting_go", lambda self: pauses.append(len(self.ops)) or letting_go(self))
    original = dist._broadcast_coalesced
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    w = Workload(nn.parallel.DistributedDataParallel(model), torch.randn(2, 3, 8, 8), loss_fn=lambda y, _: y.sum())
    run_step(w)  # DDP rebuilds its buckets in the first step
    with settled_collectives(seconds=0.01):
        led = trace(w)
    assert dist._broadcast_coalesced is original
    flatten = next(ev for ev in led.events if ev.op == "aten.cat")  # the buffers, in one flat buffer per dtype
    assert flatten.phase == "forward" and led.events[flatten.index + 1].op == "c10d.broadcast_"
    assert pauses == [0]  # one call waited for, the step's first: DDP syncs its buffers before the forward


def test_phase_seconds_lists_only_the_phases_measured():
    from trainledger.shard.launch import PhaseSeconds

    seconds = PhaseSeconds(forward=1.5, backward=2.5, optimizer=None, zero_grad=0.25)
    assert seconds.measured() == {"forward": 1.5, "backward": 2.5, "zero_grad": 0.25}
