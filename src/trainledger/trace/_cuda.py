"""CUDA-kind traces: the step as PyTorch's CUDA kernels would run it, traced on fake CPU tensors.

A CPU-only build of torch aborts on autograd over fake tensors that claim ``device="cuda"``, so the tracer
keeps fake CPU tensors and substitutes, for the few places where CUDA's kernels allocate or save something
else than the CPU's, what the CUDA kernel would have done (PyTorch 2.13):

- **Scaled dot-product attention** (above autograd, a ``TorchFunctionMode``): the backend CUDA's
  ``select_sdp_backend`` would pick (:func:`sdpa_backend`), then that backend's aten op called directly on
  the fake tensors. Their meta kernels are device-agnostic and give the CUDA outputs (the log-sum-exp, the
  RNG seed and offset), so autograd saves what CUDA's backward reads; the CPU picks its own flash kernel or,
  with dropout, the math kernel that saves T×T tensors.
- **Dropout**: ``at::dropout`` runs the fused ``native_dropout`` on CUDA (a 1-byte mask saved), on the CPU
  a multiplication by a mask in the input's dtype (``Dropout.cpp``, ``is_fused_kernel_acceptable``); also
  inside the math SDPA backend, whose composite is run op for op with CUDA's dropout.
- **LayerNorm and GroupNorm statistics** (below autograd, in the tracer): CUDA keeps mean and rstd in
  fp32 for fp16/bf16 inputs (the accumulate type), the CPU kernels in the input's dtype.
- **The optimizer**: ``foreach`` (``_default_to_fused_or_foreach`` picks it when every parameter is a CUDA
  tensor; fused is never the default), so the group-wide temporaries of ``_multi_tensor_*`` are traced.
- **Autocast**: CUDA autocast's op lists (softmax, LayerNorm, ``exp``, ``pow``, ``sum``… in fp32) applied to
  the CPU step (:mod:`trainledger.trace._autocast`).
- **cuBLAS workspace**: a declared persistent entry per stream (:func:`trainledger.devices.cublas_workspace_bytes`);
  the CUDA context and NCCL's buffers, outside the caching allocator, are stated beside the ledger, not in it.
- **cuBLAS's operand copies**: a matrix product whose operand (or written result) cuBLAS cannot read in place
  (no unit stride, as the expanded-scalar gradient a plain ``.sum()`` loss gives) is copied contiguous inside
  the op (:func:`cublas_copy_bytes`); the copy is a ``kernel_internal`` workspace entry at that op's event,
  evidence ``analytic`` (the rule, not a measurement).

Known limitations:
    - cuDNN convolution workspaces and other buffers kernels allocate inside one op are not modelled (cuBLAS's
      operand copies are); nor the copy of a conjugated complex operand (``resolve_conj_if_indicated``).
    - Recurrent layers run the CPU's kernel on fake tensors: cuDNN's RNN reserve space is not modelled.
    - A step with data-dependent shapes (top-k routing through ``nonzero``) cannot run on fake tensors.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import _make_grads
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode

from trainledger.devices import (
    DEFAULT_CUDA_DEVICE,
    Device,
    SdpaCall,
    cublas_workspace_bytes,
    lookup,
    nccl_buffer_bytes,
    sdpa_backend,
)
from trainledger.ledger import Category, Entry, Evidence, Ledger
from trainledger.trace._autocast import CudaAutocast
from trainledger.trace._kernels import MATMUL_OPERANDS, KernelCall, internal_entry

TORCH_SOURCE = "PyTorch 2.13 (cf30153c4c131c8164ee7798e5022d810682e2cb)"


def cuda_device(name: str | Device | None) -> Device:
    """The device table's entry for ``name``; ``None`` or ``cuda``: ``trainledger.devices.DEFAULT_CUDA_DEVICE``."""
    if isinstance(name, Device):
        return name
    if name is None or name.split(":")[0] == "cuda":
        return lookup(DEFAULT_CUDA_DEVICE)
    return lookup(name)


_SDPA = torch._C._nn.scaled_dot_product_attention
_aten = torch.ops.aten


