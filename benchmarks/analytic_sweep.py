"""The analytic model against the fake trace on config variants: one option at a time, then random mixes.

``python -m benchmarks.analytic_sweep`` starts from a small config of each family (two layers, 64 wide, a
512-token vocabulary; 2 × 64 tokens of bf16 with AdamW and SDPA), changes one config key or one step option
at a time, then draws random combinations of them (seeded), and for each variant and kernel kind (``cpu``,
``cuda``) compares ``estimate`` (:func:`trainledger.analytic.estimate`) with the fake trace of the same step
(:func:`trainledger.trace.trace` of :func:`trainledger.hf.workload_from_setup` on fake tensors; with
``world``/``stage``, rank 0 of :func:`trainledger.shard.shard` of it, as ``trace --world --stage`` does).

Compared: the peak, and each category's maximum over the step (weights, gradients, optimizer,
activations, workspace, inputs, other). The CUDA kind's cuBLAS workspace (a constant 32 MiB declared on
both sides) is left out of both ledgers, or it would hide every other difference in these small steps.
A variant one side refuses is listed with its one-line reason. Writes
``benchmarks/results/analytic_sweep.md``; ``--family NAME`` and ``--random N`` narrow or widen the run.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainledger.analytic import FAMILIES, Setup, estimate
from trainledger.errors import InputError
from trainledger.ledger import Evidence, Ledger

OUT = Path(__file__).parent / "results" / "analytic_sweep.md"
COMMAND = "python -m benchmarks.analytic_sweep"
TOLERANCE = 0.01
KINDS = ("cpu", "cuda")

_LLAMA_LIKE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2}
BASE: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_LIKE, "num_attention_heads": 4, "num_key_value_heads": 4},
    "mistral": {**_LLAMA_LIKE, "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen2": {**_LLAMA_LIKE, "num_attention_heads": 4, "num_key_value_heads": 2},
    "gpt2": {"vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
    "gpt_neox": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                 "num_attention_heads": 4},
    "phi": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4},
    "mixtral": {**_LLAMA_LIKE, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_local_experts": 4, "num_experts_per_tok": 2},
}  # fmt: skip
STEP: dict[str, Any] = {"micro_batch": 2, "seq_len": 64, "recipe": "bf16", "attn_impl": "sdpa"}

ROTARY = ("llama", "mistral", "qwen2", "gpt_neox", "phi", "mixtral")
LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral")
ALL = FAMILIES


@dataclass(frozen=True)
class Option:
    """One config key or step option, and the families whose config or step it applies to."""

    name: str
    families: tuple[str, ...]
    config: dict[str, Any] = field(default_factory=dict)
    step: dict[str, Any] = field(default_factory=dict)
    world: tuple[int, str] = (1, "0")


def _rope(kind: str, **kw: Any) -> dict[str, Any]:
    return {"rope_scaling": {"rope_type": kind, "factor": 2.0, **kw}}


_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
OPTIONS: tuple[Option, ...] = (
    Option("tie_word_embeddings=true", ALL, {"tie_word_embeddings": True}),
    Option("tie_word_embeddings=false", ALL, {"tie_word_embeddings": False}),
    Option("num_key_value_heads=1", (*LLAMA_LIKE, "phi"), {"num_key_value_heads": 1}),
    Option("num_key_value_heads=2", (*LLAMA_LIKE, "phi"), {"num_key_value_heads": 2}),
    Option("num_key_value_heads=heads", (*LLAMA_LIKE, "phi"), {"num_key_value_heads": 4}),
    Option("num_key_value_heads=2 (no GQA family)", ("gpt2", "gpt_neox"), {"num_key_value_heads": 2}),
    Option("head_dim=32", ALL, {"head_dim": 32}),
    Option("head_dim=8", ALL, {"head_dim": 8}),
    Option("attention_bias=true", ALL, {"attention_bias": True}),
    Option("attention_bias=false", ALL, {"attention_bias": False}),
    Option("mlp_bias=true", ALL, {"mlp_bias": True}),
    Option("hidden_act=gelu", ROTARY, {"hidden_act": "gelu"}),
    Option("hidden_act=gelu_new", ROTARY, {"hidden_act": "gelu_new"}),
    Option("hidden_act=gelu_pytorch_tanh", ROTARY, {"hidden_act": "gelu_pytorch_tanh"}),
    Option("hidden_act=relu", ROTARY, {"hidden_act": "relu"}),
    Option("hidden_act=silu", ROTARY, {"hidden_act": "silu"}),
    Option("hidden_act=quick_gelu", ROTARY, {"hidden_act": "quick_gelu"}),
    Option("hidden_act=tanh", ROTARY, {"hidden_act": "tanh"}),
    Option("activation_function=gelu", ("gpt2",), {"activation_function": "gelu"}),
    Option("activation_function=relu", ("gpt2",), {"activation_function": "relu"}),
    Option("activation_function=silu", ("gpt2",), {"activation_function": "silu"}),
    Option("activation_function=gelu_pytorch_tanh", ("gpt2",), {"activation_function": "gelu_pytorch_tanh"}),
    Option("rope_scaling=linear", ROTARY, _rope("linear")),
    Option("rope_scaling=dynamic", ROTARY, _rope("dynamic")),
    Option("rope_scaling=yarn", ROTARY, _rope("yarn", original_max_position_embeddings=64)),
    Option("rope_scaling=llama3", ROTARY, _rope("llama3", **_LLAMA3)),
    Option(
        "rope_scaling partial_rotary_factor=0.25",
        ("phi", "gpt_neox"),
        {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.25}},
    ),
    Option("sliding_window=16", ("mistral", "mixtral"), {"sliding_window": 16}),
    Option("sliding_window=128 (> seq)", ("mistral", "mixtral"), {"sliding_window": 128}),
    Option(
        "use_sliding_window", ("qwen2",), {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}
    ),
    Option("partial_rotary_factor=0.25", ("phi",), {"partial_rotary_factor": 0.25}),
    Option("partial_rotary_factor=1.0", ("phi",), {"partial_rotary_factor": 1.0}),
    Option("rotary_pct=0.5", ("gpt_neox",), {"rotary_pct": 0.5}),
    Option("rotary_pct=1.0", ("gpt_neox",), {"rotary_pct": 1.0}),
    Option("use_parallel_residual=false", ("gpt_neox",), {"use_parallel_residual": False}),
    Option("n_inner=100", ("gpt2",), {"n_inner": 100}),
    Option("scale_attn_by_inverse_layer_idx", ("gpt2",), {"scale_attn_by_inverse_layer_idx": True}),
    Option("reorder_and_upcast_attn", ("gpt2",), {"reorder_and_upcast_attn": True}),
    Option("reorder_and_upcast_attn eager", ("gpt2",), {"reorder_and_upcast_attn": True}, {"attn_impl": "eager"}),
    Option("qk_layernorm", ("phi",), {"qk_layernorm": True}),
    Option("num_experts_per_tok=1", ("mixtral",), {"num_experts_per_tok": 1}),
    Option("num_experts_per_tok=4", ("mixtral",), {"num_experts_per_tok": 4}),
    Option("num_local_experts=8", ("mixtral",), {"num_local_experts": 8}),
    Option("vocab_size=509", ALL, {"vocab_size": 509}),
    Option("vocab_size=1001", ALL, {"vocab_size": 1001}),
    Option("torch_dtype=bfloat16", ALL, {"torch_dtype": "bfloat16"}),
    Option("torch_dtype=float16", ALL, {"torch_dtype": "float16"}),
    Option("torch_dtype=float32", ALL, {"torch_dtype": "float32"}),
    Option("attention_dropout=0.1", ROTARY, {"attention_dropout": 0.1}),
    Option("--micro-batch 1", ALL, step={"micro_batch": 1}),
    Option("--micro-batch 3", ALL, step={"micro_batch": 3}),
    Option("--seq-len 37", ALL, step={"seq_len": 37}),
    Option("--seq-len 100", ALL, step={"seq_len": 100}),
    Option("--attn eager", ALL, step={"attn_impl": "eager"}),
    Option("--dtype fp32", ALL, step={"recipe": "fp32"}),
    Option("--dtype bf16-master", ALL, step={"recipe": "bf16-master"}),
    Option("--optimizer adam", ALL, step={"optimizer": "adam"}),
    Option("--optimizer sgd", ALL, step={"optimizer": "sgd"}),
    Option("--optimizer sgd-momentum", ALL, step={"optimizer": "sgd-momentum"}),
    Option("--lora-rank 4", ALL, step={"lora_rank": 4}),
    Option("--remat full", ALL, step={"remat": "full"}),
    Option("--remat full --remat-every 2", ALL, step={"remat": "full", "remat_every": 2}),
    Option("--world 4 --stage 1", ALL, world=(4, "1")),
    Option("--world 4 --stage 2", ALL, world=(4, "2")),
    Option("--world 4 --stage 3", ALL, world=(4, "3")),
)
BASELINE = Option("base", ALL)


@dataclass(frozen=True)
class Row:
    """One variant of one family in one kernel kind, compared."""

    family: str
    option: str
    kind: str
    status: str
    """``ok``, ``differs``, ``refused`` (by both, one line each), ``analytic only`` (the trace cannot run it) or
    ``trace only`` (the analytic model refuses it)."""
    peak_diff: float | None = None
    diffs: tuple[tuple[str, int, int], ...] = ()
    """Categories (and ``peak``) over the tolerance: name, analytic bytes, traced bytes."""
    detail: str = ""


def _no_kernel_scratch(ledger: Ledger) -> Ledger:
    """The ledger without what the estimate leaves out by design: cuBLAS's workspace, and the buffers CPU kernels
    hold inside an op (measured by running them here: oneDNN's and SDPA's flash kernel's per-thread scratch)."""
    measured = (Evidence.MEASURED, Evidence.ESTIMATED)
    return ledger.with_entries(
        [
            e
            for e in ledger.entries
            if e.role != "cublas_workspace" and not (e.role == "kernel_internal" and e.evidence in measured)
        ]
    )


def _analytic(cfg: dict[str, Any], setup: Setup, world: tuple[int, str]) -> Ledger:
    return estimate(cfg, setup, world=world[0], stage=world[1]).ledger


def _traced(cfg: dict[str, Any], setup: Setup, world: tuple[int, str], fake: bool = True) -> Ledger:
    from trainledger.hf import quiet_transformers, workload_from_setup
    from trainledger.shard import ShardConfig, parse_strategy, shard
    from trainledger.trace import trace

    with quiet_transformers():
        led = trace(workload_from_setup(cfg, setup, fake=fake), fake=fake, kernel_kind=setup.device)
    if world[0] > 1:
        led = shard(led, ShardConfig(world_size=world[0], strategy=parse_strategy(world[1]))).ranks[0]
    return led


def _attempt(fn: Any, *args: Any) -> tuple[Ledger | None, str]:
    try:
        return fn(*args), ""
    except InputError as exc:
        return None, str(exc).splitlines()[0]
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def compare(family: str, name: str, config: dict[str, Any], step: dict[str, Any], world: tuple[int, str],
            kind: str) -> Row:  # fmt: skip
    """Estimate and trace one variant; the categories whose maxima (and the peak) differ over the tolerance."""
    cfg = copy.deepcopy({"model_type": family, **BASE[family], **config})  # transformers edits nested dicts
    try:
        setup = Setup(**{**STEP, **step, "device": kind})
    except InputError as exc:
        return Row(family, name, kind, "refused", detail=f"setup: {exc}")
    analytic, a_err = _attempt(_analytic, cfg, setup, world)
    traced, t_err = _attempt(_traced, copy.deepcopy(cfg), setup, world)
    if traced is None and "data-dependent" in t_err and kind == "cpu":  # fake tensors cannot run it: for real
        traced, t_err = _attempt(_traced, copy.deepcopy(cfg), setup, world, False)
        name += " (real trace)"
    if analytic is None or traced is None:
        status = {(True, True): "refused", (True, False): "trace only", (False, True): "analytic only"}
        detail = "; ".join(x for x in (f"estimate: {a_err}" if a_err else "", f"trace: {t_err}" if t_err else "") if x)
        return Row(family, name, kind, status[analytic is None, traced is None], detail=detail)
    analytic, traced = _no_kernel_scratch(analytic), _no_kernel_scratch(traced)
    a_max, t_max = analytic.category_maxima(), traced.category_maxima()
    diffs = []
    for cat in sorted(set(a_max) | set(t_max)):
        a, t = a_max.get(cat, 0), t_max.get(cat, 0)
        if abs(a - t) > TOLERANCE * max(t, 1):
            diffs.append((cat, a, t))
    a_pk, t_pk = analytic.peak(), traced.peak()
    peak_diff = (a_pk.bytes - t_pk.bytes) / t_pk.bytes
    if abs(peak_diff) > TOLERANCE:
        diffs.insert(0, ("peak", a_pk.bytes, t_pk.bytes))
    detail = f"peak {a_pk.phase} / traced {t_pk.phase}" if a_pk.phase != t_pk.phase else ""
    return Row(family, name, kind, "differs" if diffs else "ok", peak_diff, tuple(diffs), detail)


def single_options(families: tuple[str, ...]) -> list[tuple[str, str, dict[str, Any], dict[str, Any], tuple]]:
    out = []
    for opt in (BASELINE, *OPTIONS):
        for family in families:
            if family in opt.families:
                out.append((family, opt.name, opt.config, opt.step, opt.world))
    return out


def random_mixes(families: tuple[str, ...], count: int, seed: int = 0) -> list[tuple]:
    """``count`` random combinations per family of two to four options that apply to it (seeded)."""
    rng = random.Random(seed)
    out = []
    for family in families:
        pool = [o for o in OPTIONS if family in o.families]
        for _ in range(count):
            picked = rng.sample(pool, rng.randint(2, 4))
            out.append((family, " + ".join(o.name for o in picked), *combine(picked)))
    return out


def combine(options: list[Option]) -> tuple[dict[str, Any], dict[str, Any], tuple[int, str]]:
    """The config keys, step options and world of several options at once (a later one wins a shared key)."""
    config: dict[str, Any] = {}
    step: dict[str, Any] = {}
    world = (1, "0")
    for o in options:
        config.update(o.config)
        step.update(o.step)
        world = o.world if o.world[0] > 1 else world
    return config, step, world


def _fmt_diffs(row: Row) -> str:
    return "; ".join(f"{c} {a:,} vs {t:,} ({100 * (a - t) / max(t, 1):+.1f}%)" for c, a, t in row.diffs)


def table(rows: list[Row]) -> list[str]:
    out = [
        "| family | variant | kind | result | peak Δ | over 1% (estimate vs trace) / reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        pd = f"{100 * r.peak_diff:+.2f}%" if r.peak_diff is not None else "—"
        what = " ".join(x for x in (_fmt_diffs(r), r.detail) if x) or ""
        out.append(f"| {r.family} | {r.option} | {r.kind} | {r.status} | {pd} | {what.replace('|', '/')} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=ALL, action="append", help="only these families (repeatable)")
    ap.add_argument("--random", type=int, default=4, help="random combinations per family (default 4)")
    ap.add_argument("--kind", choices=KINDS, action="append", help="only these kernel kinds")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    families = tuple(args.family or ALL)
    kinds = tuple(args.kind or KINDS)
    start = time.perf_counter()
    sections = []
    for title, variants in (("One option at a time", single_options(families)),
                            (f"Random combinations ({args.random} per family, seed 0)", random_mixes(families, args.random))):  # fmt: skip
        rows = []
        for family, name, config, step, world in variants:
            for kind in kinds:
                rows.append(compare(family, name, config, step, world, kind))
                print(" ".join(table([rows[-1]])[2:]), flush=True)
        sections.append((title, rows))
    every = [r for _, rs in sections for r in rs]
    counts = {s: sum(r.status == s for r in every) for s in ("ok", "differs", "refused", "trace only", "analytic only")}
    lines = [
        "# The analytic model against the fake trace, on config variants",
        "",
        f"`{COMMAND}` ({time.perf_counter() - start:.0f} s). Each family's small config (two layers, 64 wide, a "
        "512-token vocabulary), 2 × 64 tokens of bf16, AdamW, SDPA, changed one option at a time and then in "
        "random combinations; `estimate` against the fake trace of the same step in both kernel kinds (the "
        "CUDA kind's constant cuBLAS workspace left out of both). Listed over 1%: the peak and each category's "
        "maximum over the step.",
        "",
        "Totals: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(every)}.",
        "",
    ]
    for title, rows in sections:
        lines += [f"## {title}", "", *table(rows), ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
