"""A rematerialization plan: what to recompute, what it should achieve, and how to make a model run it.

``apply(model)`` wraps each named module's ``forward`` in non-reentrant ``torch.utils.checkpoint`` (RNG
state preserved, so dropout draws the same masks when recomputed); a ``selective`` region keeps the
outputs of matrix multiplications and convolutions and recomputes the rest
(``create_selective_checkpoint_contexts``). ``remove(model)`` restores the exact original ``forward``.
Plans save to JSON by module path with a fingerprint of the model's structure, and refuse to apply to a
model whose structure differs.

A region may name one call of a module that runs several times per step (``call``, counted from 0 in
each forward of the model, as the tracer counts): the wrapper counts the calls and checkpoints only that
one. A region that updates module buffers in forward (a BatchNorm's running statistics) lists them in
``restore``: the wrapper copies them before the call and runs the recomputation on the copy, so the
buffers are updated once per call, as without the plan.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainledger.checks import describe, one_of, unreadable_json, whole_number
from trainledger.errors import InputError
from trainledger.ledger import Ledger
from trainledger.remat._policy_file import _STATE as POLICY_STATE
from trainledger.remat._policy_file import (
    OWN_CHECKPOINTING,
    PLAN_STATE,
    cache_back,
    cache_off,
    checkpointed_call,
    checkpoints_its_layers,
    on_a_copy_when_recomputed,
    running_statistics,
)

PLAN_SCHEMA = "trainledger.remat-plan/1"

# Op types, by the names the tracer gives them (``str(op.overloadpacket)``: the overload left out).
MATMUL_OPS: frozenset[str] = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})
CONVOLUTION_OPS: frozenset[str] = frozenset({"aten.convolution"})
ATTENTION_OPS: frozenset[str] = frozenset(
    {
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
    }
)
STRIDED_OPS: frozenset[str] = MATMUL_OPS | CONVOLUTION_OPS
"""The ops an :class:`OpPolicy`'s ``matmul_stride`` counts (matrix products; a convolution is one)."""

# Ops whose outputs the ``selective`` policy keeps (expensive to recompute, per byte); everything else is
# recomputed during backward.
SAVED_OP_NAMES: frozenset[str] = MATMUL_OPS | CONVOLUTION_OPS | ATTENTION_OPS


@dataclass(frozen=True, kw_only=True)
class OpPolicy:
    """An op-level selective policy: which op types' outputs a region keeps; all other ops are recomputed.

    The form ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` takes, as data. The ops of
    one call of the region are seen in forward order (and again, in the same order, when it is recomputed).

    Example:
        >>> p = OP_POLICIES["op-sac"]
        >>> [p.saves("aten.mm", k) for k in (1, 2, 3, 4)], p.saves("aten.add.Tensor", 0)
        ([True, False, True, False], False)
    """

    name: str
    """How plans, JSON and the command line name it."""
    description: str
    """What it keeps, in words (the ``policy`` column of ``trainledger plan``)."""
    saved_ops: frozenset[str]
    """Op types (``aten.mm``, without overload) whose outputs are kept from forward to backward."""
    matmul_stride: int = 1
    """Among the saved ops of :data:`STRIDED_OPS`, counted from 1 in each call, every ``k``-th is
    recomputed (torchtitan's op-level SAC: ``k = 2``); 1: every one is kept."""

    def __post_init__(self) -> None:
        assert self.matmul_stride >= 1, self.matmul_stride

    def saves(self, op: str, matmul_index: int) -> bool:
        """Whether the output of ``op`` is kept, ``matmul_index`` being its count among the strided saved
        ops of this call so far (itself included)."""
        op = op_type(op)
        if op not in self.saved_ops:
            return False
        return op not in STRIDED_OPS or self.matmul_stride == 1 or matmul_index % self.matmul_stride != 0

    def saved_positions(self, ops: Sequence[str]) -> tuple[bool, ...]:
        """For each op of one call, in forward order, whether its output is kept."""
        out, count = [], 0
        for op in ops:
            if op_type(op) in STRIDED_OPS and op_type(op) in self.saved_ops:
                count += 1
            out.append(self.saves(op, count))
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {"saved_ops": sorted(self.saved_ops), "matmul_stride": self.matmul_stride}