class CudaKernels(TorchFunctionMode):
    """Above autograd: SDPA runs the CUDA backend's own op, dropout CUDA's fused ``native_dropout``.

    ``backends`` counts the SDPA backends chosen, ``dropouts`` the dropouts substituted."""

    def __init__(self, device: Device, *, autocast: bool = False) -> None:
        super().__init__()
        self.device = device
        self.backends: Counter[str] = Counter()
        self.dropouts = 0
        self.autocast = CudaAutocast() if autocast else None
        """With ``autocast``: CPU autocast runs CUDA autocast's op lists while the mode is on."""

    def __enter__(self) -> CudaKernels:
        if self.autocast is not None:
            self.autocast.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self.autocast is not None:
                self.autocast.__exit__()

    def on_phase(self, phase: str) -> None:
        """Backward begins after autocast's region exits, which empties autocast's cast cache."""
        if phase == "backward" and self.autocast is not None:
            self.autocast.clear()

    def reset(self) -> None:
        """Count the next step's calls only."""
        self.backends.clear()
        self.dropouts = 0
        if self.autocast is not None:
            self.autocast.num_calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._attention(*args, **kwargs)
        if func is F.dropout:
            out = self._dropout(*args, **kwargs)
            if out is not None:
                return out
        if func is torch.Tensor.backward:
            return self._backward(*args, **kwargs)
        return func(*args, **kwargs)

    def _backward(
        self,
        tensor: torch.Tensor,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """``tensor.backward(...)`` with this mode on the stack. A mode is off the function-mode stack while its
        own handler runs, so ``loss.backward()`` would run the whole backward without the substitutions, and a
        checkpointed region's recomputation would make the CPU's dropout mask and attention where the forward
        saved CUDA's (``torch.utils.checkpoint`` refuses the mismatch). ``torch.autograd.backward``'s body,
        without its ``__torch_function__`` check, which would bring the call back here with the mode off."""
        tensors = (tensor,)
        wrt = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        grads = _make_grads(tensors, (gradient,), is_grads_batched=False)
        _push_mode(self)
        try:
            keep = create_graph if retain_graph is None else retain_graph
            _engine_run_backward(tensors, grads, keep, create_graph, wrt, allow_unreachable=True, accumulate_grad=True)
        finally:
            _pop_mode()

    def _dropout(
        self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor | None:
        """``is_fused_kernel_acceptable`` on CUDA: ``0 < p < 1`` and a non-empty input (in place: as the CPU)."""
        if not training or inplace or not 0 < p < 1 or input.numel() == 0:
            return None
        self.dropouts += 1
        return _aten.native_dropout(input, p, True)[0]

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        call = SdpaCall(
            dtype=str(query.dtype).removeprefix("torch."),
            head_dim=query.shape[-1],
            num_heads=query.shape[-3] if query.dim() >= 3 else 1,
            num_kv_heads=key.shape[-3] if key.dim() >= 3 else 1,
            has_mask=attn_mask is not None,
            dropout=dropout_p,
            requires_grad=grad,
        )
        backend = sdpa_backend(self.device, call)
        self.backends[backend] += 1
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
        if backend == "math":
            if dropout_p > 0:
                self.dropouts += 1
                return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            return _aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
            )[0]
        # the fused kernels read grouped key/value heads as they are (attention.cpp passes them through)
        if backend == "flash":
            return _flash(query, key, value, dropout_p, is_causal, scale)
        if backend == "cudnn":
            return _aten._scaled_dot_product_cudnn_attention(
                query, key, value, None, grad, dropout_p, is_causal, False, scale=scale
            )[0]
        if attn_mask is not None:
            attn_mask = _mem_efficient_mask(attn_mask, query, key)
        return _aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
        )[0]


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """``attention.cpp``: the head dim padded to a multiple of 8 (copies), the flash op, the padding sliced off."""
    d = q.shape[-1]
    pad = -d % 8
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    scale = scale if scale is not None else d**-0.5
    out = _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :d] if pad else out


def _fused_dropout(attn: torch.Tensor, p: float) -> torch.Tensor:
    return _aten.native_dropout.default(attn, p, True)[0]


