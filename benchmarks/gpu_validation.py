"""The CUDA numbers checked on a GPU: predictions made without one against what one step does on one.

For each of eight workloads (a ~1B Llama-style model in bf16 at 2048 tokens, BERT-base, a U-Net, LoRA, DPO
with a frozen reference, a mixture of experts, a rematerialization plan applied, an FSDP2 step on one GPU):

(a) the prediction made without the GPU: the CUDA-kind trace (``trace(..., kernel_kind="cuda")``: CUDA's
    kernels substituted on fake CPU tensors, for the card the kit runs on: ``torch.cuda.get_device_name``
    looked up in the device table, an H100 where it is not there), and the analytic estimate (cuda kernels,
    the same card) where the workload is a Hugging Face architecture it covers; beside them the CPU fake trace
    (cpu kernels), which shows how much the CUDA substitutions move the prediction;
(b) the step traced on the GPU (real CUDA tensors, cuda kernels);
(c) ``torch.cuda.max_memory_allocated()`` over one step (trainledger.measure);
(d) the caching allocator model's reserved peak, replayed from (a) and from (b), against
    ``torch.cuda.max_memory_reserved()``.

The Hugging Face workloads are traced 3 and 4 layers deep and extended to their depth (``trace_stacked``, exact
against the traces of both depths), so that the two traces made without the GPU cost less than one of every
layer. A step whose shapes depend on data cannot run on fake tensors: its (a) cell says so.

Each workload's GPU part runs in a fresh process, so that one step's allocator cache does not carry into
the next. The table is written to ``benchmarks/results/gpu_validation.md`` (and ``.json``).

Run from the repository root on a machine with one CUDA GPU (about 5 minutes on an 80 GB card):

    python -m benchmarks.gpu_validation            # the full kit; without CUDA: "skipped: no CUDA device"
    python -m benchmarks.gpu_validation --dry      # every part but the GPU's, each workload at reduced size

``--dry`` builds every workload (small), makes every prediction (the CUDA-kind trace, for an H100, included) and
runs the allocator model on the CPU, runs each step's device part on the CPU (so the code that measures runs),
and writes the table with the GPU columns marked "not run". Until the full kit has run on a GPU, trainledger's CUDA figures are unvalidated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from trainledger.allocator import predict_reserved
from trainledger.analytic import Setup, estimate
from trainledger.devices import DEFAULT_CUDA_DEVICE, Device, lookup
from trainledger.errors import InputError
from trainledger.ledger import Ledger
from trainledger.workload import Workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
NOT_RUN = "not run"

# --- the workloads -----------------------------------------------------------------------------------------

# TinyLlama-1.1B's shape (22 layers, 2048 wide, grouped-query attention with 4 key/value heads).
LLAMA_1B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
LLAMA_300M = {**LLAMA_1B, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16}
MIXTRAL_SMALL = {
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 1792,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
# Every Hugging Face workload at reduced size for --dry: two narrow layers, short sequences.
DRY_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@dataclass(frozen=True)
class Case:
    """One workload: how to build it (full size or reduced), and what kind of step it is."""

    name: str
    what: str
    build: Callable[[bool, bool], Workload]
    """``build(dry, fake)``: the step on the CPU (real tensors, or fake ones for the prediction)."""
    hf: Callable[[bool], tuple[dict[str, Any], Setup]] | None = None
    """The Hugging Face config and setup, for the analytic estimate."""
    kind: str = "plain"
    """``plain``; ``plan`` (a rematerialization plan applied before the step); ``fsdp2`` (``fully_shard``)."""


def _hf_case(config: dict[str, Any], full: Setup, dry: Setup) -> Callable[[bool], tuple[dict[str, Any], Setup]]:
    return lambda is_dry: ({**config, **DRY_SHAPE}, dry) if is_dry else (config, full)


def _hf_build(spec: Callable[[bool], tuple[dict[str, Any], Setup]]) -> Callable[[bool, bool], Workload]:
    def build(dry: bool, fake: bool) -> Workload:
        from trainledger.hf import workload_from_setup

        config, setup = spec(dry)
        return workload_from_setup(config, setup, fake=fake)

    return build


def _bert(dry: bool, fake: bool) -> Workload:
    """BERT-base (110M) masked-language-model step at 512 tokens, fp32, AdamW (random weights, no download)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128) if dry else {}
    config = BertConfig(vocab_size=512 if dry else 30522, **sizes)
    config._attn_implementation = "sdpa"
    model = BertForMaskedLM(config)
    batch, seq = (2, 32) if dry else (8, 512)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return Workload(model, {"input_ids": ids, "labels": ids}, name="bert-base")


