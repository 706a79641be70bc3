"""``trainledger estimate``: the analytic peak of a Hugging Face architecture, instantly, without running it."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.text import Text

from trainledger.analytic import (
    FAMILIES,
    OPTIMIZERS,
    RECIPES,
    REMATS,
    EstimateResult,
    Setup,
    estimate,
    load_config_file,
)
from trainledger.commands._gpu import Target, add_device_flags, device_line, reserved_text
from trainledger.commands.common import add_json_flag, emit, positive_int
from trainledger.devices import Device
from trainledger.errors import InputError
from trainledger.report.terminal import (
    UNITS_NOTE,
    both_units,
    category_table,
    notes_text,
    peak_text,
    print_renderables,
)

RECIPE_HELP = "bf16-master (bf16 weights, fp32 master and moments), bf16 (pure) or fp32 (default bf16-master)"
STEP_DEFAULTS: dict[str, Any] = {
    "micro_batch": 1,
    "seq_len": 2048,
    "dtype": "bf16-master",
    "optimizer": "adamw",
    "attn": "sdpa",
    "lora_rank": 0,
    "lora_targets": None,
    "reference": False,
}
"""The step of a Hugging Face architecture when its flags are not given."""


def add_step_flags(
    p: argparse._ActionsContainer, *, micro_batch: bool = True, unset: bool = False, dtype_help: str = RECIPE_HELP
) -> None:
    """The flags of one step of a Hugging Face architecture (``estimate``, ``fit``, ``trace --hf-config``).

    ``unset``: leave every default ``None`` (the help still states it), so that a command can tell a flag
    the user gave from one left alone (``trace --model`` refuses the flags it would ignore).
    """

    def default(name: str) -> Any:
        return None if unset else STEP_DEFAULTS[name]

    if micro_batch:
        p.add_argument(
            "--micro-batch", type=positive_int(), default=default("micro_batch"), help="sequences (default 1)"
        )
    p.add_argument(
        "--seq-len", type=positive_int(), default=default("seq_len"), help="tokens per sequence (default 2048)"
    )
    p.add_argument("--dtype", default=default("dtype"), choices=tuple(RECIPES), metavar="RECIPE", help=dtype_help)
    p.add_argument(
        "--optimizer",
        default=default("optimizer"),
        choices=OPTIMIZERS,
        metavar="NAME",
        help=f"{', '.join(OPTIMIZERS)} (default adamw)",
    )
    p.add_argument(
        "--attn",
        default=default("attn"),
        choices=("sdpa", "eager"),
        metavar="IMPL",
        help="attention implementation: sdpa or eager (default sdpa)",
    )
    p.add_argument(
        "--lora-rank",
        type=positive_int(minimum=0),
        default=default("lora_rank"),
        help="LoRA rank (frozen base); 0 trains every weight (default 0)",
    )
    p.add_argument(
        "--lora-targets",
        default=None,
        help="with --lora-rank: comma-separated linears to adapt (default q_proj,v_proj)",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        default=default("reference"),
        help="a frozen reference model and the DPO loss",
    )


def add_setup_flags(p: argparse.ArgumentParser, *, micro_batch: bool = True, dtype_help: str = RECIPE_HELP) -> None:
    """The flags that describe the step, shared by ``estimate`` and ``fit``."""
    p.add_argument("--hf-config", required=True, metavar="PATH", help="a local config.json or a folder holding one")
    add_step_flags(p, micro_batch=micro_batch, dtype_help=dtype_help)
    p.add_argument("--tensor-parallel", type=positive_int(), default=1, help="Megatron TP degree (default 1)")
    p.add_argument(
        "--sequence-parallel", action="store_true", help="with --tensor-parallel above 1: split norms/dropouts"
    )
    p.add_argument("--pipeline-parallel", type=positive_int(), default=1, help="1F1B stages (default 1)")
    p.add_argument(
        "--device-kind",
        default=None,
        choices=("cuda", "cpu"),
        metavar="KIND",
        help="whose kernels: cuda (default) or cpu (to compare with a trace on this machine)",
    )
    add_device_flags(p)
    p.add_argument("--world", type=positive_int(), default=1, help="data-parallel ranks (default 1)")


def check_lora_flags(args: argparse.Namespace) -> None:
    """``--lora-targets`` only means something with a LoRA rank, and names at least one linear."""
    if args.lora_targets is not None and not args.lora_rank:
        raise InputError(
            f"--lora-targets {args.lora_targets!r} needs --lora-rank N (above 0); add it or drop the targets"
        )
    if args.lora_targets is not None and not any(t.strip() for t in args.lora_targets.split(",")):
        raise InputError(
            f"--lora-targets {args.lora_targets!r} names no linear; give comma-separated names (q_proj,v_proj)"
        )


def kernel_kind_of(args: argparse.Namespace) -> str:
    """``--device-kind``, or ``cuda`` (its default, and a ``--device``'s kernels)."""
    kind = getattr(args, "device_kind", None)
    device = getattr(args, "device", None)
    if device is not None and kind not in (None, device.kernel_kind):
        raise InputError(
            f"--device {device.name} runs {device.kernel_kind} kernels, --device-kind {kind} assumes others: "
            "drop one of them"
        )
    return kind or "cuda"


def _gpu_of(args: argparse.Namespace) -> str | None:
    """The card a cuda step runs on: ``--device``'s (``None``: the H100 the cuda kind assumes)."""
    device = getattr(args, "device", None)
    return device.name if device is not None and kernel_kind_of(args) == "cuda" else None


def setup_from(args: argparse.Namespace, **overrides: object) -> Setup:
    """The :class:`Setup` the step flags describe (a flag a command does not have takes its default)."""
    targets = tuple(t.strip() for t in (args.lora_targets or "").split(",") if t.strip())
    fields = dict(
        micro_batch=getattr(args, "micro_batch", 1),
        seq_len=args.seq_len,
        recipe=args.dtype,
        optimizer=args.optimizer,
        attn_impl=args.attn,
        device=kernel_kind_of(args),
        gpu=_gpu_of(args),
        remat=getattr(args, "remat", "none"),
        remat_every=getattr(args, "remat_every", None) or 1,
        lora_rank=args.lora_rank,
        lora_targets=targets,
        reference=args.reference,
        tensor_parallel=getattr(args, "tensor_parallel", 1),
        sequence_parallel=getattr(args, "sequence_parallel", False),
        pipeline_parallel=getattr(args, "pipeline_parallel", 1),
    )
    fields.update(overrides)
    return Setup(**fields)  # type: ignore[arg-type]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="analytic peak of a Hugging Face architecture (instant, nothing is run or downloaded)",
        description="Closed-form ledger of one training step of a Hugging Face config: exact parameter counts, "
        "activations as each family saves them, the peak taken at one instant (evidence analytic).",
    )
    add_setup_flags(p)
    p.add_argument(
        "--remat",
        default="none",
        choices=REMATS,
        metavar="POLICY",
        help=f"rematerialization: {', '.join(REMATS)} (default none)",
    )
    p.add_argument(
        "--remat-every", type=positive_int(), default=None, help="with --remat full: every k-th layer (default 1)"
    )
    p.add_argument("--stage", default="0", help="ZeRO stage 0, 1, 2 or 3 across --world ranks (default 0)")
    add_json_flag(p)
    p.set_defaults(run=run)


