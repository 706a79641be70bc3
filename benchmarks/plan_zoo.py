"""Plans for architectures we never tried: the zoo's configs made wider and deeper, planned at full size.

Every row of :mod:`benchmarks.hf_zoo` (a config built locally by transformers' own config class, nothing
downloaded) is scaled up so that ``--verify``'s small instance has something to narrow: widths times 4
(``hidden_size``, ``d_model``, the feed-forward widths), 8 attention heads where it had 4, 6 blocks in every
stack (the zoo's sizes where the config class refuses those: a per-layer list of the zoo's length; the
``sizes`` column says which). Then, in this process:

- ``trainledger plan --hf-config config.json --fake --micro-batch 4 --budget 100% --json``: the plain step's
  traced peak and the floor (the lowest peak any plan reaches);
- ``trainledger plan ... --budget B --verify --json`` with ``B`` halfway between the floor and the plain peak:
  the plan, its prediction against the step traced again with the plan applied, and the gradients and state
  of a real CPU step of the small instance (``trainledger.anymodel.small_instance``) compared bit for bit
  with its plain step's.

Run from the repository root (several minutes):

    python -m benchmarks.plan_zoo                     # every row
    python -m benchmarks.plan_zoo --only bert t5      # some rows

Writes ``benchmarks/results/plan_zoo.json`` (``--only`` keeps the other rows') and ``plan_zoo.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.hf_zoo import ROWS, Arch, _in_process, write_config

RESULTS = Path(__file__).parent / "results"
_WIDER = (
    *("hidden_size", "d_model", "n_embd", "intermediate_size", "d_ff", "n_inner"),
    *("encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim"),
)
_HEADS = ("num_attention_heads", "num_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads")
_DEPTHS = ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers")


def scaled(sizes: dict[str, Any]) -> dict[str, Any]:
    """A zoo row's sizes, wider and deeper (its sub-configs' too; lists, a net of stages', kept)."""
    out: dict[str, Any] = {}
    for key, value in sizes.items():
        if isinstance(value, dict):
            out[key] = scaled(value)
        elif isinstance(value, bool) or not isinstance(value, int):
            out[key] = value
        elif key in _WIDER:
            out[key] = value * 4
        elif key in _HEADS and value == 4:
            out[key] = 8
        elif key in _DEPTHS:
            out[key] = 6
        elif key in ("head_dim", "d_kv"):
            out[key] = value * 2  # 4x wider, twice the heads
        else:
            out[key] = value
    return out


def _plan(path: str, step: list[str], budget: str, *extra: str) -> dict[str, Any]:
    status, out, err = _in_process(["plan", "--hf-config", path, "--fake", *step, "--budget", budget, *extra, "--json"])
    if status:
        lines = err.strip().splitlines() or [f"exit {status}"]
        return {"status": status, "line": lines[-1][:200], "traceback": "Traceback" in err}
    return {"status": 0, **json.loads(out)}


def run_row(arch: Arch) -> dict[str, Any]:
    """The two plans of one scaled architecture (at the zoo's sizes where its config class refuses the scaled
    ones: a per-layer list of the zoo's length)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path, sizes = str(write_config(replace(arch, sizes=scaled(arch.sizes)), Path(tmp))), "scaled"
        except Exception:  # the config class's own validation
            path, sizes = str(write_config(arch, Path(tmp))), "the zoo's"
        step = ["--micro-batch", "4", "--dtype", "fp32", *(["--seq-len", "64"] if arch.sequence else [])]
        step += ["--task", arch.task] if arch.task else []
        plain = _plan(path, step, "100%")
        if plain["status"]:
            return {"status": plain["status"], "line": plain["line"].replace(path, "config.json")}
        peak, floor = plain["plain_peak_bytes"], plain["floor_bytes"]
        budget = (peak + floor) // 2
        planned = _plan(path, step, str(budget), "--verify")
    if planned["status"]:
        return {"status": planned["status"], "line": planned["line"].replace(path, "config.json")}
    v = planned["verification"]
    instance = next((n for n in planned["plan_notes"] if "small instance" in n), "")
    return {
        "status": 0,
        "sizes": sizes,
        "plain_peak_bytes": peak,
        "floor_bytes": floor,
        "budget_bytes": budget,
        "predicted_peak_bytes": v["predicted_peak_bytes"],
        "traced_peak_bytes": v["traced_peak_bytes"],
        "regions": len(planned["regions"]),
        "gradients": f"{v['num_gradients'] - len(v['mismatched_gradients'])} of {v['num_gradients']}",
        "state": f"{v['num_state_tensors'] - len(v['mismatched_state'])} of {v['num_state_tensors']}",
        "passed": v["passed"],
        "instance": instance.partition("architecture (")[2].partition(") running")[0],
    }


def line(arch: Arch, r: dict[str, Any]) -> str:
    if r["status"]:
        kind = "crash" if r.get("traceback") or r["status"] != 2 else "refused"
        return (
            f"| {arch.name} | {arch.architecture} | {kind} ({r['status']}): {r['line'].replace('|', '/')} |" + " |" * 8
        )
    diff = r["traced_peak_bytes"] - r["predicted_peak_bytes"]
    same = "yes" if not diff else f"{diff:+,} ({diff / r['predicted_peak_bytes']:+.3%})"
    return (
        f"| {arch.name} | {arch.architecture} | {r['sizes']} | {r['plain_peak_bytes']:,} | {r['floor_bytes']:,} | "
        f"{r['budget_bytes']:,} | {r['predicted_peak_bytes']:,} | {same} | {r['regions']} | {r['gradients']} | "
        f"{r['state']} | {r['instance']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="rows to run (default: all)")
    args = ap.parse_args()
    saved = RESULTS / "plan_zoo.json"
    results = json.loads(saved.read_text()) if args.only and saved.exists() else {}
    for arch in (r for r in ROWS if not args.only or r.name in args.only):
        try:
            results[arch.name] = run_row(arch)
        except Exception as exc:  # a crash of the benchmark's own: reported in the row, the sweep goes on
            results[arch.name] = {"status": "crash", "line": f"{type(exc).__name__}: {exc}"[:200], "traceback": True}
        print(line(arch, results[arch.name]), flush=True)
        saved.write_text(json.dumps(results, indent=1) + "\n")
    write_table(results)


def write_table(results: dict[str, Any]) -> None:
    """``plan_zoo.md`` from the rows' results (``python -c`` can remake it from ``plan_zoo.json``)."""
    import torch
    import transformers

    lines = [line(a, results[a.name]) for a in ROWS if a.name in results]
    done = [results[a.name] for a in ROWS if a.name in results]
    passed = sum(1 for r in done if r["status"] == 0 and r["passed"])
    head = [
        f"The zoo's configs 4x wider, 6 blocks deep, planned at full size on fake tensors and verified "
        f"(transformers {transformers.__version__}, torch {torch.__version__}); micro-batch 4, fp32, AdamW, "
        "sequences of 64; the budget halfway between the floor and the plain peak; `python -m benchmarks.plan_zoo`.",
        "",
        "| row | architectures | sizes | plain peak | floor | budget | planned peak | re-traced equal | regions | "
        "gradients bitwise | state bitwise | small instance |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---|---|---|",
    ]
    tail = ["", f"{passed} of {len(done)} rows planned and verified (prediction within 1%, budget, gradients, state)."]
    (RESULTS / "plan_zoo.md").write_text("\n".join(head + lines + tail) + "\n")


if __name__ == "__main__":
    main()