def math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    *,
    dropout: Callable[[torch.Tensor, float], torch.Tensor] = _fused_dropout,
) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` (``attention.cpp``) op for op, its locals alive as long, with
    ``dropout`` for its ``at::dropout``: CUDA's fused ``native_dropout`` (a bool mask saved) by default, where
    the CPU multiplies by a mask in the attention's dtype. ``tests/test_cuda_math_attention.py`` holds it,
    with the CPU's dropout, equal to the C++ op allocation for allocation."""
    origin = query.dtype
    upcast = (
        origin in (torch.float16, torch.bfloat16) and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    )
    # fp16/bf16 inputs are kept in fp32 for accuracy unless allow_fp16_bf16_reduction_math_sdp
    q, k, v = (
        (_aten._to_copy.default(t, dtype=torch.float32) for t in (query, key, value)) if upcast else (query, key, value)
    )
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1 / math.sqrt(q.shape[-1]))
    scaled = _aten.mul.Scalar(q, -factor if negative else factor)
    mask = attn_mask
    if is_causal:
        causal = torch.ones(scaled.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        neg_inf = _aten.scalar_tensor.default(float("-inf"), dtype=scaled.dtype, device=q.device)
        zero = _aten.scalar_tensor.default(0.0, dtype=scaled.dtype, device=q.device)
        mask = _aten.where.self(causal, zero, neg_inf)
        del causal, neg_inf, zero
    keys, values = k, v
    if enable_gqa and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        repeats = q.shape[-3] // k.shape[-3]
        keys, values = k.repeat_interleave(repeats, dim=-3), v.repeat_interleave(repeats, dim=-3)
    attn = torch.matmul(scaled, _aten.mul.Scalar(keys.transpose(-2, -1), factor))
    if mask is not None:
        attn = attn.add(mask)
    attn = _aten._safe_softmax.default(attn, -1)
    if dropout_p > 0:
        attn = dropout(attn, dropout_p)
    weights = attn.to(origin)  # the op's second output, made before the first and dropped by SDPA
    out = torch.matmul(attn, values).to(origin)
    del weights
    return out


def _mem_efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` (``attention.cpp``): expanded to (B, H, T, S), padded to 16 along S, made contiguous
    where a stride is not a multiple of 16 (a broadcast mask becomes a full (B, H, T, S) tensor)."""
    out = mask.expand(query.shape[0], query.shape[-3], query.shape[-2], key.shape[-2])
    if out.stride(-1) % 16:
        pad = -out.shape[-1] % 16
        out = F.pad(out, (0, pad))[..., : key.shape[-2]]
    if any(s % 16 or s == 0 for s in (out.stride(0), out.stride(1), out.stride(2), out.stride(-1))):
        out = out.contiguous()
    return out


def _fp32_statistics(out: tuple[torch.Tensor, ...], args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """A norm's (output, mean, rstd) with the statistics in fp32 as CUDA keeps them for fp16/bf16 inputs."""
    result, mean, rstd = out
    if mean.dtype not in (torch.float16, torch.bfloat16):
        return out
    return result, torch.empty_like(mean, dtype=torch.float32), torch.empty_like(rstd, dtype=torch.float32)


DISPATCH_SUBSTITUTES: dict[Any, Any] = {
    _aten.native_layer_norm.default: _fp32_statistics,
    _aten.native_group_norm.default: _fp32_statistics,
}
"""Below autograd: ops whose CUDA outputs differ from the CPU's, with the function that makes them so."""


def use_foreach(optimizer: torch.optim.Optimizer) -> int:
    """Set ``foreach`` on the groups left to the default (``None``), as ``_default_to_fused_or_foreach`` does for
    CUDA parameters; ``fused`` and ``differentiable`` groups, and a ``foreach`` the user chose, are left alone.
    Returns how many groups changed. Call it on the traced twin's optimizer, never the user's."""
    changed = 0
    for group in optimizer.param_groups:
        if (
            "foreach" in group
            and group["foreach"] is None
            and not group.get("fused")
            and not group.get("differentiable")
        ):
            group["foreach"] = True
            changed += 1
    return changed


_LABELS = {
    "aten._scaled_dot_product_flash_attention": "cuda: flash attention (select_sdp_backend), its log-sum-exp and "
    "RNG state",
    "aten._scaled_dot_product_efficient_attention": "cuda: memory-efficient attention (select_sdp_backend), its "
    "log-sum-exp padded to 32 rows",
    "aten._scaled_dot_product_cudnn_attention": "cuda: cuDNN attention (select_sdp_backend), its log-sum-exp",
    "aten._scaled_dot_product_attention_math": "cuda: math attention (no fused backend accepts the call)",
    "aten.native_dropout": "cuda: fused native_dropout, a bool mask (the CPU keeps one in the input dtype)",
    "aten._foreach_": "cuda: foreach optimizer (CUDA's default), group-wide temporaries",
}
_STATISTICS = ("aten.native_layer_norm#", "aten.native_group_norm#")
_STATISTICS_LABEL = "cuda: normalization statistics in fp32 (the CPU keeps the input's dtype)"


