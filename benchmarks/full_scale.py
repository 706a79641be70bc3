"""Full-scale fake traces of Hugging Face architectures: time and memory of the whole command, and the
analytic model beside the traced peak.

Each measurement runs in a fresh process (imports, building the model under ``FakeTensorMode``, the
warm-up and traced steps, all included), timed by the wall clock and measured by the child's peak
resident memory (``getrusage(RUSAGE_CHILDREN).ru_maxrss``). For scale, the plain step on fake tensors
(no tracer) of the same model is timed too.

Run from the repository root:

    python -m benchmarks.full_scale                              # Llama-2-7B, bf16 + fp32 master, AdamW, 1 × 4096
    python -m benchmarks.full_scale --configs llama-2-7b llama-3-8b gpt2 --seq-lens 1024 4096

It prints a Markdown table and writes it to ``benchmarks/results/full_scale.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures" / "hf"
RESULTS = Path(__file__).parent / "results"

CHILD = r"""
import json, sys, time
start = time.perf_counter()
from trainledger.hf import workload_from_hf_config
from trainledger.trace import trace
from trainledger.workload import run_step
cfg, mb, seq, recipe, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
w = workload_from_hf_config(cfg, micro_batch=mb, seq_len=seq, recipe=recipe, fake=True)
built = time.perf_counter()
out = {"build_s": built - start}
if mode == "plain":
    mode_ = next(w.model.parameters()).fake_mode
    with mode_:
        run_step(w)  # warm-up: optimizer state appears
        t = time.perf_counter()
        run_step(w)
        out["plain_step_s"] = time.perf_counter() - t
else:
    led = trace(w, fake=True)
    pk = led.peak()
    out.update(peak_bytes=pk.bytes, phase=pk.phase, by_category=pk.by_category, num_params=led.num_params(),
               num_events=led.num_events, traced_step_s=led.meta.get("traced_step_seconds"))
out["total_s"] = time.perf_counter() - start
print(json.dumps(out))
"""


def child(config: Path, mb: int, seq: int, recipe: str, mode: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(config), str(mb), str(seq), recipe, mode],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{config.name} failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out["wall_s"] = wall
    out["max_rss_bytes"] = max(after, before) * 1024  # Linux reports KiB; the largest child so far
    return out


def analytic(config: Path, mb: int, seq: int, recipe: str) -> tuple[int, int]:
    from trainledger.analytic import Setup, estimate

    r = estimate(config, Setup(micro_batch=mb, seq_len=seq, recipe=recipe, device="cpu"))  # type: ignore[arg-type]
    return r.ledger.peak().bytes, r.num_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["llama-2-7b"])
    ap.add_argument("--micro-batches", nargs="+", type=int, default=[1])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[4096])
    ap.add_argument("--recipe", default="bf16-master")
    ap.add_argument("--out", default="full_scale.md")
    args = ap.parse_args()
    rows = [
        "| config | micro-batch × seq | recipe | whole command s (build s) | max RSS | plain fake step s "
        "| traced peak | analytic peak | analytic − traced | peak phase | params (= transformers) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name in args.configs:
        config = FIXTURES / f"{name}.json"
        for mb in args.micro_batches:
            for seq in args.seq_lens:
                if name == "gpt2" and seq > 1024:
                    cfg = json.loads(config.read_text())
                    cfg["n_positions"] = seq  # GPT-2 has 1024 learned positions; raised to run longer sequences
                    config = Path(tempfile.mkdtemp()) / "config.json"
                    config.write_text(json.dumps(cfg))
                traced = child(config, mb, seq, args.recipe, "trace")
                plain = child(config, mb, seq, args.recipe, "plain")
                peak, params = analytic(config, mb, seq, args.recipe)
                err = (peak - traced["peak_bytes"]) / traced["peak_bytes"]
                rows.append(
                    f"| {name} | {mb} × {seq} | {args.recipe} | {traced['wall_s']:.1f} ({traced['build_s']:.1f}) "
                    f"| {traced['max_rss_bytes'] / 2**30:.2f} GiB | {plain['plain_step_s']:.1f} "
                    f"| {traced['peak_bytes'] / 2**30:.2f} GiB | {peak / 2**30:.2f} GiB | {100 * err:+.3f}% "
                    f"| {traced['phase']} | {params:,} ({'yes' if params == traced['num_params'] else 'NO'}) |"
                )
                print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
