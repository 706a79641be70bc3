"""A convolution's kernel-internal buffers, estimated from small instances of the same call.

Running a full-size convolution again to measure its buffers costs what the step costs, and much more where
the machine has no fast kernel for the dtype: without AVX-512 BF16, a bf16 convolution falls back to
im2col and a scalar matrix product (a (4, 320, 64, 64) 3×3 convolution takes minutes here, its fp32 twin
0.4 s). What its buffers depend on was measured by probing shapes (``python -m benchmarks.kernel_workspace``
lists the ops; ``tests/test_kernel_scaling.py`` holds the shapes):

- bf16 on this kind of machine (im2col): exactly ``batch × in_channels × kh × kw × out_rows × out_cols × 2``
  bytes, the columns of one image at a time times the batch; independent of out_channels.
- fp32 through oneDNN: not a product of the sizes (a (1, 64, 8, 8) 3×3 forward holds 144 KiB, batch 2
  176 KiB, batch 4 208 KiB; 32×32 holds less than 16×16: the algorithm changes with the shape).

So the rule measures, for each call too slow to run whole, a small instance of it (batch 1, at most 16
channels each way, at most 4×4 output pixels) and the same instance with one size doubled at a time, and
reads from the ratios how the buffers grow with each size: not at all (ratio 1) or in proportion (ratio
2). Where every size fits one of the two, and the instance with all of them doubled at once holds what that
predicts, the full call's buffers are the small instance's scaled by the
sizes they grow with (evidence ``estimated``); where any size fits neither (the oneDNN case), the call is
not estimated and the ledger's notes count it. The rule is checked against full probes of mid-size
shapes (``tests/test_kernel_scaling.py``: within 5 %).

Only plain 2-D convolutions (not transposed, one group, contiguous or channels-last) are scaled; other
ops' kernels do work in proportion to their bytes and run whole.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

import torch

KernelCall = Any  # trainledger.trace._kernels.KernelCall, which imports this module; specs as _TensorSpec

MAX_PROBE_SECONDS = 2.0
"""A call predicted to take longer than this to run (twice: a warm-up run, then the measured one) is
estimated from small instances of it, or left out."""

MAX_PROBE_FRACTION_OF_FREE = 0.25
"""A call is run only if its tensors fit in this fraction of the memory free now."""

_SMALL = {"n": 1, "cin": 16, "cout": 16, "ho": 4, "wo": 4}
"""The small instance's sizes (each at most the call's own)."""

_RATIO_TOLERANCE = 0.05
"""How far a measured ratio may be from 1 or from the size's ratio and still count as one of them."""

_CONV = "aten.convolution"
_CONV_BACKWARD = "aten.convolution_backward"


@dataclass(frozen=True)
class ConvSizes:
    """The sizes of a 2-D convolution that its buffers may grow with."""

    n: int
    cin: int
    cout: int
    ho: int
    wo: int


@dataclass(frozen=True)
class _Conv:
    """A 2-D convolution call taken apart: the sizes that vary and the geometry that stays."""

    call: KernelCall
    sizes: ConvSizes
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    remainder: tuple[int, int]  # input rows/cols past the last output's window, kept in smaller instances
    channels_last: bool

    def input_side(self, out: int, axis: int) -> int:
        d, k, s, p = self.dilation[axis], self.kernel[axis], self.stride[axis], self.padding[axis]
        return (out - 1) * s + d * (k - 1) + 1 - 2 * p + self.remainder[axis]

    def flops(self, sizes: ConvSizes | None = None) -> int:
        z = sizes or self.sizes
        per_pass = 2 * z.n * z.cout * z.ho * z.wo * z.cin * self.kernel[0] * self.kernel[1]
        if str(self.call.op).startswith(_CONV_BACKWARD):
            mask = self.call.args[-1]
            return per_pass * max(1, sum(1 for m in mask[:2] if m))
        return per_pass

    def at(self, z: ConvSizes) -> KernelCall | None:
        """The same call at sizes ``z`` (``None`` where the input would be empty)."""
        h, w = self.input_side(z.ho, 0), self.input_side(z.wo, 1)
        if h < 1 or w < 1:
            return None
        like = self.call.args[1]  # the input (backward) or the weight (forward): a spec of the call's dtype

        def spec(shape: tuple[int, ...]) -> Any:
            return type(like)(shape, _strides(shape, channels_last=self.channels_last), like.dtype)

        weight = spec((z.cout, z.cin, *self.kernel))
        args = list(self.call.args)
        if str(self.call.op).startswith(_CONV_BACKWARD):
            args[0] = spec((z.n, z.cout, z.ho, z.wo))
            args[1] = spec((z.n, z.cin, h, w))
            args[2] = weight
            if args[3] is not None:
                args[3] = (z.cout,)
        else:
            args[0] = spec((z.n, z.cin, h, w))
            args[1] = weight
            if args[2] is not None:
                args[2] = type(args[2])((z.cout,), (1,), args[2].dtype)
        return replace(self.call, args=tuple(args))


