"""FSDP2's storages as the tracer needs to see them (used by ``record`` and by ``shard --run``'s ranks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from trainledger.ledger import Category
from trainledger.trace._tracer import active_tracer


@contextlib.contextmanager
def fsdp_storages(model: nn.Module) -> Iterator[None]:
    """Let the tracer see FSDP2's real storages while it traces a step of ``model``.

    FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter (and so its gradient and optimizer
    state) as a ``DTensor``, a wrapper whose ``untyped_storage()`` reports the *global* size; the bytes a rank
    holds are its local shard. And it frees a unit's gathered parameters with ``untyped_storage().resize_(0)``
    (and re-grows them the same way), which no dispatched op shows. The tracer itself declares DTensors by
    their local shards; while active, this wraps FSDP2's own storage hooks to tell the tracer on the dispatch
    stack (if any) when a gathered storage is grown (allocated) or shrunk to nothing (freed). For a model
    without DTensor parameters it does nothing.

    Example:
        >>> from trainledger.examples import mlp
        >>> w = mlp()
        >>> with fsdp_storages(w.model):  # not sharded: nothing to follow
        ...     pass
    """
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        yield
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    original_alloc, original_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(t: torch.Tensor) -> None:
        original_alloc(t)
        tracer = active_tracer()
        if tracer is not None:
            tracer.allocated_outside_dispatch(t, "gathered parameters", Category.WEIGHTS, "gathered")

    def free_storage(t: torch.Tensor) -> None:
        tracer = active_tracer()
        if tracer is not None:
            tracer.freed_outside_dispatch(t)
        original_free(t)

    # the parameter group imports the functions by name (its one-rank path grows storages with it)
    modules = (_fsdp_param, _fsdp_param_group)
    patched = [(m, n, f) for m in modules for n, f in vars(m).items() if f is original_alloc or f is original_free]
    for module, name, original in patched:
        setattr(module, name, alloc_storage if original is original_alloc else free_storage)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
