"""Exact parameter tensors of each family, as ``transformers`` builds them (no torch).

``tests/test_analytic_params.py`` checks every family, tied and untied, against ``sum(p.numel())`` of the
model ``transformers`` builds on the meta device, tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainledger.analytic._arch import ArchSpec


@dataclass(frozen=True, slots=True)
class ParamTensor:
    """One parameter tensor of the model."""

    name: str
    numel: int
    layer: int | None
    """Decoder layer index; ``None`` for embeddings, the final norm and the head."""
    tp_split: bool
    """Divided across tensor-parallel ranks (Megatron's column/row/vocab-parallel layers); norms are not."""
    lora_target: str = ""
    """The linear's name as LoRA targets it (``q_proj``, ``c_attn``…), with ``(in, out)`` in ``lora_dims``."""
    lora_dims: tuple[int, int] = (0, 0)
    shape: tuple[int, ...] = ()


def _linear(prefix: str, name: str, d_in: int, d_out: int, bias: bool, layer: int | None) -> list[ParamTensor]:
    out = [ParamTensor(f"{prefix}{name}.weight", d_in * d_out, layer, True, name, (d_in, d_out), (d_out, d_in))]
    if bias:
        out.append(ParamTensor(f"{prefix}{name}.bias", d_out, layer, True, shape=(d_out,)))
    return out


def _norm(prefix: str, name: str, dim: int, layernorm: bool, layer: int | None) -> list[ParamTensor]:
    out = [ParamTensor(f"{prefix}{name}.weight", dim, layer, False, shape=(dim,))]
    if layernorm:
        out.append(ParamTensor(f"{prefix}{name}.bias", dim, layer, False, shape=(dim,)))
    return out


def param_tensors(spec: ArchSpec) -> list[ParamTensor]:
    """Every parameter tensor (a tied head is one storage: listed once, under the embedding).

    Example:
        >>> from trainledger.analytic._config import arch_from_config
        >>> s = arch_from_config({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
        ...     "n_head": 12})
        >>> sum(p.numel for p in param_tensors(s))  # GPT-2 small
        124439808
    """
    H, V, L = spec.hidden_size, spec.vocab_size, spec.num_layers
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    I = spec.intermediate_size
    ln = spec.norm == "layernorm"
    out: list[ParamTensor] = []
    if spec.family == "gpt2":
        out.append(ParamTensor("transformer.wte.weight", V * H, None, True, shape=(V, H)))
        out.append(
            ParamTensor(
                "transformer.wpe.weight", spec.learned_positions * H, None, False, shape=(spec.learned_positions, H)
            )
        )
        for i in range(L):
            p = f"transformer.h.{i}."
            out += _norm(p, "ln_1", H, True, i)
            out += _linear(p + "attn.", "c_attn", H, 3 * H, True, i)
            out += _linear(p + "attn.", "c_proj", H, H, True, i)
            out += _norm(p, "ln_2", H, True, i)
            out += _linear(p + "mlp.", "c_fc", H, I, True, i)
            out += _linear(p + "mlp.", "c_proj", I, H, True, i)
        out += _norm("transformer.", "ln_f", H, True, None)
    elif spec.family == "gpt_neox":
        out.append(ParamTensor("gpt_neox.embed_in.weight", V * H, None, True, shape=(V, H)))
        for i in range(L):
            p = f"gpt_neox.layers.{i}."
            out += _norm(p, "input_layernorm", H, True, i)
            out += _norm(p, "post_attention_layernorm", H, True, i)
            out += _linear(p + "attention.", "query_key_value", H, 3 * H, spec.qkv_bias, i)
            out += _linear(p + "attention.", "dense", H, H, spec.o_bias, i)
            out += _linear(p + "mlp.", "dense_h_to_4h", H, I, True, i)
            out += _linear(p + "mlp.", "dense_4h_to_h", I, H, True, i)
        out += _norm("gpt_neox.", "final_layer_norm", H, True, None)
    else:  # llama, mistral, qwen2, mixtral, phi: model.layers.*
        out.append(ParamTensor("model.embed_tokens.weight", V * H, None, True, shape=(V, H)))
        for i in range(L):
            p = f"model.layers.{i}."
            out += _norm(p, "input_layernorm", H, ln, i)
            if spec.num_norms_per_layer == 2:
                out += _norm(p, "post_attention_layernorm", H, ln, i)
            a = p + "self_attn."
            out += _linear(a, "q_proj", H, q_out, spec.qkv_bias, i)
            out += _linear(a, "k_proj", H, kv_out, spec.qkv_bias, i)
            out += _linear(a, "v_proj", H, kv_out, spec.qkv_bias, i)
            out += _linear(a, "dense" if spec.family == "phi" else "o_proj", q_out, H, spec.o_bias, i)
            if spec.qk_layernorm:
                out += _norm(a, "q_layernorm", spec.head_dim, True, i)
                out += _norm(a, "k_layernorm", spec.head_dim, True, i)
            m = p + "mlp."
            if spec.moe:
                E = spec.num_experts
                out.append(ParamTensor(m + "gate.weight", H * E, i, False, shape=(E, H)))
                out.append(ParamTensor(m + "experts.gate_up_proj", E * 2 * I * H, i, True, shape=(E, 2 * I, H)))
                out.append(ParamTensor(m + "experts.down_proj", E * I * H, i, True, shape=(E, H, I)))
            elif spec.gated_mlp:
                out += _linear(m, "gate_proj", H, I, spec.mlp_bias, i)
                out += _linear(m, "up_proj", H, I, spec.mlp_bias, i)
                out += _linear(m, "down_proj", I, H, spec.mlp_bias, i)
            else:
                out += _linear(m, "fc1", H, I, True, i)
                out += _linear(m, "fc2", I, H, True, i)
        out += _norm("model.", "final_layernorm" if spec.family == "phi" else "norm", H, ln, None)
    if not spec.tied:
        out.append(ParamTensor("lm_head.weight", V * H, None, True, shape=(V, H)))
    if spec.lm_head_bias:  # Phi's head has a bias, kept when the weight is tied
        out.append(ParamTensor("lm_head.bias", V, None, True, shape=(V,)))
    return out


def num_params(spec: ArchSpec) -> int:
    """Total parameters, tied weights counted once (what ``model.num_parameters()`` reports)."""
    return sum(p.numel for p in param_tensors(spec))