def check_analytic_family(path: str) -> None:
    """An architecture outside the analytic model's families: say that only the trace covers it."""
    model_type = load_config_file(path).get("model_type")
    if isinstance(model_type, str) and model_type not in FAMILIES:
        raise InputError(
            f"model_type {model_type!r} is outside the analytic model ({', '.join(FAMILIES)}); only the trace "
            f"covers it: trainledger trace --hf-config {path} --fake"
        )


def compute(args: argparse.Namespace) -> EstimateResult:
    check_analytic_family(args.hf_config)
    check_lora_flags(args)
    if args.remat_every is not None and args.remat != "full":
        raise InputError(f"--remat-every {args.remat_every} applies with --remat full; add it or drop --remat-every")
    result = estimate(args.hf_config, setup_from(args), world=args.world, stage=args.stage)
    if result.world == 1 and result.stage != "zero0":
        raise InputError(
            f"--stage {args.stage} shards across --world ranks, and one rank (the default) changes nothing; "
            "give --world N"
        )
    return replace(result, reserved=Target.of(args).predict(result.ledger, kernel_kind=result.setup.device))


def run(args: argparse.Namespace) -> int:
    result = compute(args)
    device = args.device
    return emit(result, lambda r, console: render(r, console, device=device), as_json=args.json)


def render(result: EstimateResult, console: Console, *, device: Device | None = None) -> None:
    led, s = result.ledger, result.setup
    pk = led.peak()
    if s.device == "cuda":
        kinds = f"kernels: cuda as on {s.card.name} (--device-kind: cuda by default, cpu to compare with a trace here)"
    else:
        kinds = "kernels: cpu (--device-kind: cuda by default, cpu to compare with a trace on this machine)"
    first = [kinds] + ([device_line(device)] if device is not None else [])
    title = (
        f"{result.spec.family} from {result.source}: micro-batch {s.micro_batch} × {s.seq_len} tokens, {s.recipe}, "
        f"{s.optimizer}, {s.attn_impl}, remat {s.remat}"
        + (f", ZeRO-{result.stage[-1]} over {result.world} ranks (rank 0)" if result.world > 1 else "")
        + (f", tensor-parallel {s.tensor_parallel}" if s.tensor_parallel > 1 else "")
    )
    per_layer = result.saved_bytes_per_layer
    split = s.tensor_parallel > 1 or s.pipeline_parallel > 1  # the ledger is one rank's share of the layers
    facts = [
        f"parameters {result.num_params:,} (exact: transformers' own count); trainable "
        f"{result.num_trainable_params:,}" + (" on this rank (its tensor-parallel or pipeline share)" if split else ""),
        f"activations saved per layer {per_layer:,} bytes ({both_units(per_layer)})",
        "an analytic peak is an estimate; `trainledger trace --hf-config ... --fake` traces the real step at full size",
    ]
    items: list[object] = [
        Text("\n".join(first)),
        category_table(led, title=title),
        peak_text(pk, evidence=str(led.evidence), maxima=led.category_maxima(), single_instant=False, kernels=s.device),
        Text("\n".join(facts)),
    ]
    if result.reserved is not None:
        items.append(reserved_text(result.reserved, device))
    print_renderables(*items, notes_text([*led.notes, UNITS_NOTE]), console=console)
