"""Very deep models traced a few blocks deep and extended, against the full fake trace: the whole command.

Run from the repository root:

    python -m benchmarks.stack_speed            # both configs; a Markdown table, benchmarks/results/
    python -m benchmarks.stack_speed 405b       # one of them

Each case is the whole CLI command a user runs, in a fresh process,

    trainledger trace --hf-config tests/fixtures/hf/CONFIG.json --fake --micro-batch 1 --seq-len 8192 --json

extended (the default: 3 and 4 layers traced, the ledger extended to the config's layer count) or with
``--full-depth`` (every layer traced), the full trace only where it finishes within ``FULL_TIMEOUT_S``.
Wall time includes starting Python and importing torch and transformers; peak resident memory is the
child's ``ru_maxrss``. Both write the same JSON; the peak (bytes, event, breakdown) and the number of
events must be equal. The machine is shared: its load average is recorded beside the times.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
CASES = {"70b": "llama-3.1-70b", "405b": "llama-3.1-405b"}
FULL_TIMEOUT_S = 600


def one(config: str, mode: str, timeout_s: float) -> dict:
    """Run the command once in a child process: its wall time, peak resident memory and JSON."""
    cmd = [sys.executable, "-m", "trainledger.cli", "trace", "--hf-config", str(CONFIGS / f"{config}.json")]
    cmd += ["--fake", "--micro-batch", "1", "--seq-len", "8192", "--json"]
    cmd += ["--full-depth"] if mode == "full" else []
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"config": config, "mode": mode, "error": f"over {timeout_s:.0f} s", "load": load}
    seconds = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        return {"config": config, "mode": mode, "error": proc.stderr.strip().splitlines()[-1], "load": load}
    out = json.loads(proc.stdout)
    return {
        "config": config,
        "mode": mode,
        "seconds": seconds,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,
        "load": load,
        "peak": out["peak"],
        "num_events": out["num_events"],
        "blocks": out["meta"].get("blocks"),
        "evidence": out["evidence"],
    }


def _run(config: str, mode: str) -> dict:
    """One case in a process of its own, so that the peak resident memory is that command's alone."""
    args = [sys.executable, "-m", "benchmarks.stack_speed", "_one", config, mode]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"config": config, "mode": mode, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(r: dict) -> str:
    if "error" in r:
        return f"| {r['config']} | {r['mode']} | {r['error']} | | | | | | {r.get('load', 0):.1f} |"
    blocks = r["blocks"] or {}
    how = f"{blocks['traced'][0]} of {blocks['total']} extended" if blocks.get("extended") else "all"
    return (
        f"| {r['config']} | {r['mode']} ({how}) | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | "
        f"{r['max_rss_bytes'] / 1e9:.2f} | "
        f"{r['peak']['bytes']:,} | {r['peak']['event']:,} | {r['num_events']:,} | {r['load']:.1f} |"
    )


def _agreement(rows: list[dict]) -> list[str]:
    lines = []
    for config in dict.fromkeys(r["config"] for r in rows):
        done = {r["mode"]: r for r in rows if r["config"] == config and "error" not in r}
        if {"extended", "full"} <= done.keys():
            e, f = done["extended"], done["full"]
            same = e["peak"] == f["peak"] and e["num_events"] == f["num_events"]
            lines.append(f"- {config}: peak (bytes, event, breakdown) and events equal: {'yes' if same else 'NO'}")
        else:
            lines.append(f"- {config}: no full trace to compare with")
    return lines


def main(which: str = "all") -> None:
    RESULTS.mkdir(exist_ok=True)
    configs = list(CASES.values()) if which == "all" else [CASES[which]]
    rows = [_run(c, mode) for c in configs for mode in ("extended", "full")]
    lines = [
        "`trainledger trace --hf-config CONFIG --fake --micro-batch 1 --seq-len 8192 --json`, whole command in a "
        f"fresh process (full depth: `--full-depth`, given up after {FULL_TIMEOUT_S} s); GB = 10^9 bytes; "
        "CPU time: user + system of the command's process; load: the machine's 1-minute load average when the "
        "command started (2 cores, shared: wall time grows with the load, CPU time much less).",
        "",
        "| config | trace | wall time (s) | CPU time (s) | peak resident memory (GB) | peak bytes | peak event | events "
        "| load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *map(_row, rows),
        "",
        *_agreement(rows),
    ]
    text = "\n".join(lines)
    (RESULTS / "stack_speed.md").write_text(text + "\n")
    (RESULTS / "stack_speed.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "_one":
        print(json.dumps(one(args[1], args[2], FULL_TIMEOUT_S)))
    else:
        main(args[0] if args else "all")
