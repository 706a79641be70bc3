"""``estimate``: the analytic ledger of a config, optionally sharded across data-parallel ranks (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from trainledger.allocator import ReservedPrediction
from trainledger.analytic._arch import ArchSpec
from trainledger.analytic._config import arch_from_config, load_config_file
from trainledger.analytic._model import analytic_ledger, saved_bytes_per_layer
from trainledger.analytic._params import num_params
from trainledger.analytic._setup import Setup, setup_from_dict, setup_to_dict
from trainledger.checks import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    MAX_WIDTH,
    MAX_WORLD,
    instance_of,
    whole_number,
)
from trainledger.errors import InputError
from trainledger.ledger import Ledger

STAGES = ("zero0", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class EstimateResult:
    """The analytic peak of one rank, with the numbers it rests on."""

    source: str
    spec: ArchSpec
    setup: Setup
    ledger: Ledger
    """One rank's ledger (after the ZeRO transform when ``world > 1``)."""
    world: int
    stage: str
    num_params: int
    num_trainable_params: int
    saved_bytes_per_layer: int
    reserved: ReservedPrediction | None = None
    """The caching allocator model's prediction for this ledger (``estimate --device``/``--allocator``)."""

    def to_dict(self) -> dict[str, Any]:
        out = self.ledger.to_dict(entries=False)
        out["result"] = "estimate"
        out["source"] = self.source
        out["family"] = self.spec.family
        out["spec"] = asdict(self.spec)
        out["num_params"] = self.num_params
        out["num_trainable_params"] = self.num_trainable_params
        out["saved_activation_bytes_per_layer"] = self.saved_bytes_per_layer
        out["world"] = self.world
        out["stage"] = self.stage
        out["setup"] = setup_to_dict(self.setup)
        out["by_category"] = {k[0]: v for k, v in self.ledger.bytes_by("category").items()}
        out["kernel_kind"] = self.setup.device
        if self.reserved is not None:
            out["allocator"] = self.reserved.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EstimateResult:
        """Read ``to_dict()`` back (``trainledger report``).

        The saved JSON holds the architecture and the setup, not the entries: the closed form is evaluated
        again (instant, nothing runs) and must give the saved peak, or the file came from another version
        of the model and is refused.
        """
        spec = _saved_spec(data["spec"])
        result = _estimate(spec, setup_from_dict(data["setup"]), int(data["world"]), str(data["stage"]))
        reserved = data.get("allocator")
        result = replace(
            result,
            source=str(data["source"]),
            reserved=ReservedPrediction.from_dict(reserved) if reserved is not None else None,
        )
        saved, now = int(data["peak"]["bytes"]), result.ledger.peak().bytes
        if saved != now:
            raise InputError(
                f"the saved estimate's peak {saved:,} bytes differs from {now:,} bytes that this version's "
                "analytic model gives for the same setup; re-run trainledger estimate"
            )
        return result


_SAVED_LIMITS = {
    "num_layers": MAX_LAYERS,
    "vocab_size": MAX_VOCAB,
    "learned_positions": MAX_SEQ_LEN,
    "sliding_window": MAX_SEQ_LEN,
    "num_experts": MAX_EXPERTS,
}
"""The limits a config's sizes have, for those of a saved architecture that are no widths."""


def _saved_spec(data: Any) -> ArchSpec:
    """A saved architecture, its sizes checked as a config's are (a file edited by hand could name 10^30 layers,
    which the closed form would try to list)."""
    if not isinstance(data, dict):
        raise InputError(f"the saved estimate's spec is {type(data).__name__}, not an object; re-run the estimate")
    for key, value in data.items():
        limit = _SAVED_LIMITS.get(key, MAX_WIDTH)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= limit.value:
            raise InputError(
                f"the saved estimate's spec.{key} is {value:,}; from 0 to {limit.value:,} is accepted ({limit.why})"
            )
    try:
        return ArchSpec(**data)
    except TypeError as exc:
        raise InputError(f"the saved estimate's spec does not read as one: {exc}; re-run the estimate") from None