def op_type(op: str) -> str:
    """``aten.mul.Tensor`` -> ``aten.mul``: the op type a policy names (traced names carry the overload)."""
    return ".".join(op.split(".")[:2])


OP_POLICIES: dict[str, OpPolicy] = {
    p.name: p
    for p in (
        OpPolicy(
            name="selective",
            description="keep matmul, convolution and attention outputs",
            saved_ops=SAVED_OP_NAMES,
        ),
        OpPolicy(
            name="op-sac",
            description="keep attention and every 2nd matmul output",
            saved_ops=SAVED_OP_NAMES,
            matmul_stride=2,
        ),
        OpPolicy(name="attention", description="keep attention outputs", saved_ops=ATTENTION_OPS),
        OpPolicy(
            name="matmul", description="keep matmul and convolution outputs", saved_ops=MATMUL_OPS | CONVOLUTION_OPS
        ),
    )
}
"""The op-level policies a plan may choose per region, besides ``full`` (keep the region's inputs only)."""

Policy = str
"""``full`` or a name in :data:`OP_POLICIES`."""
POLICIES: tuple[str, ...] = ("full", *OP_POLICIES)

_STATE = PLAN_STATE  # instance attributes only while a plan is applied
_HOOK = "_trainledger_remat_hook"
_NO_INSTANCE_FORWARD = object()


