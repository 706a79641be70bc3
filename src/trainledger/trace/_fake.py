"""Run a workload on fake tensors: same shapes, dtypes and ops, nothing allocated.

The model's parameters and buffers are swapped *in place* for fake tensors (so a loss function that
refers to the model, or to a reference model, from a closure sees them too) and restored afterwards,
whatever happens. A model already built under ``FakeTensorMode`` is used as it is, in its own mode.

A model built on the ``meta`` device (``with torch.device("meta"):``, accelerate's ``init_empty_weights()``)
has shapes and dtypes but no values, which is all a fake step needs: its meta tensors become fake tensors on
the device the trace names (default cpu), so tensors that ``forward`` creates on the default device (a causal
mask from ``torch.ones(T, T)``) meet its weights on one device. Meta tensors that were views of one another
become separate fake tensors: a model that ties weights by sharing the ``Parameter`` keeps them tied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

from trainledger.errors import InputError
from trainledger.workload import Workload


@contextlib.contextmanager
def fake_workload(workload: Workload, device: str = "cpu") -> Iterator[tuple[Workload, FakeTensorMode]]:
    """A fake twin of ``workload`` (model swapped in place, batch and optimizer rebuilt) and its mode; meta
    tensors become fake tensors on ``device``."""
    roots = [m for m in (workload.model, workload.reference) if m is not None]
    existing = _existing_fake_mode(roots)
    mode = existing or FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Any]] = []

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor):
            return t
        if id(t) not in memo:
            f = _from_meta(mode, t, torch.device(device)) if t.is_meta else mode.from_tensor(t)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
            memo[id(t)] = f
        return memo[id(t)]

    try:
        for root in roots:
            for mod in root.modules():
                for table in (mod._parameters, mod._buffers):
                    for name, t in list(table.items()):
                        if t is not None and not isinstance(t, FakeTensor):
                            swapped.append((table, name, t))
                            table[name] = fake_of(t)
        batch = tree_map(lambda x: fake_of(x) if isinstance(x, torch.Tensor) else x, workload.batch)
        with mode:
            optimizer = _fake_optimizer(workload, fake_of)
        twin = Workload(
            workload.model,
            batch,
            loss_fn=workload.loss_fn,
            optimizer=optimizer,
            reference=workload.reference,
            autocast_dtype=workload.autocast_dtype,
            name=workload.name,
        )
        yield twin, mode
    finally:
        for table, name, original in reversed(swapped):
            table[name] = original


def _from_meta(mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor on ``device`` with the shape, strides and dtype of the meta tensor ``t``."""
    f = mode.fake_tensor_converter.from_meta_and_device(mode, t.detach(), device)
    return f.requires_grad_(t.requires_grad) if t.is_leaf else f


def _existing_fake_mode(roots: list[nn.Module]) -> FakeTensorMode | None:
    for root in roots:
        for t in [*root.parameters(), *root.buffers()]:
            if isinstance(t, FakeTensor):
                return t.fake_mode
    return None


def _fake_optimizer(workload: Workload, fake_of: Any) -> torch.optim.Optimizer:
    """The workload's optimizer over the (now fake) trainable parameters."""
    opt = workload.optimizer
    params = [p for p in workload.model.parameters() if p.requires_grad]
    if not params:
        raise InputError("the model has no trainable parameters (all have requires_grad=False)")
    if opt is None:
        return torch.optim.AdamW(params)
    if not isinstance(opt, torch.optim.Optimizer):
        return opt(params)
    # An instance: rebuild the same class with the same hyperparameters over the fake parameters.
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [fake_of(p) for p in g["params"]]}
        for g in opt.param_groups
    ]
    try:
        return type(opt)(groups)
    except Exception as exc:
        raise InputError(
            f"cannot rebuild {type(opt).__name__} over fake tensors ({exc}); "
            "give Workload(optimizer=...) a factory of the parameters instead of an instance"
        ) from exc
