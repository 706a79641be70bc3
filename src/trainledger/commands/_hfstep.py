"""The step a command traces: ``--model``, or a Hugging Face config with its step flags (``trace``,
``plan``, ``pareto``), and how it is sharded over data-parallel ranks."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from rich.console import Console

from trainledger.analytic import FAMILIES, load_config_file, unmodelled
from trainledger.commands.common import add_model_flag, flags_verb, positive_int
from trainledger.commands.estimate import STEP_DEFAULTS, add_step_flags, check_lora_flags, setup_from
from trainledger.errors import InputError
from trainledger.sources import load_workload
from trainledger.workload import Workload

if TYPE_CHECKING:
    from trainledger.anymodel import AnyConfig
    from trainledger.hf import HFConfig

TASK_NAMES = (
    "causal-lm",
    "seq2seq",
    "masked-lm",
    "sequence-classification",
    "token-classification",
    "question-answering",
    "image-classification",
    "semantic-segmentation",
    "speech-seq2seq",
    "ctc",
    "audio-classification",
    "contrastive",
)
"""The tasks of ``--task`` (:data:`trainledger.anymodel.TASKS`, named here so that ``--help`` imports no torch)."""


def add_step_source_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--model``, or ``--hf-config`` with the step flags; ``--world``/``--stage``; ``--fake``; ``--task``,
    ``--diffusers-config`` and ``--image-size`` for architectures outside the analytic families. Returns the
    group of the last three."""
    add_model_flag(p, unless="--hf-config")
    hf = p.add_argument_group("a Hugging Face architecture instead of --model (local config; nothing downloaded)")
    hf.add_argument("--hf-config", metavar="PATH", help="a local config.json or a folder holding one")
    add_step_flags(hf, unset=True)
    anymodel = p.add_argument_group("architectures outside the analytic families (built whole, on fake tensors too)")
    anymodel.add_argument(
        "--task",
        choices=tuple(TASK_NAMES),
        metavar="TASK",
        help=f"the model trained: {', '.join(TASK_NAMES)} (default: the config's architectures)",
    )
    anymodel.add_argument(
        "--diffusers-config",
        metavar="PATH",
        help="a diffusers model's local config.json, trained with the denoising loss (the diffusers extra)",
    )
    anymodel.add_argument(
        "--image-size",
        type=positive_int(),
        help="pixels per side for image classification, latent pixels for a diffusers model (default: the config's)",
    )
    sh = p.add_argument_group("data-parallel sharding of the traced step (predicted per rank)")
    sh.add_argument("--world", type=positive_int(), default=1, help="data-parallel ranks (default 1)")
    sh.add_argument("--stage", default="0", help="ZeRO stage 0-3 or an FSDP strategy (default 0)")
    p.add_argument("--fake", action="store_true", help="run on fake tensors: same ops and shapes, nothing allocated")
    return anymodel


