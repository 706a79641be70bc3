"""The analytic model's CUDA variant against the CUDA-kind trace, family by family.

``python -m benchmarks.cuda_kind`` traces each small Hugging Face fixture (``tests/fixtures/hf/*-small.json``,
2 × 256 tokens, so the peak falls in backward) with ``kernel_kind="cuda"`` on the default H100 and builds the
analytic ledger of the same step with ``device="cuda"``; it reports the peaks, the activations' maxima and
their differences, and the SDPA backend the trace ran. ``--before`` also reports the figures the analytic
model gave before it chose the SDPA backend and declared the cuBLAS workspace (its peak compared with the
trace's less that workspace, which it did not model). Writes ``benchmarks/results/cuda_kind.md``.

Both sides are predictions for a GPU made without one: nothing here is validated on a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainledger.analytic import Setup, analytic_ledger, arch_from_config
from trainledger.hf import workload_from_hf_config
from trainledger.ledger import Evidence, Ledger
from trainledger.trace import trace

FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures" / "hf"
OUT = Path(__file__).parent / "results" / "cuda_kind.md"
COMMAND = "python -m benchmarks.cuda_kind"
STEPS = (("sdpa", "bf16"), ("sdpa", "fp32"), ("eager", "fp32"))
MICRO_BATCH, SEQ_LEN = 2, 256


def _percent(a: int, b: int) -> str:
    return f"{100 * (a - b) / b:+.2f}%"


def _without_declared(ledger: Ledger) -> Ledger:
    return ledger.with_entries([e for e in ledger.entries if e.evidence != Evidence.DECLARED])


def rows(*, before: bool = False) -> list[str]:
    """One markdown row per family and step."""
    out = []
    for path in sorted(FIXTURES.glob("*-small.json")):
        spec = arch_from_config(json.loads(path.read_text()))
        for attn, recipe in STEPS:
            if "mixtral" in path.stem and recipe == "fp32":
                continue  # torch's fake grouped matmul takes bf16 only
            kw = {"micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "recipe": recipe, "attn_impl": attn}
            traced = trace(workload_from_hf_config(path, fake=True, **kw), kernel_kind="cuda")
            if before:
                traced = _without_declared(traced)
            analytic = analytic_ledger(spec, Setup(device="cuda", **kw))
            t, a = traced.peak(), analytic.peak()
            ta, aa = traced.category_maxima()["activations"], analytic.category_maxima()["activations"]
            backends = ", ".join(f"{k} ×{n}" for k, n in traced.meta["sdpa_backends"].items()) or "—"
            out.append(
                f"| {path.stem} | {attn} {recipe} | {backends} | {t.bytes:,} ({t.phase}) | {a.bytes:,} ({a.phase}) "
                f"| {_percent(a.bytes, t.bytes)} | {ta:,} | {aa:,} | {_percent(aa, ta)} |"
            )
            print(out[-1], flush=True)
    return out


def main() -> None:
    before = "--before" in sys.argv
    head = [
        f"# Analytic CUDA variant against the CUDA-kind trace{' (before)' if before else ''}",
        "",
        f"`{COMMAND}{' --before' if before else ''}`: {MICRO_BATCH} × {SEQ_LEN} tokens, AdamW, the default H100 "
        "(sm90); predictions, unvalidated on a GPU.",
        "",
        "| fixture | step | SDPA backend (trace) | traced peak | analytic peak | peak diff | traced activations "
        "max | analytic activations max | activations diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table = rows(before=before)
    if not before:
        OUT.write_text("\n".join([*head, *table, ""]))


if __name__ == "__main__":
    main()