def _strides(shape: tuple[int, ...], *, channels_last: bool) -> tuple[int, ...]:
    if len(shape) == 4 and channels_last:
        n, c, h, w = shape
        return (h * w * c, 1, w * c, c)
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def conv_of(call: KernelCall) -> _Conv | None:
    """``call`` as a 2-D convolution that can be scaled, or ``None``."""
    op = str(call.op)
    if not (op.startswith(_CONV) and call.op._overloadname == "default"):
        return None
    backward = op.startswith(_CONV_BACKWARD)
    a = call.args
    x, weight = (a[1], a[2]) if backward else (a[0], a[1])
    stride, padding, dilation, transposed, _, groups = a[4:10] if backward else a[3:9]
    if not (hasattr(x, "stride") and hasattr(weight, "stride")) or len(x.shape) != 4:
        return None
    if transposed or groups != 1 or len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        return None
    channels_last = x.stride == _strides(x.shape, channels_last=True) and x.stride != _strides(
        x.shape, channels_last=False
    )
    if x.stride != _strides(x.shape, channels_last=channels_last):
        return None
    n, cin, h, w = x.shape
    cout, _, kh, kw = weight.shape
    outs = [
        (side + 2 * p - d * (k - 1) - 1) // s + 1
        for side, p, d, k, s in zip((h, w), padding, dilation, (kh, kw), stride, strict=True)
    ]
    rem = tuple(
        (side + 2 * p - d * (k - 1) - 1) % s
        for side, p, d, k, s in zip((h, w), padding, dilation, (kh, kw), stride, strict=True)
    )
    if min(outs) < 1:
        return None
    return _Conv(
        call,
        ConvSizes(n, cin, cout, *outs),
        (kh, kw),
        tuple(stride),
        tuple(padding),
        tuple(dilation),
        rem,
        channels_last,
    )  # type: ignore[arg-type]


@dataclass(frozen=True)
class Scaling:
    """A call too slow to run whole, and the small instances whose buffers estimate its own."""

    small: KernelCall
    """The small instance."""
    variants: tuple[tuple[str, float, KernelCall], ...]
    """Per size that differs from the call's: its name, how much larger the variant is in it, the variant."""
    factors: tuple[tuple[str, float], ...]
    """Per size that differs: the call's size over the small instance's."""

    check: KernelCall | None
    """The small instance with every such size doubled at once: the rule must predict it too."""

    @property
    def calls(self) -> tuple[KernelCall, ...]:
        return (self.small, *(v for *_, v in self.variants), *([self.check] if self.check is not None else []))

    def estimate(self, measured: dict[KernelCall, int]) -> int | None:
        """The call's buffers: the small instance's, times each size's factor where they grew with that size;
        ``None`` where a size's ratio is neither 1 nor the size's own (no product of sizes)."""
        base = measured[self.small]
        grows: dict[str, bool] = {}
        for name, ratio, variant in self.variants:
            held = measured[variant]
            if base == 0:
                if held != 0:
                    return None
                continue
            got = held / base
            if abs(got - 1) <= _RATIO_TOLERANCE:
                grows[name] = False
            elif abs(got - ratio) <= _RATIO_TOLERANCE * ratio:
                grows[name] = True
            else:
                return None
        if self.check is not None:
            predicted = base * math.prod(r for name, r, _ in self.variants if grows.get(name))
            if abs(measured[self.check] - predicted) > _RATIO_TOLERANCE * predicted:
                return None  # each size alone fits, all of them together do not
        scale = math.prod(f for name, f in self.factors if grows.get(name))
        return round(base * scale)


def scaling_of(call: KernelCall) -> Scaling | None:
    """Small instances that estimate ``call``'s buffers, or ``None`` where it is no scalable convolution."""
    conv = conv_of(call)
    if conv is None:
        return None
    full = conv.sizes
    small = ConvSizes(**{k: min(getattr(full, k), v) for k, v in _SMALL.items()})
    small_call = conv.at(small)
    if small_call is None:
        return None
    variants, factors, together = [], [], {}
    for name in _SMALL:
        lo, hi = getattr(small, name), getattr(full, name)
        if hi == lo:
            continue
        bigger = min(2 * lo, hi)
        variant = conv.at(replace(small, **{name: bigger}))
        if variant is None:
            return None
        variants.append((name, bigger / lo, variant))
        factors.append((name, hi / lo))
        together[name] = bigger
    check = conv.at(replace(small, **together)) if len(together) > 1 else None
    return Scaling(small_call, tuple(variants), tuple(factors), check)