def kernel_label(entry: Entry, siblings: dict[str, set[str]]) -> str:
    """Why an entry of a CUDA-kind trace differs from the CPU trace's (``""``: it does not)."""
    name = entry.name
    for prefix, label in _LABELS.items():
        if name.startswith(prefix):
            return label
    if name.startswith(_STATISTICS) and entry.dtype == "float32" and siblings.get(name, set()) - {"float32"}:
        return _STATISTICS_LABEL
    return ""


@dataclass(frozen=True, slots=True)
class CudaFacts:
    """What a CUDA-kind trace records beside its entries."""

    device: Device
    backends: dict[str, int]
    dropouts: int
    foreach_groups: int
    cublas_config: str | None
    autocast_calls: int | None = None
    """Calls that CUDA autocast's lists cast (``None``: the step runs without autocast)."""


def cuda_ledger(ledger: Ledger, facts: CudaFacts, *, world_size: int = 1) -> Ledger:
    """``ledger`` as the CUDA step's: on device ``cuda``, each substituted entry labelled, the cuBLAS workspace
    declared, the memory outside the allocator (context, NCCL) in ``meta["outside_allocator"]``."""
    siblings: dict[str, set[str]] = {}
    for e in ledger.entries:
        siblings.setdefault(e.name, set()).add(e.dtype)
    entries = [replace(e, device="cuda", kernel=kernel_label(e, siblings)) for e in ledger.entries]
    device = facts.device
    workspace = cublas_workspace_bytes(device, facts.cublas_config)
    entries.append(
        Entry(
            "cuda.cublas_workspace",
            Category.WORKSPACE,
            "cublas_workspace",
            "uint8",
            workspace,
            workspace,
            device="cuda",
            owner="cuBLAS",
            evidence=Evidence.DECLARED,
            kernel="cuda: cuBLAS workspace of the step's one stream, allocated by the first matmul and kept "
            "(CublasHandlePool.cpp, getChosenWorkspaceSize"
            + (f", CUBLAS_WORKSPACE_CONFIG={facts.cublas_config})" if facts.cublas_config else ")"),
        )
    )
    outside = [
        {
            "name": "cuda_context",
            "bytes": device.context_bytes,
            "evidence": "declared",
            "source": "an estimate (trainledger.devices.CUDA_CONTEXT_BYTES_ESTIMATE); outside memory_allocated",
        }
    ]
    if world_size > 1:
        outside.append(
            {
                "name": "nccl_buffers",
                "bytes": nccl_buffer_bytes(world_size),
                "evidence": "declared",
                "source": "NCCL_BUFFSIZE × 2 × channels, an estimate (trainledger.devices.nccl_buffer_bytes); "
                "cudaMalloc, outside memory_allocated",
            }
        )
    meta = {
        **ledger.meta,
        "kernel_kind": "cuda",
        "cuda_device": device.name,
        "compute_capability": list(device.compute_capability) if device.compute_capability else None,
        "sdpa_backends": dict(facts.backends),
        "outside_allocator": outside,
    }
    return replace(ledger, entries=tuple(entries), device="cuda", notes=(*ledger.notes, cuda_note(facts)), meta=meta)


def cuda_note(facts: CudaFacts) -> str:
    """The note a CUDA-kind ledger carries: what was substituted, and what was not."""
    backends = ", ".join(f"{n} {k}" for k, n in sorted(facts.backends.items())) or "no SDPA call"
    cc = facts.device.compute_capability
    return (
        f"kernels: cuda as on {facts.device.name}"
        + (f" (sm{cc[0]}{cc[1]})" if cc else "")
        + f", traced on fake CPU tensors with CUDA's kernels substituted ({TORCH_SOURCE}): SDPA {backends}; "
        f"{facts.dropouts} dropouts as native_dropout; LayerNorm/GroupNorm statistics in fp32; foreach optimizer "
        f"({facts.foreach_groups} groups); cuBLAS workspace declared"
        + (
            f"; autocast with CUDA's op lists ({facts.autocast_calls} calls cast; softmax, LayerNorm, exp, pow, sum "
            "in fp32)"
            if facts.autocast_calls is not None
            else ""
        )
        + "; cuBLAS's copies of operands it cannot read in place (analytic). Not substituted: kernels' other "
        "internal buffers (cuDNN convolution workspaces, cuDNN RNN reserve space). "
        "Unvalidated on a GPU"
    )


