"""The step a command traces: ``--model``, or a Hugging Face config with its step flags (``trace``,
``plan``, ``pareto``), and how it is sharded over data-parallel ranks."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from trainledger.commands.common import add_model_flag, flags_verb, positive_int
from trainledger.commands.estimate import (
    STEP_DEFAULTS,
    add_step_flags,
    check_analytic_family,
    check_lora_flags,
    setup_from,
)
from trainledger.errors import InputError
from trainledger.sources import load_workload
from trainledger.workload import Workload

if TYPE_CHECKING:
    from trainledger.hf import HFConfig


def add_step_source_flags(p: argparse.ArgumentParser) -> None:
    """``--model``, or ``--hf-config`` with the step flags; ``--world``/``--stage``; ``--fake``."""
    add_model_flag(p, unless="--hf-config")
    hf = p.add_argument_group("a Hugging Face architecture instead of --model (local config; nothing downloaded)")
    hf.add_argument("--hf-config", metavar="PATH", help="a local config.json or a folder holding one")
    add_step_flags(hf, unset=True)
    sh = p.add_argument_group("data-parallel sharding of the traced step (predicted per rank)")
    sh.add_argument("--world", type=positive_int(), default=1, help="data-parallel ranks (default 1)")
    sh.add_argument("--stage", default="0", help="ZeRO stage 0-3 or an FSDP strategy (default 0)")
    p.add_argument("--fake", action="store_true", help="run on fake tensors: same ops and shapes, nothing allocated")


def given_step_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The step flags the user gave (those of :data:`STEP_DEFAULTS` not left unset)."""
    return {k: getattr(args, k) for k in STEP_DEFAULTS if getattr(args, k) not in (None, False)}


def workload_for(args: argparse.Namespace, *, config: HFConfig | None = None, **step: Any) -> Workload:
    """The step the flags describe (``config``: this config instead of ``--hf-config``'s; ``step``: step
    settings that replace the flags', as a small instance's sequence length)."""
    if args.model and args.hf_config:
        raise InputError("give either --model or --hf-config, not both")
    given = given_step_flags(args)
    if args.hf_config:
        from trainledger.hf import workload_from_setup

        if config is None:  # plan's and pareto's step is built for the analytic families only (trace's is not)
            check_analytic_family(args.hf_config)
        flags = argparse.Namespace(**{**STEP_DEFAULTS, **given, **step})
        check_lora_flags(flags)
        fake = step.get("fake", args.fake)
        return workload_from_setup(args.hf_config if config is None else config, setup_from(flags), fake=fake)
    if not args.model:
        raise InputError("give --model NAME|file.py:factory or --hf-config PATH (see --help)")
    if given:
        flags = flags_verb(["--" + k.replace("_", "-") for k in given], "applies", "apply")
        raise InputError(
            f"{flags} only to a Hugging Face step (--hf-config); --model {args.model} runs its own model "
            "and batch: drop them"
        )
    return load_workload(args.model)


SMALL_STEP: dict[str, Any] = {"micro_batch": 2, "seq_len": 32, "fake": False}
"""The step of a small real instance (see :func:`small_workload`)."""


def small_workload(args: argparse.Namespace) -> Workload:
    """A real step of the ``--hf-config`` architecture, a few blocks deep and narrow, with the other step
    flags kept: where a plan made on fake tensors at full size has its gradients compared."""
    from trainledger.commands._stacked import small_config

    return workload_for(args, config=small_config(args.hf_config), **SMALL_STEP)
