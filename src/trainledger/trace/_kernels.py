"""Memory that CPU kernels allocate and free inside one op, measured by running each kernel alone.

A dispatch-level trace sees the storages an op returns, not the buffers its kernel allocates and frees
before returning: oneDNN's convolution copies its input and the output gradient into blocked layouts
(channels padded to its vector width), BatchNorm's backward keeps a temporary of the input's size, the
LSTM's backward a workspace. Those are real memory at the op's instant (the profiler's allocation
events, ``trainledger trace --measure``, see them), and on convolutional nets they can be a sixth of the
peak.

Which ops do this was found by probing every built-in example and the test zoo under the profiler
(``python -m benchmarks.kernel_workspace``); the kernels they run depend on the machine (vector width,
thread count), so their buffers are not a formula: each distinct call (op, shapes, strides, dtypes and
arguments) is run once more, alone, on zero-filled tensors of the same layout, under the profiler, and its
largest allocation above what it returns becomes a ``workspace`` entry with role ``kernel_internal`` and
evidence ``measured``, live at that op's event only. Calls too large to run here are left out and the
ledger's notes say how many.

Matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``addbmm``, ``mv``, ``addmv``: what ``matmul`` and
``linear`` dispatch to) copy an operand BLAS cannot read in place, or compute into a copy of a result it
cannot write: the expanded-scalar gradient a plain ``loss = out.sum()`` hands the last layer's backward (every
stride 0) is cloned inside ``mm``, one operand above a tensor trace. Such a call is probed like the ops above,
but only when :func:`blas_reads` (the layout test of ``addmm_impl_cpu_``) fails for one of its operands: an
ordinary product, contiguous or transposed, costs one stride test and adds nothing. Probed rather than
modelled, because which CPU kernel runs, and so what it copies, depends on dtype and build (bmm copies one
batch item at a time on its split path, nothing below 400 multiply-adds; bf16 goes to oneDNN, which copies
nothing here); a CUDA-kind trace models cuBLAS's copies from its rule instead
(:func:`trainledger.trace._cuda.cublas_copy_bytes`).

Nothing the step observes changes: the kernels run on tensors of their own, outside the traced step, and
no random numbers are drawn.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainledger.ledger import Category, Entry, Evidence
from trainledger.trace import _scaled
from trainledger.trace._scaled import bytes_free_for_probes, scaling_of, seconds_to_run
from trainledger.workload import profiler_stderr_filtered, quiet_gc

KERNEL_INTERNAL = "kernel_internal"

# Ops whose CPU kernels allocate buffers they free before returning (found by the probe named above).
PROBED_OPS: frozenset[str] = frozenset(
    {
        "aten.convolution",
        "aten.convolution_backward",
        "aten.embedding",
        "aten.embedding_dense_backward",
        "aten.mkldnn_rnn_layer",
        "aten.mkldnn_rnn_layer_backward",
        "aten.mse_loss",
        "aten.native_batch_norm",
        "aten.native_batch_norm_backward",
        "aten.native_layer_norm_backward",
        # found by running ops of losses, resampling, pooling, sorting and normalization alone under the profiler,
        # each with a dense gradient (an expanded one from ``loss = out.sum()`` makes others copy it, which the
        # matrix products' rule above covers where it matters): composites inside one CPU kernel, whose
        # intermediates (BCE's log-sigmoid and (1 - target), upsampling's channels-last copies) no dispatch shows
        "aten.binary_cross_entropy_with_logits",
        "aten.huber_loss",
        "aten.smooth_l1_loss",
        "aten.soft_margin_loss_backward",
        "aten._ctc_loss_backward.Tensor",
        "aten.logsumexp",
        "aten.sort",
        "aten.sort.stable",
        "aten.kthvalue",
        "aten.cumsum",
        "aten._embedding_bag",
        "aten._embedding_bag_backward",
        "aten.native_group_norm_backward",
        "aten.im2col",
        "aten._euclidean_dist",
        "aten.affine_grid_generator",
        "aten.masked_scatter_backward",
        "aten.upsample_nearest1d",
        "aten.upsample_nearest2d",
        "aten.upsample_nearest3d",
        "aten._upsample_nearest_exact1d",
        "aten._upsample_nearest_exact2d",
        "aten._upsample_nearest_exact3d",
        "aten.upsample_linear1d",
        "aten.upsample_bilinear2d",
        "aten.upsample_bicubic2d",
        "aten.upsample_trilinear3d",
        # SDPA's CPU flash kernel: per-thread blocks of scores, and in backward per-thread gradient accumulators
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
        # LAPACK's workspace and the copies it factors in place (a Shampoo- or SOAP-like optimizer's eigh, an
        # orthogonal parametrization's matrix exponential): sized by the shapes, not the values (measured),
        # except the matrix exponential's (``NORM_SIZED``)
        "aten._linalg_det",
        "aten._linalg_eigh",
        "aten._linalg_slogdet",
        "aten._linalg_solve_ex",
        "aten._linalg_svd",
        "aten.linalg_cholesky_ex",
        "aten.linalg_eig",
        "aten.linalg_householder_product",
        "aten.linalg_inv_ex",
        "aten.linalg_lstsq",
        "aten.linalg_lu_factor_ex",
        "aten.linalg_matrix_exp",
        "aten.linalg_pinv.atol_rtol_tensor",
        "aten.linalg_qr",
    }
)

NORM_SIZED: frozenset[Any] = frozenset({torch.ops.aten.linalg_matrix_exp.default})
"""Ops whose buffers depend on their input's 1-norm: the matrix exponential picks its series' degree by it (a
16 by 16 matrix: 4,112 bytes for zeros, 6,160 at a norm of 0.01, 12,312 from about 0.3). Such a call is probed on
a matrix of one value with the input's largest 1-norm, which picks the same degree (the largest of a batch's)."""

# Matrix products, by the positions of the operands BLAS reads as matrices (or vectors): what ``matmul`` and
# ``linear`` become at dispatch level, and the out= and in-place forms whose written result BLAS may not be able
# to write in place. Their kernels copy an operand only when its layout fails :func:`blas_reads`, so the tracer
# probes a call only then (``blas_copies``): an ordinary product costs one stride test.
MATMUL_OPERANDS: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(("aten.mm", "aten.mm.out", "aten.bmm", "aten.bmm.out", "aten.mv", "aten.mv.out"), (0, 1)),
    **dict.fromkeys(
        (
            "aten.addmm",
            "aten.addmm.out",
            "aten._addmm_activation",
            "aten._addmm_activation.out",
            "aten.baddbmm",
            "aten.baddbmm.out",
            "aten.addbmm",
            "aten.addbmm.out",
            "aten.addmv",
            "aten.addmv.out",
        ),
        (1, 2),
    ),
    # in place: the first argument is the result the product is written into
    **dict.fromkeys(("aten.addmm_", "aten.baddbmm_", "aten.addbmm_", "aten.addmv_"), (0, 1, 2)),
}


def blas_reads(t: Any) -> bool:
    """Whether BLAS reads (or writes) ``t`` in place: a matrix (its last two dims, a batch's items) row- or
    column-major with a leading dimension at least its extent; a vector with a non-zero stride.

    This is the test of ``addmm_impl_cpu_`` (aten/src/ATen/native/LinearAlgebra.cpp), which clones an
    operand that fails it (``m1.clone(at::MemoryFormat::Contiguous)``) and computes into a column-major copy
    of a result that fails it. Every other path copies on a subset of these layouts: ``bmm_out_or_baddbmm_``
    accepts a batch whose items pass it (size-1 dims exempt) and otherwise calls ``addmm_impl_cpu_`` on one
    item at a time (a copy of one item), or runs a naive kernel without copies below 400 multiply-adds or a
    oneDNN one for bf16/fp16; ``addmv_impl_cpu`` (aten/src/ATen/native/Blas.cpp) takes ``mat.contiguous()``
    of a matrix that fails it; cuBLAS's ``prepare_matrix_for_cublas`` and ``prepare_batch_matrix_for_cublas``
    (aten/src/ATen/native/cuda/Blas.cpp) also accept a dense one, and ``addmv_impl_cuda`` copies a vector of
    stride 0. How much a CPU call copies is measured (the kernel it takes depends on dtype and build); a CUDA
    kind trace computes it from cuBLAS's rule (:func:`trainledger.trace._cuda.cublas_copy_bytes`).
    """
    # runs for every matrix product of a step: the shape is read only where a stride is 1
    if not isinstance(t, torch.Tensor):
        return True
    stride = t.stride()
    if len(stride) < 2:
        return not stride or stride[0] != 0 or t.shape[0] <= 1
    a, b = stride[-2], stride[-1]
    if b == 1 and a >= 1 and a >= t.shape[-1]:  # row-major, leading dimension at least the row
        return True
    return a == 1 and b >= 1 and b >= t.shape[-2]  # column-major


def blas_copies(positions: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a matrix product's kernel may hold buffers inside, so that the call is probed: an operand at
    ``positions`` (or its ``out=`` result) fails :func:`blas_reads`, or the product is in a precision that CPU
    kernels hand to oneDNN (:data:`ONEDNN_PRODUCT_DTYPES`)."""
    for i in positions:
        if i < len(args):
            t = args[i]
            if not blas_reads(t) or (isinstance(t, torch.Tensor) and t.dtype in ONEDNN_PRODUCT_DTYPES):
                return True
    out = kwargs.get("out")
    return out is not None and not blas_reads(out)


# Elementwise ops computed by a CPU TensorIterator, which casts an operand of another dtype than the one it computes
# in into a temporary of the operand's size (on CUDA the kernel casts as it loads): ``fp32 + bf16`` holds an fp32
# copy of the bf16 operand inside the op, ``float_tensor * long_tensor`` one of the integers; a 0-dim operand is a
# scalar to it (4 bytes). Probed only where two operands differ in dtype (``casts_an_operand``).
CASTING_OPS: frozenset[str] = frozenset(
    f"aten.{name}"
    for name in (
        "add.Tensor add_.Tensor sub.Tensor sub_.Tensor mul.Tensor mul_.Tensor div.Tensor div_.Tensor div.Tensor_mode "
        "where.self maximum minimum pow.Tensor_Tensor atan2 hypot copysign.Tensor fmod.Tensor remainder.Tensor "
        "eq.Tensor ne.Tensor lt.Tensor le.Tensor gt.Tensor ge.Tensor addcmul addcmul_ addcdiv addcdiv_ lerp.Tensor "
        "lerp_.Tensor xlogy.Tensor clamp.Tensor logical_and logical_or"
    ).split()
)
# Reductions given a dtype other than their input's (``x.sum(dtype=torch.float64)``, ``softmax(x, dtype=...)``):
# the input is cast into a temporary of its size first.
# Summing or multiplying integers or booleans without a dtype computes in int64 (``(labels != -100).sum()``): a
# bool or int32 input is cast into an int64 temporary of its length first, 8 bytes an element.
_INTEGER_REDUCTIONS = frozenset(
    f"aten.{name}" for name in "sum sum.dim_IntList prod prod.dim_int cumsum cumprod".split()
)
REDUCTIONS_TO_A_DTYPE: frozenset[str] = _INTEGER_REDUCTIONS | frozenset(
    f"aten.{name}" for name in "mean mean.dim linalg_vector_norm".split()
)
# Ops whose kernels compute on a contiguous copy of a tensor that is not (``X.expect_contiguous()`` in
# layer_norm.cpp, ``input.contiguous()`` in SoftMax.cpp): a ConvNeXt block's LayerNorm of a
# permuted feature map, a segmentation loss's log-softmax over the channels of a channels-last map, each hold a copy
# of their input inside the op. Probed only where a tensor argument is not contiguous (``reads_a_copy``).
CONTIGUOUS_OPS: frozenset[str] = frozenset(
    f"aten.{name}"
    for name in "native_layer_norm _softmax _log_softmax _safe_softmax _softmax_backward_data "
    "_log_softmax_backward_data".split()
)
# Elementwise kernels that copy where their operands' layouts differ (measured: the exact GELU's backward, given a
# permuted gradient of a contiguous input, holds twice the input's size inside; its tanh form and the other
# activations' backwards nothing). Probed only where two tensor arguments' strides differ (``strides_differ``).
LAYOUT_SENSITIVE_OPS: frozenset[str] = frozenset({"aten.gelu_backward"})
# Index ops whose CPU kernels compute a bf16 or fp16 source through an fp32 buffer, or make an expanded (stride-0)
# index contiguous: DeBERTa's disentangled attention gathers bf16 scores by an expanded index, 16,777,216 bytes
# inside one gather of 4 x 4 x 512 x 512 (nothing for the same gather in fp32).
INDEX_OPS: frozenset[str] = frozenset(
    f"aten.{name}"
    for name in "gather scatter_add scatter_add_ scatter.src scatter_.src scatter_reduce.two index_select".split()
)


def casts_an_operand(divides: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a :data:`CASTING_OPS` call has two operands (not 0-dim) of different dtypes, or (``divides``: a true
    division, no rounding mode) divides integers, which it computes in a float copy of them."""
    dtype = None
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim():
            if dtype is None:
                dtype = a.dtype
            elif a.dtype != dtype:
                return True
    if not divides or dtype is None or kwargs.get("rounding_mode") is not None:
        return False
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def casts_to_its_dtype(integer_reduction: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a :data:`REDUCTIONS_TO_A_DTYPE` call is given a dtype other than its input's, or (``integer_reduction``:
    a sum or product) is given none for integers narrower than int64 or booleans."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        return False
    dtype = kwargs.get("dtype")
    if dtype is None:  # ``sum.dim_IntList(self, dim, keepdim, dtype)``: positional
        dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
    if dtype is None:
        kind = first.dtype
        return integer_reduction and kind != torch.int64 and not kind.is_floating_point and not kind.is_complex
    return first.dtype != dtype


def reads_a_copy(_unused: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a :data:`CONTIGUOUS_OPS` call has a tensor argument that is not contiguous."""
    for a in args:
        if isinstance(a, torch.Tensor) and not a.is_contiguous():
            return True
    return any(isinstance(v, torch.Tensor) and not v.is_contiguous() for v in kwargs.values())


def strides_differ(_unused: Any, args: tuple[Any, ...], _kwargs: dict[str, Any]) -> bool:
    """Whether two tensor arguments of a :data:`LAYOUT_SENSITIVE_OPS` call have different strides."""
    strides = {a.stride() for a in args if isinstance(a, torch.Tensor)}
    return len(strides) > 1


def index_copies(_positions: Any, args: tuple[Any, ...], _kwargs: dict[str, Any]) -> bool:
    """Whether an :data:`INDEX_OPS` call has a bf16 or fp16 tensor, or an expanded (stride-0) one."""
    for a in args:
        if isinstance(a, torch.Tensor) and (
            a.dtype in ONEDNN_PRODUCT_DTYPES
            or any(st == 0 and n > 1 for st, n in zip(a.stride(), a.shape, strict=True))
        ):
            return True
    return False


ONEDNN_PRODUCT_DTYPES = frozenset({torch.bfloat16, torch.float16})


def _conditional_probes() -> dict[str, tuple[Any, Any]]:
    table: dict[str, tuple[Any, Any]] = {op: (blas_copies, positions) for op, positions in MATMUL_OPERANDS.items()}
    table.update({op: (casts_an_operand, op.startswith(("aten.div.", "aten.div_."))) for op in CASTING_OPS})
    table.update({op: (casts_to_its_dtype, op in _INTEGER_REDUCTIONS) for op in REDUCTIONS_TO_A_DTYPE})
    table.update({op: (reads_a_copy, None) for op in CONTIGUOUS_OPS})
    table.update({op: (strides_differ, None) for op in LAYOUT_SENSITIVE_OPS})
    table.update({op: (index_copies, None) for op in INDEX_OPS})
    return table


CONDITIONAL_PROBES: dict[str, tuple[Any, Any]] = _conditional_probes()
"""Ops probed only where their arguments make the kernel hold buffers inside: ``op -> (test, its first argument)``,
the test called as ``test(first, args, kwargs)`` before the op runs (one stride or dtype test per call)."""
"""Precisions whose CPU matrix products oneDNN computes: on processors whose oneDNN reorders operands into its
blocked layouts (measured on one of this project's machines: 9,856 bytes inside a bf16 ``addmm`` of 16×32 by 32×64,
2.1 MB inside one of 512×1024 by 1024×1024; nothing in fp32), the buffers live inside the op, so every such call is
probed. On a processor whose oneDNN reads them in place the probe measures nothing and adds no entry."""


# Ops whose CPU kernel returns a storage of another size than its meta kernel declares, so that a fake trace
# would get it wrong: ``mse_loss``'s scalar lives in a buffer the size of its input, and oneDNN's LSTM layer
# returns a workspace that is empty on fake tensors. A fake trace sizes these outputs by running the kernel.
REAL_STORAGE_OPS: frozenset[str] = frozenset({"aten.mse_loss", "aten.mkldnn_rnn_layer"})

# Kernels that read a buffer an earlier kernel made, whose size fake tensors get wrong (the LSTM's backward
# reads the forward's workspace): on a fake trace they are not run, and the notes count them.
NEEDS_REAL_INPUTS: frozenset[str] = frozenset({"aten.mkldnn_rnn_layer_backward", "aten.linalg_matrix_exp"})

MAX_CALIBRATION_BYTES = 1 << 30
"""A call whose tensors (inputs and outputs) exceed this is not run to measure it (too large for here)."""

_MEASURED: dict[tuple[KernelCall, int], int] = {}  # (call, intra-op threads) -> bytes, for this process


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        if not self.shape:
            return torch.empty((), dtype=self.dtype, device="meta").element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True) if n > 0)
        return span * torch.empty((), dtype=self.dtype, device="meta").element_size()

    def filled(self, value: float = 0.0) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype).fill_(value)

    def meta(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")


@dataclass(frozen=True)
class KernelCall:
    """An op with the layout of its arguments: what decides which buffers its kernel allocates."""

    op: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    grad_enabled: bool
    """Autograd's mode when the op ran (some kernels keep a training workspace only with it on)."""
    fill: float = 0.0
    """The value its tensors are filled with when it is probed: 0, or for :data:`NORM_SIZED` ops the one whose
    matrix has the input's 1-norm."""

    @classmethod
    def of(cls, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> KernelCall | None:
        """The call's signature, or ``None`` when an argument is not a plain CPU tensor or value."""
        try:
            return cls(
                func,
                tuple(_spec(a) for a in args),
                tuple((k, _spec(v)) for k, v in sorted(kwargs.items())),
                torch.is_grad_enabled(),
                _norm_fill(args[0]) if func in NORM_SIZED else 0.0,
            )
        except _Unsupported:
            return None

    def run(self) -> Any:
        """The op on zero-filled tensors of the call's layout, in the call's autograd mode."""
        args, kwargs = self.arguments()
        with torch.set_grad_enabled(self.grad_enabled):
            return self.op(*args, **kwargs)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the call's tensors, its inputs and what it returns (an embedding's backward returns a
        gradient the size of the vocabulary's table from small inputs). Once per distinct call in a process:
        sizing the outputs runs the op on the meta device, a millisecond a call at every trace otherwise."""
        found = _TENSOR_BYTES.get(self)
        if found is None:
            inputs = sum(s.nbytes for s in _specs(self.args)) + sum(
                s.nbytes for s in _specs(tuple(v for _, v in self.kwargs))
            )
            found = _TENSOR_BYTES[self] = inputs + self._output_bytes()
        return found

    def _output_bytes(self) -> int:
        """What the call returns, sized by running it on the meta device (0 when it cannot run there)."""
        args = tuple(_build(a, meta=True) for a in self.args)
        kwargs = {k: _build(v, meta=True) for k, v in self.kwargs}
        try:
            with torch.set_grad_enabled(self.grad_enabled):
                out = self.op(*args, **kwargs)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return 0
        flat = out if isinstance(out, (tuple, list)) else (out,)
        return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))

    def arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Tensors of the call's layout filled with its ``fill`` (zeros but for :data:`NORM_SIZED` ops), and its
        other arguments as given."""
        fill = self.fill
        return tuple(_build(a, fill=fill) for a in self.args), {k: _build(v, fill=fill) for k, v in self.kwargs}


class _Unsupported(Exception):
    pass


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.device.type != "cpu":
            raise _Unsupported
        return _TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_spec(y) for y in x)
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.memory_format, torch.layout)):
        return x
    raise _Unsupported


