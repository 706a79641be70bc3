"""`trainledger shard` without --run: the declared path reproduces the ZeRO paper; bad input is one line."""

from __future__ import annotations

import pytest

PAPER = ["shard", "--params", "7.5e9", "--weights", "fp16", "--master", "fp32", "--grads", "fp16", "--world", "64"]


def test_paper_table_all_stages(cli_json):
    d = cli_json(*PAPER, "--stage", "all")
    for key in ("schema", "evidence", "device", "peak", "category_maxima", "sum_of_category_maxima"):
        assert key in d
    got = [round(s["model_state_bytes_per_rank"] / 1e9, 1) for s in d["stages"]]
    assert got == [120.0, 31.4, 16.6, 1.9]
    # each number names what it leaves out
    assert all(s["excluded"] for s in d["stages"])
    assert any("gathered" in x for x in d["stages"][3]["excluded"])


def test_single_stage_json_and_link_time(cli_json):
    d = cli_json(*PAPER, "--stage", "3", "--link-gbps", "100")
    assert d["evidence"] == "declared"
    assert d["ranks"][0]["model_state_bytes"] == 1_875_000_000
    # stage 3 moves 3Ψ fp16 elements per rank: 3 · 2 · 7.5e9 · 63/64 bytes
    assert sum(d["collective_wire_bytes"].values()) == round(3 * 2 * 7.5e9 * 63 / 64)
    assert d["stages"][0]["comm_seconds"] == pytest.approx(3 * 2 * 7.5e9 * 63 / 64 / (100e9 / 8))


def test_human_table(cli):
    code, out, err = cli(*PAPER, "--stage", "all")
    assert code == 0, err
    assert "120.00 GB" in out and "31.41 GB" in out and "16.64 GB" in out and "1.88 GB" in out
    assert "excludes" in out