def seconds_to_run(call: KernelCall, products: Collection[str] = ()) -> float:
    """Predicted seconds to run ``call`` twice, from this process's speed on a reference convolution of its
    dtype; for a matrix product or SDPA's flash kernel from its multiply-adds; 0 for other ops (their kernels work
    in proportion to their bytes). A call that cannot be scaled and is predicted too slow is left out rather than
    run (a 405B model's projections, probed on this CPU, took seconds each). ``products``: the names of the matrix
    products (``_kernels.MATMUL_OPERANDS``, which the caller holds: that module imports this one)."""
    conv = conv_of(call)
    if conv is not None:
        return 2 * conv.flops() / _flops_per_second(conv.call.args[1].dtype)
    op = str(call.op)
    product = _product_flops(op, call.args, products)
    if product is not None:
        return 2 * product[0] / _flops_per_second(product[1])
    if not op.startswith(_CONV):
        return 0.0
    # Grouped, transposed, 1-D or 3-D: at most every input pixel times every weight (stride 1 bounds it).
    backward = op.startswith(_CONV_BACKWARD)
    x, weight = (call.args[1], call.args[2]) if backward else (call.args[0], call.args[1])
    if not (hasattr(x, "shape") and hasattr(weight, "shape")) or len(x.shape) < 3:
        return 0.0
    passes = max(1, sum(1 for m in call.args[-1][:2] if m)) if backward else 1
    flops = 2 * x.shape[0] * math.prod(x.shape[2:]) * math.prod(weight.shape) * passes
    return 2 * flops / _flops_per_second(weight.dtype)


def _product_flops(op: str, args: tuple[Any, ...], products: Collection[str]) -> tuple[float, torch.dtype] | None:
    """FLOPs and dtype of a matrix product (its two matrix operands: the last two of ``args`` that have shapes)
    or of SDPA's CPU flash kernel (query and key: 4 x B x H x L x S x E forward, about twice that backward)."""
    shaped = [a for a in args if hasattr(a, "shape") and hasattr(a, "dtype")]
    if op.startswith("aten._scaled_dot_product_flash_attention_for_cpu"):
        backward = op.endswith("_backward.default")
        # forward (query, key, ...); backward (grad_out, query, key, ...)
        q, k = shaped[backward : 2 + backward] if len(shaped) >= 2 + backward else (None, None)
        if q is None or k is None or len(q.shape) != 4 or len(k.shape) != 4:
            return None
        return 4.0 * (1 + backward) * math.prod(q.shape) * k.shape[-2], q.dtype
    if op.removesuffix(".default") not in products or len(shaped) < 2:
        return None
    a, b = shaped[-2], shaped[-1]
    if not a.shape or not b.shape:
        return None
    # (…, n, k) by (…, k, m) or by a vector (k,): 2 x every element of a x the other side of b
    return 2.0 * math.prod(a.shape) * (b.shape[-1] if len(b.shape) >= 2 else 1), a.dtype


_RATES: dict[torch.dtype, float] = {}


def _flops_per_second(dtype: torch.dtype) -> float:
    """This machine's speed on a (1, 64, 16, 16) 3×3 convolution of ``dtype`` (19 MFLOP; the best of two runs
    after a warm-up), measured once per process."""
    if dtype not in _RATES:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch.no_grad():
            x, w = torch.zeros(1, 64, 16, 16, dtype=dtype), torch.zeros(64, 64, 3, 3, dtype=dtype)
            best = math.inf
            for i in range(3):
                start = time.perf_counter()
                torch.nn.functional.conv2d(x, w, padding=1)
                if i:
                    best = min(best, time.perf_counter() - start)
        _RATES[dtype] = 2 * 64 * 64 * 9 * 16 * 16 / max(best, 1e-6)
    return _RATES[dtype]


def bytes_free_for_probes() -> int:
    """The most a probe's tensors may take: a fraction of the memory free now."""
    try:
        with open("/proc/meminfo") as f:  # MemAvailable: free pages plus what the kernel can reclaim
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 1 << 30
    return int(free * MAX_PROBE_FRACTION_OF_FREE)