def read_config(config: Any) -> dict[str, Any]:
    """The config as a dict (a ``config.json``, a folder holding one, or the dict itself) of a causal language
    model: the step the closed form models."""
    raw = dict(config) if isinstance(config, dict) else load_config_file(config)
    named = raw.get("architectures")
    classes = [n for n in named if isinstance(n, str)] if isinstance(named, list) else []
    if classes and not any(n.endswith(_CAUSAL_LM_CLASSES) for n in classes):
        raise InputError(
            f"the config's architectures name {classes[0]!r}, not a causal language model: the closed form models "
            "the causal-LM step (its head, logits and loss); trace this one (trainledger trace --hf-config PATH "
            "--fake), or drop architectures to estimate the causal-LM model of these sizes"
        )
    return raw


_CAUSAL_LM_CLASSES = ("ForCausalLM", "LMHeadModel")
"""How transformers names the causal-LM classes of the analytic families (``GPT2LMHeadModel``)."""


def check_setup(setup: Any) -> Setup:
    """``setup``, or the default :class:`Setup` for ``None``."""
    if setup is None:
        return Setup()
    return instance_of(setup, Setup, "setup", "give a trainledger.Setup(micro_batch=..., seq_len=..., ...) or None")


def check_positions(spec: ArchSpec, setup: Setup) -> None:
    """A model with learned positions (GPT-2) cannot run sequences longer than it has positions."""
    if spec.learned_positions and setup.seq_len > spec.learned_positions:
        raise InputError(
            f"sequence length {setup.seq_len} exceeds the {spec.learned_positions} learned positions "
            f"(n_positions) of this model; give a sequence of at most {spec.learned_positions} tokens (--seq-len)"
        )


def shard_ledger(ledger: Ledger, world: int, stage: str) -> tuple[Ledger, tuple[str, ...]]:
    """Rank 0's ledger of ``ledger`` under ZeRO ``stage`` over ``world`` ranks (DeepSpeed's partitioning)."""
    if world == 1 or (stage == "zero0" and world == 1):
        return ledger, ()
    from trainledger.shard import ShardConfig, shard

    res = shard(ledger, ShardConfig(world_size=world, strategy=stage, engine="deepspeed"))  # type: ignore[arg-type]
    rank0 = res.ranks[0]
    meta = {**ledger.meta, "shard": {"world": world, "stage": stage, "label": res.label}}
    return rank0.with_entries(rank0.entries, meta=meta, notes=(*ledger.notes, *res.notes)), res.notes


def estimate(
    config: str | Path | dict[str, Any], setup: Setup | None = None, *, world: int = 1, stage: str = "zero0"
) -> EstimateResult:
    """The analytic estimate of one training step of a Hugging Face config (evidence ``analytic``).

    Arguments:
        config: a ``config.json``, a folder holding one, or the config as a dict.
        setup: how the step runs (micro-batch, sequence, precision, recomputation, parallelism).
        world: data-parallel ranks; stage: ``zero0`` … ``zero3`` (see :mod:`trainledger.shard`).

    Example:
        >>> r = estimate({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
        ...     "n_head": 12}, Setup(micro_batch=4, seq_len=1024, recipe="fp32"))
        >>> r.num_params, r.ledger.peak().phase
        (124439808, 'backward')
    """
    setup = check_setup(setup)
    whole_number(world, "world size (data-parallel ranks)", limit=MAX_WORLD)
    raw = read_config(config)
    result = _estimate(arch_from_config(raw), setup, world, stage)
    return replace(result, source="config" if isinstance(config, dict) else str(config))


def _estimate(spec: ArchSpec, setup: Setup, world: int, stage: str) -> EstimateResult:
    from trainledger.shard import parse_strategy

    check_positions(spec, setup)
    strategy = parse_strategy(stage)
    if strategy not in STAGES:
        raise InputError(f"stage {stage!r}: the analytic estimate takes ZeRO stages 0, 1, 2, 3")
    led = analytic_ledger(spec, setup)
    trainable = led.num_params()
    led, _ = shard_ledger(led, world, strategy)
    return EstimateResult(
        source="config",
        spec=spec,
        setup=setup,
        ledger=led,
        world=world,
        stage=strategy,
        num_params=num_params(spec),
        num_trainable_params=trainable,
        saved_bytes_per_layer=saved_bytes_per_layer(spec, setup),
    )