def _specs(values: tuple[Any, ...]) -> Iterator[_TensorSpec]:
    for v in values:
        if isinstance(v, _TensorSpec):
            yield v
        elif isinstance(v, tuple):
            yield from _specs(v)


def _norm_fill(matrices: Any) -> float:
    """The value a square matrix of ``matrices``' size is filled with to have their largest 1-norm."""
    if not isinstance(matrices, torch.Tensor) or matrices.dim() < 2 or matrices.shape[-1] == 0:
        raise _Unsupported
    with torch.no_grad():
        norm = torch.linalg.matrix_norm(matrices.detach().float(), ord=1).max().item()
    return norm / matrices.shape[-1]


def _build(x: Any, *, meta: bool = False, fill: float = 0.0) -> Any:
    if isinstance(x, _TensorSpec):
        return x.meta() if meta else x.filled(fill)
    if isinstance(x, tuple):
        return [_build(y, meta=meta, fill=fill) for y in x]
    return x


@dataclass(frozen=True)
class Probe:
    """What probing one call found."""

    nbytes: int | None
    """The most its kernel held above what it returned; ``None`` where it was not run nor estimated."""
    evidence: Evidence | None
    """``measured`` (the call ran whole) or ``estimated`` (scaled from small instances of it)."""
    why: str = ""
    """Why it was estimated or left out."""


