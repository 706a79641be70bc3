"""Accelerators by name: memory, compute capability, bf16, and the memory a training step may use (no torch).

Three figures of a card's memory differ, and the difference matters at the limit:

- ``nominal_bytes``: the datasheet's "80 GB", read as 10⁹ bytes per GB: a round figure, below what the
  driver reports for every card listed, and above what torch reports for the L40S and the A10G.
- ``driver_total_bytes``: what the driver reports as the card's total, ``nvidia-smi``'s ``memory.total``
  (MiB × 2²⁰; ``rocm-smi``'s VRAM total for AMD). An 80 GB H100 reports 81,559 MiB = 85,520,809,984 bytes.
- ``torch_total_bytes``: ``torch.cuda.get_device_properties(i).total_memory`` (``cudaDeviceProp.totalGlobalMem``)
  as observed on real machines. On data-centre cards it is 0.3–0.6 GiB below the driver total (an H100
  80 GB HBM3 showed 81,082–81,090 MiB depending on the driver), on GeForce cards close to it. ``None``
  where no public report was found.

``total_bytes`` is the best of these known for a card (torch's, else the driver's, else the nominal), and
``usable_bytes`` subtracts an estimate of the CUDA context, which PyTorch's allocator never sees.
Compute capabilities are NVIDIA's (https://developer.nvidia.com/cuda-gpus).

Example:
    >>> from trainledger.devices import lookup
    >>> h100 = lookup("H100")
    >>> h100.name, h100.driver_total_bytes, h100.flash_attention
    ('H100-80GB-SXM', 85520809984, True)
    >>> h100.usable_bytes == h100.total_bytes - h100.context_bytes
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Literal

from trainledger.errors import InputError

MiB = 1 << 20

CUDA_CONTEXT_BYTES_ESTIMATE = 512 * MiB
"""An estimate, not a measurement: the CUDA context, the loaded kernels and the driver's per-process
reservations take device memory outside PyTorch's caching allocator — typically 300–600 MiB, depending on
the driver, the CUDA version (lazy module loading) and the torch build. To measure it on a machine:
``total - torch.cuda.mem_get_info()[0]`` after the first CUDA op, before any tensor is allocated."""


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """One accelerator model."""

    name: str
    aliases: tuple[str, ...]
    """Lower-case names accepted by ``lookup`` (the canonical name's lower-case form is always accepted)."""
    vendor: Literal["nvidia", "amd"]
    nominal_bytes: int
    """The datasheet's capacity, GB read as 10⁹ bytes."""
    driver_total_bytes: int | None
    """The driver's total (``nvidia-smi`` ``memory.total``, ``rocm-smi`` VRAM total); ``None``: not found."""
    torch_total_bytes: int | None
    """``torch.cuda.get_device_properties().total_memory`` as observed (varies a little with the driver)."""
    compute_capability: tuple[int, int] | None
    """CUDA compute capability (``None`` for AMD, whose architecture is named in ``arch``)."""
    bf16: bool
    """Native bfloat16 arithmetic (NVIDIA sm80 and later; CDNA3)."""
    source: str
    """The vendor's datasheet or product page."""
    arch: str = ""
    context_bytes: int = CUDA_CONTEXT_BYTES_ESTIMATE
    """Device memory outside PyTorch's allocator: an estimate (``CUDA_CONTEXT_BYTES_ESTIMATE``)."""

    @property
    def total_bytes(self) -> int:
        """torch's total if observed, else the driver's, else the nominal capacity."""
        for value in (self.torch_total_bytes, self.driver_total_bytes):
            if value is not None:
                return value
        return self.nominal_bytes

    @property
    def total_source(self) -> Literal["torch", "driver", "nominal"]:
        if self.torch_total_bytes is not None:
            return "torch"
        return "driver" if self.driver_total_bytes is not None else "nominal"

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can reserve: ``total_bytes`` less the context estimate."""
        return self.total_bytes - self.context_bytes

    @property
    def kernel_kind(self) -> KernelKind:
        """Whose kernels a step on this device runs: PyTorch's CUDA kernels (on AMD, their HIP builds, which
        PyTorch exposes as ``cuda``)."""
        return "cuda"

    @property
    def flash_attention(self) -> bool:
        """Whether PyTorch's flash SDPA kernel runs here: NVIDIA sm80 and later; on ROCm, CDNA2/3 (AOTriton)."""
        if self.vendor == "amd":
            return self.arch in ("gfx90a", "gfx942")
        return self.compute_capability is not None and self.compute_capability >= (8, 0)


