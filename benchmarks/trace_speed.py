"""Tracing overhead vs the plain step, and a fake trace of a 7B-parameter GPT step.

Run from the repository root (each case in a fresh process, so peak memory is its own):

    python -m benchmarks.trace_speed              # all cases; a Markdown table, benchmarks/results/
    python -m benchmarks.trace_speed overhead     # only the real-step overhead
    python -m benchmarks.trace_speed fake7b       # only the 7B fake trace

Overhead: median over repeated runs, in one process, of the plain step, of the step under our tracer, and
of the step under PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``). Ratios are the
numbers to read; absolute times on a shared 2-core machine are noisy.

Fake 7B: a GPT of 32 layers, hidden 4096, 32 heads, vocabulary 32000, sequence 4096, micro-batch 1, bf16
weights, AdamW, built under ``FakeTensorMode`` (nothing allocated). Wall time of the whole call and the
process's peak resident memory (``ru_maxrss``).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overhead(name: str, repeats: int = 7) -> dict:
    import torch

    from trainledger import examples
    from trainledger.trace import trace
    from trainledger.workload import run_step

    w = examples.build(name) if name in examples.EXAMPLES else _gpt_small()
    run_step(w)
    plain = _median_time(lambda: run_step(w), repeats)
    traced = statistics.median(trace(w).meta["traced_step_seconds"] for _ in range(repeats))
    memtracker = None
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        def with_memtracker() -> None:
            mt = MemTracker()
            mt.track_external(w.model, w.get_optimizer())
            with mt:
                run_step(w)

        with_memtracker()
        memtracker = _median_time(with_memtracker, repeats)
    except Exception as exc:  # report, do not hide: MemTracker fails on some models
        memtracker = f"fails: {type(exc).__name__}"
    del torch
    return {"model": name, "plain_s": plain, "traced_s": traced, "memtracker_s": memtracker}


def _gpt_small():
    from trainledger.examples import gpt_tiny

    w = gpt_tiny(n_layer=4, n_embd=256, n_head=8, seq_len=256, batch_size=8)
    w.name = "gpt-small"
    return w


def fake7b(mode: str) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainledger.examples import GPT
    from trainledger.workload import Workload, run_step

    t0 = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        torch.set_default_dtype(torch.bfloat16)
        model = GPT(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, dropout=0.0)
        torch.set_default_dtype(torch.float32)
        idx = torch.randint(0, 32000, (1, 4096))
        tgt = torch.randint(0, 32000, (1, 4096))
    num_params = sum(p.numel() for p in model.parameters())
    w = Workload(model, (idx, tgt), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), name="gpt-7b")
    out: dict = {"case": mode, "num_params": num_params}
    if mode == "trainledger":
        from trainledger.trace import trace

        led = trace(w, fake=True)
        out["peak_bytes"] = led.peak().bytes
        out["num_events"] = led.num_events
    elif mode == "plain":
        with fake_mode:
            run_step(w)
            run_step(w)
    elif mode == "memtracker":
        from torch.distributed._tools.mem_tracker import MemTracker

        with fake_mode:
            run_step(w)
            mt = MemTracker()
            mt.track_external(model, w.get_optimizer())
            with mt:
                run_step(w)
            out["peak_bytes"] = sum(mt.get_tracker_snapshot("peak")[torch.device("cpu")].values()) // 2
    out["seconds"] = time.perf_counter() - t0
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _run(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.trace_speed", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(which: str = "all") -> None:
    RESULTS.mkdir(exist_ok=True)
    lines = []
    if which in ("all", "overhead"):
        rows = [_run(["_overhead", m]) for m in ("gpt-tiny", "gpt-small", "cnn", "mlp")]
        lines += [
            "| model | plain step (ms, median) | traced step (ms, median) | ratio | MemTracker step (ms) | MemTracker ratio |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if "error" in r:
                lines.append(f"| ? | error: {r['error']} | | | | |")
                continue
            mt = r["memtracker_s"]
            mt_ms, mt_ratio = (f"{mt * 1e3:.1f}", f"{mt / r['plain_s']:.2f}×") if isinstance(mt, float) else (mt, "")
            lines.append(
                f"| {r['model']} | {r['plain_s'] * 1e3:.1f} | {r['traced_s'] * 1e3:.1f} | "
                f"{r['traced_s'] / r['plain_s']:.2f}× | {mt_ms} | {mt_ratio} |"
            )
        (RESULTS / "trace_overhead.json").write_text(json.dumps(rows, indent=2))
    if which in ("all", "fake7b"):
        rows = [_run(["_fake7b", m]) for m in ("plain", "trainledger", "memtracker")]
        lines += [
            "",
            "| 7B GPT, fake tensors | wall time (s) | peak resident memory (GB) | peak found |",
            "|---|---:|---:|---:|",
        ]
        for r in rows:
            if "error" in r:
                lines.append(f"| ? | error: {r['error']} | | |")
                continue
            peak = f"{r['peak_bytes'] / 2**30:.1f} GiB" if "peak_bytes" in r else "—"
            lines.append(f"| {r['case']} | {r['seconds']:.1f} | {r['max_rss_bytes'] / 1e9:.2f} | {peak} |")
        (RESULTS / "trace_fake7b.json").write_text(json.dumps(rows, indent=2))
    table = "\n".join(lines)
    (RESULTS / f"trace_speed_{which}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "_overhead":
        print(json.dumps(overhead(args[1])))
    elif args and args[0] == "_fake7b":
        print(json.dumps(fake7b(args[1])))
    else:
        main(args[0] if args else "all")