def _unet(dry: bool, fake: bool) -> Workload:
    from trainledger.examples import unet_small

    return unet_small(batch_size=2, size=16) if dry else unet_small(batch_size=64, size=256)


def _gpt(dry: bool, fake: bool) -> Workload:
    from trainledger.examples import gpt_tiny

    if dry:
        return gpt_tiny()
    return gpt_tiny(n_layer=8, n_embd=512, n_head=8, seq_len=512, batch_size=8)


def _gpt_to_plan(dry: bool, fake: bool) -> Workload:
    """Smaller: the planner traces the real step on the CPU, and its solver runs there too."""
    from trainledger.examples import gpt_tiny

    if dry:
        return gpt_tiny()
    return gpt_tiny(n_layer=6, n_embd=384, n_head=6, seq_len=256, batch_size=8)


_LLAMA_1B = _hf_case(LLAMA_1B, Setup(seq_len=2048, recipe="bf16"), Setup(seq_len=64, recipe="bf16"))
_LORA = _hf_case(LLAMA_1B, Setup(seq_len=2048, lora_rank=16), Setup(seq_len=64, lora_rank=4))
_DPO = _hf_case(LLAMA_300M, Setup(seq_len=1024, reference=True), Setup(seq_len=32, reference=True))
_MOE = _hf_case(MIXTRAL_SMALL, Setup(seq_len=1024, recipe="bf16"), Setup(seq_len=32, recipe="bf16"))

CASES: tuple[Case, ...] = (
    Case("llama-1b-bf16", "Llama-style 1.1B, bf16, AdamW, 2048 tokens", _hf_build(_LLAMA_1B), _LLAMA_1B),
    Case("bert-base", "BERT-base masked LM, fp32, 8 × 512 tokens", _bert),
    Case("unet", "U-Net, BatchNorm, 64 × 256² images", _unet),
    Case("lora", "LoRA rank 16 on the 1.1B Llama, frozen bf16 base", _hf_build(_LORA), _LORA),
    Case("dpo", "DPO, 300M Llama policy + frozen reference, 1024 tokens", _hf_build(_DPO), _DPO),
    Case("moe", "Mixtral-style MoE, 8 experts top-2, bf16, 1024 tokens", _hf_build(_MOE), _MOE),
    Case("plan-applied", "GPT 6×384, 8 × 256 tokens, a remat plan to 60% applied", _gpt_to_plan, kind="plan"),
    Case("fsdp2", "GPT 8×512, 8 × 512 tokens, FSDP2 fully_shard on one GPU", _gpt, kind="fsdp2"),
)
CASE_BY_NAME = {c.name: c for c in CASES}

# --- (a) the prediction, made on the CPU ----------------------------------------------------------------------


def card_of(torch_name: str | None) -> Device:
    """The device table's card that ``torch.cuda.get_device_name`` calls ``torch_name`` (``NVIDIA H200``,
    ``NVIDIA H100 80GB HBM3``, ``NVIDIA A100-SXM4-80GB``, ``Tesla V100-SXM2-32GB``); the H100 the CUDA kind
    assumes when it is not listed there, or with no name (a dry run)."""
    name = (torch_name or "").strip()
    for vendor in ("NVIDIA ", "Tesla "):
        name = name.removeprefix(vendor)
    try:
        return lookup(name) if name else lookup(DEFAULT_CUDA_DEVICE)
    except InputError:
        return lookup(DEFAULT_CUDA_DEVICE)


def predict(case: Case, dry: bool, card: Device) -> tuple[dict[str, Any], Any]:
    """Every figure made without a GPU for ``card``, and the plan to apply (``plan`` cases; else ``None``):
    the CUDA-kind trace (``cuda_*``), the CPU fake trace (``fake_*``), the analytic estimate (``analytic_*``)."""
    out: dict[str, Any] = {"card": card.name}
    if case.hf is not None:
        config, setup = case.hf(dry)
        led = estimate(config, replace(setup, gpu=card.name)).ledger
        out["analytic_peak"] = led.peak().bytes
        out["analytic_reserved"] = predict_reserved(led, kernel_kind="cuda").max_reserved_bytes
    workload, plan = None, None
    if case.hf is None:  # a Hugging Face step is built at each depth it is traced at
        workload = case.build(dry, False)
        if case.kind == "plan":
            from trainledger import remat

            plan = remat.plan(workload, "60%")
            plan.apply(workload.model)
            out["plan_predicted_peak"] = plan.predicted_peak_bytes
    for kind, key in (("cuda", "cuda"), ("cpu", "fake")):
        try:
            ledger = _as_run(case, _predicted(case, dry, workload, kind, card))
        except InputError as exc:  # a step fake tensors cannot take (data-dependent shapes)
            out[f"{key}_error"] = " ".join(str(exc).split())[:120]
            continue
        out[f"{key}_peak"] = ledger.peak().bytes
        out[f"{key}_reserved"] = predict_reserved(ledger, kernel_kind=kind).max_reserved_bytes
    return out, plan


