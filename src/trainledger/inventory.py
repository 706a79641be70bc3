"""Persistent training state of real PyTorch objects, as a ledger.

Every parameter, buffer and existing gradient of the model, every optimizer state tensor with its real
dtype and role, and the weights of a frozen reference model. Bytes are counted per storage
(``untyped_storage().nbytes()``): tied weights count once, views count nothing.

Optimizer state that does not exist yet (before the first step) is listed from the optimizer's layout
with evidence ``declared``: the layout is read off a step of the same optimizer class on fake tensors
(nothing allocated), or, for optimizers whose step cannot run on fake tensors (Adafactor, ASGD), from a
table of their known state.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from trainledger.checks import instance_of
from trainledger.ledger import Category, Entry, Evidence, Ledger, weakest_evidence

EXCLUDED_NOTE = (
    "bytes are tensor storage only; excluded: Python objects, autograd graph objects, "
    "allocator rounding and fragmentation, activations and workspace (use `trainledger trace`)"
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by views and tied parameters)."""
    return t.untyped_storage()._cdata


def storage_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors whose storages hold ``t``'s bytes: ``t`` itself, or a sparse tensor's index and value
    tensors (a sparse tensor has no storage of its own: ``nn.Embedding(sparse=True)``'s gradient).

    Read with Python dispatch off, so that a tracer asking for a sparse gradient's parts sees no op.
    """
    layout = t.layout
    if layout is torch.strided:
        return (t,)
    with torch._C._DisableTorchDispatch():
        if layout is torch.sparse_coo:
            return (t._indices(), t._values())
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            return (t.crow_indices(), t.col_indices(), t.values())
        if layout in (torch.sparse_csc, torch.sparse_bsc):
            return (t.ccol_indices(), t.row_indices(), t.values())
    return (t,)


@dataclass(frozen=True, slots=True)
class Owner:
    name: str
    category: Category
    role: str


class _Collector:
    """Adds one entry per storage, in the order met; later names of the same storage become aliases."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._index: dict[int, int] = {}

    def add(self, t: torch.Tensor, owner: Owner, evidence: Evidence = Evidence.INVENTORIED) -> None:
        key = storage_key(t)
        if key in self._index:
            i = self._index[key]
            e = self.entries[i]
            if owner.name not in e.aliases and owner.name != e.name:
                self.entries[i] = replace(e, aliases=(*e.aliases, owner.name))
            return
        st = t.untyped_storage()
        itemsize = t.element_size()
        self._index[key] = len(self.entries)
        self.entries.append(
            Entry(
                name=owner.name,
                category=owner.category,
                role=owner.role,
                dtype=dtype_name(t.dtype),
                numel=st.nbytes() // itemsize,
                nbytes=st.nbytes(),
                device=str(t.device),
                owner=owner.name,
                evidence=evidence,
                shape=tuple(t.shape),
            )
        )

    def declare(self, name: str, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
        numel = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        self.entries.append(
            Entry(
                name=name,
                category=Category.OPTIMIZER,
                role=role,
                dtype=dtype_name(dtype),
                numel=numel,
                nbytes=numel * itemsize,
                device=device,
                owner=name,
                evidence=Evidence.DECLARED,
                shape=shape,
            )
        )


def inventory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    reference: nn.Module | None = None,
) -> Ledger:
    """The persistent state of a model, its optimizer and an optional frozen reference model.

    Arguments:
        model: the model being trained. Parameters with ``requires_grad=False`` are ``frozen``.
        optimizer: its optimizer. Parameters it holds that are not the model's, matched by shape to
            lower-precision model weights, are fp32 ``master`` copies.
        reference: a frozen model taking part in the loss (a DPO reference): all its weights ``frozen``.

    Returns:
        A single-instant ledger (evidence ``inventoried``, or ``declared`` where optimizer state that
        does not exist yet was listed from the optimizer's layout).

    Example:
        >>> m = torch.nn.Linear(3, 2).double()
        >>> led = inventory(m, torch.optim.Adam(m.parameters()))
        >>> led.bytes_by("category")[("weights",)], led.bytes_by("role")[("exp_avg",)]
        (64, 64)
    """
    instance_of(model, nn.Module, "inventory()'s model", "give an nn.Module instance")
    if optimizer is not None:
        instance_of(optimizer, torch.optim.Optimizer, "inventory()'s optimizer", "give a torch.optim.Optimizer or None")
    if reference is not None:
        instance_of(reference, nn.Module, "inventory()'s reference", "give an nn.Module instance or None")
    col = _Collector()
    for t, owner in iter_state(model, optimizer, reference=reference):
        col.add(t, owner)
    notes = [EXCLUDED_NOTE]
    if optimizer is not None:
        missing = [p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)]
        if missing:
            notes += _declare_missing_state(col, model, optimizer, missing)
    evidence = weakest_evidence(e.evidence for e in col.entries) if col.entries else Evidence.INVENTORIED
    devices = Counter(e.device for e in col.entries)
    return Ledger(
        tuple(col.entries),
        evidence=evidence,
        device=devices.most_common(1)[0][0] if devices else "cpu",
        notes=tuple(notes),
        meta={"optimizer": type(optimizer).__name__ if optimizer is not None else None},
    )