@dataclass(frozen=True)
class Region:
    """One recomputed region: a module (or one of its calls) and how it is recomputed."""

    path: str
    """Module path as ``model.named_modules()`` names it: ``blocks.3``, ``blocks.3.mlp``."""
    policy: Policy = "full"
    """``full``: keep only the module's inputs; an op-level policy (:data:`OP_POLICIES`): also keep the
    outputs of the op types it names."""
    call: int | None = None
    """Which call of the module, for a module called several times per step; ``None``: every call."""
    num_calls: int = 1
    """How many times the module is called per step (the traced step's count)."""
    restore: tuple[str, ...] = ()
    """Buffers (names from the model's root) the region's forward updates in place: recomputed on a copy."""

    @property
    def label(self) -> str:
        """``blocks.3``, ``block (call 2 of 4)``, ``blocks.0 (selective)``, ``blocks.0 (op-sac)``."""
        return self.where + (f" ({self.policy})" if self.policy != "full" else "")

    @property
    def where(self) -> str:
        """The module and call, without the policy: ``blocks.3``, ``block (call 2 of 4)``."""
        if self.call is None:
            return self.path
        return f"{self.path} (call {self.call + 1} of {self.num_calls})"

    @property
    def description(self) -> str:
        """What the region keeps, in words."""
        return OP_POLICIES[self.policy].description if self.policy in OP_POLICIES else "keep inputs only"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "policy": self.policy}
        if self.call is not None:
            out.update(call=self.call, num_calls=self.num_calls)
        if self.restore:
            out["restore"] = list(self.restore)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Region:
        if not isinstance(d, dict):
            raise InputError(f"a region is {describe(d)}, not an object with a module path and a policy")
        return cls(
            str(d["path"]),
            one_of(d.get("policy", "full"), "recomputation policy", POLICIES),
            call=None if d.get("call") is None else whole_number(d["call"], "a region's call", minimum=0),
            num_calls=whole_number(d.get("num_calls", 1), "a region's num_calls"),
            restore=tuple(str(n) for n in d.get("restore", ())),
        )


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
    extra_flops: int | None = None
    """FLOPs recomputed during backward (``FlopCounterMode``'s formulas, op by op, early stop included);
    ``None``: not known (a plan written by hand)."""
    extra_other_flops: int | None = None
    """The cost charged to the recomputed ops ``FlopCounterMode`` counts as 0 (one FLOP per element they
    output, see :data:`~trainledger.remat.OTHER_OP_FLOPS_PER_ELEMENT`); ``None``: not known."""
    extra_seconds: float | None = None
    """Measured time of the recomputed forwards (median of repeated runs); ``None``: not measured."""
    solver: str = ""
    optimal: bool = False
    gap: float | None = None
    lp_bound: float | None = None
    floor_bytes: int | None = None
    """The lowest peak any plan of this kind reaches on this model."""
    notes: tuple[str, ...] = ()
    kernel_kind: str = "cpu"
    """Whose kernels the step was traced with: ``cpu`` (the ones that run here) or ``cuda`` (PyTorch's CUDA
    kernels substituted on fake tensors, :func:`trainledger.trace.trace`'s ``kernel_kind``)."""
    cuda_device: str | None = None
    """With ``cuda``: the card of the device table whose kernels were assumed (``None`` with ``cpu``)."""

    # --- running it ------------------------------------------------------------------------------------

    def check(self, model: nn.Module) -> None:
        """Raise ``InputError`` unless ``model`` has this plan's structure and every region can run."""
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            raise InputError(
                "this is torch.compile's wrapper of the model: apply the plan to the model itself before compiling "
                "it (plan.apply(model), then torch.compile(model))"
            )
        modules = dict(model.named_modules())
        buffers = dict(model.named_buffers())
        seen: set[tuple[str, int | None]] = set()
        for r in self.regions:
            if r.path not in modules:
                raise InputError(
                    f"the plan recomputes module {r.path!r}, which this model does not have; "
                    "make the plan for this model (trainledger plan --model ... --save plan.json)"
                )
            if r.policy not in POLICIES:
                raise InputError(f"region {r.path!r} has policy {r.policy!r}; accepted: {', '.join(POLICIES)}")
            module = modules[r.path]
            if type(module).forward is nn.Module.forward:
                held = ", ".join(f"{r.path}.{n}" for n, _ in module.named_children()) or "none"
                raise InputError(
                    f"module {r.path!r} is a {type(module).__name__}, which is never called (it has no forward); "
                    f"recompute the modules it holds instead: {held}"
                )
            if getattr(module, "inplace", False) is True:
                raise InputError(
                    f"module {r.path!r} works in place on its input (inplace=True): recomputed, it would start from "
                    "its own result; recompute the module that holds it"
                )
            if r.call is not None and not 0 <= r.call < r.num_calls:
                raise InputError(f"region {r.path!r}: call {r.call} is not one of its {r.num_calls} calls")
            if (
                (r.path, r.call) in seen
                or (r.path, None) in seen
                or (r.call is None and any(p == r.path for p, _ in seen))
            ):
                raise InputError(f"the plan names module {r.path!r} twice; give each call of a module once")
            seen.add((r.path, r.call))
            outer = next((o.path for o in self.regions if _inside(r, o)), None)
            if outer is not None:
                raise InputError(
                    f"region {r.path!r} lies inside region {outer or '(the whole model)'!r}, which recomputes it "
                    "already (a checkpoint run inside another's recomputation saves other tensors than in forward, "
                    "and backward fails); keep one of the two"
                )
            missing = [n for n in r.restore if n not in buffers]
            if missing:
                raise InputError(
                    f"region {r.path!r} restores {', '.join(missing)}, which are not buffers of this model"
                )
        got = structure_fingerprint(model)
        if got != self.fingerprint:
            raise InputError(
                f"the plan was made for a model of another structure (fingerprint {self.fingerprint[:12]}, "
                f"this model {got[:12]}); make a new plan for this model"
            )

    def apply(self, model: nn.Module) -> None:
        """Make ``model`` recompute this plan's regions (in place; undo with :meth:`remove`)."""
        self.check(model)
        if _HOOK in model.__dict__:
            raise InputError("the model already runs under a plan; remove that plan first")
        if checkpoints_its_layers(model):
            raise InputError(OWN_CHECKPOINTING)
        by_path: dict[str, list[Region]] = {}
        for r in self.regions:
            by_path.setdefault(r.path, []).append(r)
        for path in by_path:
            if {_STATE, POLICY_STATE} & model.get_submodule(path).__dict__.keys():  # a plan, or an exported one
                raise InputError(f"module {path!r} already runs under a plan; remove that plan first")
        cache_off(model)
        states = [_wrap(model, model.get_submodule(path), regions) for path, regions in by_path.items()]
        restart = _RestartCounts(states, self.regions)
        model.__dict__[_HOOK] = (model.register_forward_pre_hook(restart), restart)

    def remove(self, model: nn.Module) -> None:
        """Restore the original ``forward`` of every region this plan wrapped (and a Hugging Face model's
        key/value cache, turned off while it ran)."""
        applied = model.__dict__.get(_HOOK)
        if applied is not None and applied[1].regions != self.regions:
            shown = ", ".join(r.label for r in applied[1].regions)
            raise InputError(f"the model runs under another plan (regions: {shown}); remove it with that plan")
        if applied is not None:
            del model.__dict__[_HOOK]
            applied[0].remove()
        cache_back(model)
        for path in dict.fromkeys(r.path for r in self.regions):
            module = model.get_submodule(path)
            st = module.__dict__.pop(_STATE, None)
            if st is None:
                continue
            if st.original is _NO_INSTANCE_FORWARD:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = st.original

    def runs(self, model: nn.Module) -> dict[Region, int]:
        """How many times each region was checkpointed since :meth:`apply` (0: it never ran)."""
        out: dict[Region, int] = {}
        for r in self.regions:
            st = model.get_submodule(r.path).__dict__.get(_STATE)
            out[r] = 0 if st is None else st.ran.get(r.call, 0)
        return out

    def export_policy(self, path: str | Path, *, command: str = "") -> None:
        """Write this plan as a Python file that needs only torch: its regions as data, the selective
        ``policy_fn``, and ``apply(model)``/``remove(model)`` that wrap forwards exactly as :meth:`apply` does.

        Example (the second line in the training script, where trainledger need not be installed)::

            plan.export_policy("remat_policy.py")
            import remat_policy; remat_policy.apply(model)
        """
        from trainledger.remat._export import export_policy

        export_policy(self, path, policies=OP_POLICIES, strided_ops=STRIDED_OPS, command=command)

    # --- JSON ---------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON: top-level keys of every command (from the predicted ledger) plus the plan."""
        out: dict[str, Any] = self.predicted.to_dict(entries=False) if self.predicted is not None else {}
        out.update(
            {
                "schema": PLAN_SCHEMA,
                "model": self.model,
                "fingerprint": self.fingerprint,
                "regions": [r.to_dict() for r in self.regions],
                "policies": {
                    name: OP_POLICIES[name].to_dict()
                    for name in sorted({r.policy for r in self.regions})
                    if name in OP_POLICIES
                },
                "budget_bytes": self.budget_bytes,
                "plain_peak_bytes": self.plain_peak_bytes,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "extra_flops": self.extra_flops,
                "extra_other_flops": self.extra_other_flops,
                "extra_seconds": self.extra_seconds,
                "solver": self.solver,
                "optimal": self.optimal,
                "optimality_gap": self.gap,
                "lp_bound": self.lp_bound,
                "floor_bytes": self.floor_bytes,
                "plan_notes": list(self.notes),
                "kernel_kind": self.kernel_kind,
                "cuda_device": self.cuda_device,
            }
        )
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("schema") != PLAN_SCHEMA:
            raise InputError(f"not a trainledger plan: schema {data.get('schema')!r}, expected {PLAN_SCHEMA!r}")
        try:
            if not isinstance(data["regions"], list):
                raise InputError(f"its regions are {describe(data['regions'])}, not a list of regions")
            regions = tuple(Region.from_dict(r) for r in data["regions"])
            budget, plain, predicted, floor = (
                None if data.get(key) is None else whole_number(data[key], f"the plan's {key}", minimum=0)
                for key in ("budget_bytes", "plain_peak_bytes", "predicted_peak_bytes", "floor_bytes")
            )
            return cls(
                regions=regions,
                fingerprint=str(data["fingerprint"]),
                model=data.get("model", ""),
                budget_bytes=budget,
                plain_peak_bytes=plain,
                predicted_peak_bytes=predicted,
                extra_flops=None if data.get("extra_flops") is None else int(data["extra_flops"]),
                extra_other_flops=None if data.get("extra_other_flops") is None else int(data["extra_other_flops"]),
                extra_seconds=None if data.get("extra_seconds") is None else float(data["extra_seconds"]),
                solver=data.get("solver", ""),
                optimal=bool(data.get("optimal", False)),
                gap=data.get("optimality_gap"),
                lp_bound=data.get("lp_bound"),
                floor_bytes=floor,
                notes=tuple(data.get("plan_notes", ())),
                kernel_kind=str(data.get("kernel_kind", "cpu")),  # plans saved before kernel kinds: cpu
                cuda_device=data.get("cuda_device"),
            )
        except InputError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            what = f"is missing key {exc}" if isinstance(exc, KeyError) else f"is not valid ({exc})"
            raise InputError(f"the plan file {what}; save plans with `trainledger plan --save`") from None

    def save(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> None:
        """Write :meth:`to_dict` as JSON, with ``extra`` keys beside it (``plan --save``: the named baselines,
        which ``trainledger report`` shows; :meth:`load` reads the plan only)."""
        try:
            Path(path).write_text(json.dumps({**self.to_dict(), **(extra or {})}, indent=2) + "\n")
        except OSError as exc:
            raise InputError(f"cannot write the plan to {str(path)!r}: {exc.strerror or type(exc).__name__}") from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if p.is_dir():
            raise InputError(f"plan file {str(path)!r} is a folder; give the JSON file `trainledger plan --save` wrote")
        if not p.exists():
            raise InputError(f"plan file {str(path)!r} does not exist")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise InputError(f"plan file {str(path)!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
        except UnicodeDecodeError:
            raise InputError(f"plan file {str(path)!r} is not a UTF-8 text file; give a plan JSON file") from None
        except OSError as exc:
            raise InputError(f"plan file {str(path)!r} cannot be read ({exc.strerror or type(exc).__name__})") from None
        except (RecursionError, ValueError) as exc:
            raise InputError(f"plan file {str(path)!r} is JSON no plan holds ({unreadable_json(exc)})") from None
        if not isinstance(data, dict):
            raise InputError(f"plan file {str(path)!r} holds {type(data).__name__}, not a plan object")
        try:
            return cls.from_dict(data)
        except InputError as exc:
            raise InputError(f"plan file {str(path)!r}: {exc}") from None


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


class _PolicyFn:
    """An :class:`OpPolicy` as ``create_selective_checkpoint_contexts`` takes it, for one checkpointed call:
    strided ops are counted separately in forward and in the recomputation (which sees the same ops)."""

    def __init__(self, policy: OpPolicy) -> None:
        self.policy = policy
        self.counts = {False: 0, True: 0}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        name = str(getattr(op, "overloadpacket", op))
        if name in STRIDED_OPS and name in self.policy.saved_ops:
            self.counts[ctx.is_recompute] += 1
        keep = self.policy.saves(name, self.counts[ctx.is_recompute])
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(policy: Policy) -> Callable[[], Any] | None:
    if policy == "full":
        return None
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    ops = OP_POLICIES[policy]
    return lambda: create_selective_checkpoint_contexts(_PolicyFn(ops))


@functools.cache
def _sac_hooks_argument() -> dict[str, bool]:
    """``respect_saved_tensors_hooks=False`` where ``checkpoint`` takes it (newer torch): the tensors a
    selective region saves bypass saved-tensor hooks (the tracer's, ``save_on_cpu``), as every torch so far
    does by default, said explicitly so torch does not warn that the default will change."""
    import inspect

    from torch.utils.checkpoint import checkpoint

    takes = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    return {"respect_saved_tensors_hooks": False} if takes else {}


def _in_backward() -> bool:
    """Autograd's engine is running a node: a module called now is being recomputed (by any checkpoint)."""
    return torch._C._current_autograd_node() is not None


@dataclass
class _Wrapped:
    """What a wrapped module keeps while a plan is applied; it refuses to be copied (see ``_NO_COPY``)."""

    original: Any
    regions: dict[int | None, Region]
    num_calls: int
    count: int = 0
    ran: dict[int | None, int] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise InputError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InputError(_NO_COPY)


_NO_COPY = (
    "a model a plan is applied to cannot be copied or pickled whole: its recomputed regions' forwards call the "
    "original model's modules (a copy would train them); plan.remove(model) first (state_dict() is unaffected), "
    "copy, then apply the plan to each"
)


class _RestartCounts:
    """The model's forward pre-hook under a plan: call numbers restart with each forward of the model, as traced.
    It knows the regions it serves (``remove`` of another plan is refused) and, like the wrapped modules' state,
    refuses to be copied or pickled (see ``_NO_COPY``)."""

    def __init__(self, states: list[_Wrapped], regions: tuple[Region, ...]) -> None:
        self.states = states
        self.regions = regions

    def __call__(self, _module: nn.Module, _args: Any) -> None:
        if not _in_backward():
            for st in self.states:
                st.count = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise InputError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InputError(_NO_COPY)


def _inside(region: Region, outer: Region) -> bool:
    """Whether ``region`` is checkpointed inside a call that ``outer`` checkpoints: its module lies in ``outer``'s
    (``""``: the whole model), and the calls meet. A module called once per call of ``outer``'s (as many calls)
    runs its call ``j`` inside ``outer``'s call ``j``; with other counts, calls named on both sides may not meet."""
    path, within = region.path, outer.path
    if path == within or not (within == "" or path.startswith(within + ".")):
        return False
    if outer.call is None or region.call is None:
        return True
    return region.num_calls == outer.num_calls and region.call == outer.call


def _wrap(model: nn.Module, module: nn.Module, regions: list[Region]) -> _Wrapped:
    from torch.utils.checkpoint import checkpoint

    inner = module.forward  # the bound method (or the instance's own function)
    st = _Wrapped(
        module.__dict__.get("forward", _NO_INSTANCE_FORWARD),
        {r.call: r for r in regions},
        max(r.num_calls for r in regions),
    )
    # the buffers each region recomputes on a copy of: a region written without them, its running statistics
    restores = {r.call: r.restore or running_statistics(module, r.path) for r in regions}

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if _in_backward():  # a recomputation (this plan's or the model's own checkpoint): run as it is
            return inner(*args, **kwargs)
        index = st.count % st.num_calls
        st.count += 1
        region = st.regions.get(index, st.regions.get(None))
        if region is None or not torch.is_grad_enabled():  # not this call; or nothing to save (no_grad)
            return inner(*args, **kwargs)
        st.ran[region.call] = st.ran.get(region.call, 0) + 1
        restore = restores[region.call]
        fn = on_a_copy_when_recomputed(model, restore, inner) if restore else inner
        context_fn = _context_fn(region.policy)
        extra = {} if context_fn is None else {"context_fn": context_fn, **_sac_hooks_argument()}
        return checkpoint(*checkpointed_call(fn, args, kwargs), use_reentrant=False, preserve_rng_state=True, **extra)

    module.__dict__[_STATE] = st
    module.__dict__["forward"] = forward
    return st
