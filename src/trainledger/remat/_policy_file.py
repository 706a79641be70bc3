"""An activation checkpointing plan, to run without trainledger: ``apply(model)`` and ``remove(model)``.

``apply`` wraps the ``forward`` of each module in ``REGIONS`` in non-reentrant
``torch.utils.checkpoint.checkpoint`` (RNG state preserved, so dropout draws the same masks when
recomputed). A region whose policy is not ``full`` keeps the outputs of the op types its entry in
``POLICIES`` names and recomputes the rest (``create_selective_checkpoint_contexts``); with a matmul stride
``k`` > 1, every ``k``-th of its saved matmuls and convolutions (counted from 1 in each call) is recomputed
too, as in torchtitan's op-level SAC.
A region with a call number checkpoints only that call of a module run several times per step (counted
from 0 in each forward of the model). A region that lists buffers recomputes on a copy of them as they
were before the call, so in-place updates (a BatchNorm's running statistics) happen once per call.

Usage:
    import remat_policy
    remat_policy.apply(model)   # before the first step; torch.compile after, if you compile
    ...train...
    remat_policy.remove(model)  # the original forwards back
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# (module path, policy, call (None: every call), calls of the module per step, buffers restored)
REGIONS: list[tuple[str, str, int | None, int, tuple[str, ...]]] = []  # the plan's regions

# Per op-level policy: (op types whose outputs are kept, matmul stride); everything else is recomputed.
POLICIES: dict[str, tuple[frozenset[str], int]] = {}  # the plan's policies

# The ops a matmul stride counts.
STRIDED_OPS: frozenset[str] = frozenset()  # matrix products

_STATE = "_remat_policy_state"
_HOOK = "_remat_policy_hook"
PLAN_STATE = "_trainledger_remat"  # what trainledger's own Plan.apply leaves on a module it wraps
_NO_COPY = (
    "a model this policy is applied to cannot be copied or pickled whole: its wrapped forwards call the original "
    "model's modules (a copy would train them); remove(model) first (state_dict() is unaffected), copy, then "
    "apply(copy)"
)


class _State(dict):  # type: ignore[type-arg]
    """What a wrapped module keeps while the policy is applied; it refuses to be copied (see ``_NO_COPY``)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise RuntimeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(_NO_COPY)


class _RestartCounts:
    """The model's forward pre-hook: call numbers restart with each forward of the model. Like the wrapped
    modules' state, it refuses to be copied or pickled (see ``_NO_COPY``)."""

    def __init__(self, states: list[dict[str, Any]]) -> None:
        self.states = states

    def __call__(self, _module: nn.Module, _args: Any) -> None:
        if not _in_backward():
            for state in self.states:
                state["count"] = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise RuntimeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(_NO_COPY)


def policy_fn(policy: str) -> Any:
    """The policy named ``policy`` for one checkpointed call, in the form
    ``create_selective_checkpoint_contexts`` takes; strided ops are counted apart in forward and in the
    recomputation (which sees the same ops in the same order)."""
    saved, stride = POLICIES[policy]
    counts = {False: 0, True: 0}

    def fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = str(getattr(op, "overloadpacket", op))
        if name not in saved:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if name in STRIDED_OPS:
            counts[ctx.is_recompute] += 1
            if stride > 1 and counts[ctx.is_recompute] % stride == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return fn


def context_fn(policy: str) -> Any:
    """``context_fn`` for ``checkpoint(..., context_fn=functools.partial(context_fn, policy))``."""
    return create_selective_checkpoint_contexts(policy_fn(policy))


# Newer torch asks whether a selective region's saved tensors go through saved-tensor hooks; every torch
# so far bypasses them; say so explicitly where the argument exists.
_SAC_EXTRA = (
    {"respect_saved_tensors_hooks": False}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    else {}
)


def _in_backward() -> bool:
    """Autograd is running a node: a module called now is being recomputed."""
    return torch._C._current_autograd_node() is not None


