"""Which CPU kernels allocate memory they free before returning, and does the trace now see it?

``python -m benchmarks.kernel_workspace`` records every op of one training step of every built-in example
and runs each distinct call again alone, under the profiler (``profile_memory=True``), comparing the most
the allocator held inside the op with what the op returned: ops that hold more are the ones whose kernels
allocate internally (the list of ops ``trace`` measures came from this table). Then it traces each example
with and without the measured kernel buffers and compares both peaks with the profiler oracle of
``tests/oracle_profiler.py`` (a fresh process, the profiler started before the model is built).

Writes ``benchmarks/results/kernel_workspace.md``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainledger import examples
from trainledger.trace import KernelCall, kernel_internal_bytes, trace
from trainledger.workload import run_step

OUT = Path(__file__).parent / "results" / "kernel_workspace.md"
COMMAND = "python -m benchmarks.kernel_workspace"


class _Calls(TorchDispatchMode):
    """Every op of a step, with the layout of its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[KernelCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("prim", "profiler"):
            call = KernelCall.of(func, args, kwargs)
            if call is not None:
                self.calls.append(call)
        return func(*args, **kwargs)


def internal_by_op(name: str) -> dict[str, tuple[int, int]]:
    """Per op the trace sees: (distinct calls holding more than they return, the most any held).

    Every distinct call of one step is run again alone and measured as ``trace`` measures the probed
    ones (``trainledger.trace.kernel_internal_bytes``).
    """
    w = examples.build(name)
    run_step(w)
    with _Calls() as mode:
        run_step(w)
    found: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for call, held in kernel_internal_bytes(mode.calls).items():
        if held > 16:  # above the 12 bytes of a Python scalar wrapped as a tensor
            op = str(call.op).removesuffix(".default")
            found[op][0] += 1
            found[op][1] = max(found[op][1], held)
    return {k: (v[0], v[1]) for k, v in found.items()}


def oracle_peak(name: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "tests.oracle_profiler", name], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


def main() -> None:
    torch.set_num_threads(torch.get_num_threads())
    names = [n for n in examples.EXAMPLES if n != "seed-423"]
    lines = [
        "# Kernel-internal memory on CPU",
        "",
        f"`{COMMAND}` (torch {torch.__version__}, {torch.get_num_threads()} threads).",
        "",
        "## Ops that hold more inside than they return (each distinct call of one step run alone)",
        "",
        "| example | op | distinct calls | most held above its outputs (B) |",
        "|---|---|---:|---:|",
    ]
    for name in names:
        for op, (calls, most) in sorted(internal_by_op(name).items(), key=lambda kv: -kv[1][1]):
            lines.append(f"| {name} | `{op}` | {calls} | {most:,} |")
    lines += [
        "",
        "## Traced peaks with and without the measured kernel buffers, against the profiler oracle",
        "",
        "| example | oracle (B) | traced, tensors only (B) | gap | traced with kernel buffers (B) | gap |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        oracle = oracle_peak(name)
        plain = trace(examples.build(name), kernel_workspace=False).peak().bytes
        full = trace(examples.build(name)).peak().bytes
        lines.append(f"| {name} | {oracle:,} | {plain:,} | {oracle - plain:,} | {full:,} | {oracle - full:,} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
