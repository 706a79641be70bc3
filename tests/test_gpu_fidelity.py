"""A device by name and the caching allocator's model in the commands: verdicts worked by hand, fit on reserved
memory against fit on allocated memory, and the memory_viz export read by PyTorch's own tools."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

from trainledger.allocator import AllocatorConfig, ReservedPrediction, predict_reserved
from trainledger.analytic import FitOptions, Setup, fit
from trainledger.devices import cublas_workspace_bytes, lookup
from trainledger.ledger import Category, Entry, Event, Ledger

MiB = 1 << 20
HF = Path(__file__).parent / "fixtures" / "hf"


def _act(name: str, mib: int, born: int) -> Entry:
    return Entry(name, Category.ACTIVATIONS, "saved", "float32", 1, mib * MiB, alloc_event=born, free_event=3)


# Worked by hand from CUDACachingAllocator.cpp (get_free_block before cudaMalloc; get_allocation_size gives a
# request under 10 MiB a 20 MiB segment; a large block is split when more than 1 MiB would remain):
#   a (6 MiB): nothing cached, new 20 MiB segment 1 -> a, 14 free
#   b (12):    best fit is segment 1's 14 MiB block -> split: a, b, 2 free
#   c (6):     only 2 MiB cached -> new 20 MiB segment 2 -> c, 14 free
#   d (12):    segment 2's 14 MiB block -> c, d, 2 free
#   e (3):     only 2 MiB blocks cached -> new 20 MiB segment 3 -> e, 17 free
# Peak: 39 MiB allocated, 60 MiB reserved, 21 MiB cached, the largest free block 17 MiB, 3 segments. Under a
# 50 MiB limit, e's segment cannot be had and no cached segment is whole (each is split), so nothing can be
# released: out of memory although the 39 MiB allocated would fit.
LEDGER = Ledger(
    (_act("a", 6, 0), _act("b", 12, 0), _act("c", 6, 1), _act("d", 12, 1), _act("e", 3, 2)),
    tuple(Event(i, "forward") for i in range(3)),
)


def test_the_three_verdicts_at_three_capacities():
    allocated = (6 + 12 + 6 + 12 + 3) * MiB  # every request is a multiple of 512 bytes: no rounding
    roomy = predict_reserved(LEDGER, kernel_kind="cpu", capacity_bytes=64 * MiB)
    assert (roomy.max_allocated_bytes, roomy.max_reserved_bytes) == (allocated, 60 * MiB)
    assert roomy.verdict == "fits" and roomy.fits is True and roomy.reserved_under_limit_bytes == 60 * MiB
    # at the peak: 60 MiB reserved, 39 allocated, so 21 MiB cached in the segments' remainders
    assert roomy.fragmentation_bytes == 21 * MiB and roomy.num_segments == 3
    assert roomy.largest_free_block_bytes == 17 * MiB
    assert roomy.fragmentation_share == pytest.approx(21 / 60)
    tight = predict_reserved(LEDGER, kernel_kind="cpu", capacity_bytes=50 * MiB)
    assert tight.verdict == "oom-although-allocated-fits" and tight.fits is False  # 39 MiB would fit in 50
    assert (tight.oom_entry, tight.oom_event, tight.reserved_under_limit_bytes) == ("e", 2, None)
    small = predict_reserved(LEDGER, kernel_kind="cpu", capacity_bytes=30 * MiB)
    assert small.verdict == "oom"  # 39 MiB allocated does not fit 30 MiB whatever the allocator does
    assert predict_reserved(LEDGER, kernel_kind="cpu").verdict == "no-limit"


def test_expandable_segments_leave_less_behind():
    default = predict_reserved(LEDGER, kernel_kind="cpu")
    expandable = predict_reserved(LEDGER, kernel_kind="cpu", config=AllocatorConfig(expandable_segments=True))
    assert expandable.max_reserved_bytes == 40 * MiB < default.max_reserved_bytes  # two 20 MiB pages


def test_prediction_round_trips_through_json():
    p = predict_reserved(LEDGER, kernel_kind="cuda", capacity_bytes=50 * MiB)
    again = ReservedPrediction.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p


def test_fit_on_reserved_is_stricter_than_on_allocated():
    """Reserved bytes are never below allocated ones: what fits on reserved memory fits on allocated memory,
    and every configuration that fits reports reserved bytes within the device and at least its peak."""
    l4 = lookup("l4")
    base = Setup(seq_len=512)
    kw = dict(device_memory=l4.usable_bytes, micro_batches=(1, 2, 4, 8), stages=("zero0",), recipes=("bf16",))
    on_alloc = fit(HF / "llama-small.json", FitOptions(**kw), base)
    on_reserved = fit(HF / "llama-small.json", FitOptions(**kw, budget_on="reserved"), base)
    key = lambda c: (c.micro_batch, c.stage, c.remat, c.recipe)  # noqa: E731
    assert on_reserved.fitting, "nothing fits: the check below would be empty"
    assert {key(c) for c in on_reserved.fitting} <= {key(c) for c in on_alloc.fitting}
    for c in on_reserved.fitting:
        assert c.peak_bytes <= c.reserved_bytes <= l4.usable_bytes
    assert all(c.reserved_bytes is None for c in on_alloc.fitting)


def test_unknown_device_is_one_line_with_close_names(cli):
    code, out, err = cli("estimate", "--hf-config", str(HF / "llama-small.json"), "--device", "h100-81gb")
    assert code == 2 and not out and err.count("\n") == 1
    assert "unknown device 'h100-81gb'" in err and "close names: h100-80gb" in err


def test_fit_takes_a_device_or_a_memory_size_not_both(cli):
    code, _, err = cli("fit", "--hf-config", str(HF / "llama-small.json"), "--device", "l4", "--device-memory", "8GB")
    assert code == 2 and "not both" in err
    code, _, err = cli("fit", "--hf-config", str(HF / "llama-small.json"))
    assert code == 2 and "--device NAME" in err


def test_estimate_with_a_device_adds_keys_and_changes_none(cli_json, cli):
    args = ("estimate", "--hf-config", str(HF / "llama-small.json"), "--seq-len", "512")
    plain = cli_json(*args)
    on_h100 = cli_json(*args, "--device", "h100")  # the card the cuda kind assumes without one: the same step
    for out in (plain, on_h100):
        for setup in (out["setup"], out["meta"]["setup"]):
            setup.pop("gpu")
    assert set(plain) <= set(on_h100) and {k: on_h100[k] for k in plain} == plain
    on_l4 = cli_json(*args, "--device", "l4")
    workspace = cublas_workspace_bytes(lookup("h100")) - cublas_workspace_bytes(lookup("l4"))
    assert plain["peak"]["bytes"] - on_l4["peak"]["bytes"] == workspace  # sm89's cuBLAS workspace: 8.1 MiB
    pred = on_l4["allocator"]
    assert pred["evidence"] == "analytic" and pred["kernel_kind"] == "cuda" == on_l4["kernel_kind"]
    assert pred["capacity_bytes"] == lookup("l4").usable_bytes and pred["verdict"] == "fits"
    assert pred["max_reserved_bytes"] >= pred["max_allocated_bytes"] >= on_l4["peak"]["bytes"]
    code, out, _ = cli(*args, "--device", "l4")
    first = out.splitlines()[:2]
    assert first[0].startswith("kernels: cuda") and first[1].startswith("device L4: usable")
    assert "predicted max reserved" in out and "on L4's usable" in out


def test_estimate_says_its_default_kernel_kind_first(cli):
    code, out, _ = cli("estimate", "--hf-config", str(HF / "llama-small.json"), "--seq-len", "512")
    assert code == 0 and out.splitlines()[0].startswith(
        "kernels: cuda as on H100-80GB-SXM (--device-kind: cuda by default"
    )
    assert re.search(r"^peak [\d,]+ bytes .*evidence analytic \(cuda kernels\)", out, re.M)


def test_trace_with_a_device_exports_the_predicted_segments(cli, tmp_path):
    """The memory_viz pickle holds the model's segments at the peak, and PyTorch's own tool reads them."""
    from torch.cuda import _memory_viz

    snap = tmp_path / "snap.pickle"
    code, out, err = cli("trace", "--model", "mlp", "--device", "a100-40gb", "--export-memory-viz", str(snap), "--json")
    assert code == 0, err
    d = json.loads(out)
    pred = d["allocator"]
    assert d["kernel_kind"] == "cpu" == pred["kernel_kind"]
    data = pickle.loads(snap.read_bytes())
    segments = data["segments"]
    assert len(segments) == pred["num_segments"]
    reserved = sum(s["total_size"] for s in segments)
    allocated = sum(s["allocated_size"] for s in segments)
    assert reserved - allocated == pred["fragmentation_at_peak_bytes"]
    for s in segments:  # blocks tile each segment
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
    summary = _memory_viz.segsum(data)
    assert f"segments: {len(segments)}" in summary
    assert "<html" in _memory_viz.trace_plot(data) and "<html" in _memory_viz.segment_plot(data)


def test_a_7b_step_replays_in_under_two_seconds():
    """The analytic ledger of a Llama-2-7B step (2,856 arrays, 524 events) through the allocator model."""
    import time

    from trainledger.analytic import estimate

    led = estimate(HF / "llama-2-7b.json", Setup(seq_len=2048)).ledger
    start = time.process_time()  # CPU time: the replay's own cost, not what other processes take of the cores
    pred = predict_reserved(led, kernel_kind="cuda", capacity_bytes=lookup("h200").usable_bytes)
    elapsed = time.process_time() - start
    assert len(led.entries) > 2000 and elapsed < 2.0, elapsed
    assert pred.verdict == "oom" and pred.max_allocated_bytes > lookup("h200").usable_bytes  # 161.7 GB > 143 GiB


def test_a_device_and_cpu_kernels_contradict(cli):
    code, _, err = cli(
        "estimate", "--hf-config", str(HF / "llama-small.json"), "--device", "h100", "--device-kind", "cpu"
    )
    assert code == 2 and "--device H100-80GB-SXM runs cuda kernels" in err and err.count("\n") == 1