def apply(model: nn.Module) -> None:
    """Make ``model`` recompute the regions (in place; undo with :func:`remove`)."""
    if _HOOK in model.__dict__:
        raise RuntimeError("the model already runs under this policy; call remove(model) first")
    by_path: dict[str, dict[int | None, tuple]] = {}
    for region in REGIONS:
        by_path.setdefault(region[0], {})[region[2]] = region
    for path in by_path:  # every module found and free before any is wrapped
        if {_STATE, PLAN_STATE} & model.get_submodule(path).__dict__.keys():
            raise RuntimeError(f"module {path!r} already runs under a plan or policy; remove it first")
    if checkpoints_its_layers(model):
        raise RuntimeError(OWN_CHECKPOINTING)
    cache_off(model)
    states = [_wrap(model, model.get_submodule(path), regions) for path, regions in by_path.items()]
    model.__dict__[_HOOK] = model.register_forward_pre_hook(_RestartCounts(states))


def remove(model: nn.Module) -> None:
    """Restore the original ``forward`` of every wrapped module."""
    hook = model.__dict__.pop(_HOOK, None)
    if hook is not None:
        hook.remove()
    cache_back(model)
    for path in dict.fromkeys(region[0] for region in REGIONS):
        module = model.get_submodule(path)
        state = module.__dict__.pop(_STATE, None)
        if state is None:
            continue
        if state["original"] is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = state["original"]


def running_statistics(module: nn.Module, path: str) -> tuple[str, ...]:
    """The running statistics that normalization layers in ``module`` (at ``path`` in the model) update as they
    run in training: what a region written without its buffers recomputes on a copy of (a plan made by
    trainledger lists what its trace saw written)."""
    names = []
    for sub_path, sub in module.named_modules(prefix=path):
        if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats:
            held = [n for n, b in sub.named_buffers(recurse=False) if b is not None]
            names += [f"{sub_path}.{n}" if sub_path else n for n in held]
    return tuple(names)


def checkpoints_its_layers(model: nn.Module) -> bool:
    """Whether a Hugging Face model recomputes its own layers (``gradient_checkpointing_enable()``, in transformers 5
    ``activation_checkpointing_enable()``, sets ``gradient_checkpointing`` on each module that does)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


_CACHE_WAS_ON = "_remat_policy_use_cache"


def cache_off(model: nn.Module, *, warn: bool = True) -> bool:
    """A Hugging Face model's key/value cache off while it recomputes, as its ``gradient_checkpointing_enable``
    does: a recomputed layer would append to the cache again and save other tensors (a ``CheckpointError``
    in backward). Every config the model's modules hold is turned off, not only ``model.config``: an
    encoder-decoder's decoder keeps a copy of its own (T5's stacks), which it reads when the caller passes no
    ``use_cache``. :func:`cache_back` turns them on again. Returns whether any was on."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    cached = [c for c in configs.values() if getattr(c, "use_cache", False) is True]
    if not cached:
        return False
    if warn:
        warnings.warn(
            "model.config.use_cache=True does not go with recomputation: set to False until the plan is removed",
            stacklevel=3,
        )
    for config in cached:
        config.use_cache = False
    model.__dict__[_CACHE_WAS_ON] = cached
    return True


def cache_back(model: nn.Module) -> None:
    for config in model.__dict__.pop(_CACHE_WAS_ON, ()):
        config.use_cache = True


