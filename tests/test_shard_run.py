"""Real multi-process runs on gloo: predicted against traced per rank, collectives counted, faults stopped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trainledger.errors import InputError
from trainledger.shard.launch import RankError, RunConfig, refuse_outputs_fsdp_cannot_see, run

pytestmark = pytest.mark.slow

FACTORIES = """
import time
import torch
import torch.distributed as dist
from trainledger.examples import mlp
from trainledger.workload import Workload

def raises_on_rank_1():
    if dist.get_rank() == 1:
        raise RuntimeError("rank one has no data")
    return mlp()

def hangs_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return mlp()


def with_an_unused_parameter():
    w = mlp()
    w.model.spare = torch.nn.Linear(4, 4)  # never called in forward: it gets no gradient
    return w


class Result:
    def __init__(self, loss):
        self.loss = loss


class Boxed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *batch):
        return Result(self.inner(*batch))


def boxed_output():
    w = mlp()
    w.model = Boxed(w.model)
    return w


def seeded_by_rank():
    torch.manual_seed(dist.get_rank())  # the parent builds the reference as rank 0 of a group of its own
    return mlp()


class TwoBlocksOneProjection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        proj = torch.nn.Linear(8, 8, bias=False)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), proj) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def shared_by_two_blocks():
    return Workload(TwoBlocksOneProjection(), torch.randn(4, 8), loss_fn=lambda out, _b: out.square().mean())


def scalar_temperature():
    w = mlp()
    w.model.temperature = torch.nn.Parameter(torch.tensor(2.0))
    w.loss_fn = lambda out, batch, f=w.loss_fn, t=w.model.temperature: f(out / t, batch)
    return w


def rprop():
    w = mlp()
    w.optimizer = torch.optim.Rprop
    return w


def mixed_dtypes():
    w = mlp()
    w.model.spare = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))  # trained beside the rest
    w.loss_fn = lambda out, batch, f=w.loss_fn, s=w.model.spare: f(out, batch) + s.sum().float()
    return w
"""


def _children() -> set[int]:
    """Live processes whose parent is this test process (ranks left behind would show here)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == me and fields[0] != "Z":
                found.add(int(entry))
    return found


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_gpt_tiny_predicted_equals_traced(strategy):
    res = run(RunConfig(model="gpt-tiny", world_size=2, strategy=strategy, timeout_seconds=120))
    d = res.to_dict()
    for r in d["ranks"]:
        assert abs(r["relative_error"]) <= 0.03, r
        # what the collectives moved, counted at every c10d call, equals the model's prediction
        assert r["collectives"] == r["predicted_collectives"], r
        assert r["wait_seconds"] >= 0 and r["step_seconds"] > 0
    for key in ("rank", "predicted_peak_bytes", "traced_peak_bytes", "collective_bytes", "wait_seconds"):
        assert key in d["ranks"][0]
    json.dumps(d)  # plain JSON


def test_cli_run_prints_one_table(cli):
    code, out, err = cli("shard", "--model", "mlp", "--world", "2", "--stage", "3", "--run")
    assert code == 0, err
    for col in ("rank", "predicted", "traced", "collective bytes", "wait"):
        assert col in out


def test_a_rank_that_raises_stops_every_rank(tmp_path):
    f = tmp_path / "factories.py"
    f.write_text(FACTORIES)
    before = _children()
    with pytest.raises(RankError, match=r"rank 1 raised .*RuntimeError: rank one has no data"):
        run(RunConfig(model=f"{f}:raises_on_rank_1", world_size=2, strategy="zero0", timeout_seconds=60))
    assert _children() <= before


@pytest.mark.parametrize("strategy", ["zero0", "zero1"])
def test_ddp_on_a_parameter_without_gradient_says_what_to_change(tmp_path, strategy):
    """DDP's own error asks for a keyword argument no one can pass here (cut off mid-word); FSDP runs it."""
    f = tmp_path / "factories.py"
    f.write_text(FACTORIES)
    with pytest.raises(RankError, match=r"gets none \(unused in forward\).*freeze that parameter.*stage 2 or 3"):
        run(RunConfig(model=f"{f}:with_an_unused_parameter", world_size=2, strategy=strategy, timeout_seconds=120))
    res = run(RunConfig(model=f"{f}:with_an_unused_parameter", world_size=2, strategy="zero3", timeout_seconds=120))
    assert all(r["predicted_peak_bytes"] == r["traced_peak_bytes"] for r in res.to_dict()["ranks"])


