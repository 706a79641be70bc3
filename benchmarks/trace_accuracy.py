"""Traced peak vs an independent oracle on eleven diverse models; measured mode's view of the difference.

The oracle: ``torch.profiler.profile(profile_memory=True)`` started before the model is built, in a fresh
process, and the running sum of its allocation events inside the measured step's window
(``tests/oracle_profiler.py``; it shares no code with the tracer).

Run from the repository root:

    python -m benchmarks.trace_accuracy            # prints a Markdown table, writes benchmarks/results/

Columns: traced peak (evidence traced); the oracle's peak; their difference; what measured mode calls
workspace not visible as tensors (kernel-internal buffers); whether the fake-tensor trace is identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trainledger import examples
from trainledger.errors import InputError
from trainledger.measure import measure
from trainledger.trace import trace

MODELS = {
    "mlp": "MLP, SGD with momentum",
    "cnn": "CNN, BatchNorm, in-place ReLU, Adam",
    "gpt-tiny": "GPT, tied embeddings, dropout, AdamW",
    "lstm": "2-layer LSTM, RMSprop",
    "moe": "mixture of experts, data-dependent top-2 routing",
    "dpo": "policy + frozen reference under no_grad (DPO loss)",
    "lora": "LoRA, frozen base",
    "autocast-bf16": "MLP under bf16 autocast",
    "bf16-master": "bf16 weights, fp32 master copies",
    "seed-423": "the seed's 423 float64 parameters, Adam",
    "unet-small": "U-Net: skip connections, BatchNorm, channel dropout",
}

RESULTS = Path(__file__).parent / "results"


def oracle_peak(name: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "tests.oracle_profiler", name], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


def fake_identical(name: str, real) -> str:
    try:
        fake = trace(examples.build(name), fake=True)
    except InputError:
        return "n/a (data-dependent shapes)"
    if fake.peak().bytes != real.peak().bytes:
        return f"no: peak {fake.peak().bytes:,}"
    same = [(e.phase, e.op, e.module) for e in fake.events] == [(e.phase, e.op, e.module) for e in real.events]
    key = lambda led: sorted((str(e.category), e.nbytes, e.alloc_event or -1, e.free_event or -1) for e in led.entries)  # noqa: E731
    return "yes" if same and key(fake) == key(real) else "events equal, storages differ"


def main() -> None:
    rows = []
    for name, what in MODELS.items():
        led = trace(examples.build(name))
        traced = led.peak().bytes
        oracle = oracle_peak(name)
        unseen = measure(examples.build(name), num_steps=1).unseen_workspace_bytes
        rows.append(
            {
                "model": name,
                "what": what,
                "traced_peak_bytes": traced,
                "oracle_peak_bytes": oracle,
                "difference_bytes": oracle - traced,
                "measured_unseen_workspace_bytes": unseen,
                "fake_identical": fake_identical(name, led),
            }
        )
        print(f"{name}: traced {traced:,} oracle {oracle:,}", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "trace_accuracy.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "| model | what it exercises | traced peak (B) | profiler oracle (B) | oracle − traced (B) | measured: not visible as tensors (B) | fake trace identical |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['what']} | {r['traced_peak_bytes']:,} | {r['oracle_peak_bytes']:,} | "
            f"{r['difference_bytes']:,} | {r['measured_unseen_workspace_bytes']:,} | {r['fake_identical']} |"
        )
    table = "\n".join(lines)
    (RESULTS / "trace_accuracy.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
