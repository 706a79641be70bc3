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
    row = {"name": "w", "what": "a step", "analytic_peak": 3 << 30, "fake_peak": 2 << 30, "fake_reserved": 5 << 29}
    row.update({"traced_peak": 2 << 30, "traced_reserved": 9 << 28, "max_allocated": 4 << 29, "max_reserved": 3 << 30})
    (line,) = [ln for ln in kit.table([row], dry=False).splitlines() if ln.startswith("| w:")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # (a) 2 GiB against (c) 2 GiB: +0.0%; (d) from (b) 2.25 GiB against 3 GiB reserved: -25.0%
    assert cells == ["w: a step", "3.000", "2.000", "2.000", "2.000", "+0.0%", "2.500", "2.250", "3.000", "-25.0%"]


@pytest.mark.slow
def test_one_workload_in_a_fresh_process_as_on_the_gpu():
    """The worker path the full kit takes (a subprocess per workload, JSON back), dry on the CPU."""
    row = kit._in_fresh_process("lora", 300, dry=True)
    assert row["name"] == "lora" and "trace_error" not in row, row
    assert row["dry_traced_peak"] == row["fake_peak"]


@pytest.mark.slow
def test_dry_mode_runs_every_workload_end_to_end(tmp_path, capsys):
    """Every workload is built small, predicted on fake tensors and replayed by the allocator model; its step
    then runs for real on the CPU. The fake trace's peak must be the real step's (traced, and measured by
    the profiler's own allocation events): the prediction path and the measured path agree where they can.
    Both traces leave out what CPU kernels allocate inside an op (not the CUDA step's), which measurement sees."""
    assert kit.main(["--dry", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_validation_dry.json").read_text())
    assert [r["name"] for r in rows] == [c.name for c in kit.CASES]
    assert len(rows) >= 8
    for r in rows:
        assert "fake_error" not in r and "dry_trace_error" not in r, r
        assert r["fake_reserved"] >= r["fake_peak"] > 0
        if r["name"] == "fsdp2":  # FSDP2's own buffers: the world-1 transform is a prediction, checked on a GPU
            continue
        assert r["dry_traced_peak"] == r["fake_peak"], r["name"]
        assert r["dry_max_allocated"] >= r["fake_peak"], r["name"]
        if r["name"] != "unet":  # oneDNN's convolution and BatchNorm buffers, inside ops: measured, not traced
            assert r["dry_max_allocated"] == pytest.approx(r["fake_peak"], rel=0.02), r["name"]
    with_hf = [r for r in rows if "analytic_peak" in r]
    assert len(with_hf) == 4 and all(r["analytic_reserved"] >= r["analytic_peak"] for r in with_hf)
    text = (tmp_path / "gpu_validation_dry.md").read_text()
    body = [line for line in text.splitlines() if line.startswith("| ") and "workload" not in line]
    assert len(body) == len(rows) and all(line.count("not run") == 6 for line in body)
    assert "the GPU columns are not run" in capsys.readouterr().out
