"""Built-in example workloads: small, real models built locally (nothing is downloaded).

Each is a factory returning a :class:`~trainledger.workload.Workload`, seeded so every build is identical.
They cover what memory accounting must get right: tied weights, buffers, in-place ops, dropout, frozen
weights (a LoRA base, a reference model under ``no_grad``), data-dependent routing, autocast, and
low-precision weights with fp32 master copies.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainledger.workload import Workload

# --- the seed's fixture ------------------------------------------------------------------------------


def seed_423() -> Workload:
    """The seed's core: exactly 423 float64 trainable parameters, trained with Adam.

    ``Linear(3, 60)`` (240) + ``Linear(60, 3)`` (183) = 423. A frozen reference copy of the model takes
    part in the loss under ``no_grad`` (a proximal term), as a DPO reference would: it adds 3384 bytes.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 60), nn.Tanh(), nn.Linear(60, 3)).double()
    reference = copy.deepcopy(model).requires_grad_(False)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def loss_fn(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            ref_out = reference(batch[0])
        return F.mse_loss(out, batch[1]) + 0.1 * F.mse_loss(out, ref_out)

    return Workload(
        _FirstArg(model),
        (x, y),
        loss_fn=loss_fn,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
        reference=reference,
        name="seed-423",
    )


class _FirstArg(nn.Module):
    """Calls the wrapped model on the first element of the batch (the input), leaving the target."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, *_targets: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


# --- a small GPT (tied embeddings, dropout, explicit attention) ------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = self.attn_drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLPBlock(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLPBlock(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A nanoGPT-style decoder: learned positions, pre-LayerNorm blocks, LM head tied to the embedding."""

    def __init__(
        self, *, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one storage, counted once

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def gpt_tiny(
    *, n_layer: int = 4, n_embd: int = 64, n_head: int = 4, seq_len: int = 64, batch_size: int = 4
) -> Workload:
    """A 4-layer GPT (≈0.2M parameters) on random tokens, AdamW."""
    torch.manual_seed(0)
    vocab = 256
    model = GPT(vocab_size=vocab, block_size=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=0.1)
    idx = torch.randint(0, vocab, (batch_size, seq_len))
    targets = torch.randint(0, vocab, (batch_size, seq_len))
    return Workload(model, (idx, targets), optimizer=_adamw, name="gpt-tiny")


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


# --- small models of other kinds -------------------------------------------------------------------


def mlp() -> Workload:
    """Three linear layers with ReLU, SGD with momentum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return Workload(
        _FirstArg(model),
        (x, y),
        loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        name="mlp",
    )


def cnn() -> Workload:
    """Conv → BatchNorm → in-place ReLU, twice, then a classifier; Adam."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return Workload(
        _FirstArg(model),
        (x, y),
        loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
        name="cnn",
    )


class LSTMRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return F.mse_loss(self.head(out[:, -1]), y)


def lstm() -> Workload:
    """A two-layer LSTM regressor; RMSprop."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 20, 16), torch.randn(8, 1)
    return Workload(LSTMRegressor(), (x, y), optimizer=lambda ps: torch.optim.RMSprop(ps, lr=1e-3), name="lstm")


class MoE(nn.Module):
    """Top-2 routing over four expert MLPs: which tokens reach which expert depends on the data."""

    def __init__(self, dim: int = 32, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(num_experts)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(dim=-1)  # (N, E)
        weight, chosen = gates.topk(self.top_k, dim=-1)  # (N, k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * weight[rows, slot].unsqueeze(-1))
        return F.mse_loss(out, y)


def moe() -> Workload:
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    return Workload(MoE(), (x, y), optimizer=_adamw, name="moe")


def dpo() -> Workload:
    """A policy and a frozen reference model under ``no_grad`` in a DPO-style loss."""
    torch.manual_seed(0)
    policy = GPT(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    reference = copy.deepcopy(policy).requires_grad_(False)
    chosen = torch.randint(0, 128, (4, 32))
    rejected = torch.randint(0, 128, (4, 32))

    def logprob(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
        return -model(tokens[:, :-1], tokens[:, 1:])

    def dpo_loss(_out: object, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            ref_margin = logprob(reference, batch[0]) - logprob(reference, batch[1])
        margin = logprob(policy, batch[0]) - logprob(policy, batch[1])
        return -F.logsigmoid(0.1 * (margin - ref_margin))

    return Workload(
        _Identity(policy), (chosen, rejected), loss_fn=dpo_loss, optimizer=_adamw, reference=reference, name="dpo"
    )


class _Identity(nn.Module):
    """Holds a model whose use is entirely inside the loss (DPO computes log-probs there)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return batch


class LoRALinear(nn.Module):
    """A frozen base ``W`` plus a trainable low-rank update ``B @ A`` (Hu et al., 2021)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / rank)
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def lora() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(64, 256), nn.ReLU(), LoRALinear(256, 64))
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    return Workload(
        _FirstArg(model), (x, y), loss_fn=lambda out, b: F.mse_loss(out, b[1]), optimizer=_adamw, name="lora"
    )


def autocast_bf16() -> Workload:
    """An MLP whose forward runs under bf16 autocast (fp32 weights, bf16 matmuls)."""
    w = mlp()
    w.autocast_dtype = torch.bfloat16
    w.optimizer = _adamw
    w.name = "autocast-bf16"
    return w


class AdamWWithMasterWeights(torch.optim.AdamW):
    """AdamW over fp32 master copies of low-precision model weights (the classic mixed-precision recipe).

    The model holds bf16 weights and receives bf16 gradients; ``step`` casts them up onto the fp32
    masters, updates the masters, and copies them back down into the model.
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict[str, Any]], **kwargs: float) -> None:
        # the model's parameters, or groups of them (``ZeroRedundancyOptimizer`` builds it over each rank's groups)
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.model_params = [p for g in groups for p in g["params"]]
        masters = [
            {**g, "params": [p.detach().float().clone().requires_grad_(True) for p in g["params"]]} for g in groups
        ]
        super().__init__(masters, **kwargs)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        masters = [m for g in self.param_groups for m in g["params"]]
        for p, m in zip(self.model_params, masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        super().step(closure)
        for p, m in zip(self.model_params, masters, strict=True):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None


def bf16_master() -> Workload:
    """An MLP with bf16 weights and fp32 master copies held by the optimizer."""
    w = mlp()
    w.model = w.model.to(torch.bfloat16)
    w.batch = (w.batch[0].to(torch.bfloat16), w.batch[1])
    w.optimizer = lambda ps: AdamWWithMasterWeights(ps, lr=1e-3)
    w.name = "bf16-master"
    return w


# --- a U-Net (skip connections: not a chain) ---------------------------------------------------------
# A U-Net (Ronneberger et al., 2015) keeps every encoder stage's output for the decoder stage that mirrors
# it, so what can be dropped and when differs from a transformer: the rematerialization benchmark uses it.


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


EXAMPLES: dict[str, Callable[[], Workload]] = {
    "seed-423": seed_423,
    "gpt-tiny": gpt_tiny,
    "mlp": mlp,
    "cnn": cnn,
    "lstm": lstm,
    "moe": moe,
    "dpo": dpo,
    "lora": lora,
    "autocast-bf16": autocast_bf16,
    "bf16-master": bf16_master,
    "unet-small": unet_small,
}


def build(name: str) -> Workload:
    """Build the built-in example ``name`` (see ``EXAMPLES``)."""
    return EXAMPLES[name]()