@pytest.mark.slow  # traces a real model
def test_traced_model_prediction(cli_json):
    d = cli_json("shard", "--model", "mlp", "--world", "2", "--stage", "1")
    assert d["evidence"] == "traced"
    assert len(d["ranks"]) == 2 and d["shard"]["engine"] == "torch"
    assert {c["kind"] for c in d["collectives"]} == {"all_reduce", "broadcast"}


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["shard", "--params", "1e9", "--world", "0"], "--world: 0 must be at least 1"),
        (["shard", "--params", "1e9", "--world", "two"], "--world: 'two' is not a whole number"),
        (["shard", "--params", "1e9", "--stage", "5"], "unknown stage '5'"),
        (
            ["shard", "--params", "1e9", "--stage", "hybrid_shard", "--world", "6", "--nodes", "4"],
            "4 nodes do not divide the world of 6 ranks",
        ),
        (["shard", "--params", "1e9", "--link-gbps", "0"], "--link-gbps: '0' is not a number above 0"),
        (["shard", "--params", "1e9", "--prefetch", "-1"], "--prefetch: -1 must be at least 0"),
        (["shard", "--params", "1e9", "--weights", "fp12"], "unknown dtype 'fp12'"),
        (["shard"], "give --model"),
        (["shard", "--params", "1e9", "--model", "mlp"], "not both"),
        (["shard", "--params", "1e9", "--run"], "--run needs a model to run"),
        (["shard", "--model", "mlp", "--run", "--world", "100000"], "more ranks than this machine can run"),
        (["shard", "--model", "mlp", "--run", "--stage", "all"], "not 'all'"),
        (["shard", "--model", "mlp", "--run", "--stage", "full_shard"], "a real run supports stages 0, 1, 2, 3"),
        (["shard", "--model", "nope", "--run"], "unknown model 'nope'"),
        (["shard", "--model", "mlp", "--run", "--timeout", "0"], "--timeout: '0' is not a number above 0"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _most_live(ledger, role: str) -> int:
    """The most bytes of ``role`` live at one event of ``ledger``."""
    entries = ledger.select(role=role)
    return max(sum(e.nbytes for e in entries if e.live_at(ev)) for ev in range(ledger.num_events))


@pytest.mark.slow  # traces a model twice
def test_traced_model_with_cuda_kernels_sharded(cli_json):
    """``--device-kind cuda``: the ledger sharded is the CUDA-kind trace. On one rank DDP adds only its
    gradient buckets, so the peak is ``trace --device-kind cuda``'s plus them, to the byte. On two ranks under
    ZeRO-3 CUDA's foreach AdamW takes the square root of every second moment the rank holds at once
    (``_foreach_sqrt``), where the CPU's for-loop holds one parameter's; the cuBLAS workspace, one per stream,
    is not divided."""
    from trainledger.shard import ShardConfig, shard
    from trainledger.shard.launch import reference_step

    one = cli_json("shard", "--model", "gpt-tiny", "--world", "1", "--stage", "0", "--device-kind", "cuda")
    traced = cli_json("trace", "--model", "gpt-tiny", "--device-kind", "cuda")
    # one rank of DDP holds the trace plus its gradient buckets, a copy of every gradient for the whole step
    assert one["device"] == "cuda" and one["peak"]["event"] == traced["peak"]["event"]
    buckets = one["peak"]["by_category"].pop("communication")
    assert (
        buckets == traced["peak"]["by_category"]["weights"]
        and one["peak"]["by_category"] == traced["peak"]["by_category"]
    )
    assert one["peak"]["bytes"] == traced["peak"]["bytes"] + buckets
    two = cli_json("shard", "--model", "gpt-tiny", "--world", "2", "--stage", "3", "--device-kind", "cuda")
    assert two["device"] == "cuda" and two["peak"]["by_category"]["workspace"] >= 32 * 2**20

    config = ShardConfig(world_size=2, strategy="zero3", engine="torch")
    ranks = {k: shard(reference_step("gpt-tiny", kernel_kind=k).ledger, config).ranks[0] for k in ("cuda", "cpu")}
    assert ranks["cuda"].peak().bytes == two["peak"]["bytes"]
    moments = sum(e.nbytes for e in ranks["cuda"].select(role="exp_avg_sq"))
    assert moments == sum(e.nbytes for e in ranks["cpu"].select(role="exp_avg_sq")) > 0
    assert _most_live(ranks["cuda"], "optimizer_temporary") >= moments  # the group's sqrt, all at once
    largest = max(e.nbytes for e in ranks["cpu"].select(role="exp_avg_sq"))
    # the for-loop: the square root and the denominator of one parameter at a time (and a few scalars)
    assert 2 * largest <= _most_live(ranks["cpu"], "optimizer_temporary") < 2 * largest + 1024 < moments
    (workspace,) = ranks["cuda"].select(role="cublas_workspace")
    assert workspace.nbytes == 4096 * 1024 * 8  # getChosenWorkspaceSize() on sm90 (CublasHandlePool.cpp)
    assert not ranks["cpu"].select(role="cublas_workspace")


def test_device_kind_is_refused_with_run_and_without_a_traced_model(cli):
    for argv, fragment in (
        (["--model", "mlp", "--run", "--device-kind", "cuda"], "--device-kind cuda shapes a trace on fake tensors"),
        (["--params", "1e9", "--device-kind", "cuda"], "applies to a traced --model"),
    ):
        code, _, err = cli("shard", *argv)
        assert code == 2 and fragment in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_cpu_prediction_traces_the_step_on_each_rank_s_threads():
    """What a convolution allocates inside the op follows the intra-op thread count, and each CPU rank runs on
    its share of the cores: the step a prediction shards is traced on that share (``rank_threads``), so its
    kernel buffers are the ranks' (``tests/test_shard_accuracy.py`` runs it), and the count is put back."""
    from pathlib import Path

    import torch

    from trainledger.shard.launch import rank_threads, reference_step
    from trainledger.sources import load_workload
    from trainledger.trace import trace
    from trainledger.workload import intra_op_threads

    model = f"{Path(__file__).parent / 'fixtures' / 'shard_models.py'}:conv_unet"
    before = torch.get_num_threads()
    ref = reference_step(model, world_size=2)
    assert torch.get_num_threads() == before
    with intra_op_threads(rank_threads(2)):
        alone = trace(load_workload(model))
    assert ref.ledger.peak().bytes == alone.peak().bytes
    assert [e.nbytes for e in ref.ledger.select(role="kernel_internal")] == [
        e.nbytes for e in alone.select(role="kernel_internal")
    ]
    assert any(f"on {rank_threads(2)} intra-op threads" in note for note in ref.ledger.notes)


PARAMETER_LIST = """
import torch
from torch import nn
from trainledger.workload import Workload


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(16, 16)) for _ in range(3)])

    def forward(self, x):
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x.square().mean()


def make():
    torch.manual_seed(0)
    return Workload(Chain(), torch.randn(8, 16))
"""


@pytest.mark.parametrize("stage", ["0", "3"])
def test_a_parameter_list_is_parameters_not_units(cli_json, tmp_path, stage):
    """``weights.0`` of an ``nn.ParameterList`` is a parameter: the root holds them (it was taken for a unit and
    looked up as a module: a traceback)."""
    f = tmp_path / "chain.py"
    f.write_text(PARAMETER_LIST)
    d = cli_json("shard", "--model", f"{f}:make", "--world", "2", "--stage", stage)
    weights = 3 * 16 * 16 * 4
    # ZeRO-3: each rank keeps half of every row, and at the peak the root's parameters gathered whole
    expected = weights if stage == "0" else weights // 2 + weights
    assert d["peak"]["by_category"]["weights"] == expected
