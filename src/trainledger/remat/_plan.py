"""A rematerialization plan: what to recompute, what it should achieve, and how to make a model run it.

``apply(model)`` wraps each named module's ``forward`` in non-reentrant ``torch.utils.checkpoint`` (RNG
state preserved, so dropout draws the same masks when recomputed); a ``selective`` region keeps the
outputs of matrix multiplications and convolutions and recomputes the rest
(``create_selective_checkpoint_contexts``). ``remove(model)`` restores the exact original ``forward``.
Plans save to JSON by module path with a fingerprint of the model's structure, and refuse to apply to a
model whose structure differs.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from trainledger.errors import InputError
from trainledger.ledger import Ledger

PLAN_SCHEMA = "trainledger.remat-plan/1"
Policy = Literal["full", "selective"]
POLICIES: tuple[str, ...] = ("full", "selective")

# Ops whose outputs a selective region keeps (expensive to recompute, per byte); everything else is
# recomputed during backward. The policy of torchtitan's "op-level SAC", written for our op names.
SAVED_OP_NAMES: frozenset[str] = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten.convolution",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
    }
)

_ORIGINAL = "_trainledger_remat_original_forward"  # an instance attribute only while a plan is applied
_NO_INSTANCE_FORWARD = object()


@dataclass(frozen=True)
class Region:
    """One recomputed region: a module path and how it is recomputed."""

    path: str
    """Module path as ``model.named_modules()`` names it: ``blocks.3``, ``blocks.3.mlp``."""
    policy: Policy = "full"
    """``full``: keep only the module's inputs; ``selective``: also keep matmul/conv outputs."""


