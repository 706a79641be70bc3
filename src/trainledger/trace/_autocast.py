"""CUDA autocast's op lists, applied to a CPU step: which ops run in low precision and which in fp32.

``aten/src/ATen/autocast_mode.cpp`` (PyTorch 2.13) registers, per device, a kernel for each op that autocast
touches, with one of five policies. The CUDA and CPU lists differ (on CUDA ``softmax``, ``log_softmax``,
``layer_norm``, ``group_norm``, ``exp``, ``pow``, ``sum`` … run in fp32; on the CPU in the input's dtype), so a
bf16-autocast step saves fp32 softmax and LayerNorm outputs on CUDA and bf16 ones on the CPU.

The CPU build registers the ``AutocastCUDA`` kernels too, but their casts touch only CUDA tensors and their
policies cannot be read back from the dispatcher. :class:`CudaAutocast` therefore registers, for the duration
of a trace, Python kernels under ``AutocastCPU`` for every op that either device's autocast touches: CUDA's
policy for the ops in :data:`POLICIES` (transcribed from the source; ``tests/test_cuda_kind.py`` checks that
they are exactly the ops holding an ``AutocastCUDA`` kernel in the installed build), a fallthrough for the
ops only CPU's autocast touches. Casts of fp32 leaf weights to the low precision are cached until autocast exits,
as ``cached_cast`` does.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import library as op_library  # PyTorch's operator registration API

Policy = Literal["lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned"]

_LOWER = (
    "_convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input "
    "conv_transpose3d.input convolution cudnn_convolution cudnn_convolution_transpose prelu addmm addmv addr matmul "
    "einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell "
    "_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention "
    "scaled_dot_product_attention"
)
_FP32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar "
    "pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm group_norm frobenius_norm.dim nuclear_norm "
    "nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
    "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
    "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits "
    "dist pdist cdist renorm logsumexp rms_norm upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d "
    "_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
    "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
)
_SET_OPT_DTYPE = (
    "prod prod.dim_int softmax.int log_softmax.int cumprod "
    "cumsum linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum "
    "sum.dim_IntList "
)
_APPEND_DTYPE = "norm.Scalar norm.ScalarOpt_dim "
_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"

POLICIES: dict[str, Policy] = {
    **dict.fromkeys(_LOWER.split(), "lower_precision_fp"),
    **dict.fromkeys(_FP32.split(), "fp32"),
    **dict.fromkeys(_SET_OPT_DTYPE.split(), "fp32_set_opt_dtype"),
    **dict.fromkeys(_APPEND_DTYPE.split(), "fp32_append_dtype"),
    **dict.fromkeys(_PROMOTE.split(), "promote"),
    "binary_cross_entropy": "banned",
}
"""CUDA autocast's policy per op overload (``name`` or ``name.overload``), as ``autocast_mode.cpp`` lists them."""

_KEY = torch._C.DispatchKey.AutocastCPU
_LOW = (torch.float16, torch.bfloat16)


def autocast_ops(key: str) -> set[str]:
    """The op overloads (``name`` or ``name.overload``) holding a kernel for dispatch key ``key`` here."""
    names = torch._C._dispatch_get_all_op_names()
    return {n.removeprefix("aten::") for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


def _overload(name: str) -> Any:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    return getattr(packet, overload or "default")


class CudaAutocast:
    """While entered, CPU autocast runs CUDA autocast's lists (a context manager; ``clear()`` empties the cast
    cache, as autocast's exit does)."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lib: Any = None
        self.num_calls = 0

    def clear(self) -> None:
        self._cache.clear()

    def __enter__(self) -> CudaAutocast:
        self._lib = op_library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # overriding CPU autocast's own kernels warns once
            warnings.simplefilter("ignore")
            for name in sorted(autocast_ops("AutocastCUDA") | autocast_ops("AutocastCPU")):
                try:
                    op = _overload(name)
                except AttributeError:
                    continue
                policy = POLICIES.get(name)
                # an op only CPU autocast touches falls through, as on CUDA: a composite op's parts
                # (cross_entropy_loss's log_softmax) then meet CUDA's policies
                kernel = op_library.fallthrough_kernel if policy is None else self._kernel(op, policy)
                self._lib.impl(name, kernel, "AutocastCPU")
        return self

    def __exit__(self, *exc: object) -> None:
        self._lib._destroy()
        self._lib = None
        self.clear()

    def _kernel(self, op: Any, policy: Policy) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
                self.num_calls += 1
                args, kwargs = self._cast(policy, op, args, kwargs)
                return op(*args, **kwargs)

        return kernel

    def _cast(self, policy: Policy, op: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if policy == "banned":  # autocast_mode.cpp's binary_cross_entropy_banned, CUDA's message
            raise RuntimeError(
                "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast; use "
                "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss instead"
            )
        if policy == "lower_precision_fp":
            low = torch.get_autocast_dtype("cpu")
            return self._map(args, low), self._map(kwargs, low)
        if policy in ("fp32", "fp32_append_dtype"):  # norm's dtype overload: the same fp32 result
            return self._map(args, torch.float32), self._map(kwargs, torch.float32)
        if policy == "promote":
            widest = _widest(args, kwargs)
            return (self._map(args, widest), self._map(kwargs, widest)) if widest is not None else (args, kwargs)
        # fp32_set_opt_dtype: an eligible first argument and no dtype given run in fp32
        first = args[0] if args else None
        if _eligible(first) and kwargs.get("dtype") is None and not _dtype_given(op, args):
            return args, {**kwargs, "dtype": torch.float32}
        return args, kwargs

    def _map(self, obj: Any, dtype: torch.dtype) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._cached_cast(obj, dtype)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._map(x, dtype) for x in obj)
        if isinstance(obj, dict):
            return {k: self._map(v, dtype) for k, v in obj.items()}
        return obj

    def _cached_cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``cached_cast``: floating, non-double tensors; fp32 leaf weights' low-precision casts cached."""
        if not _eligible(t) or t.dtype == dtype:
            return t
        if dtype in _LOW and t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view():
            hit = self._cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            cast = t.to(dtype)
            self._cache[id(t)] = (t, cast)
            return cast
        return t.to(dtype)


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _widest(args: Any, kwargs: dict[str, Any]) -> torch.dtype | None:
    tensors = [t for t in _flat((args, kwargs)) if _eligible(t)]
    if not tensors:
        return None
    widest = tensors[0].dtype
    for t in tensors[1:]:
        widest = torch.promote_types(widest, t.dtype)
    return widest


def _flat(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [y for x in obj for y in _flat(x)]
    if isinstance(obj, dict):
        return _flat(list(obj.values()))
    return [obj]


def _dtype_given(op: Any, args: Any) -> bool:
    """Whether a positional argument fills the schema's ``dtype``."""
    names = [a.name for a in op._schema.arguments]
    return "dtype" in names and len(args) > names.index("dtype") and args[names.index("dtype")] is not None
