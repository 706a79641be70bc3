"""The two speed goals of the full-size traces, before and after a change, in one run: the whole commands.

Run from the repository root:

    python -m benchmarks.speed_goals --before main      # this checkout against the source of `main`
    python -m benchmarks.speed_goals --repeat 3         # this checkout alone

The goals: ``trace --hf-config tests/fixtures/hf/llama-3.1-405b.json --fake`` at 1 × 8192 under 8 s and 1 GB
resident, and ``fit --hf-config tests/fixtures/hf/llama-3-8b.json --device-memory 80GiB --world 8`` (its 5 best
rows traced) under 30 s, whole command in a fresh process. ``--before REV`` runs each command with the ``src``
of git revision ``REV`` first on ``PYTHONPATH`` (``git archive``, nothing checked out), alternating with this
checkout, so that both meet the same load; each command's JSON (for the trace, the whole ledger of
``--export-json``) is hashed, and the two revisions must print the same bytes. A third line times the imports
both pay (torch, ``torch._dynamo``, transformers' Llama), the floor under any change of ours.

The machine is shared: wall time follows its load average, recorded beside each run; CPU time (user + system
of the child) much less so. The table gives the median of the repeats.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
HF = "tests/fixtures/hf"
IMPORTS = "import torch, torch._dynamo, transformers; from transformers import LlamaForCausalLM"
GOALS = {"trace 405B": 8.0, "fit 8B": 30.0}


def commands(ledger_json: str) -> dict[str, list[str]]:
    """The measured commands, each a child process's argument list."""
    cli = [sys.executable, "-m", "trainledger.cli"]
    trace = ["trace", "--hf-config", f"{HF}/llama-3.1-405b.json", "--fake", "--micro-batch", "1", "--seq-len", "8192"]
    fit = ["fit", "--hf-config", f"{HF}/llama-3-8b.json", "--device-memory", "80GiB", "--world", "8"]
    return {
        "imports only": [sys.executable, "-c", IMPORTS],
        "trace 405B": [*cli, *trace, "--json", "--export-json", ledger_json],
        "fit 8B": [*cli, *fit, "--json"],
    }


def run_once(argv: list[str], src: Path, ledger_json: str) -> dict:
    """One command in a fresh process: wall and CPU seconds, peak resident bytes, hash of what it wrote."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.decode().strip().splitlines()[-1:]}")
    out = proc.stdout
    if "--export-json" in argv:  # the exported ledger, and the JSON without the temporary path it was written to
        printed = {k: v for k, v in json.loads(out).items() if k != "written"}
        out = json.dumps(printed).encode() + Path(ledger_json).read_bytes()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "max_rss_bytes": after.ru_maxrss * 1024,  # the only child of this process
        "load": load,
        "sha256": hashlib.sha256(out).hexdigest() if out else "",
    }


def _measure(case: str, src: Path) -> list[dict]:
    """One run of a case, from a process of its own (so that the resident peak is that run's alone)."""
    args = [sys.executable, "-m", "benchmarks.speed_goals", "_case", case, str(src)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr.strip().splitlines()[-1])
    return json.loads(proc.stdout)


def _source_of(rev: str, into: Path) -> Path:
    """The ``src`` folder of git revision ``rev``, unpacked under ``into``."""
    archive = into / "src.tar"
    subprocess.run(["git", "archive", "-o", str(archive), rev, "src"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _row(case: str, label: str, runs: list[dict]) -> str:
    goal = GOALS.get(case)
    wall = _median(runs, "wall_s")
    met = "" if goal is None else ("yes" if wall < goal else "no")
    loads = ", ".join(f"{r['load']:.1f}" for r in runs)
    return (
        f"| {case} | {label} | {wall:.1f} | {_median(runs, 'cpu_s'):.1f} | "
        f"{max(r['max_rss_bytes'] for r in runs) / 1e9:.2f} | {loads} | "
        f"{'' if goal is None else f'< {goal:g} s: {met}'} | {runs[0]['sha256'][:12]} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="REV", help="also run the src of this git revision, alternating")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each command per revision (default 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"this checkout": ROOT / "src"}
        if args.before:
            sources = {f"before ({args.before})": _source_of(args.before, Path(tmp)), **sources}
        record: dict[str, list[dict]] = {f"{case} / {label}": [] for case in commands("") for label in sources}
        for case in commands(""):
            for _ in range(args.repeat):  # the revisions alternate, so that they meet the same load
                for label, src in sources.items():
                    record[f"{case} / {label}"] += _measure(case, src)
        rows = [_row(case, label, record[f"{case} / {label}"]) for case in commands("") for label in sources]
    same = [
        case
        for case in commands("")
        if len({r["sha256"] for key, runs in record.items() if key.startswith(case) for r in runs}) == 1
    ]
    lines = [
        "`python -m benchmarks.speed_goals"
        + (f" --before {args.before}" if args.before else "")
        + f" --repeat {args.repeat}`: whole commands in fresh processes, median of {args.repeat} runs; CPU = user + "
        "system of the child; GB = 10^9 bytes; load: the 1-minute load average as each run started (2 shared "
        "cores: wall time follows it); sha256: of the command's JSON (and of the whole ledger it exported).",
        "",
        "| command | source | wall (s) | CPU (s) | peak resident (GB) | load | goal (wall) | sha256 |",
        "|---|---|---:|---:|---:|---|---|---|",
        *rows,
        "",
        f"- the same bytes from every run and revision: {', '.join(same) or 'none'}",
    ]
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speed_goals.md").write_text(text + "\n")
    (RESULTS / "speed_goals.json").write_text(json.dumps(record, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_case"]:
        case, src = sys.argv[2], Path(sys.argv[3])
        with tempfile.TemporaryDirectory() as tmp:
            ledger = str(Path(tmp) / "ledger.json")
            print(json.dumps([run_once(commands(ledger)[case], src, ledger)]))
    else:
        main()
