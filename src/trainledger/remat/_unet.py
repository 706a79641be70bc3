"""A small U-Net for the rematerialization benchmark and tests (not a built-in example).

A U-Net (Ronneberger et al., 2015) is not a chain: every encoder stage's output is kept for the decoder
stage that mirrors it (the skip connections), so what can be dropped and when differs from a transformer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainledger.workload import Workload


class ConvBlock(nn.Module):
    """(conv 3x3 → BatchNorm → ReLU) twice, with channel dropout between."""

    def __init__(self, c_in: int, c_out: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.drop = nn.Dropout2d(dropout)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(F.relu(self.bn1(self.conv1(x))))
        return F.relu(self.bn2(self.conv2(x)))


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.block = ConvBlock(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.pool(x))


class Up(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.block = ConvBlock(2 * c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.block(torch.cat([self.up(x), skip], dim=1))  # (B, 2·c_out, H, W)


class UNet(nn.Module):
    def __init__(self, *, in_channels: int = 3, num_classes: int = 4, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]  # 16, 32, 64, 128
        self.stem = ConvBlock(in_channels, widths[0])
        self.downs = nn.ModuleList(Down(widths[i], widths[i + 1]) for i in range(depth))
        self.ups = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        skips = [self.stem(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        y = skips.pop()
        for up in self.ups:
            y = up(y, skips.pop())
        return F.cross_entropy(self.head(y), target)


def unet_small(*, batch_size: int = 4, size: int = 32) -> Workload:
    """A 3-level U-Net (16→128 channels) on random 32×32 images, per-pixel cross-entropy, AdamW."""
    torch.manual_seed(0)
    model = UNet()
    x = torch.randn(batch_size, 3, size, size)
    target = torch.randint(0, 4, (batch_size, size, size))
    return Workload(model, (x, target), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), name="unet-small")
