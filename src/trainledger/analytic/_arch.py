"""The memory-relevant shape of a decoder-only transformer (no torch): what :mod:`._config` reads from a
Hugging Face config and what the parameter, activation and step models compute from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["llama", "mistral", "qwen2", "gpt2", "gpt_neox", "phi", "mixtral"]
FAMILIES: tuple[Family, ...] = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox", "phi", "mixtral")

# Tensors of the MLP width that an activation's autograd saves besides its output (which the next op, the
# second linear or the gate's product, saves anyway): silu and gelu keep their input; relu keeps only its
# output (``threshold_backward`` reads it); gelu_new (GPT-2's and Phi's tanh formula, written out in Python)
# keeps its input, the tanh, x/2 and 1 + tanh.
ACTIVATIONS = {"silu": 1, "swish": 1, "gelu": 1, "relu": 0, "gelu_new": 4, "gelu_fast": 7, "gelu_pytorch_tanh": 1}
OUTPUT_SAVING = frozenset({"relu"})
"""Activations whose backward reads their output: it stays saved when no later op saves it."""


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    """The memory-relevant shape of a decoder-only transformer, read from a Hugging Face config."""

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied: bool
    """Input embedding and LM head share one storage."""
    norm: Literal["rmsnorm", "layernorm"]
    gated_mlp: bool
    """SwiGLU (gate, up, down) rather than two linears."""
    act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    lm_head_bias: bool
    parallel_residual: bool
    """Attention and MLP read the same normalised input (GPT-NeoX, Phi)."""
    num_norms_per_layer: int
    learned_positions: int
    """Rows of a learned position embedding (GPT-2's ``n_positions``); 0 for rotary models."""
    rotary_dim: int
    attn_dropout: float
    resid_dropout: float
    embd_dropout: float
    num_experts: int = 0
    top_k: int = 0
    qk_layernorm: bool = False
    sliding_window: int = 0
    """Tokens a sliding-window layer attends to (Mistral, Mixtral, Qwen2's ``use_sliding_window``); 0: none."""
    sliding_from: int = 0
    """The first layer that slides (Qwen2's ``max_window_layers``); every later one does too."""
    upcast_attn: bool = False
    """Eager attention computes the scores from fp32 copies of q and k and keeps an fp32 softmax (GPT-2's
    ``reorder_and_upcast_attn``; SDPA ignores it)."""

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def act_saved(self) -> int:
        """Tensors of the MLP width that the activation function's autograd saves."""
        return ACTIVATIONS.get(self.act, 1)

    @property
    def act_keeps_output(self) -> bool:
        """The activation's backward reads its output (relu), so autograd saves it whoever else does."""
        return self.act in OUTPUT_SAVING