KernelKind = Literal["cpu", "cuda"]


def kernel_kind(device: str) -> KernelKind:
    """Whose kernels a ledger on ``device`` assumes: ``cuda`` for ``cuda``/``cuda:N`` (ROCm included), else ``cpu``.

    What a kernel saves for backward and allocates as workspace differs between the two (SDPA backends,
    fused optimizers, autocast's op lists), so a peak is stated with the kernel kind it assumes.

    Example:
        >>> kernel_kind("cuda:1"), kernel_kind("cpu")
        ('cuda', 'cpu')
    """
    return "cuda" if device.split(":")[0] == "cuda" else "cpu"


DEFAULT_CUDA_DEVICE = "H100-80GB-SXM"
"""The card a CUDA-kind figure assumes when only ``cuda`` is named: an H100/H200-class part (sm90)."""

KiB = 1 << 10
_CUBLAS_DEFAULT_WORKSPACE = ((4096 * KiB, 2), (16 * KiB, 8))
_CUBLAS_LARGE_WORKSPACE = ((4096 * KiB, 8),)
_CUBLAS_LARGE_MAJORS = (9, 10, 12)


def cublas_workspace_bytes(device: Device, config: str | None = None) -> int:
    """Bytes of the cuBLAS workspace PyTorch allocates per (handle, stream) through its caching allocator.

    PyTorch 2.13, ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (``getChosenWorkspaceSize``): the sum of
    ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KiB:COUNT`` pairs when it is set; otherwise ``4096 KiB × 2 + 16 KiB × 8``
    (8,519,680 bytes), or ``4096 KiB × 8`` (32 MiB) on compute capability 9.x, 10.x and 12.x. cuBLASLt's
    workspace is the same block unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``. It is kept for the life of the
    process once a matmul ran on the stream (``cublas_handle_stream_to_workspace``), so a steady-state step
    holds it throughout. ROCm builds size hipBLASLt differently: the default stands there, unvalidated.

    Example:
        >>> cublas_workspace_bytes(lookup("A100")), cublas_workspace_bytes(lookup("H100")) // MiB
        (8519680, 32)
        >>> cublas_workspace_bytes(lookup("H100"), ":4096:2:16:8")
        8519680
    """
    if config:
        pairs = config.split(":")[1:]
        try:
            numbers = [int(x) for x in pairs]
        except ValueError:
            numbers = []
        if not numbers or len(numbers) % 2:
            raise InputError(
                f"CUBLAS_WORKSPACE_CONFIG {config!r} is not a list of :SIZE_KiB:COUNT pairs (e.g. :4096:8)"
            )
        return sum(size * KiB * count for size, count in zip(numbers[::2], numbers[1::2], strict=True))
    cc = device.compute_capability
    sizes = _CUBLAS_LARGE_WORKSPACE if cc is not None and cc[0] in _CUBLAS_LARGE_MAJORS else _CUBLAS_DEFAULT_WORKSPACE
    return sum(size * count for size, count in sizes)


NCCL_BUFFSIZE = 4 * MiB
"""NCCL's default ``NCCL_BUFFSIZE``: the Simple protocol's buffer per channel and peer connection."""
NCCL_CHANNELS_ESTIMATE = 16


def nccl_buffer_bytes(world_size: int, *, buffsize: int = NCCL_BUFFSIZE, channels: int = NCCL_CHANNELS_ESTIMATE) -> int:
    """An estimate of the device memory one rank's NCCL communicator holds for a ring over ``world_size``
    ranks: a send and a receive buffer of ``NCCL_BUFFSIZE`` per channel (the LL and LL128 protocols' smaller
    buffers left out). NCCL allocates it with ``cudaMalloc``, outside PyTorch's caching allocator; the channel
    count depends on the topology (NCCL picks it at init), so this is an order of magnitude, unvalidated.

    Example:
        >>> nccl_buffer_bytes(1), nccl_buffer_bytes(8) // MiB
        (0, 128)
    """
    return 0 if world_size <= 1 else 2 * buffsize * channels