def test_a_rank_that_hangs_is_stopped_within_the_timeout(tmp_path):
    f = tmp_path / "factories.py"
    f.write_text(FACTORIES)
    before = _children()
    with pytest.raises(RankError, match=r"rank 1 in building the workload") as info:
        run(RunConfig(model=f"{f}:hangs_on_rank_1", world_size=2, strategy="zero0", timeout_seconds=15))
    assert "did not finish within 15 s" in str(info.value)
    assert _children() <= before
    assert isinstance(info.value, InputError)  # the CLI prints it as one line, exit status 2


def test_an_output_fsdp_cannot_see_into_and_mixed_dtypes_under_zero1_say_why(tmp_path):
    """FSDP hooks backward on the tensors of the model's output: an object of another class hides them, and the
    root's parameters stay sharded in backward (PyTorch: an empty storage); ZeroRedundancyOptimizer needs one
    dtype. Both are refused in terms of the model."""
    from torch import nn

    from trainledger.workload import Workload

    f = tmp_path / "factories.py"
    f.write_text(FACTORIES)
    before = _children()
    with pytest.raises(InputError, match=r"returns an object of class Result, whose tensors it cannot see"):
        run(RunConfig(model=f"{f}:boxed_output", world_size=2, strategy="zero3", timeout_seconds=60))
    assert _children() <= before  # refused before any rank started
    with pytest.raises(RankError, match=r"needs every trainable parameter in one dtype.*float32, float64"):
        run(RunConfig(model=f"{f}:mixed_dtypes", world_size=2, strategy="zero1", timeout_seconds=60))
    tupled = Workload(nn.Linear(3, 2), torch.randn(4, 3), loss_fn=lambda out, _b: out.sum())
    refuse_outputs_fsdp_cannot_see(tupled)  # a tensor output passes


def test_what_fsdp_cannot_shard_is_refused_before_any_rank_starts_and_an_optimizer_it_cannot_step_says_why(
    tmp_path,
):
    """FSDP2 fails in the middle of the step on a parameter two units share (PyTorch: "value was None"), refuses a
    0-dim parameter by its last name, and DTensor cannot run Rprop's indexing on shards: each in the model's terms.
    Stages 0 and 1 run them all."""
    f = tmp_path / "factories.py"
    f.write_text(FACTORIES)
    before = _children()
    with pytest.raises(InputError, match=r"blocks.0.1.weight is shared by blocks.0 and blocks.1 .*stage 0 or 1"):
        run(RunConfig(model=f"{f}:shared_by_two_blocks", world_size=2, strategy="zero3", timeout_seconds=60))
    with pytest.raises(InputError, match=r"0-dim parameter, and this model has 1 \(temperature\)"):
        run(RunConfig(model=f"{f}:scalar_temperature", world_size=2, strategy="zero2", timeout_seconds=60))
    assert _children() <= before  # refused before any rank started
    with pytest.raises(RankError, match=r"runs aten.index_put_.default on them.*Rprop"):
        run(RunConfig(model=f"{f}:rprop", world_size=2, strategy="zero3", timeout_seconds=120))
    res = run(RunConfig(model=f"{f}:shared_by_two_blocks", world_size=2, strategy="zero1", timeout_seconds=120))
    assert all(r["predicted_peak_bytes"] == r["traced_peak_bytes"] for r in res.to_dict()["ranks"])


def test_a_factory_that_asks_for_its_rank_is_run_and_predicted(tmp_path):
    f = tmp_path / "factories.py"
    f.write_text(FACTORIES)
    res = run(RunConfig(model=f"{f}:seeded_by_rank", world_size=2, strategy="zero3", timeout_seconds=120))
    ranks = res.to_dict()["ranks"]
    assert all(r["predicted_peak_bytes"] == r["traced_peak_bytes"] for r in ranks)
    assert not torch.distributed.is_initialized()  # the parent's group of one is gone