def _predicted(case: Case, dry: bool, workload: Workload | None, kind: str, card: Device) -> Ledger:
    """The step traced on fake tensors with ``kind`` kernels (tensor storages only: the CPU kernels' own
    buffers are not the CUDA step's); a Hugging Face step 3 and 4 layers deep, extended to its depth."""
    from trainledger.trace import trace, trace_stacked

    kinds: dict[str, Any] = {"kernel_kind": kind, "cuda_device": card if kind == "cuda" else None}
    if workload is not None:
        return trace(workload, fake=True, kernel_workspace=False, **kinds)
    assert case.hf is not None
    from trainledger.hf import workload_from_setup

    config, setup = case.hf(dry)

    def build(depth: int) -> Workload:
        return workload_from_setup({**config, "num_hidden_layers": depth}, setup, fake=True)

    return trace_stacked(build, config["num_hidden_layers"], kernel_workspace=False, **kinds)


def _as_run(case: Case, ledger: Ledger) -> Ledger:
    """The ledger of the step as the GPU runs it: FSDP2 on one rank is the sharding transform at world 1."""
    if case.kind != "fsdp2":
        return ledger
    from trainledger.shard import shard

    return shard(ledger, world_size=1, strategy="full_shard").ranks[0]


# --- (b), (c), (d): the step on the device --------------------------------------------------------------------


