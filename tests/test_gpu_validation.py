"""The GPU validation kit: its dry mode runs every part but the GPU's, and without CUDA it skips in one line."""

from __future__ import annotations

import json

import pytest
import torch
from benchmarks import gpu_validation as kit


def test_without_cuda_it_skips_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kit.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("skipped: no CUDA device") and out.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_unknown_workload_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        kit.main(["--dry", "--only", "llama-7b", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "accepted: llama-1b-bf16" in capsys.readouterr().err


def test_the_gpu_table_compares_predictions_with_the_counters():
    row = {"name": "w", "what": "a step", "analytic_peak": 3 << 30, "cuda_peak": 5 << 29, "cuda_reserved": 3 << 30}
    row.update({"fake_peak": 2 << 30, "fake_reserved": 5 << 29})
    row.update({"traced_peak": 2 << 30, "traced_reserved": 9 << 28, "max_allocated": 4 << 29, "max_reserved": 3 << 30})
    (line,) = [ln for ln in kit.table([row], dry=False).splitlines() if ln.startswith("| w:")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # (a) 2.5 GiB against (c) 2 GiB: +25.0%; the CPU fake trace's 2 GiB: +0.0%; (d) from (a) 3 GiB against
    # 3 GiB reserved: +0.0%, from (b) 2.25 GiB: -25.0%
    assert cells == [
        *("w: a step", "2.500", "3.000", "2.000", "2.000", "2.000", "+25.0%", "+0.0%"),
        *("3.000", "2.250", "3.000", "+0.0%", "-25.0%"),
    ]


def test_a_step_fake_tensors_cannot_take_says_so_in_its_cells():
    row = {"name": "w", "what": "a step", "cuda_error": "the step has data-dependent shapes", "fake_peak": 1 << 20}
    (line,) = [ln for ln in kit.table([row], dry=True).splitlines() if ln.startswith("| w:")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == cells[8] == "the step has data-dependent shapes" and cells[3] == "1.000"


@pytest.mark.parametrize(
    ("torch_name", "card"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB-SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA B200", "H100-80GB-SXM"),  # not in the device table: the card the cuda kind assumes
        (None, "H100-80GB-SXM"),
    ],
)
def test_the_card_the_kit_predicts_for_is_the_one_torch_names(torch_name, card):
    assert kit.card_of(torch_name).name == card


@pytest.mark.slow
def test_one_workload_in_a_fresh_process_as_on_the_gpu():
    """The worker path the full kit takes (a subprocess per workload, JSON back), dry on the CPU."""
    row = kit._in_fresh_process("lora", 300, dry=True)
    assert row["name"] == "lora" and "trace_error" not in row, row
    assert row["dry_traced_peak"] == row["fake_peak"] and row["cuda_peak"] > row["fake_peak"]


@pytest.mark.slow
def test_dry_mode_runs_every_workload_end_to_end(tmp_path, capsys):
    """Every workload is built small, predicted on fake tensors (with CUDA's kernels and with the CPU's) and
    replayed by the allocator model; its step then runs for real on the CPU. The CPU fake trace's peak must be
    the real step's (traced, and measured by the profiler's own allocation events): the prediction path and the
    measured path agree where they can. Both traces leave out what CPU kernels allocate inside an op (not the
    CUDA step's), which measurement sees. The CUDA-kind prediction is checked against the analytic model's cuda
    variant, an independent closed form, where it covers the workload, and carries the H100's cuBLAS workspace."""
    assert kit.main(["--dry", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_validation_dry.json").read_text())
    assert [r["name"] for r in rows] == [c.name for c in kit.CASES]
    assert len(rows) >= 8
    for r in rows:
        assert "fake_error" not in r and "dry_trace_error" not in r, r
        assert r["card"] == "H100-80GB-SXM"
        assert "cuda_error" not in r, r
        assert r["fake_reserved"] >= r["fake_peak"] > 0 and r["cuda_reserved"] >= r["cuda_peak"] > 0
        # the 32 MiB cuBLAS workspace is persistent: the CUDA-kind peak holds it, the CPU's does not
        assert r["cuda_peak"] >= 32 * 2**20 > r["fake_peak"], r["name"]
        if r["name"] == "fsdp2":  # FSDP2's own buffers: the world-1 transform is a prediction, checked on a GPU
            continue
        assert r["dry_traced_peak"] == r["fake_peak"], r["name"]
        assert r["dry_max_allocated"] >= r["fake_peak"], r["name"]
        if r["name"] != "unet":  # oneDNN's convolution and BatchNorm buffers, inside ops: measured, not traced
            assert r["dry_max_allocated"] == pytest.approx(r["fake_peak"], rel=0.02), r["name"]
    with_hf = [r for r in rows if "analytic_peak" in r]
    assert len(with_hf) == 4 and all(r["analytic_reserved"] >= r["analytic_peak"] for r in with_hf)
    for r in with_hf:
        assert r["cuda_peak"] == pytest.approx(r["analytic_peak"], rel=0.01), r["name"]
    text = (tmp_path / "gpu_validation_dry.md").read_text()
    body = [line for line in text.splitlines() if line.startswith("| ") and "workload" not in line]
    assert len(body) == len(rows) and all(line.count("not run") == 8 for line in body)
    out = capsys.readouterr().out
    assert "the GPU columns are not run" in out and "CUDA's kernels as on the H100-80GB-SXM" in out
