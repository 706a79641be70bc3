"""What tracing costs: per event, against the floor of any Python dispatch mode, and against MemTracker.

Run from the repository root (each model in a fresh process, on one intra-op thread):

    python -m benchmarks.trace_speed                 # all cases; a Markdown table, benchmarks/results/
    python -m benchmarks.trace_speed overhead        # only the real-step overhead
    python -m benchmarks.trace_speed overhead main   # the same, and the same cases on git revision ``main``
    python -m benchmarks.trace_speed fake7b          # only the 7B fake trace

Overhead, per model: CPU time of the process (``time.process_time``, so that other processes on a shared
machine disturb it less than wall time), medians over rounds run in one process (each round times every
variant once, so what load remains falls on all of them alike):

- plain step: ``run_step`` alone;
- no-op mode: the step under a ``TorchDispatchMode`` whose ``__torch_dispatch__`` only calls the op —
  the floor any Python dispatch mode pays, before any bookkeeping;
- traced step: the step inside ``trace()`` (our dispatch mode, saved-tensor hooks, module hooks), timed
  around the ``run_step`` call that ``trace()`` makes under the tracer;
- ``trace()``: the whole call (warm-up step, traced step, ledger, kernel-buffer probes); the first call of
  the process is shown apart, since it also runs the probes, which are cached per process after;
- MemTracker: the step under ``torch.distributed._tools.mem_tracker.MemTracker`` tracking the same model
  and optimizer.

µs per event is the time beyond the plain step divided by the step's events (ops the tracer records);
"above no-op" divides the time beyond the no-op mode instead: the part that is our own bookkeeping.
``trace()`` per event is its time beyond two plain steps (the warm-up and the traced step run the step
twice) per event. With a revision given, the same cases run on that revision's ``src/`` (extracted with
``git archive``) in the same run, alternating with this tree's, and the table shows both.

Fake 7B: a GPT of 32 layers, hidden 4096, 32 heads, vocabulary 32000, sequence 4096, micro-batch 1, bf16
weights, AdamW, built under ``FakeTensorMode`` (nothing allocated). Wall time of the whole call and the
process's peak resident memory (``ru_maxrss``).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

MODELS = {
    "gpt-tiny": "built-in example: 4 blocks, width 64, sequence 64, batch 4",
    "gpt-mid": "gpt_tiny(n_embd=128, seq_len=128, batch_size=8): a step between the two",
    "gpt-small": "gpt_tiny(n_embd=256, n_head=8, seq_len=256, batch_size=8)",
}
ROUNDS = {"gpt-tiny": 9, "gpt-mid": 7, "gpt-small": 5}


def build(name: str):
    from trainledger import examples

    if name == "gpt-mid":
        w = examples.gpt_tiny(n_embd=128, seq_len=128, batch_size=8)
    elif name == "gpt-small":
        w = examples.gpt_tiny(n_layer=4, n_embd=256, n_head=8, seq_len=256, batch_size=8)
    else:
        return examples.build(name)
    w.name = name
    return w


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _time_traced_steps(into: list[float]) -> None:
    """Append the CPU time of every step ``trace()`` runs under its tracer (the one given ``on_phase``)."""
    module = sys.modules["trainledger.trace"]
    run_step = module.run_step

    def timed(workload, **kwargs) -> None:
        t0 = time.process_time()
        run_step(workload, **kwargs)
        if "on_phase" in kwargs:
            into.append(time.process_time() - t0)

    module.run_step = timed


def overhead(name: str) -> dict:
    """Times of one model's step plain, under a no-op mode, traced, the whole ``trace()``, and MemTracker."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import trainledger
    from trainledger.trace import trace
    from trainledger.workload import run_step

    torch.set_num_threads(1)

    class NoOpMode(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:  # as the tracer: no dynamo-disable wrapper per op
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def under_noop() -> None:
        with NoOpMode():
            run_step(w)

    def under_memtracker() -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(w.model, w.get_optimizer())
        with mt:
            run_step(w)

    times: dict[str, list[float]] = {k: [] for k in ("plain", "noop", "traced_step", "trace", "memtracker")}
    _time_traced_steps(times["traced_step"])
    w = build(name)
    run_step(w)
    first = _timed(lambda: trace(w))
    times["traced_step"].clear()
    memtracker_error = None
    for _ in range(ROUNDS.get(name, 5)):
        times["plain"].append(_timed(lambda: run_step(w)))
        times["noop"].append(_timed(under_noop))
        times["trace"].append(_timed(lambda: trace(w)))
        if memtracker_error is None:
            try:
                times["memtracker"].append(_timed(under_memtracker))
            except Exception as exc:  # report, do not hide: MemTracker fails on some models
                memtracker_error = f"fails: {type(exc).__name__}"
    out: dict = {"model": name, "events": trace(w).num_events, "source": _source_label(trainledger.__file__)}
    out.update({f"{k}_s": statistics.median(v) for k, v in times.items() if v})
    out["trace_first_s"] = first
    if memtracker_error is not None:
        out["memtracker_s"] = memtracker_error
    return out


def _run(args: list[str], src: str | None = None) -> dict:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "benchmarks.trace_speed", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _extract_src(revision: str, into: str) -> str:
    """``src/`` of a git revision, unpacked under ``into``; returns the folder to put on ``sys.path``."""
    archive = subprocess.run(["git", "archive", "--format=tar", revision, "src"], capture_output=True, check=True)
    path = Path(into) / "archive.tar"
    path.write_bytes(archive.stdout)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return str(Path(into) / "src")


def _source_label(module_file: str) -> str:
    """Which code ran, without a path of the machine: this checkout's, or a revision's extracted copy."""
    here = Path(__file__).resolve().parent.parent
    return "this checkout" if Path(module_file).resolve().is_relative_to(here) else "an extracted revision"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _overhead_row(r: dict, label: str) -> str:
    if "error" in r:
        return f"| {label} | error: {r['error']} |" + " |" * 11
    plain, n = r["plain_s"], r["events"]
    mt = r.get("memtracker_s")
    mt_ms, mt_ratio = (_ms(mt), f"{mt / plain:.2f}×") if isinstance(mt, float) else (str(mt), "")
    return (
        f"| {label} | {n:,} | {_ms(plain)} | {_ms(r['noop_s'])} ({r['noop_s'] / plain:.2f}×) | "
        f"{_ms(r['traced_step_s'])} | {r['traced_step_s'] / plain:.2f}× | "
        f"{(r['traced_step_s'] - plain) / n * 1e6:.1f} | {(r['traced_step_s'] - r['noop_s']) / n * 1e6:.1f} | "
        f"{_ms(r['trace_s'])} | {(r['trace_s'] - 2 * plain) / n * 1e6:.1f} | {_ms(r['trace_first_s'])} | "
        f"{mt_ms} | {mt_ratio} |"
    )


def overhead_table(against: str | None = None) -> list[str]:
    rows: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        src = _extract_src(against, tmp) if against else None
        for m in MODELS:
            if src is not None:
                rows.append((f"{m} ({against})", _run(["_overhead", m], src)))
            rows.append((m, _run(["_overhead", m])))
    (RESULTS / "trace_overhead.json").write_text(json.dumps([r for _, r in rows], indent=2) + "\n")
    lines = [
        "| model | events | plain step (ms) | no-op mode (ms) | traced step (ms) | ratio | µs/event | "
        "µs/event above no-op | trace() (ms) | trace() µs/event beyond 2 plain steps | first trace() (ms) | "
        "MemTracker step (ms) | MemTracker ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_overhead_row(r, label) for label, r in rows]
    lines += [
        "",
        "Times are CPU time of the process (ms), medians over rounds; one intra-op thread.",
        "",
        *(f"- {m}: {what}" for m, what in MODELS.items()),
    ]
    return lines


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


def fake7b_table() -> list[str]:
    rows = [_run(["_fake7b", m]) for m in ("plain", "trainledger", "memtracker")]
    (RESULTS / "trace_fake7b.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "| 7B GPT, fake tensors | wall time (s) | peak resident memory (GB) | peak found |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| ? | error: {r['error']} | | |")
            continue
        peak = f"{r['peak_bytes'] / 2**30:.1f} GiB" if "peak_bytes" in r else "—"
        lines.append(f"| {r['case']} | {r['seconds']:.1f} | {r['max_rss_bytes'] / 1e9:.2f} | {peak} |")
    return lines


def main(which: str = "all", against: str | None = None) -> None:
    RESULTS.mkdir(exist_ok=True)
    lines: list[str] = []
    if which in ("all", "overhead"):
        lines += overhead_table(against)
    if which in ("all", "fake7b"):
        lines += ["", *fake7b_table()] if lines else fake7b_table()
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
        main(args[0] if args else "all", args[1] if len(args) > 1 else None)
