"""Run a workload on fake tensors: same shapes, dtypes and ops, nothing allocated.

The model's parameters and buffers are swapped *in place* for fake tensors (so a loss function that
refers to the model, or to a reference model, from a closure sees them too) and restored afterwards,
whatever happens. A model already built under ``FakeTensorMode`` is used as it is, in its own mode.

A model built on the ``meta`` device (``with torch.device("meta"):``, accelerate's ``init_empty_weights()``)
has shapes and dtypes but no values, which is all a fake step needs: its meta tensors become fake tensors on
the device the trace names (default cpu), so tensors that ``forward`` creates on the default device (a causal
mask from ``torch.ones(T, T)``) meet its weights on one device. Meta tensors that were views of one another
become separate fake tensors: a model that ties weights by sharing the ``Parameter`` keeps them tied.

A model whose constructor reads a tensor's value (a drop-path schedule ``[x.item() for x in
torch.linspace(0, rate, depth)]``, as timm's ViT and ConvNeXt compute it) cannot be built under
``FakeTensorMode``, which has no values, nor under ``torch.device("meta")``. :class:`EmptyWeights` builds it
for real with each parameter, and each buffer above a small size, moved to ``meta`` as it is registered:
the schedule is computed on the CPU, the weights never occupy memory, and initialisers run on meta tensors
(a truncated normal of a billion-element weight does nothing). Its small real buffers (position ids,
relative-position indexes) are converted to fake tensors like any real tensor.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._pytree import tree_map

from trainledger.errors import InputError
from trainledger.workload import Workload

SMALL_BUFFER_BYTES = 1 << 20
"""Buffers up to this size stay real in :class:`EmptyWeights` (index tables a constructor may read); larger
ones (a causal mask of 8,192² booleans) go to ``meta`` with the parameters."""


class EmptyWeights:
    """While entered, every parameter and every buffer above ``small_buffer_bytes`` that a module registers is
    replaced by a ``meta`` tensor of the same shape, dtype and ``requires_grad``; a model built so traces with
    ``trace(workload, fake=True)``. Everything else the constructor computes is real.

    It uses PyTorch's global registration hooks (the technique of accelerate's ``init_empty_weights``). A
    parameter's tensor is created real before it is registered: ``torch.empty`` touches no page, so only
    parameters made with values (``nn.Parameter(torch.zeros(1, 1, dim))``) are ever resident, one at a time.
    It may be entered again, and nested.

    Example:
        >>> with EmptyWeights():
        ...     rates = [x.item() for x in torch.linspace(0, 0.1, 3)]
        ...     layer = nn.Linear(4096, 4096)
        >>> layer.weight.device.type, round(rates[1], 2)
        ('meta', 0.05)
    """

    def __init__(self, small_buffer_bytes: int = SMALL_BUFFER_BYTES) -> None:
        self.small_buffer_bytes = small_buffer_bytes
        self._handles: list[list[Any]] = []

    def __enter__(self) -> EmptyWeights:
        self._handles.append(
            [
                register_module_parameter_registration_hook(_parameter_to_meta),
                register_module_buffer_registration_hook(self._buffer_to_meta),
            ]
        )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles.pop():
            handle.remove()

    def _buffer_to_meta(self, module: nn.Module, name: str, buffer: torch.Tensor | None) -> torch.Tensor | None:
        del module, name
        if buffer is None or buffer.is_meta or isinstance(buffer, FakeTensor):
            return None
        if buffer.untyped_storage().nbytes() <= self.small_buffer_bytes:
            return None
        return buffer.to("meta")


def _parameter_to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    del module, name
    if param is None or param.is_meta or isinstance(param, FakeTensor):
        return None  # a parameter shared again (tied weights) is already on meta: kept the same object
    if type(param) is not nn.Parameter:  # a subclass takes its attributes back (accelerate does the same)
        return type(param)(param.detach().to("meta"), **{**param.__dict__, "requires_grad": param.requires_grad})
    moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)
    return moved


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


def _contiguous_grad_input(out: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``native_layer_norm_backward``: the CPU and CUDA kernels write the input's gradient into a contiguous
    tensor (``empty_like(X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``); the meta kernel copies the incoming gradient's
    strides, so a transposed gradient made the next ``reshape`` copy on fake tensors only."""
    grad = out[0]
    if grad is None or grad.is_contiguous():
        return out
    return (torch.empty_like(grad, memory_format=torch.contiguous_format), *out[1:])


