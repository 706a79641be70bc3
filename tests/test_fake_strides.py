"""Where a fake tensor's meta kernel lays an output out otherwise than the real kernel, a fake trace takes the
real kernel's layout: the bytes are the same, but whether the next ``reshape`` copies is not. Oracle: the CPU
kernels themselves, run on real tensors beside the fake ones."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainledger.trace import FAKE_SUBSTITUTES

aten = torch.ops.aten


def _layer_norm_backward(x_transposed: bool, grad_transposed: bool, affine: bool):
    def make(shape, transposed):
        t = torch.randn(shape[0], shape[2], shape[1])
        return t.transpose(1, 2) if transposed else t.transpose(1, 2).contiguous()

    x, g = make((2, 16, 32), x_transposed), make((2, 16, 32), grad_transposed)
    w, b = (torch.randn(32), torch.randn(32)) if affine else (None, None)
    _, mean, rstd = aten.native_layer_norm(x, [32], w, b, 1e-5)
    args = (g, x, [32], mean, rstd, w, b, [True, affine, affine])
    return aten.native_layer_norm_backward.default, args


def _batch_norm_backward(channels_last: bool, grad_permuted: bool):
    x = torch.randn(2, 8, 4, 4)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    g = torch.randn(2, 8, 4, 4).permute(0, 1, 3, 2) if grad_permuted else torch.randn(2, 8, 4, 4)
    w, b, mean, var = torch.randn(8), torch.randn(8), torch.zeros(8), torch.ones(8)
    _, save_mean, save_invstd = aten.native_batch_norm(x, w, b, mean, var, True, 0.1, 1e-5)
    args = (g, x, w, mean, var, save_mean, save_invstd, True, 1e-5, [True, True, True])
    return aten.native_batch_norm_backward.default, args


def _batch_norm(strides: tuple[int, ...] | None, training: bool = True):
    """A 2x32x1x1 map with a 1x1 convolution's strides of a pooled channels-last map (BEiT's segmentation head),
    or a transposed 3-d input."""
    if strides is None:
        x = torch.randn(2, 6, 8).transpose(1, 2)  # (2, 8, 6), not contiguous
    else:
        x = torch.empty_strided((2, 32, 1, 1), strides).normal_()
    c = x.shape[1]
    args = (x, torch.ones(c), torch.zeros(c), torch.zeros(c), torch.ones(c), training, 0.1, 1e-5)
    return aten.native_batch_norm.default, args


CALLS = {
    "batch-norm forward, pooled channels-last map": lambda: _batch_norm((32, 1, 32, 32)),
    "batch-norm forward, pooled map, eval": lambda: _batch_norm((32, 1, 32, 32), training=False),
    "batch-norm forward, transposed 3-d input": lambda: _batch_norm(None),
    "layer-norm, both transposed": lambda: _layer_norm_backward(True, True, True),
    "layer-norm, gradient transposed": lambda: _layer_norm_backward(False, True, True),
    "layer-norm, input transposed": lambda: _layer_norm_backward(True, False, True),
    "layer-norm, no affine": lambda: _layer_norm_backward(True, True, False),
    "batch-norm, channels-last input": lambda: _batch_norm_backward(True, True),
    "batch-norm, permuted gradient": lambda: _batch_norm_backward(False, True),
    "batch-norm, channels-last, contiguous gradient": lambda: _batch_norm_backward(True, False),
}


@pytest.mark.parametrize("name", CALLS)
def test_fake_outputs_take_the_real_kernels_strides(name):
    torch.manual_seed(0)
    op, args = CALLS[name]()
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = FAKE_SUBSTITUTES[op](op(*fake_args), fake_args)
    for r, f in zip(real, fake, strict=True):
        assert (r is None) == (f is None)
        if r is not None:
            assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)
    # and the meta kernel alone differs somewhere, or the substitute would not be needed
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        plain = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    if name in META_DIFFERS:
        assert plain[0].stride() != real[0].stride()


META_DIFFERS = {n for n in CALLS if "transposed" in n and n != "layer-norm, input transposed"} | {
    "batch-norm, channels-last input",
    "batch-norm, permuted gradient",
    "batch-norm forward, pooled channels-last map",
}