# addbmm on CUDA reshapes its batches into one addmm (copies below dispatch, outside this rule): left out.
_CUBLAS_OPS = frozenset(op for op in MATMUL_OPERANDS if not op.startswith("aten.addbmm"))
_CUBLAS_LABEL = "cuda: cuBLAS reads no operand without a unit stride: copied contiguous inside the op (Blas.cpp)"


def cublas_copy_bytes(op: str, call: KernelCall) -> int:
    """Bytes a CUDA matrix product copies inside the op: each operand, and an ``out=`` or in-place result, that
    cuBLAS cannot read in place, cloned contiguous (all alive at the GEMM call). The rule of
    aten/src/ATen/native/cuda/Blas.cpp (``addmm_out_cuda_impl``, ``baddbmm_out_cuda_impl``, ``addmv_out_cuda``):

    - a matrix (``prepare_matrix_for_cublas``) is read in place when it is non-overlapping and dense, or row-
      or column-major with a leading dimension at least its extent; otherwise ``clone(MemoryFormat::Contiguous)``;
    - a batch (``prepare_batch_matrix_for_cublas``) when its items are row- or column-major so, or it is
      contiguous with no zero stride in an item; the batch stride is free (a broadcast weight is read as is);
      a batched result when its items are, size-1 dims exempt;
    - ``addmv``'s matrix when it is row- or column-major so; its vector when its stride is not 0.

    Example:
        >>> import torch
        >>> grad = torch.ones(()).expand(2048, 64)  # a .sum() loss's gradient: every stride 0
        >>> call = KernelCall.of(torch.ops.aten.mm.default, (grad, torch.zeros(64, 256)), {})
        >>> cublas_copy_bytes("aten.mm", call)  # 2048 × 64 fp32
        524288
    """
    if op not in _CUBLAS_OPS:
        return 0
    args, kwargs = call.args, dict(call.kwargs)
    vector_product = op.startswith(("aten.mv", "aten.addmv"))
    total = 0
    for i in MATMUL_OPERANDS[op]:
        spec = args[i] if i < len(args) else None
        result = i == 0 and op.endswith("_")
        if spec is not None and not _cublas_reads(spec.shape, spec.stride, result=result, strict=vector_product):
            total += math.prod(spec.shape) * spec.dtype.itemsize
    out = kwargs.get("out")
    if out is not None and not _cublas_reads(out.shape, out.stride, result=True, strict=vector_product):
        total += math.prod(out.shape) * out.dtype.itemsize
    return total


def _cublas_reads(shape: tuple[int, ...], stride: tuple[int, ...], *, result: bool, strict: bool) -> bool:
    if math.prod(shape) == 0:
        return True  # nothing to multiply: the kernels return before preparing anything
    if len(shape) == 1:  # addmv_impl_cuda: vec.contiguous() where its stride is 0; a result is written as is
        return result or stride[0] != 0 or shape[0] == 1
    rows, cols, a, b = shape[-2], shape[-1], stride[-2], stride[-1]
    if result and len(shape) == 3:  # baddbmm_out_cuda_impl's result_: size-1 dims exempt
        return (a == 1 and (cols == 1 or b >= max(1, rows))) or (b == 1 and (rows == 1 or a >= max(1, cols)))
    if (b == 1 and a >= max(1, cols)) or (a == 1 and b >= max(1, rows)):
        return True
    if len(shape) == 3:  # prepare_batch_matrix_for_cublas: contiguous, with no zero stride in an item
        return not result and a != 0 and b != 0 and _contiguous(shape, stride)
    return not strict and _non_overlapping_and_dense(shape, stride)  # prepare_matrix_for_cublas's common case


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _non_overlapping_and_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, step in sorted(zip(shape, stride, strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if step != expected:
            return False
        expected *= size
    return True


def cublas_copies(calls: list[tuple[int, str, str, KernelCall | None]]) -> list[Entry]:
    """Workspace entries for the copies cuBLAS makes inside the matrix products among ``(event, op name, module,
    call)`` of a trace (:func:`cublas_copy_bytes`), each live at its op's event only."""
    entries = []
    for event, op, module, call in calls:
        nbytes = cublas_copy_bytes(op, call) if call is not None else 0
        if nbytes:
            entries.append(
                internal_entry(event, op, module, nbytes, Evidence.ANALYTIC, device="cuda", kernel=_CUBLAS_LABEL)
            )
    return entries
