"""CPU kernels that run a composite inside one op (BCE with logits, the smooth L1 and Huber losses, upsampling,
GroupNorm's backward, log-sum-exp, sorting), or cast an operand of another dtype (TensorIterator), or compute a
bf16 gather through an fp32 buffer: memory no dispatch shows, probed like convolutions. Each step here has its
peak, or a kernel's buffers, where the trace missed them before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainledger.measure import measure
from trainledger.trace import KERNEL_INTERNAL
from trainledger.workload import Workload


def _multilabel_head() -> Workload:
    """A frozen trunk and a wide multi-label head whose bias alone trains: the step's peak is the loss, where
    BCE with logits holds its log-sigmoid and ``(1 - target)`` beside the logits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 3000))
    model[0].requires_grad_(False)
    model[2].weight.requires_grad_(False)
    targets = (torch.rand(40, 3000) > 0.9).float()
    return Workload(
        model,
        torch.randn(40, 24),
        loss_fn=lambda out, _: F.binary_cross_entropy_with_logits(out, targets),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )


class _Decoder(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.out = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm(self.inp(x)))
        return self.out(F.interpolate(h, scale_factor=2, mode=self.mode))


def _decoder(mode: str, loss) -> Workload:
    torch.manual_seed(0)
    return Workload(_Decoder(mode), torch.randn(6, 3, 24, 24), loss_fn=lambda out, batch: loss(out, batch))


def _contrastive() -> Workload:
    torch.manual_seed(0)
    enc = nn.Linear(16, 32)

    def loss(z: torch.Tensor, _batch: torch.Tensor) -> torch.Tensor:
        z = F.normalize(z, dim=1)
        logits = z @ z.T / 0.1
        return (torch.logsumexp(logits, 1) - logits.diagonal()).mean()

    return Workload(enc, torch.randn(300, 16), loss_fn=loss)


class _MixedResidual(nn.Module):
    """An fp32 layer's output added to a bf16 residual, summed in fp64: each op casts an operand into a temporary
    of its size on the CPU (TensorIterator), which no dispatch shows. The trace was 18% short."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = torch.zeros(x.shape[0], 256, dtype=torch.bfloat16)
        return self.b(torch.relu(self.a(x)) + residual).sum(dtype=torch.float64).float()


class _RelativeGather(nn.Module):
    """DeBERTa's disentangled attention in miniature: bf16 scores gathered by an expanded integer index built from
    relative positions (an integer division into floats): the gather computes through an fp32 buffer."""

    def __init__(self, n: int = 96) -> None:
        super().__init__()
        self.n = n
        self.proj = nn.Linear(32, 2 * n).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x.to(torch.bfloat16))  # (batch, n, 2n)
        pos = torch.arange(self.n)
        relative = (pos[:, None] - pos[None, :]) / 2  # integers divided into floats
        index = (relative.floor().long() + self.n).clamp(0, 2 * self.n - 1)
        picked = torch.gather(scores, -1, index.expand(x.shape[0], -1, -1))
        return picked.float().square().mean()


class _ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: a depthwise convolution, then LayerNorm and an MLP over the channels of the feature map
    permuted to channels-last; LayerNorm computes on a contiguous copy of the permuted map."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.down(F.gelu(self.up(h))).permute(0, 3, 1, 2)


class _Segmenter(nn.Module):
    """A segmentation head in channels-last (as SegFormer's decoder runs): the per-pixel cross-entropy's
    log-softmax over the channels reads a map that is not contiguous, and copies it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1).to(memory_format=torch.channels_last)
        self.head = nn.Conv2d(16, 40, 1).to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.stem(x.contiguous(memory_format=torch.channels_last))))


def _segmenter() -> Workload:
    torch.manual_seed(0)
    labels = torch.randint(0, 40, (4, 48, 48))
    return Workload(_Segmenter(), torch.randn(4, 3, 48, 48), loss_fn=lambda out, _: F.cross_entropy(out, labels))


