"""``record`` under the real launcher: ``torchrun --nproc-per-node 2`` and ``4`` on gloo with DDP and FSDP2; every
rank writes its ledger into one folder, and ``trainledger report`` reads the folder as ranks compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from trainledger.report.saved import open_saved

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize(("strategy", "world"), [("ddp", 2), ("fsdp2", 2), ("fsdp2", 4)])
def test_every_rank_records_and_the_report_compares_them(strategy: str, world: int, tmp_path: Path) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    run = subprocess.run(
        [*launcher, "tests/record_dist.py", strategy, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    saved = open_saved(tmp_path)
    assert saved.kind == "ranks"
    comparison = saved.result
    assert [r.rank for r in comparison.rows] == list(range(world))
    for row in comparison.rows:
        led = open_saved(tmp_path / Path(row.path).name).result
        assert led.meta["rank"] == row.rank and led.meta["world_size"] == world and led.meta["step"] == 1
        assert {"forward", "backward", "optimizer"} <= {ev.phase for ev in led.events}
    # rank r's micro-batch is r + 1 times rank 0's: the last rank's activations set the job's peak
    assert comparison.peak_row.rank == world - 1 and comparison.skew is not None and comparison.skew > 1