def on_device(case: Case, dry: bool, device: str, plan: Any) -> dict[str, Any]:
    """Measure one step on ``device`` (allocator counters on CUDA), then trace it there."""
    from trainledger.measure import measure
    from trainledger.trace import trace

    workload = _moved(case.build(dry, False), device)
    if plan is not None:
        plan.apply(workload.model)
    if case.kind == "fsdp2":
        _fully_shard(workload.model, device)
    m = measure(workload, num_steps=2)
    out: dict[str, Any] = {"max_allocated": m.peak_bytes, "max_reserved": m.reserved_peak_bytes}
    try:
        ledger = trace(workload, kernel_workspace=False)
    except Exception as exc:  # recorded in the table: the kit reports on every workload
        out["trace_error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        return out
    out["traced_peak"] = ledger.peak().bytes
    kind = "cuda" if device.startswith("cuda") else "cpu"
    out["traced_reserved"] = predict_reserved(ledger, kernel_kind=kind).max_reserved_bytes
    return out


def _moved(workload: Workload, device: str) -> Workload:
    """The workload with its model, reference and batch on ``device`` (before any optimizer exists)."""
    workload.model.to(device)
    if workload.reference is not None:
        workload.reference.to(device)
    batch = workload.batch
    if isinstance(batch, dict):
        workload.batch = {k: v.to(device) for k, v in batch.items()}
    elif isinstance(batch, (tuple, list)):
        workload.batch = type(batch)(v.to(device) for v in batch)
    else:
        workload.batch = batch.to(device)
    return workload


def _fully_shard(model: torch.nn.Module, device: str) -> None:
    """FSDP2 over a process group of one: each block a unit, then the root."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    mesh = dist.device_mesh.init_device_mesh(device.split(":")[0], (1,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _without_leftover_group(step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``step()``, and the process group of one that FSDP2's workload started destroyed afterwards, so the
    next workload (or whatever else runs in this process) starts without one."""
    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    try:
        return step()
    finally:
        if dist.is_available() and dist.is_initialized() and not had_group:
            dist.destroy_process_group()


def run_case(case: Case, *, dry: bool) -> dict[str, Any]:
    """One workload: the prediction on the CPU, then the step on the GPU (on the CPU with ``dry``)."""
    start = time.perf_counter()
    row: dict[str, Any] = {"name": case.name, "what": case.what}
    device = "cpu" if dry else "cuda"
    predicted, plan = predict(case, dry, card_of(None if dry else torch.cuda.get_device_name(0)))
    row.update(predicted)
    measured = _without_leftover_group(lambda: on_device(case, dry, device, plan))
    row.update(measured if not dry else {"dry_" + k: v for k, v in measured.items()})
    row["seconds"] = time.perf_counter() - start
    return row


# --- the table ----------------------------------------------------------------------------------------------


def _size(value: Any, shift: int) -> str:
    """Bytes in GiB (``shift`` 30) or MiB (20); a note as it is; ``None``: not run."""
    if value is None:
        return NOT_RUN
    return f"{value / 2**shift:.3f}" if isinstance(value, int) else str(value)


def _error(predicted: Any, actual: Any) -> str:
    if not isinstance(predicted, int) or not isinstance(actual, int) or not actual:
        return NOT_RUN if actual is None else "n/a"
    return f"{100 * (predicted - actual) / actual:+.1f}%"


COLUMNS = (
    "workload",
    "(a) CUDA-kind trace peak",
    "(a) analytic peak",
    "CPU fake trace peak (cpu kernels)",
    "(b) CUDA trace peak",
    "(c) max_memory_allocated",
    "(a) vs (c)",
    "CPU fake vs (c)",
    "(d) model reserved from (a)",
    "(d) model reserved from (b)",
    "(d) max_memory_reserved",
    "(d) from (a) vs real",
    "(d) from (b) vs real",
)


def table(rows: list[dict[str, Any]], *, dry: bool) -> str:
    """The Markdown table (GiB, 2^30 bytes; MiB in a dry run): GPU columns say "not run" in a dry run; a
    prediction that could not be made says why in its cell."""
    shift = 20 if dry else 30
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        a = r.get("cuda_peak", r.get("cuda_error", "n/a"))
        cpu = r.get("fake_peak", r.get("fake_error", "n/a"))
        reserved_a = r.get("cuda_reserved", r.get("cuda_error", "n/a"))
        gpu = {k: None if dry else r.get(k, r.get("trace_error", "n/a")) for k in ("traced_peak", "traced_reserved")}
        allocated = None if dry else r.get("max_allocated")
        reserved = None if dry else r.get("max_reserved")
        cells = (
            f"{r['name']}: {r['what']}",
            _size(a, shift),
            _size(r.get("analytic_peak", "n/a"), shift),
            _size(cpu, shift),
            _size(gpu["traced_peak"], shift),
            _size(allocated, shift),
            _error(a, allocated),
            _error(cpu, allocated),
            _size(reserved_a, shift),
            _size(gpu["traced_reserved"], shift),
            _size(reserved, shift),
            _error(reserved_a, reserved),
            _error(gpu["traced_reserved"], reserved),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _in_fresh_process(name: str, timeout_s: float, *, dry: bool = False) -> dict[str, Any]:
    """One workload in its own process, so that each starts with an empty allocator cache."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_validation", "--one", name, *(["--dry"] if dry else [])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"name": name, "what": CASE_BY_NAME[name].what, "trace_error": f"timed out after {timeout_s:g} s"}
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-1:])[:160]
        return {"name": name, "what": CASE_BY_NAME[name].what, "trace_error": f"failed: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _header(dry: bool, cards: list[str]) -> str:
    if dry:
        where = "dry run on the CPU: every workload at reduced size; the GPU columns are not run"
    else:
        props = torch.cuda.get_device_properties(0)
        where = f"{props.name}, {props.total_memory:,} bytes, torch {torch.__version__}"
    card = ", ".join(sorted(set(cards))) or DEFAULT_CUDA_DEVICE
    return (
        f"# GPU validation ({where})\n\n"
        f"{'MiB = 2^20' if dry else 'GiB = 2^30'} bytes. (a) made without the GPU, with CUDA's kernels as on the "
        f"{card} (the CUDA-kind trace: substituted on fake CPU tensors; the analytic estimate); the CPU fake trace "
        "runs the CPU's kernels on the same fake tensors; (b) traced on the GPU; (c) and max_memory_reserved: "
        "PyTorch's allocator counters over one step; (d) trainledger's caching allocator model.\n\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_validation", description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="every part but the GPU's, each workload at reduced size")
    p.add_argument("--only", default=None, help=f"comma-separated workloads (default all: {', '.join(CASE_BY_NAME)})")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu_validation.md and .json")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per workload on the GPU (default 150)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: one workload, JSON on stdout
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_case(CASE_BY_NAME[args.one], dry=args.dry)))
        return 0
    if not args.dry and not torch.cuda.is_available():
        print("skipped: no CUDA device (run with --dry for every part but the GPU's)")
        return 0
    names = [n.strip() for n in args.only.split(",")] if args.only else list(CASE_BY_NAME)
    unknown = [n for n in names if n not in CASE_BY_NAME]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; accepted: {', '.join(CASE_BY_NAME)}")
    rows = []
    for name in names:
        row = run_case(CASE_BY_NAME[name], dry=True) if args.dry else _in_fresh_process(name, args.timeout)
        print(f"{name}: {row['seconds'] if 'seconds' in row else 0:.1f} s", file=sys.stderr)
        rows.append(row)
    text = _header(args.dry, [r["card"] for r in rows if "card" in r]) + table(rows, dry=args.dry) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_validation_dry" if args.dry else "gpu_validation"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
