"""The stacked trace on every architecture of the zoo: extended where it can be, and then equal to the full trace.

For each row of ``benchmarks.hf_zoo`` (a tiny config built with the architecture's own config class, nothing
downloaded) the config is made 7 layers deep and its step on fake tensors is traced the way ``trace --hf-config
--fake`` traces it: 3 and 4 blocks deep and extended, guarded by the skeleton check
(:func:`trainledger.trace.trace_stacked` with ``skeleton``). Where it was extended, the full fake trace at 7
layers is made too and compared event for event, entry for entry, call for call and peak for peak; where it was
traced whole, the first note says why. Micro-batch 2, 32 tokens (or frames), the default recipe and AdamW.

Run from the repository root (a few minutes):

    python -m benchmarks.stack_zoo                  # every row; writes benchmarks/results/stack_zoo.md
    python -m benchmarks.stack_zoo --only bert opt  # some rows, printed only
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.hf_zoo import ROWS, Arch

RESULTS = Path(__file__).parent / "results"
DEPTH = 7
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers")


def run_row(arch: Arch) -> dict[str, Any]:
    """One architecture: how its step was traced at 7 layers, and whether the extension equals the full trace."""
    from transformers import AutoConfig

    from trainledger.analytic import Setup
    from trainledger.anymodel import at_depth, depth_of, load_any_config, skeleton, workload_from_any_config
    from trainledger.errors import InputError
    from trainledger.hf import config_errors
    from trainledger.trace import trace, trace_stacked

    sizes = {k: DEPTH if k in _LAYER_KEYS else v for k, v in arch.sizes.items()}
    try:
        made = AutoConfig.for_model(arch.model_type, **sizes)
    except config_errors() as exc:  # a per-layer setting of the zoo's config sized for its own depth
        return {"how": "not run", "why": f"the zoo's config is not valid {DEPTH} layers deep: {exc}"}
    try:
        cfg = load_any_config({**made.to_dict(), "architectures": [arch.architecture]}, task=arch.task)
        depth = depth_of(cfg)
        if depth is None:
            return {"how": "whole", "why": "no single stack of blocks (several towers or stages, or none)"}
        setup = Setup(micro_batch=2, seq_len=32)

        def build(d: int) -> Any:
            return workload_from_any_config(at_depth(cfg, depth, d), setup, fake=True)

        t0 = time.perf_counter()
        led = trace_stacked(
            build, depth.num_layers, differs=depth.uneven, skeleton=lambda d: skeleton(at_depth(cfg, depth, d))
        )
        seconds = time.perf_counter() - t0
    except InputError as exc:
        return {"how": "refused", "why": str(exc)}
    if not led.meta["blocks"]["extended"]:
        return {"how": "whole", "why": led.notes[0].partition("(not extended: ")[2].removesuffix(")"), "s": seconds}
    full = trace(build(depth.num_layers), fake=True)
    same = (led.events, led.entries, led.calls, led.peak()) == (full.events, full.entries, full.calls, full.peak())
    return {"how": "extended", "same": same, "s": seconds, "stack": led.notes[0].split("(")[1].split(")")[0]}


def line(arch: Arch, r: dict[str, Any]) -> str:
    if r["how"] == "extended":
        verdict = "equal to the full trace" if r["same"] else "**differs from the full trace**"
        return f"| {arch.name} | extended ({r['stack']}) | {verdict} | {r['s']:.1f} |"
    seconds = f"{r['s']:.1f}" if "s" in r else ""
    return f"| {arch.name} | {r['how']} | {' '.join(r['why'].split())[:160]} | {seconds} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="rows to run (default: all)")
    args = ap.parse_args()
    rows = [a for a in ROWS if not args.only or a.name in args.only]
    lines = [
        f"`python -m benchmarks.stack_zoo`: each architecture {DEPTH} layers deep, traced as `trace --hf-config "
        "--fake` traces it (3 and 4 blocks, extended, skeleton-checked); an extended ledger compared with the "
        f"full fake trace at {DEPTH} layers (events, entries, calls, peak). Seconds: the stacked trace's.",
        "",
        "| architecture | traced | against the full trace, or why whole | s |",
        "|---|---|---|---:|",
    ]
    for arch in rows:
        lines.append(line(arch, run_row(arch)))
        print(lines[-1], flush=True)
    extended = [ln for ln in lines if "| extended (" in ln]
    equal = [ln for ln in extended if "equal to the full trace" in ln]
    lines += ["", f"- {len(extended)} of {len(rows)} extended, {len(equal)} of them equal to the full trace"]
    print(lines[-1])
    if not args.only:
        (RESULTS / "stack_zoo.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
