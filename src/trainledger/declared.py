"""Declared ledgers: the persistent state of a training setup from its stated format, no tensors.

``P`` parameters, each listed array with its own precision: weights, gradients, the optimizer's
full-length state arrays, an optional master copy. This is the seed's payload arithmetic
(``B = P · Σ b_k``) made into a ledger, so every consumer (reports, the sharding transform) treats it
like any other. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainledger.checks import MAX_PARAMS, instance_of, whole_number
from trainledger.errors import InputError
from trainledger.ledger import Category, Entry, Evidence, Ledger
from trainledger.units import dtype_bytes, parse_dtype

# Full-length state arrays each optimizer keeps per parameter (scalar step counters are left out and
# named in the notes). Adafactor's factored state depends on tensor shapes, so it cannot be declared
# from a parameter count alone.
OPTIMIZER_ARRAYS: dict[str, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw-amsgrad": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "sgd": (),
    "sgd-momentum": ("momentum_buffer",),
    "lion": ("exp_avg",),
    "adagrad": ("sum",),
    "rmsprop": ("square_avg",),
    "adamax": ("exp_avg", "exp_inf"),
    "none": (),
}

RNG_STATE_ROLE = "checkpoint_rng_state"
"""The role of a copy of the CPU generator's state that ``torch.utils.checkpoint`` makes
(``preserve_rng_state=True``): traced, declared by a plan's prediction, or analytic."""

CPU_RNG_STATE_BYTES = 5056
"""Bytes of ``torch.get_rng_state()``: the CPU generator's state (Mersenne Twister's 624 words and its
normal-sampling cache, ``CPUGeneratorImplState``), uint8; checked against torch in the tests."""


EXCLUDED = (
    "activations",
    "workspace",
    "communication buffers",
    "optimizer step counters (a few bytes per tensor)",
    "allocator rounding and fragmentation",
    "framework objects",
)


@dataclass(frozen=True, kw_only=True)
class StateSpec:
    """A training setup stated as formats, for a declared ledger."""

    num_params: int
    """Trainable parameters ``P``."""
    weights: str = "bf16"
    """Precision of the model's weights."""
    grads: str | None = None
    """Precision of the gradients (default: as the weights); ``"none"`` leaves them out."""
    optimizer: str = "adamw"
    """One of ``OPTIMIZER_ARRAYS``."""
    moments: str = "fp32"
    """Precision of the optimizer's state arrays."""
    master: str | None = None
    """Precision of a master copy of the weights held by the optimizer (``None``: no master copy)."""
    frozen_params: int = 0
    """Parameters of frozen weights (a LoRA base, a reference model), in the weights' precision."""
    device: str = "device"

    def __post_init__(self) -> None:
        whole_number(self.num_params, "parameter count", limit=MAX_PARAMS)
        whole_number(self.frozen_params, "frozen parameter count", minimum=0, limit=MAX_PARAMS)
        for what, value in (("weight", self.weights), ("optimizer state", self.moments)):
            _dtype(value, what)
        if self.grads is not None and self.grads != "none":
            _dtype(self.grads, "gradient")
        if self.master is not None:
            _dtype(self.master, "master copy")
        opt = self.optimizer.lower() if isinstance(self.optimizer, str) else self.optimizer
        if opt == "adafactor":
            raise InputError(
                "adafactor's factored state depends on tensor shapes, which a parameter count does not give; "
                "inventory a real model instead"
            )
        if opt not in OPTIMIZER_ARRAYS:
            raise InputError(f"unknown optimizer {self.optimizer!r}; accepted: {', '.join(OPTIMIZER_ARRAYS)}")
        instance_of(self.device, str, "device", "give a device name such as 'cuda' or 'device'")


def _dtype(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{what} precision {value!r} is not a dtype name; accepted: fp32, bf16, fp16, fp64, fp8")
    try:
        return parse_dtype(value)
    except InputError as exc:
        raise InputError(f"{what} precision: {exc}") from None


def declared_ledger(spec: StateSpec) -> Ledger:
    """The ledger of ``spec``: one entry per full-length array, evidence ``declared``.

    Example:
        >>> led = declared_ledger(StateSpec(num_params=10**9, weights="bf16", optimizer="adamw", moments="fp32"))
        >>> led.peak().bytes
        12000000000
    """
    instance_of(spec, StateSpec, "the stated format", "give a trainledger.StateSpec(num_params=..., ...)")
    opt = spec.optimizer.lower()
    P = spec.num_params
    weights = parse_dtype(spec.weights)
    rows: list[tuple[str, Category, str, str, int]] = [("weights", Category.WEIGHTS, "param", weights, P)]
    if spec.master is not None:
        rows.append(("master", Category.OPTIMIZER, "master", parse_dtype(spec.master), P))
    moments = parse_dtype(spec.moments)
    rows += [(role, Category.OPTIMIZER, role, moments, P) for role in OPTIMIZER_ARRAYS[opt]]
    grads = weights if spec.grads is None else spec.grads
    if grads != "none":
        rows.append(("gradients", Category.GRADIENTS, "grad", parse_dtype(grads), P))
    if spec.frozen_params:
        rows.append(("frozen", Category.FROZEN, "param", weights, spec.frozen_params))
    entries = tuple(
        Entry(
            name=name,
            category=cat,
            role=role,
            dtype=dtype,
            numel=numel,
            nbytes=numel * dtype_bytes(dtype),
            device=spec.device,
            owner="declared",
            evidence=Evidence.DECLARED,
        )
        for name, cat, role, dtype, numel in rows
    )
    return Ledger(
        entries,
        evidence=Evidence.DECLARED,
        device=spec.device,
        notes=("declared from a stated format; excluded: " + ", ".join(EXCLUDED),),
        meta={"spec": dict(spec.__dict__)},
    )
