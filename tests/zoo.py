"""Small models of the kinds users train that the built-in examples do not cover: blocks held in
``ModuleList``/``ModuleDict``/nested ``Sequential`` inside wrappers, a DPO pair, a block shared by several
layers, BatchNorm and running-statistic modules, forward hooks that write state, in-place ops on a
module's input, and a model that checkpoints some of its blocks itself.

Each factory returns a seeded :class:`~trainledger.Workload`, small enough for a planner test to trace,
plan and verify it in seconds.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainledger import Workload
from trainledger.examples import Block

VOCAB, T, C, HEADS = 64, 32, 32, 2


class TinyLM(nn.Module):
    """A tied-embedding language model; ``layout`` says how it holds its blocks."""

    def __init__(self, n_layer: int = 3, *, layout: str = "list", dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, C)
        self.layout = layout
        blocks = [Block(C, HEADS, dropout) for _ in range(n_layer)]
        if layout == "list":
            self.blocks = nn.ModuleList(blocks)
        elif layout == "dict":
            self.blocks = nn.ModuleDict({f"layer{i}": b for i, b in enumerate(blocks)})
        elif layout == "nested":  # a Sequential of Sequentials of blocks
            half = (n_layer + 1) // 2
            self.blocks = nn.Sequential(nn.Sequential(*blocks[:half]), nn.Sequential(*blocks[half:]))
        else:
            raise ValueError(layout)
        self.ln_f = nn.LayerNorm(C)
        self.head = nn.Linear(C, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.layout == "list":
            for b in self.blocks:
                x = b(x)
        elif self.layout == "dict":
            for key in self.blocks:
                x = self.blocks[key](x)
        else:
            x = self.blocks(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def _tokens(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (batch, T)), torch.randint(0, VOCAB, (batch, T))


class LMLoss(nn.Module):
    """A wrapper computing the loss around the real model (as training frameworks do)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.model = lm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(idx).flatten(0, 1), targets.flatten())


def wrapped(layout: str) -> Workload:
    torch.manual_seed(0)
    return Workload(LMLoss(TinyLM(layout=layout)), _tokens(), name=f"wrapped-{layout}")


def _logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits[:, :-1].log_softmax(-1).gather(2, tokens[:, 1:, None]).squeeze(-1).sum(-1)


class DPOPair(nn.Module):
    """A policy and its frozen reference in one module; the reference runs under ``no_grad``.

    ``concat``: the policy runs once on both batches; otherwise twice (chosen, then rejected), so
    each of its modules is called twice per step.
    """

    def __init__(self, *, concat: bool) -> None:
        super().__init__()
        self.policy = TinyLM(dropout=0.0)
        self.reference = copy.deepcopy(self.policy).requires_grad_(False)
        self.concat = concat

    def forward(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        n = chosen.size(0)
        if self.concat:
            both = torch.cat([chosen, rejected])
            with torch.no_grad():
                ref = _logprob(self.reference(both), both)
            pol = _logprob(self.policy(both), both)
            margin = (pol[:n] - pol[n:]) - (ref[:n] - ref[n:])
        else:
            with torch.no_grad():
                ref = _logprob(self.reference(chosen), chosen) - _logprob(self.reference(rejected), rejected)
            margin = _logprob(self.policy(chosen), chosen) - _logprob(self.policy(rejected), rejected) - ref
        return -F.logsigmoid(0.1 * margin).mean()


def dpo_pair(*, concat: bool = True) -> Workload:
    torch.manual_seed(0)
    return Workload(DPOPair(concat=concat), _tokens(), name=f"dpo-pair-{'concat' if concat else 'twice'}")


class SharedBlock(nn.Module):
    """ALBERT-style: one block applied ``depth`` times."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, C)
        self.block = Block(C, HEADS, 0.1)
        self.depth = depth
        self.head = nn.Linear(C, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for _ in range(self.depth):
            x = self.block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def shared_block() -> Workload:
    torch.manual_seed(0)
    return Workload(SharedBlock(), _tokens(), name="shared-block")


class RunningScale(nn.Module):
    """Normalises by a running mean that it updates in forward, before using it: recomputing it without
    care changes both the statistic and the output."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(channels))
        self.scale = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(dim=(0, 2, 3)))
        return (x - self.mean[None, :, None, None]) * self.scale[None, :, None, None]


class ConvBNBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.stat = RunningScale(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stat(self.relu(self.bn(self.conv(x))))


class StatefulCNN(nn.Module):
    """Conv → BatchNorm → in-place ReLU → running statistic, three times; the first ReLU of the stem
    writes into its input, so it alone cannot be recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stem_relu = nn.ReLU(inplace=True)
        self.blocks = nn.ModuleList([ConvBNBlock(8, 16), ConvBNBlock(16, 16), ConvBNBlock(16, 16)])
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem_relu(self.stem(x))
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.fc(x.mean(dim=(2, 3))), y)


def stateful_cnn() -> Workload:
    torch.manual_seed(0)
    return Workload(StatefulCNN(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))), name="stateful-cnn")


class BasicBlock(nn.Module):
    """torchvision's ResNet block: in-place ReLU and ``out += identity``, a downsample when shapes change."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    """ResNet in torchvision's layout (stem, ``layerN`` Sequentials of blocks, pool, fc), narrow."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(x.mean(dim=(2, 3)))


def tiny_resnet() -> Workload:
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    return Workload(TinyResNet(), x, loss_fn=lambda out, _x: F.cross_entropy(out, y), name="tiny-resnet")


class CountingLM(nn.Module):
    """Each block counts the tokens it has seen in a buffer, from a forward hook on its MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM(dropout=0.0)
        for block in self.lm.blocks:
            block.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
            block.mlp.register_forward_hook(self._counter(block))

    @staticmethod
    def _counter(block: nn.Module):
        def hook(_module: nn.Module, _args: object, out: torch.Tensor) -> None:
            block.tokens_seen.add_(out.shape[0] * out.shape[1])

        return hook

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm(idx).flatten(0, 1), targets.flatten())


def counting_lm() -> Workload:
    torch.manual_seed(0)
    return Workload(CountingLM(), _tokens(), name="counting-lm")


class SelfCheckpointing(nn.Module):
    """Checkpoints every other block itself (non-reentrant), as many training scripts do."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM(n_layer=4)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.lm.wte(idx)
        for i, block in enumerate(self.lm.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i % 2 == 0 else block(x)
        return F.cross_entropy(self.lm.head(self.lm.ln_f(x)).flatten(0, 1), targets.flatten())


def self_checkpointing() -> Workload:
    torch.manual_seed(0)
    return Workload(SelfCheckpointing(), _tokens(), name="self-checkpointing")


ZOO = {
    "wrapped-list": lambda: wrapped("list"),
    "wrapped-dict": lambda: wrapped("dict"),
    "wrapped-nested": lambda: wrapped("nested"),
    "dpo-pair-concat": lambda: dpo_pair(concat=True),
    "dpo-pair-twice": lambda: dpo_pair(concat=False),
    "shared-block": shared_block,
    "stateful-cnn": stateful_cnn,
    "tiny-resnet": tiny_resnet,
    "counting-lm": counting_lm,
    "self-checkpointing": self_checkpointing,
}