def internal_bytes(calls: list[KernelCall]) -> dict[KernelCall, int]:
    """Per call: the most its kernel held at once above the storages it returned (profiler events).

    Each call is measured once per process and thread count. Calls too large or too slow to run whole
    (:func:`probe_calls`) are absent from the result.
    """
    return {
        c: p.nbytes for c, p in probe_calls(calls).items() if p.evidence == Evidence.MEASURED and p.nbytes is not None
    }


def probe_calls(
    calls: list[KernelCall], *, max_seconds: float | None = None, max_bytes: int | None = None
) -> dict[KernelCall, Probe]:
    """Per distinct call, its kernel's buffers: measured by running it whole where that is predicted to take
    at most ``max_seconds`` (default ``_scaled.MAX_PROBE_SECONDS``) and its tensors fit in ``max_bytes``
    (default: the smaller of :data:`MAX_CALIBRATION_BYTES` and a quarter of the memory free now); otherwise
    estimated from small instances of it where it is a convolution whose buffers grow as a product of its
    sizes (:mod:`trainledger.trace._scaled`); otherwise left out, with the reason.
    """
    limit = min(MAX_CALIBRATION_BYTES, bytes_free_for_probes()) if max_bytes is None else max_bytes
    max_seconds = _scaled.MAX_PROBE_SECONDS if max_seconds is None else max_seconds
    whole, scaled, out = [], {}, {}
    for call in dict.fromkeys(calls):
        too_large = call.tensor_bytes > limit
        if not too_large and seconds_to_run(call, MATMUL_OPERANDS) <= max_seconds:
            whole.append(call)
            continue
        scaling = scaling_of(call)
        if scaling is None:
            out[call] = Probe(None, None, "too large to run here" if too_large else "too slow to run here")
        else:
            scaled[call] = scaling
    measured = _measured([*whole, *(c for s in scaled.values() for c in s.calls)])
    for call in whole:
        out[call] = Probe(measured[call], Evidence.MEASURED)
    for call, scaling in scaled.items():
        nbytes = scaling.estimate(measured)
        why = "scaled from small instances" if nbytes is not None else "its buffers grow as no product of its sizes"
        out[call] = Probe(nbytes, Evidence.ESTIMATED if nbytes is not None else None, why)
    return out