def iter_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, reference: nn.Module | None = None
) -> Iterator[tuple[torch.Tensor, Owner]]:
    """Every persistent tensor with its name, category and role, in a stable order.

    Parameters and buffers of the model (``requires_grad=False`` → ``frozen``), the reference model's
    weights (``frozen``), existing gradients, master copies held by the optimizer and their gradients,
    and every optimizer state tensor (role = its state key). The same storage may be yielded under
    several names (tied weights); consumers count it once. A sparse tensor is yielded as its parts
    (``storage_parts``), each under the tensor's name.
    """
    for t, owner in _named_state(model, optimizer, reference):
        if t.layout is torch.strided:
            yield t, owner
        else:
            for part in storage_parts(t):
                yield part, owner


def _named_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, reference: nn.Module | None
) -> Iterator[tuple[torch.Tensor, Owner]]:
    for name, p in model.named_parameters(remove_duplicate=False):
        yield p, Owner(name, Category.WEIGHTS if p.requires_grad else Category.FROZEN, "param")
    for name, b in model.named_buffers(remove_duplicate=False):
        yield b, Owner(name, Category.OTHER, "buffer")
    if reference is not None:
        for name, p in reference.named_parameters(remove_duplicate=False):
            yield p, Owner(f"reference.{name}", Category.FROZEN, "reference")
        for name, b in reference.named_buffers(remove_duplicate=False):
            yield b, Owner(f"reference.{name}", Category.OTHER, "buffer")
    for name, p in model.named_parameters():
        if p.grad is not None:
            yield p.grad, Owner(f"{name}.grad", Category.GRADIENTS, "grad")
    if optimizer is None:
        return
    for opt in optimizers_within(optimizer):
        yield from _optimizer_state(model, opt)


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, Owner]]:
    names = {id(p): n for n, p in model.named_parameters()}
    masters = match_masters(model, optimizer)
    outside = {id(p): name for name, p in trained_outside(model, optimizer, masters)}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) in masters:
                label = f"{masters[id(p)]}.master"
                yield p, Owner(f"optimizer.{label}", Category.OPTIMIZER, "master")
                if p.grad is not None:
                    yield p.grad, Owner(f"{label}.grad", Category.GRADIENTS, "master_grad")
            elif id(p) in outside:  # trained beside the model (a soft prompt): weights, as the model's are
                label = f"group{gi}.param{pi}"
                yield p, Owner(outside[id(p)], Category.WEIGHTS, "param")
                if p.grad is not None:
                    yield p.grad, Owner(f"{outside[id(p)]}.grad", Category.GRADIENTS, "grad")
            else:
                label = names.get(id(p), f"group{gi}.param{pi}")
            for key, value in optimizer.state.get(p, {}).items():
                for suffix, t in _state_tensors(value):
                    yield t, Owner(f"optimizer.{label}.{key}{suffix}", Category.OPTIMIZER, key)