@dataclass(frozen=True)
class Plan:
    """What is recomputed and what that is predicted to achieve. Apply it with :meth:`apply`.

    Example:
        >>> from trainledger.examples import gpt_tiny
        >>> w = gpt_tiny()
        >>> p = Plan(regions=(Region("blocks.0"),), fingerprint=structure_fingerprint(w.model))
        >>> p.apply(w.model); p.remove(w.model)
    """

    regions: tuple[Region, ...]
    fingerprint: str
    """Hash of the model's module paths, classes and parameter shapes (see :func:`structure_fingerprint`)."""
    model: str = ""
    budget_bytes: int | None = None
    plain_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted: Ledger | None = field(default=None, compare=False, repr=False)
    """The plain step's traced ledger with this plan's recomputation replayed on it."""
    extra_flops: int = 0
    """FLOPs recomputed during backward (``FlopCounterMode``'s formulas, op by op, early stop included)."""
    extra_seconds: float = 0.0
    """Measured time of the recomputed forwards (median of repeated runs)."""
    solver: str = ""
    optimal: bool = False
    gap: float | None = None
    lp_bound: float | None = None
    floor_bytes: int | None = None
    """The lowest peak any plan of this kind reaches on this model."""
    notes: tuple[str, ...] = ()

    # --- running it ------------------------------------------------------------------------------------

    def check(self, model: nn.Module) -> None:
        """Raise ``InputError`` unless ``model`` has this plan's structure and every region path."""
        modules = dict(model.named_modules())
        for r in self.regions:
            if r.path not in modules:
                raise InputError(
                    f"the plan recomputes module {r.path!r}, which this model does not have; "
                    "make the plan for this model (trainledger plan --model ... --save plan.json)"
                )
            if r.policy not in POLICIES:
                raise InputError(f"region {r.path!r} has policy {r.policy!r}; accepted: {', '.join(POLICIES)}")
        got = structure_fingerprint(model)
        if got != self.fingerprint:
            raise InputError(
                f"the plan was made for a model of another structure (fingerprint {self.fingerprint[:12]}, "
                f"this model {got[:12]}); make a new plan for this model"
            )

    def apply(self, model: nn.Module) -> None:
        """Make ``model`` recompute this plan's regions (in place; undo with :meth:`remove`)."""
        self.check(model)
        for r in self.regions:
            module = model.get_submodule(r.path)
            if _ORIGINAL in module.__dict__:
                raise InputError(f"module {r.path!r} already runs under a plan; remove that plan first")
        for r in self.regions:
            _wrap(model.get_submodule(r.path), r.policy)

    def remove(self, model: nn.Module) -> None:
        """Restore the original ``forward`` of every region this plan wrapped."""
        for r in self.regions:
            module = model.get_submodule(r.path)
            original = module.__dict__.pop(_ORIGINAL, None)
            if original is None:
                continue
            if original is _NO_INSTANCE_FORWARD:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = original

    # --- JSON ---------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON: top-level keys of every command (from the predicted ledger) plus the plan."""
        out: dict[str, Any] = self.predicted.to_dict(entries=False) if self.predicted is not None else {}
        out.update(
            {
                "schema": PLAN_SCHEMA,
                "model": self.model,
                "fingerprint": self.fingerprint,
                "regions": [{"path": r.path, "policy": r.policy} for r in self.regions],
                "budget_bytes": self.budget_bytes,
                "plain_peak_bytes": self.plain_peak_bytes,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "extra_flops": self.extra_flops,
                "extra_seconds": self.extra_seconds,
                "solver": self.solver,
                "optimal": self.optimal,
                "optimality_gap": self.gap,
                "lp_bound": self.lp_bound,
                "floor_bytes": self.floor_bytes,
                "plan_notes": list(self.notes),
            }
        )
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("schema") != PLAN_SCHEMA:
            raise InputError(f"not a trainledger plan: schema {data.get('schema')!r}, expected {PLAN_SCHEMA!r}")
        try:
            regions = tuple(Region(r["path"], r.get("policy", "full")) for r in data["regions"])
            return cls(
                regions=regions,
                fingerprint=str(data["fingerprint"]),
                model=data.get("model", ""),
                budget_bytes=data.get("budget_bytes"),
                plain_peak_bytes=data.get("plain_peak_bytes"),
                predicted_peak_bytes=data.get("predicted_peak_bytes"),
                extra_flops=int(data.get("extra_flops", 0)),
                extra_seconds=float(data.get("extra_seconds", 0.0)),
                solver=data.get("solver", ""),
                optimal=bool(data.get("optimal", False)),
                gap=data.get("optimality_gap"),
                lp_bound=data.get("lp_bound"),
                floor_bytes=data.get("floor_bytes"),
                notes=tuple(data.get("plan_notes", ())),
            )
        except (KeyError, TypeError) as exc:
            raise InputError(f"the plan file is missing {exc}; save plans with `trainledger plan --save`") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"plan file {str(path)!r} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(f"plan file {str(path)!r} is not JSON ({exc.msg} at line {exc.lineno})") from exc
        if not isinstance(data, dict):
            raise InputError(f"plan file {str(path)!r} holds {type(data).__name__}, not a plan object")
        return cls.from_dict(data)


def structure_fingerprint(model: nn.Module) -> str:
    """SHA-256 of every module path with its class and every parameter/buffer path with its shape and dtype."""
    h = hashlib.sha256()
    for name, mod in model.named_modules():
        h.update(f"m {name} {type(mod).__qualname__}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"p {name} {tuple(p.shape)} {p.dtype}\n".encode())
    for name, b in model.named_buffers():
        h.update(f"b {name} {tuple(b.shape)} {b.dtype}\n".encode())
    return h.hexdigest()


def _policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    name = str(getattr(op, "overloadpacket", op))
    return CheckpointPolicy.MUST_SAVE if name in SAVED_OP_NAMES else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(policy: Policy) -> Callable[[], Any] | None:
    if policy == "full":
        return None
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, _policy_fn)


def _wrap(module: nn.Module, policy: Policy) -> None:
    from torch.utils.checkpoint import checkpoint

    original = module.__dict__.get("forward", _NO_INSTANCE_FORWARD)
    inner = module.forward  # the bound method (or the instance's own function)
    context_fn = _context_fn(policy)
    extra = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to save: run as is (evaluation, no_grad references)
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    module.__dict__[_ORIGINAL] = original
    module.__dict__["forward"] = forward