def _measured(calls: list[KernelCall]) -> dict[KernelCall, int]:
    """``_measure`` of each distinct call, once per process and thread count."""
    threads = torch.get_num_threads()
    todo = [c for c in dict.fromkeys(calls) if (c, threads) not in _MEASURED]
    if todo:
        for call, nbytes in zip(todo, _measure(todo), strict=True):
            _MEASURED[call, threads] = nbytes
    return {c: _MEASURED[c, threads] for c in calls}


def _measure(calls: list[KernelCall]) -> list[int]:
    """Run each call twice on zero-filled tensors under the profiler; the second run counts (a first run
    may build and cache the kernel's plan). The cyclic collector is paused, so that no collection frees
    anything inside a call's window; the calls' own tensors are freed by reference counting as they go."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with (
        profiler_stderr_filtered(),
        quiet_gc(generation=1),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        for i, call in enumerate(calls):
            args, kwargs = call.arguments()
            with torch.set_grad_enabled(call.grad_enabled):
                call.op(*args, **kwargs)
                with record_function(f"{_WINDOW}{i}"):
                    out = call.op(*args, **kwargs)
            del out, args, kwargs
    events = prof.profiler.kineto_results.events()
    windows = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name().startswith(_WINDOW)}
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    out = []
    for i in range(len(calls)):
        t0, t1 = windows[f"{_WINDOW}{i}"]
        run = peak = 0
        for e in memory:
            if t0 <= e.start_ns() <= t1:
                run += e.nbytes()
                peak = max(peak, run)
        out.append(max(0, peak - max(run, 0)))
    return out


_WINDOW = "trainledger.kernel."
_TENSOR_BYTES: dict[KernelCall, int] = {}
_OUTPUTS: dict[KernelCall, list[int]] = {}


def real_output_bytes(call: KernelCall) -> list[int] | None:
    """Storage bytes of each tensor the call's CPU kernel returns, run on zero-filled tensors (fake mode
    switched off for the run); ``None`` when the call is too large to run here."""
    if call.tensor_bytes > MAX_CALIBRATION_BYTES:
        return None
    if call not in _OUTPUTS:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            out = call.run()
        flat = out if isinstance(out, (tuple, list)) else (out,)
        _OUTPUTS[call] = [t.untyped_storage().nbytes() for t in flat if isinstance(t, torch.Tensor)]
    return _OUTPUTS[call]


def kernel_entries(calls: list[tuple[int, str, str, KernelCall | None]]) -> tuple[list[Entry], KernelCounts]:
    """Workspace entries for ``(event, op name, module, call)`` of a trace, and how many calls were measured,
    estimated, or not run here (too large or too slow and not scalable, or a call that fake tensors cannot
    describe: ``None``)."""
    probes = probe_calls([c for *_, c in calls if c is not None])
    entries = []
    for event, op, module, call in calls:
        found = probes.get(call) if call is not None else None
        if found is None or not found.nbytes:
            continue
        entries.append(internal_entry(event, op, module, found.nbytes, found.evidence or Evidence.MEASURED))
    evidence = [probes[c].evidence if c is not None else None for *_, c in calls]
    return entries, KernelCounts(
        num_estimated=sum(1 for e in evidence if e == Evidence.ESTIMATED),
        num_skipped=sum(1 for e in evidence if e is None),
    )


def internal_entry(
    event: int, op: str, module: str, nbytes: int, evidence: Evidence, *, device: str = "cpu", kernel: str = ""
) -> Entry:
    """The ``workspace`` entry of ``nbytes`` a kernel holds inside the op at ``event`` (live at that event only)."""
    return Entry(
        name=f"{op}#{event}:internal",
        category=Category.WORKSPACE,
        role=KERNEL_INTERNAL,
        dtype="uint8",
        numel=nbytes,
        nbytes=nbytes,
        device=device,
        owner=module,
        alloc_event=event,
        free_event=event + 1,
        evidence=evidence,
        shape=(nbytes,),
        kernel=kernel,
    )


@dataclass(frozen=True)
class KernelCounts:
    """How the kernel calls of a trace were probed (by op call in the step, not by distinct call)."""

    num_estimated: int
    """Calls whose buffers were scaled from small instances (evidence ``estimated``)."""
    num_skipped: int
    """Calls not run here: too large or too slow, and not scalable; or inputs fake tensors cannot size."""