class _ConvThenTokens(nn.Module):
    """An exact GELU on a convolution's map, then its pixels as tokens: the GELU's gradient comes back permuted,
    and its backward holds a copy for the two layouts."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.proj = nn.Conv2d(3, 24, 3, padding=1), nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.conv(x)).flatten(2).transpose(1, 2)  # (batch, pixels, channels)
        scores = torch.softmax(self.proj(h).transpose(1, 2), dim=-1)  # softmax over the pixels of a transposed map
        valid = (h[..., 0] > 0).sum(dtype=None)  # a count of booleans: summed in int64
        return scores.square().sum() + valid * 1e-6


CASES = {
    "bce-with-logits": (_multilabel_head, {"aten.binary_cross_entropy_with_logits"}),
    "nearest-smooth-l1": (lambda: _decoder("nearest", F.smooth_l1_loss), {"aten.smooth_l1_loss"}),
    "bilinear-huber": (
        lambda: _decoder("bilinear", F.huber_loss),
        {"aten.huber_loss", "aten.upsample_bilinear2d", "aten.native_group_norm_backward"},
    ),
    "logsumexp": (_contrastive, {"aten.logsumexp"}),
    "mixed-dtypes": (
        lambda: Workload(_MixedResidual(), torch.randn(300, 64)),
        {"aten.add.Tensor", "aten.sum"},
    ),
    "convnext-permuted-layer-norm": (
        lambda: Workload(_ConvNeXtBlock(), torch.randn(4, 32, 28, 28), loss_fn=lambda out, _: out.square().mean()),
        {"aten.native_layer_norm"},
    ),
    "channels-last-cross-entropy": (_segmenter, {"aten._log_softmax"}),
    "permuted-gelu-gradient": (
        lambda: Workload(_ConvThenTokens(), torch.randn(4, 3, 24, 24)),
        {"aten.gelu_backward", "aten._softmax", "aten.sum"},
    ),
    "expanded-gather": (
        lambda: Workload(_RelativeGather(), torch.randn(4, 96, 32)),
        {"aten.gather", "aten.div.Tensor"},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_composite_kernels_buffers_are_traced_to_the_allocators_count(name):
    build, ops = CASES[name]
    m = measure(build(), num_steps=1)
    probed = {e.name.split("#")[0] for e in m.traced.entries if e.role == KERNEL_INTERNAL}
    assert ops <= probed, probed
    assert 0 <= m.peak_bytes - m.traced.peak().bytes <= 16  # a Python scalar wrapped as a tensor inside a kernel


def test_the_multilabel_heads_peak_is_its_loss_with_the_kernels_intermediates():
    m = measure(_multilabel_head(), num_steps=1)
    peak = m.traced.peak()
    assert (peak.phase, peak.op) == ("forward", "aten.binary_cross_entropy_with_logits")
    assert peak.by_category["workspace"] >= 2 * 40 * 3000 * 4  # two logits-sized intermediates


@pytest.mark.parametrize(
    ("name", "op", "nbytes"),
    [
        ("convnext-permuted-layer-norm", "aten.native_layer_norm", 4 * 28 * 28 * 32 * 4),  # a copy of its input
        ("channels-last-cross-entropy", "aten._log_softmax", 4 * 40 * 48 * 48 * 4),  # a copy of the logits
        ("permuted-gelu-gradient", "aten._softmax", 4 * 24 * 576 * 4),  # a copy of the transposed scores
        ("permuted-gelu-gradient", "aten.sum", 4 * 576 * 8),  # the booleans as int64
        ("permuted-gelu-gradient", "aten.gelu_backward", 2 * 4 * 24 * 24 * 24 * 4),  # twice the input
    ],
)
def test_a_copy_for_a_layout_or_a_dtype_is_the_size_a_hand_calculation_gives(name, op, nbytes):
    m = measure(CASES[name][0](), num_steps=1)
    internal = [e.nbytes for e in m.traced.entries if e.role == KERNEL_INTERNAL and e.name.split("#")[0] == op]
    assert internal == [nbytes]