def optimizers_within(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``optimizer`` and the optimizers it holds and steps, each keeping state of its own: the local optimizer of
    ``ZeroRedundancyOptimizer`` (whose own ``state`` stays empty), a Lookahead's base optimizer."""
    found: list[torch.optim.Optimizer] = []
    todo = [optimizer]
    while todo:
        opt = todo.pop(0)
        if not any(opt is f for f in found):
            found.append(opt)
            todo += [v for v in vars(opt).values() if isinstance(v, torch.optim.Optimizer)]
    return found


def _state_tensors(value: Any, suffix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one optimizer state value, each with its index suffix: the value itself, or those in its
    lists and tuples (L-BFGS keeps its history of directions and steps as lists of tensors)."""
    if isinstance(value, torch.Tensor):
        yield suffix, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _state_tensors(item, f"{suffix}[{i}]")


def trained_outside(
    model: nn.Module, optimizer: torch.optim.Optimizer, masters: dict[int, str] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameters that are neither the model's nor master copies of its weights (a soft
    prompt kept beside the model), named ``optimizer.group<g>.param<i>``: weights the step trains too."""
    masters = match_masters(model, optimizer) if masters is None else masters
    model_keys = {storage_key(p) for p in model.parameters()}
    return [
        (f"optimizer.group{gi}.param{pi}", p)
        for gi, group in enumerate(optimizer.param_groups)
        for pi, p in enumerate(group["params"])
        if id(p) not in masters and storage_key(p) not in model_keys
    ]


def match_masters(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Optimizer parameters that are not model parameters, matched in order to a lower-precision
    model weight of the same shape: those are master copies. Returns ``id(master) -> weight name``.

    An optimizer that keeps such masters copies every weight, so where it holds any, a copy of a weight already
    in the master's precision (an fp32 router kept beside bf16 layers) is matched too: it is that weight's master,
    not a parameter trained beside the model."""
    model_keys = {storage_key(p) for p in model.parameters()}
    pool = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    others = [p for group in optimizer.param_groups for p in group["params"] if storage_key(p) not in model_keys]
    used: set[str] = set()
    out: dict[int, str] = {}
    for same_precision in (False, True):
        if same_precision and not out:
            break
        for p in others:
            if id(p) in out:
                continue
            for n, w in pool:
                wider = w.element_size() <= p.element_size() if same_precision else w.element_size() < p.element_size()
                if n not in used and w.shape == p.shape and wider:
                    out[id(p)] = n
                    used.add(n)
                    break
    return out


def trains_none_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` trains none of ``model``'s trainable parameters, nor master copies of them (when the
    model has any): most likely another model's optimizer. Worth a warning, not an error: prompt tuning trains
    only what is beside a model whose weights may still ask for gradients."""
    trained = {storage_key(p) for p in model.parameters() if p.requires_grad}
    if not trained:
        return False
    ours = any(storage_key(p) in trained for g in optimizer.param_groups for p in g["params"])
    return not ours and not match_masters(model, optimizer)


def _declare_missing_state(
    col: _Collector, model: nn.Module, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    masters = match_masters(model, optimizer)
    layout = declared_state_layout(optimizer, params)
    if layout is None:
        return [
            f"{type(optimizer).__name__} state does not exist yet and its layout is unknown: "
            "run one step to inventory it"
        ]
    for p, slots in zip(params, layout, strict=True):
        label = f"{masters[id(p)]}.master" if id(p) in masters else names.get(id(p), "param")
        for key, (shape, dtype) in slots.items():
            col.declare(f"optimizer.{label}.{key}", key, shape, dtype, str(p.device))
    name = type(optimizer).__name__
    return [f"{name} state does not exist yet (no step taken): listed from its layout, evidence declared"]


StateLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def declared_state_layout(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[StateLayout] | None:
    """The state each parameter will hold after the first step: ``{key: (shape, dtype)}`` per parameter.

    Read off a step of the same optimizer class on fake tensors; falls back to known layouts.
    """
    probed = _probe_layout(optimizer, params)
    if probed is not None:
        return probed
    return _known_layout(optimizer, params)


def _probe_layout(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[StateLayout] | None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    wanted = {id(p) for p in params}
    try:
        with FakeTensorMode():
            groups, fakes = [], []
            for group in optimizer.param_groups:
                ps = []
                for p in group["params"]:
                    f = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device))
                    f.grad = torch.zeros_like(f)
                    ps.append(f)
                    if id(p) in wanted:
                        fakes.append(f)
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ps})
            probe = type(optimizer)(groups)
            probe.step()
            return [
                {k: (tuple(v.shape), v.dtype) for k, v in probe.state[f].items() if isinstance(v, torch.Tensor)}
                for f in fakes
            ]
    except Exception:  # a step that cannot run on fake tensors (e.g. it reads a value with .item())
        return None


def _known_layout(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[StateLayout] | None:
    """Known state of optimizers whose step reads tensor values (so cannot run on fake tensors)."""
    scalar = ((), torch.float32)
    out: list[StateLayout] = []
    for p in params:
        shape, dtype = tuple(p.shape), p.dtype
        if isinstance(optimizer, torch.optim.Adafactor):
            if p.dim() >= 2:  # factored second moment: one row and one column statistic
                row = (*shape[:-1], 1)
                col = (*shape[:-2], 1, shape[-1])
                out.append({"step": scalar, "row_var": (row, dtype), "col_var": (col, dtype)})
            else:
                out.append({"step": scalar, "variance": (shape, dtype)})
        elif isinstance(optimizer, torch.optim.ASGD):
            out.append({"step": scalar, "eta": scalar, "mu": scalar, "ax": (shape, dtype)})
        else:
            return None
    return out


# --- recovery checkpoint -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecoveryCheckpoint:
    """Durable state a restart needs: weights, buffers, master copies, optimizer state, step counters.

    Not to be confused with *activation* checkpointing (recomputation during backward): a recovery
    checkpoint is state saved to disk; it holds no gradients and no activations.
    """

    bytes: int
    by_part: dict[str, int]
    frozen_bytes: int
    """Frozen weights, reloadable from their source (a LoRA base, a reference model): not included."""


def recovery_checkpoint(ledger: Ledger) -> RecoveryCheckpoint:
    """The size of a recovery checkpoint of the state in ``ledger`` (tensor payload, no file overhead)."""
    instance_of(ledger, Ledger, "recovery_checkpoint()'s ledger", "give a trainledger.Ledger")
    parts: dict[str, int] = {}
    for e in ledger.entries:
        if e.category == Category.WEIGHTS:
            part = "weights"
        elif e.category == Category.OTHER and e.role == "buffer":
            part = "buffers"
        elif e.category == Category.OPTIMIZER:
            part = "master" if e.role == "master" else "optimizer state"
        else:
            continue
        parts[part] = parts.get(part, 0) + e.nbytes
    frozen = sum(e.nbytes for e in ledger.select(category=Category.FROZEN))
    return RecoveryCheckpoint(sum(parts.values()), parts, frozen)


def iter_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor the optimizer, and the optimizers it holds, keep in their state (in its lists too)."""
    for opt in optimizers_within(optimizer):
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):  # the common case without a generator per value (asked twice a step)
                    yield v
                elif isinstance(v, (list, tuple)):
                    for _, t in _state_tensors(v):
                        yield t


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of ``untyped_storage().nbytes()`` over unique storages (the independent oracle for tests)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())