SdpaBackend = Literal["flash", "efficient", "cudnn", "math"]
_LOW_PRECISION = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SdpaCall:
    """What ``select_sdp_backend`` looks at in one ``scaled_dot_product_attention`` call."""

    dtype: str
    """The query's dtype, as torch names it without the prefix."""
    head_dim: int
    """The last dimension of query and key (value's is the same in every family traced here)."""
    num_heads: int
    num_kv_heads: int
    """Key/value heads: fewer than ``num_heads`` under grouped-query attention (``enable_gqa``)."""
    has_mask: bool
    dropout: float
    requires_grad: bool


def prefers_cudnn(device: Device) -> bool:
    """``check_prefer_cudnn_attention``: cuDNN's attention comes first on compute capability 9.0, 9.3, 10.0
    and 10.3 (Hopper, Blackwell data-centre parts), assuming the wheel's cuDNN runtime is newer than 9.15.0
    and ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is unset."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on", "yes"):
        return False
    cc = device.compute_capability
    return cc is not None and cc[0] in (9, 10) and cc[1] in (0, 3)


def _flash_ok(cc: tuple[int, int], call: SdpaCall) -> bool:
    """``can_use_flash_attention``: sm80 to sm121, fp16/bf16, head dim ≤ 256, no mask; on sm86/89/120/121
    training rejects head dims in (192, 224] and above 224 with dropout."""
    if not ((8, 0) <= cc <= (12, 1)) or call.dtype not in _LOW_PRECISION or call.has_mask:
        return False
    if call.head_dim > 256:
        return False
    if call.requires_grad and cc in ((8, 6), (8, 9), (12, 0), (12, 1)):
        d = call.head_dim
        if 192 < d <= 224 or (d > 224 and call.dropout > 0):
            return False
    return True


def _efficient_ok(cc: tuple[int, int], call: SdpaCall) -> bool:
    """``can_use_mem_efficient_attention``: sm50 and later; fp32 and fp16, bf16 from sm80; the head dim a
    multiple of the GEMM alignment (8 for 16-bit types on tensor cores, 4 for fp32 from sm80); as many key/value
    heads as query heads (``check_batch_size_and_num_heads_dense<false>``: its backward returns gradients with
    the query's heads, so grouped heads fall back to math)."""
    if cc < (5, 0) or call.num_kv_heads != call.num_heads:
        return False
    if call.dtype not in ("float32", "float16") and not (call.dtype == "bfloat16" and cc >= (8, 0)):
        return False
    half = call.dtype in _LOW_PRECISION
    alignment = 1
    if cc >= (8, 0):
        alignment = 4
    if cc >= (8, 0) or (cc >= (7, 0) and half):  # use_tensor_cores
        alignment = max(alignment, 128 // (16 if half else 32))
    return call.head_dim % alignment == 0


def _cudnn_ok(cc: tuple[int, int], call: SdpaCall) -> bool:
    """``can_use_cudnn_attention``, conservatively: sm80 and later, fp16/bf16, head dim a multiple of 8 up to
    128, no mask, no dropout, no grouped-query heads (the cases its checks accept in every cuDNN 9 release)."""
    return (
        cc >= (8, 0)
        and call.dtype in _LOW_PRECISION
        and call.head_dim % 8 == 0
        and call.head_dim <= 128
        and not call.has_mask
        and call.dropout == 0
        and call.num_kv_heads == call.num_heads
    )


def sdpa_backend(device: Device, call: SdpaCall) -> SdpaBackend:
    """The SDPA backend PyTorch's CUDA dispatcher picks (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``,
    ``select_sdp_backend``): the first of its priority order whose checks pass, math when none does.

    Order: flash, memory-efficient, math; cuDNN first where :func:`prefers_cudnn`. AMD parts (ROCm, no
    compute capability) use flash where :attr:`Device.flash_attention` says so, else memory-efficient.

    Example:
        >>> call = SdpaCall(dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=8, has_mask=False,
        ...                 dropout=0.0, requires_grad=True)
        >>> sdpa_backend(lookup("A100"), call), sdpa_backend(lookup("H100"), call)
        ('flash', 'cudnn')
        >>> sdpa_backend(lookup("V100"), call), sdpa_backend(lookup("A100"), dataclasses.replace(call, has_mask=True))
        ('math', 'efficient')
    """
    cc = device.compute_capability
    if cc is None:  # ROCm: AOTriton's flash and memory-efficient kernels
        if device.flash_attention and call.dtype in _LOW_PRECISION and not call.has_mask and call.head_dim <= 256:
            return "flash"
        return "efficient" if call.num_kv_heads == call.num_heads else "math"
    if prefers_cudnn(device) and _cudnn_ok(cc, call):
        return "cudnn"
    if _flash_ok(cc, call):
        return "flash"
    if _efficient_ok(cc, call):
        return "efficient"
    return "math"


def _gb(n: int) -> int:
    return n * 10**9


_A100_DATASHEET = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_V100_DATASHEET = (
    "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
)

# The driver totals (MiB) are nvidia-smi's memory.total as printed on machines with each card; the torch
# totals are total_memory as printed by torch.cuda.get_device_properties on such machines.
DEVICES: tuple[Device, ...] = (
    Device(
        name="A100-40GB",
        aliases=("a100-40gb", "a100-sxm4-40gb", "a100-pcie-40gb"),
        vendor="nvidia",
        nominal_bytes=_gb(40),
        driver_total_bytes=40960 * MiB,
        torch_total_bytes=40536 * MiB,
        compute_capability=(8, 0),
        bf16=True,
        source=_A100_DATASHEET,
    ),
    Device(
        name="A100-80GB",
        aliases=("a100-80gb", "a100", "a100-sxm4-80gb", "a100-pcie-80gb"),
        vendor="nvidia",
        nominal_bytes=_gb(80),
        driver_total_bytes=81920 * MiB,
        torch_total_bytes=None,
        compute_capability=(8, 0),
        bf16=True,
        source=_A100_DATASHEET,
    ),
    Device(
        # torch: 81,089 MiB (81,082–81,090 MiB seen across drivers); nvidia-smi: 81,559 MiB
        name="H100-80GB-SXM",
        aliases=("h100-80gb", "h100", "h100-sxm", "h100-sxm5", "h100-80gb-hbm3"),
        vendor="nvidia",
        nominal_bytes=_gb(80),
        driver_total_bytes=81559 * MiB,
        torch_total_bytes=81089 * MiB,
        compute_capability=(9, 0),
        bf16=True,
        source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
    ),
    Device(
        # no report of this card's totals was found: the nominal 80 GB stands (the SXM part reports 85.5 GB)
        name="H100-80GB-PCIe",
        aliases=("h100-pcie", "h100-80gb-pcie"),
        vendor="nvidia",
        nominal_bytes=_gb(80),
        driver_total_bytes=None,
        torch_total_bytes=None,
        compute_capability=(9, 0),
        bf16=True,
        source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
    ),
    Device(
        name="H200",
        aliases=("h200", "h200-141gb", "h200-sxm"),
        vendor="nvidia",
        nominal_bytes=_gb(141),
        driver_total_bytes=143771 * MiB,
        torch_total_bytes=143156 * MiB,
        compute_capability=(9, 0),
        bf16=True,
        source="https://www.nvidia.com/en-us/data-center/h200/",
    ),
    Device(
        name="L4",
        aliases=("l4",),
        vendor="nvidia",
        nominal_bytes=_gb(24),
        driver_total_bytes=23034 * MiB,
        torch_total_bytes=None,
        compute_capability=(8, 9),
        bf16=True,
        source="https://www.nvidia.com/en-us/data-center/l4/",
    ),
    Device(
        name="L40S",
        aliases=("l40s",),
        vendor="nvidia",
        nominal_bytes=_gb(48),
        driver_total_bytes=46068 * MiB,
        torch_total_bytes=45589 * MiB,
        compute_capability=(8, 9),
        bf16=True,
        source="https://www.nvidia.com/en-us/data-center/l40s/",
    ),
    Device(
        name="RTX-4090",
        aliases=("rtx-4090", "4090", "geforce-rtx-4090"),
        vendor="nvidia",
        nominal_bytes=_gb(24),
        driver_total_bytes=24564 * MiB,
        torch_total_bytes=24563 * MiB,
        compute_capability=(8, 9),
        bf16=True,
        source="https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/",
    ),
    Device(
        # torch: 24,268 MiB (as Hugging Face's docs print it); 24,259 MiB seen with another driver
        name="RTX-3090",
        aliases=("rtx-3090", "3090", "geforce-rtx-3090"),
        vendor="nvidia",
        nominal_bytes=_gb(24),
        driver_total_bytes=24576 * MiB,
        torch_total_bytes=24268 * MiB,
        compute_capability=(8, 6),
        bf16=True,
        source="https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/",
    ),
    Device(
        name="V100-16GB",
        aliases=("v100-16gb", "v100-sxm2-16gb", "v100-pcie-16gb"),
        vendor="nvidia",
        nominal_bytes=_gb(16),
        driver_total_bytes=16160 * MiB,
        torch_total_bytes=None,
        compute_capability=(7, 0),
        bf16=False,
        source=_V100_DATASHEET,
    ),
    Device(
        name="V100-32GB",
        aliases=("v100-32gb", "v100", "v100-sxm2-32gb"),
        vendor="nvidia",
        nominal_bytes=_gb(32),
        driver_total_bytes=32768 * MiB,
        torch_total_bytes=None,
        compute_capability=(7, 0),
        bf16=False,
        source=_V100_DATASHEET,
    ),
    Device(
        # AWS's variant of the A10 (G5 instances); the A10's page: https://www.nvidia.com/en-us/data-center/products/a10-gpu/
        name="A10G",
        aliases=("a10g",),
        vendor="nvidia",
        nominal_bytes=_gb(24),
        driver_total_bytes=23028 * MiB,
        torch_total_bytes=22587 * MiB,
        compute_capability=(8, 6),
        bf16=True,
        source="https://aws.amazon.com/ec2/instance-types/g5/",
    ),
    Device(
        # rocm-smi's VRAM total; hipDeviceProp totalGlobalMem and torch.cuda.mem_get_info report the same bytes
        name="MI300X",
        aliases=("mi300x", "instinct-mi300x"),
        vendor="amd",
        nominal_bytes=_gb(192),
        driver_total_bytes=205822885888,
        torch_total_bytes=205822885888,
        compute_capability=None,
        bf16=True,
        source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
        arch="gfx942",
    ),
)


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


_BY_NAME: dict[str, Device] = {}
for _device in DEVICES:
    for _alias in {_key(_device.name), *_device.aliases}:
        assert _alias not in _BY_NAME, f"device alias {_alias!r} is listed twice"
        _BY_NAME[_alias] = _device


def device_names() -> tuple[str, ...]:
    """Every name ``lookup`` accepts, sorted."""
    return tuple(sorted(_BY_NAME))


def lookup(name: str) -> Device:
    """The device called ``name`` (case, spaces and underscores do not matter: ``H100``, ``a100_80gb``).

    Example:
        >>> lookup("RTX 4090").compute_capability
        (8, 9)
        >>> lookup("h100-80")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        trainledger.errors.InputError: unknown device 'h100-80'; close names: h100-80gb, a100-80gb, h100 (every ...
    """
    device = _BY_NAME.get(_key(name))
    if device is None:
        close = difflib.get_close_matches(_key(name), device_names(), n=3, cutoff=0.5)
        if not close:  # nothing alike: the canonical names
            close = [_key(d.name) for d in DEVICES]
        raise InputError(
            f"unknown device {name!r}; close names: {', '.join(close)} (every name: trainledger.devices.device_names())"
        )
    return device