def _wrap(model: nn.Module, module: nn.Module, regions: dict[int | None, tuple]) -> dict[str, Any]:
    inner = module.forward
    state = _State(
        original=module.__dict__.get("forward"),
        num_calls=max(r[3] for r in regions.values()),
        count=0,
    )
    # the buffers each region recomputes on a copy of: a region written without them, its running statistics
    restores = {r[2]: r[4] or running_statistics(module, r[0]) for r in regions.values()}

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if _in_backward():  # a recomputation: run as it is
            return inner(*args, **kwargs)
        index = state["count"] % state["num_calls"]
        state["count"] += 1
        region = regions.get(index, regions.get(None))
        if region is None or not torch.is_grad_enabled():  # not this call, or nothing to save
            return inner(*args, **kwargs)
        _path, policy, call, _num_calls, _restore = region
        restore = restores[call]
        fn = on_a_copy_when_recomputed(model, restore, inner) if restore else inner
        extra = {} if policy == "full" else {"context_fn": functools.partial(context_fn, policy), **_SAC_EXTRA}
        return checkpoint(*checkpointed_call(fn, args, kwargs), use_reentrant=False, preserve_rng_state=True, **extra)

    module.__dict__[_STATE] = state
    module.__dict__["forward"] = forward
    return state


def checkpointed_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``fn`` and the positional arguments to give ``checkpoint`` for ``fn(*args, **kwargs)``: each tensor passed
    once (:func:`each_tensor_once`), and the keywords bound here, since ``checkpoint`` keeps keywords of its own
    (``debug``, ``early_stop``, ``use_reentrant``) from the function it runs."""
    once = each_tensor_once(fn, args, kwargs)
    if once is not None:
        (fn, args), kwargs = once, {}
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    return (fn, *args)


OWN_CHECKPOINTING = (
    "the model checkpoints its own layers (transformers' gradient checkpointing is on), inside which a region would "
    "be recomputed twice over and backward fails; turn it off first (model.gradient_checkpointing_disable(), "
    "activation_checkpointing_disable() in transformers 5)"
)


def each_tensor_once(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]] | None:
    """A call passing one tensor as several arguments (self-attention's ``attn(x, x, x)``), as one that passes
    each tensor once, positionally, and rebuilds the arguments inside; ``None`` when no tensor repeats.

    Checkpointing saves its inputs for backward, and under saved-tensor hooks (a tracer's, the user's
    offloading) each comes back as a tensor object of its own: ``query is key`` no longer holds when the region
    is recomputed, and ``nn.MultiheadAttention`` takes its separate-projections path, which saves other
    tensors than its forward did (``CheckpointError``).
    """
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    unique = list({id(t): t for t in tensors}.values())
    if len(unique) == len(tensors):
        return None
    slot = {id(t): j for j, t in enumerate(unique)}
    positional = [(slot[id(a)], None) if isinstance(a, torch.Tensor) else (None, a) for a in args]
    named = {k: (slot[id(v)], None) if isinstance(v, torch.Tensor) else (None, v) for k, v in kwargs.items()}

    def rebuilt(*given: torch.Tensor) -> Any:
        pick = lambda j, value: value if j is None else given[j]  # noqa: E731
        return fn(*(pick(j, a) for j, a in positional), **{k: pick(j, v) for k, (j, v) in named.items()})

    return rebuilt, tuple(unique)


def on_a_copy_when_recomputed(model: nn.Module, names: tuple[str, ...], inner: Any) -> Any:
    """``inner`` whose first run updates the buffers ``names`` as usual and whose recomputation runs on a
    copy of them as they were before the call (made before it: a selective recomputation may run no op its
    forward did not)."""
    slots = []
    for name in names:
        path, _, attr = name.rpartition(".")
        slots.append((model.get_submodule(path) if path else model, attr))
    before = [owner._buffers[attr].clone() for owner, attr in slots]
    first = [True]

    def run(*args: Any, **kwargs: Any) -> Any:
        if first[0]:
            first[0] = False
            return inner(*args, **kwargs)
        current = [owner._buffers[attr] for owner, attr in slots]
        for (owner, attr), t in zip(slots, before, strict=True):
            owner._buffers[attr] = t
        try:
            return inner(*args, **kwargs)
        finally:
            for (owner, attr), t in zip(slots, current, strict=True):
                owner._buffers[attr] = t

    return run
