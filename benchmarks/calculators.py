"""Side by side with the calculators people use: per-rank peak of GPT-2, Llama-2-7B and Llama-3-8B under
ZeRO 0–3 over 8 ranks, from our fake trace, our analytic model, DeepSpeed's estimators and the ZeRO paper.

- traced: ``trace(workload_from_hf_config(..., fake=True), fake=True)`` at full size, then the sharding
  transform (``trainledger.shard``, DeepSpeed's flat partitions) for the stage; the peak of rank 0.
- analytic: ``trainledger estimate`` with ``--device-kind cpu`` (the same kernels as the trace).
- DeepSpeed: ``estimate_zero2_model_states_mem_needs_all_cold`` (stages 1–2) and
  ``estimate_zero3_model_states_mem_needs_all_cold`` (stage 3), no offload, as DeepSpeed prints them;
  "not installed" when ``deepspeed`` is missing.
- ZeRO paper: Rajbhandari et al. 2019, §5: (2 + 2 + K)·Ψ with K = 12, divided per stage:
  ``16Ψ``, ``4Ψ + 12Ψ/N``, ``2Ψ + 14Ψ/N``, ``16Ψ/N``.
- llm-analysis: pins ``transformers==4.31`` and cannot be installed beside transformers 5, so it is not run.

Run from the repository root (about ten minutes on two cores):

    python -m benchmarks.calculators
    python -m benchmarks.calculators --configs gpt2 --micro-batches 1 --seq-lens 2048   # one row group

It prints a Markdown table and writes it to ``benchmarks/results/calculators.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path

from trainledger.analytic import Setup, arch_from_config, estimate, num_params, param_tensors
from trainledger.shard import ShardConfig, shard

FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures" / "hf"
RESULTS = Path(__file__).parent / "results"
WORLD = 8

LEAVES_OUT = {
    "traced": "allocator rounding/fragmentation; kernels' internal scratch",
    "analytic": "as traced, plus anything the family's code does that the model does not list",
    "analytic, CUDA kernels": "the same model with CUDA's kernels: 1-byte dropout masks, fp32 LayerNorm statistics, "
    "flash SDPA with dropout, foreach AdamW (one state-sized temporary); not checked against a GPU trace here",
    "deepspeed": "activations, logits and their fp32 copy, workspace, the fp32 gradient copies, buffers; "
    "assumes 16 B/param (fp16 + fp32 master + Adam) and a 1.5× buffer factor",
    "paper": "activations, logits, workspace, buffers, communication buckets; 16 B/param",
}


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f}"


def deepspeed_estimates(P: int, largest_layer: int) -> dict[int, float | None]:
    """Per-GPU bytes DeepSpeed's cold estimators print (offload none), captured from their output."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
    except Exception:  # not installed, or no usable accelerator backend
        return dict.fromkeys(range(4))

    def per_gpu(fn, **kw) -> float:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            fn(**kw)
        for line in buf.getvalue().splitlines():  # "  301.23GB |  26.67GB | offload_optimizer=none"
            parts = [p.strip() for p in line.split("|")]
            if len(parts) != 3 or "offload_optimizer=none" not in parts[2]:
                continue
            if "offload_param" in parts[2] and "offload_param=none" not in parts[2]:
                continue
            if "zero_init=0" in parts[2]:
                continue  # the same per-GPU figure as zero_init=1
            return float(parts[1].removesuffix("GB")) * 2**30  # DeepSpeed's "GB" is 2^30 bytes
        raise RuntimeError(f"unexpected DeepSpeed output: {buf.getvalue()!r}")

    z2 = per_gpu(estimate_zero2_model_states_mem_needs_all_cold, total_params=P, num_gpus_per_node=WORLD, num_nodes=1)
    z3 = per_gpu(
        estimate_zero3_model_states_mem_needs_all_cold,
        total_params=P,
        largest_layer_params=largest_layer,
        num_gpus_per_node=WORLD,
        num_nodes=1,
    )
    return {0: None, 1: z2, 2: z2, 3: z3}


def paper(P: int, stage: int, n: int = WORLD) -> float:
    return [16 * P, 4 * P + 12 * P / n, 2 * P + 14 * P / n, 16 * P / n][stage]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["gpt2", "llama-2-7b", "llama-3-8b"])
    ap.add_argument("--micro-batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--recipe", default="bf16-master")
    ap.add_argument("--out", default="calculators.md")
    args = ap.parse_args()
    from trainledger.hf import workload_from_hf_config
    from trainledger.trace import trace

    rows = [
        f"Per-rank peak (GiB = 2^30 bytes) of rank 0 of {WORLD}, {args.recipe}, AdamW, SDPA. "
        "Traced and analytic include activations; DeepSpeed and the paper count model states only.",
        "",
        "| model | mb × seq | ZeRO | traced | analytic | analytic − traced | analytic, CUDA kernels "
        "| DeepSpeed | ZeRO paper | traced peak in |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in args.configs:
        for mb in args.micro_batches:
            for seq in args.seq_lens:
                cfg = json.loads((FIXTURES / f"{name}.json").read_text())
                if cfg["model_type"] == "gpt2" and seq > cfg.get("n_positions", 1024):
                    cfg["n_positions"] = seq  # GPT-2's 1024 learned positions raised to run longer sequences
                spec = arch_from_config(cfg)
                P = num_params(spec)
                largest = max(p.numel for p in param_tensors(spec))
                ds = deepspeed_estimates(P, largest)
                t0 = time.perf_counter()
                led = trace(
                    workload_from_hf_config(cfg, micro_batch=mb, seq_len=seq, recipe=args.recipe, fake=True), fake=True
                )
                traced_s = time.perf_counter() - t0
                for stage in range(4):
                    res = shard(led, ShardConfig(world_size=WORLD, strategy=f"zero{stage}", engine="deepspeed"))  # type: ignore[arg-type]
                    tp = res.ranks[0].peak()
                    setup = Setup(micro_batch=mb, seq_len=seq, recipe=args.recipe, device="cpu")  # type: ignore[arg-type]
                    an = estimate(cfg, setup, world=WORLD, stage=str(stage)).ledger.peak().bytes
                    cuda = Setup(micro_batch=mb, seq_len=seq, recipe=args.recipe, device="cuda")  # type: ignore[arg-type]
                    an_cuda = estimate(cfg, cuda, world=WORLD, stage=str(stage)).ledger.peak().bytes
                    rows.append(
                        f"| {name} | {mb} × {seq} | {stage} | {_gib(tp.bytes)} | {_gib(an)} "
                        f"| {100 * (an - tp.bytes) / tp.bytes:+.2f}% | {_gib(an_cuda)} | {_gib(ds[stage])} "
                        f"| {_gib(paper(P, stage))} "
                        f"| {tp.phase} |"
                    )
                    print(rows[-1], f"(trace {traced_s:.0f} s)" if stage == 0 else "", flush=True)
    rows += ["", "What each leaves out:", ""] + [f"- {k}: {v}" for k, v in LEAVES_OUT.items()]
    rows.append("- llm-analysis: not run (pins transformers==4.31; cannot be installed beside transformers 5)")
    text = "\n".join(rows) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
