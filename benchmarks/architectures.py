"""Architectures at full size: ``trainledger trace --fake`` of each, timed and measured as a whole command.

Each row runs the CLI in a fresh process (imports, building the model under ``FakeTensorMode``, the
warm-up and traced steps, the report) and reads that one child's resource usage from ``os.wait4``: wall
time, CPU time (user + system) and peak resident memory (``ru_maxrss``, KiB on Linux). The traced peak and
its phase come from the command's ``--json`` output. Models with one stack of blocks (the seven analytic
families, other transformers architectures with one stack, timm's ViT family) are traced 3 and 4 blocks deep and
extended to their full depth; the others (ResNet, ConvNeXt, the UNet) are traced whole.

Run from the repository root (minutes per row on a small machine):

    python -m benchmarks.architectures                     # every row, bf16 + fp32 master, AdamW
    python -m benchmarks.architectures --only bert-large t5-base

It prints a Markdown table and writes it to ``benchmarks/results/architectures.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path("tests") / "fixtures" / "hf"
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True, kw_only=True)
class Row:
    """One architecture and the step traced."""

    name: str
    """The row's label."""
    kind: str
    """What is trained: the task, or the diffusion loss."""
    flags: tuple[str, ...]
    """The command's flags after ``trainledger trace``."""


def _hf(name: str, kind: str, *extra: str) -> Row:
    return Row(name=name, kind=kind, flags=("--hf-config", str(FIXTURES / f"{name}.json"), *extra))


ROWS = (
    _hf("bert-large", "masked LM", "--seq-len", "512", "--micro-batch", "8"),
    _hf("roberta-large", "masked LM", "--seq-len", "512", "--micro-batch", "8"),
    _hf("t5-base", "seq2seq", "--seq-len", "512", "--micro-batch", "8"),
    _hf("vit-large-patch16-224", "image classification", "--micro-batch", "32"),
    Row(
        name="sd15-unet",
        kind="denoising (diffusers UNet2DConditionModel, 64×64 latents)",
        flags=("--diffusers-config", str(FIXTURES / "sd15-unet-diffusers.json"), "--micro-batch", "4"),
    ),
    Row(
        name="resnet50",
        kind="image classification (timm, 224×224)",
        flags=("--timm", "resnet50", "--micro-batch", "64"),
    ),
    Row(
        name="vit_large_patch16_224",
        kind="image classification (timm ViT, 224×224)",
        flags=("--timm", "vit_large_patch16_224", "--micro-batch", "64"),
    ),
    Row(
        name="convnext_base",
        kind="image classification (timm ConvNeXt, 224×224)",
        flags=("--timm", "convnext_base", "--micro-batch", "64"),
    ),
    _hf("gpt2-xl", "causal LM", "--seq-len", "1024"),
    _hf("phi-2", "causal LM", "--seq-len", "2048"),
    _hf("qwen2-7b", "causal LM", "--seq-len", "4096"),
    _hf("mistral-7b", "causal LM", "--seq-len", "4096"),
    _hf("llama-3-8b", "causal LM", "--seq-len", "4096"),
    _hf("qwen3-8b", "causal LM", "--seq-len", "4096"),
    _hf("mixtral-8x7b", "causal LM, MoE (8 experts, top 2)", "--seq-len", "4096"),
    _hf("llama-3.1-70b", "causal LM", "--seq-len", "4096"),
    _hf("llama-3.1-405b", "causal LM", "--seq-len", "4096"),
)
"""Full-size configs from the models' public ``config.json`` values (nothing downloaded)."""


def run_row(row: Row, recipe: str, timeout_s: float) -> dict:
    """The command's JSON report, its wall and CPU seconds, and its peak resident memory."""
    cmd = [sys.executable, "-m", "trainledger.cli", "trace", *row.flags, "--fake", "--dtype", recipe, "--json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, not by Popen: its own usage, no other child's
        timer.cancel()
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            return {"error": (err.read().strip().splitlines() or [f"exit {proc.returncode}"])[-1][:160]}
        report = json.loads(out.read())
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,
        "peak_bytes": report["peak"]["bytes"],
        "phase": report["peak"]["phase"],
        "num_params": report.get("num_params"),
    }


def _line(row: Row, r: dict) -> str:
    if "error" in r:
        return f"| {row.name} | {row.kind} | failed: {r['error']} | | | | | |"
    params = f"{r['num_params'] / 1e9:.2f} B" if r.get("num_params") else "?"
    return (
        f"| {row.name} | {row.kind} | {params} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} "
        f"| {r['max_rss_bytes'] / 2**30:.2f} GiB | {r['peak_bytes'] / 2**30:.2f} GiB | {r['phase']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="rows to run (default: all)")
    ap.add_argument("--recipe", default="bf16-master")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command (default 1800)")
    ap.add_argument("--out", default="architectures.md")
    args = ap.parse_args()
    rows = [r for r in ROWS if not args.only or r.name in args.only]
    lines = [
        f"Full-size fake traces, recipe {args.recipe}, AdamW; `trainledger trace FLAGS --fake --json` per row.",
        "",
        "| model | trained as | params | whole command s | CPU s | max RSS | traced peak | peak phase |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(_line(row, run_row(row, args.recipe, args.timeout)))
        print(lines[-1], flush=True)
    lines += ["", "Commands (after `trainledger trace`, each with `--fake --dtype RECIPE --json`):", ""]
    lines += [f"- {row.name}: `{' '.join(row.flags)}`" for row in rows]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