def given_step_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The step flags the user gave (those of :data:`STEP_DEFAULTS` not left unset)."""
    return {k: getattr(args, k) for k in STEP_DEFAULTS if getattr(args, k) not in (None, False)}


def workload_for(args: argparse.Namespace, *, config: HFConfig | None = None, **step: Any) -> Workload:
    """The step the flags describe (``config``: this config of an analytic family instead of ``--hf-config``'s;
    ``step``: step settings that replace the flags', as a small instance's sequence length)."""
    sources = [f for f in ("model", "hf_config", "timm", "diffusers_config") if getattr(args, f, None)]
    if len(sources) > 1:
        flags = ", ".join("--" + f.replace("_", "-") for f in sources)
        raise InputError(f"give one of {flags}, not {len(sources)}")
    given = given_step_flags(args)
    fake = step.pop("fake", args.fake)
    if getattr(args, "timm", None) or getattr(args, "diffusers_config", None):
        return vision_workload(args, {**given, **step}, fake=fake)
    if args.hf_config and config is None and not in_analytic_family(args):
        return any_workload(args, {**given, **step}, fake=fake)
    if getattr(args, "image_size", None) is not None:
        raise InputError("--image-size applies to a model that reads images (--task image-classification): drop it")
    if args.hf_config:
        from trainledger.hf import workload_from_setup

        flags = argparse.Namespace(**{**STEP_DEFAULTS, **given, **step})
        check_lora_flags(flags)
        return workload_from_setup(args.hf_config if config is None else config, setup_from(flags), fake=fake)
    if not args.model:
        raise InputError("give --model NAME|file.py:factory or --hf-config PATH (see --help)")
    if getattr(args, "task", None) is not None:
        raise InputError(
            f"--task applies only to a Hugging Face step (--hf-config); --model {args.model} runs its own model "
            "and batch: drop it"
        )
    if given:
        flags = flags_verb(["--" + k.replace("_", "-") for k in given], "applies", "apply")
        raise InputError(
            f"{flags} only to a Hugging Face step (--hf-config); --model {args.model} runs its own model "
            "and batch: drop them"
        )
    return load_workload(args.model)


def in_analytic_family(args: argparse.Namespace) -> bool:
    """A causal-LM step of one of the analytic model's families: built by :mod:`trainledger.hf` (and traced a
    few layers deep); any other architecture is built whole by :mod:`trainledger.anymodel`."""
    if getattr(args, "task", None) not in (None, "causal-lm"):
        return False
    raw = load_config_file(args.hf_config)
    if raw.get("model_type") not in FAMILIES or unmodelled(raw) is not None:
        return False  # what the closed form has no count for (an activation): transformers still trains it
    if getattr(args, "task", None) is None and raw.get("architectures"):  # LlamaForSequenceClassification
        from trainledger.anymodel import load_any_config

        return load_any_config(raw).task == "causal-lm"
    return True


def any_workload(
    args: argparse.Namespace, given: dict[str, Any], cfg: AnyConfig | None = None, *, fake: bool | None = None
) -> Workload:
    """The step of an architecture outside the analytic families (its notes on stderr, one line each);
    ``given``: the step flags given; ``cfg``: the config to build instead of ``--hf-config`` (the same at
    another depth, a small instance); ``fake``: instead of ``--fake``."""
    from trainledger.anymodel import IMAGE_ONLY_TASKS, default_seq_len, load_any_config, workload_from_any_config

    cfg = cfg if cfg is not None else load_any_config(args.hf_config, task=args.task)
    fake = args.fake if fake is None else fake
    step = argparse.Namespace(**{**STEP_DEFAULTS, **given})
    check_lora_flags(step)
    if cfg.task in IMAGE_ONLY_TASKS and "seq_len" in given:
        article = "an" if cfg.task[:1] in "aeiou" else "a"
        raise InputError(f"--seq-len applies to sequences; {article} {cfg.task} model reads --image-size: drop it")
    if "seq_len" not in given:
        step.seq_len = default_seq_len(cfg, step.seq_len)
    setup = setup_from(step)
    workload = workload_from_any_config(cfg, setup, image_size=args.image_size, fake=fake)
    for note in (*cfg.notes, *_attention_note(workload, setup.attn_impl)):
        Console(stderr=True).print(f"note: {note}", highlight=False, soft_wrap=True)
    return workload


def _attention_note(workload: Workload, asked: str) -> tuple[str, ...]:
    """What to say when the model was built with another attention than asked for (an architecture that has
    no SDPA path in transformers, Bloom's, is built with its eager attention)."""
    config = getattr(workload.model, "config", None)
    built = getattr(config, "_attn_implementation", None)
    if not isinstance(built, str) or built == asked:
        return ()
    saves = " and saves each layer's attention probabilities (micro-batch × heads × seq²)" if built == "eager" else ""
    name = type(workload.model).__name__
    return (f"{name} has no {asked} attention in transformers: it is built with {built}{saves}",)


def vision_workload(
    args: argparse.Namespace,
    given: dict[str, Any],
    depth: int | None = None,
    *,
    fake: bool | None = None,
    config: dict[str, Any] | None = None,
) -> Workload:
    """A timm classifier (``depth`` blocks deep where given) or a diffusers denoiser (``--seq-len``: the
    denoiser's conditioning tokens, default 77); ``given``: the step flags given; ``fake`` and ``config`` (a
    diffusers config as a dict): instead of ``--fake`` and ``--diffusers-config``."""
    from trainledger.vision import workload_from_diffusers_config, workload_from_timm

    fake = args.fake if fake is None else fake
    config = args.diffusers_config if config is None else config
    step = argparse.Namespace(**{**STEP_DEFAULTS, "seq_len": 77, **given})
    check_lora_flags(step)
    setup = setup_from(step)
    if getattr(args, "timm", None):  # trace's flag alone
        return workload_from_timm(args.timm, setup, image_size=args.image_size, fake=fake, depth=depth)
    return workload_from_diffusers_config(config, setup, latent_size=args.image_size, fake=fake)


SMALL_STEP: dict[str, Any] = {"micro_batch": 2, "seq_len": 32}
"""The step of a small real instance (see :func:`small_workload`), on real tensors."""
SMALL_MAX_PARAMETERS = 200_000_000
"""The most parameters a small instance may have: a real fp32 step with AdamW state holds 16 bytes of each."""


def small_workload(args: argparse.Namespace) -> tuple[Workload, str]:
    """A real step of the ``--hf-config`` architecture, a few blocks deep and narrow, with the other step
    flags kept: where a plan made on fake tensors at full size has its gradients compared. Returns it and what
    it is, for the report (``3 blocks, hidden 64, 2 sequences of 32 tokens``)."""
    from trainledger.commands._stacked import SMALL_DEPTH, SMALL_WIDTHS, small_config

    given = given_step_flags(args)
    if args.diffusers_config:
        from trainledger.vision import small_diffusers_config

        raw, what = small_diffusers_config(load_config_file(args.diffusers_config))
        small = vision_workload(args, {**given, **SMALL_STEP}, fake=False, config=raw)
        side = args.image_size or raw.get("sample_size") or 64
        return small, f"{what}, {SMALL_STEP['micro_batch']} latents of {side} pixels a side"
    if in_analytic_family(args):
        small = workload_for(args, config=small_config(args.hf_config), **SMALL_STEP, fake=False)
        return small, f"{SMALL_DEPTH} blocks, hidden {SMALL_WIDTHS['hidden_size']}, {_small_batch('causal-lm')}"
    from trainledger.anymodel import IMAGE_ONLY_TASKS, load_any_config, skeleton, small_instance

    cfg, what = small_instance(load_any_config(args.hf_config, task=args.task))
    numel = sum(p.numel() for p in skeleton(cfg, image_size=args.image_size).parameters())
    if numel > SMALL_MAX_PARAMETERS:
        raise InputError(
            f"--verify compares gradients on a small real instance of the architecture, and this one's is "
            f"{numel:,} parameters ({what}): too many to step here; drop --verify"
        )
    step = {k: v for k, v in SMALL_STEP.items() if k != "seq_len" or cfg.task not in IMAGE_ONLY_TASKS}
    return any_workload(args, {**given, **step}, cfg, fake=False), f"{what}, {_small_batch(cfg.task)}"


def _small_batch(task: str) -> str:
    """A small instance's batch, in words."""
    from trainledger.anymodel import IMAGE_ONLY_TASKS

    if task in IMAGE_ONLY_TASKS:
        return f"{SMALL_STEP['micro_batch']} images"
    if task in ("speech-seq2seq", "ctc", "audio-classification"):
        return f"{SMALL_STEP['micro_batch']} clips"
    pairs = "image–text pairs" if task == "contrastive" else "sequences"
    return f"{SMALL_STEP['micro_batch']} {pairs} of {SMALL_STEP['seq_len']} tokens"
