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