def _grad_input_as_input(out: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``native_batch_norm_backward``: the kernels lay the input's gradient out as the input
    (``empty_like(input, input.suggest_memory_format())``); the meta kernel follows the incoming gradient."""
    grad, fmt = out[0], _suggested_format(args[1])
    if grad is None or grad.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty_like(grad, memory_format=fmt), *out[1:])


def _output_as_input(out: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``native_batch_norm``: the CPU kernel lays its output out as ``empty_like(input,
    input.suggest_memory_format())``; the meta kernel keeps the input's strides, size-1 dims included: a pooled
    map of 2x32x1x1 with strides (32, 1, 32, 32) (a 1x1 convolution's output, BEiT's segmentation head) stayed
    channels-last-like on fake tensors only, and the upsampling and convolution after it ran channels-last."""
    result = out[0]
    laid_out = torch.empty_like(result, memory_format=_suggested_format(args[0]))
    if result.stride() == laid_out.stride():
        return out
    return (laid_out, *out[1:])


def _suggested_format(x: Any) -> torch.memory_format:
    """``suggest_memory_format()`` for a dense tensor: channels-last where its strides are, else contiguous."""
    if isinstance(x, torch.Tensor) and not x.is_contiguous():
        for fmt, dim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
            if x.dim() == dim and x.is_contiguous(memory_format=fmt):
                return fmt
    return torch.contiguous_format


def _mixed_statistics(weight_at: int) -> Any:
    """``native_layer_norm`` / ``native_group_norm`` (weight at ``weight_at``): the CPU kernels keep mean and rstd
    in the parameters' dtype when input and parameters differ (``is_mixed_type``: a bf16 activation under fp32
    LayerNorm weights, as autocast and bf16-activation training run it), the meta kernels in the input's. The
    statistics are saved for backward, whose probe then runs the real kernel on them."""

    def substitute(out: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
        result, mean, rstd = out
        weight = args[weight_at] if len(args) > weight_at else None
        if not isinstance(weight, torch.Tensor) or weight.dtype == mean.dtype:
            return out
        return result, torch.empty_like(mean, dtype=weight.dtype), torch.empty_like(rstd, dtype=weight.dtype)

    return substitute


FAKE_SUBSTITUTES: dict[Any, Any] = {
    torch.ops.aten.native_layer_norm_backward.default: _contiguous_grad_input,
    torch.ops.aten.native_batch_norm_backward.default: _grad_input_as_input,
    torch.ops.aten.native_batch_norm.default: _output_as_input,
    torch.ops.aten.native_layer_norm.default: _mixed_statistics(2),
    torch.ops.aten.native_group_norm.default: _mixed_statistics(1),
}
"""Below autograd, in a fake trace: ops whose meta kernels lay outputs out otherwise than the real kernels, with
the function that gives the real kernel's layout (same bytes; what follows may copy or not)."""


class MetaKernelFailures(logging.Filter):
    """While a fake step runs: PyTorch's log of a meta kernel that raised (``log.exception`` in
    ``FakeTensorMode``, a traceback on stderr before the error reaches us) is kept here instead of printed,
    so the error stays one line and can name the op whose fake kernel refused."""

    LOGGER = "torch._subclasses.fake_tensor"

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith("failed while attempting to run meta"):
            self.ops.append(str(record.args[0]) if record.args else "an op")
            return False
        return True

    def __enter__(self) -> MetaKernelFailures:
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)


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
