"""``record`` on an FSDP2 step: the gathered parameters FSDP2 frees and re-grows by resizing their storages are
followed (allocated where they are gathered, freed where they are resharded), the peak equals the profiler's
allocation events in another process, and the training is bitwise what it is without ``record``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import record_fsdp
from tests.test_record import assert_bitwise
from trainledger import record

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_gathered_parameters_are_followed_and_training_is_unchanged(one_rank_group) -> None:
    def loop(recorded: bool):
        run = record_fsdp.build()
        rec = record(run["model"], run["opt"], steps=1) if recorded else None
        if rec is None:
            record_fsdp.train(**run)
        else:
            with rec:
                record_fsdp.train(**run)
        state = {"model": run["model"].state_dict(), "opt": run["opt"].state_dict(), "rng": torch.get_rng_state()}
        return state, rec

    plain, _ = loop(False)
    recorded, rec = loop(True)
    assert assert_bitwise(plain, recorded) == 6 + 6 + 1  # weights, momentum buffers, RNG
    led = rec.ledger(step=1)
    phases = [ev.phase for ev in led.events]
    gathered = [e for e in led.entries if e.role == "gathered"]
    # each unit's parameters are gathered for its forward and again for its backward, and freed after each
    # (the root holds none of its own); the last unit's stay gathered from its forward to its backward
    assert gathered and all(e.alloc_event is not None and e.free_event is not None for e in gathered)
    assert {phases[e.alloc_event] for e in gathered} == {"forward", "backward"}
    assert {phases[e.free_event - 1] for e in gathered} <= {"forward", "backward"}
    assert not any(e.free_event is None and e.role == "gathered" for e in led.entries)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_peaks_equal_the_allocators(world: int, tmp_path: Path) -> None:
    def peaks(mode: str) -> dict[int, list[int]]:
        out = tmp_path / mode
        out.mkdir()
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
        subprocess.run(
            [*(launch if world > 1 else [sys.executable]), "-m", "tests.record_fsdp", mode, str(out)],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=300,
        )
        return {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in out.glob("rank-*.json")}

    oracle, traced = peaks("oracle"), peaks("record")
    assert sorted(oracle) == sorted(traced) == list(range(world))
    for rank in range(world):
        assert len(oracle[rank]) == len(traced[rank]) == record_fsdp.NUM_STEPS
        for step, (o, t) in enumerate(zip(oracle[rank], traced[rank], strict=True)):
            assert abs(t - o) <= 0.001 * o, (rank, step, o, t)
