"""Sparse gradients (``nn.Embedding(sparse=True)``, ``EmbeddingBag``): the step a plain run takes.

Autograd's ``AccumulateGrad`` keeps the sparse gradient backward made, as a new sparse tensor over the
same index and value tensors, when nothing else holds them; it copies it otherwise. It counts holders by
reference counts, and under any Python dispatch mode the parts it asks for carry one more: a traced step
copies every sparse gradient a plain step shares (an embedding's indices are then the batch's own). The
tracer puts the plain step's sharing back: that ``clone`` returns the shallow tensor ``AccumulateGrad``
makes.

Sparse kernels also make and grow their parts out of sight: an in-place ``add_`` on a sparse momentum buffer
points it at new index and value tensors, or resizes them. A step with sparse gradients is traced by
:class:`SparseStepTracer`, which after every op looks at the parts of the sparse tensors it returned (an
in-place op returns the tensor it wrote): a part not seen before is allocated by that op, a part whose
storage grew is freed at its old size and allocated at its new one. Steps without sparse gradients pay
nothing for it.
"""

from __future__ import annotations

from typing import Any

import torch

from trainledger.inventory import storage_key, storage_parts
from trainledger.trace._tracer import StepTracer, tensors_of

_CLONE = torch.ops.aten.clone.default


def has_sparse_gradients(model: torch.nn.Module) -> bool:
    """Whether a module says its gradient is sparse (``nn.Embedding``'s and ``nn.EmbeddingBag``'s ``sparse``) or a
    gradient is: asked after a warm-up step's backward (any sparse gradient then exists), or before a step of the
    user's own loop (the modules' word only)."""
    return any(getattr(m, "sparse", False) is True for m in model.modules()) or any(
        p.grad is not None and p.grad.layout is torch.sparse_coo for p in model.parameters()
    )


class SparseStepTracer(StepTracer):
    """The step tracer for a step with sparse gradients: ``AccumulateGrad``'s sharing put back, and the parts of
    sparse tensors followed where kernels make or grow them (see above). Parts an op returns as new storages the
    base tracer already records; this one adds the parts of what in-place ops return, and growth."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.substitutes = {**self.substitutes, _CLONE: self._shared_gradient}

    def _shared_gradient(self, out: Any, args: tuple[Any, ...]) -> Any:
        """``AccumulateGrad``'s shallow copy of a sparse gradient (backward, grad mode off, contiguous parts) in
        place of the full ``clone`` the dispatch mode caused."""
        grad = args[0] if args else None
        if (
            not isinstance(grad, torch.Tensor)
            or grad.layout is not torch.sparse_coo
            or torch.is_grad_enabled()
            or self.phase != "backward"
        ):
            return out
        indices, values = grad._indices(), grad._values()
        if not (indices.is_contiguous() and values.is_contiguous()):
            return out  # AccumulateGrad copies these in a plain step too
        return torch.sparse_coo_tensor(
            indices, values, grad.shape, is_coalesced=grad.is_coalesced(), check_invariants=False
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.ops:
            index = len(self.ops) - 1
            for t in tensors_of(out):
                if t.layout is not torch.strided:
                    for part in storage_parts(t):
                        if part.layout is torch.strided:
                            self._follow(part, index)
        return out

    def _follow(self, part: torch.Tensor, index: int) -> None:
        key = storage_key(part)
        rec = self.storages.get(key)
        if rec is None:
            _, op, module, _ = self.ops[index]
            self._track(part, key, f"{op}#{index}", None, "", index, module, index)
        elif part.untyped_storage().nbytes() != rec.nbytes:
            # resized inside the op: the old block and the new one are both live while it copies
            rec.free_event = index + 1
            self.finished.append(rec)
            old = self._refs.get(key)
            if old is not None:
                old.rec = None
            grown = self._track(part, key, rec.name, rec.category, rec.role, index, rec.owner, index)
            grown.aliases = rec.aliases
