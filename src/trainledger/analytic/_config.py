"""Hugging Face ``config.json`` → :class:`ArchSpec`: parsed and validated here, with no torch and no transformers.

Both the analytic model and the model builder (:mod:`trainledger.hf`) read configs through
:func:`arch_from_config`, so a bad config is rejected the same way everywhere, with one line that names
the bad value. Keys a config may omit take the defaults of the family's ``transformers`` config class
(``tests/test_analytic_config.py`` checks them against ``transformers``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainledger.checks import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_PARAMS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    MAX_WIDTH,
    Limit,
    describe,
)
from trainledger.errors import InputError

Family = Literal["llama", "mistral", "qwen2", "gpt2", "gpt_neox", "phi", "mixtral"]
FAMILIES: tuple[Family, ...] = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox", "phi", "mixtral")

# Keys every config of a family must state (the sizes), under the names that family's config.json uses.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "mistral": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "qwen2": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head"),
    "gpt_neox": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "phi": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "mixtral": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
}
# GPT-2's config.json names its sizes differently; the standard names are accepted too.
_GPT2_ALIASES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head"}

# Defaults of the transformers config classes for the keys that change memory.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
    },
    "mistral": {"tie_word_embeddings": False, "attention_dropout": 0.0, "num_key_value_heads": 8, "hidden_act": "silu"},
    "qwen2": {"tie_word_embeddings": False, "attention_dropout": 0.0, "hidden_act": "silu"},
    "gpt2": {
        "tie_word_embeddings": True,
        "n_positions": 1024,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
    },
    "gpt_neox": {
        "tie_word_embeddings": False,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "use_parallel_residual": True,
        "hidden_act": "gelu",
        "rotary_pct": 0.25,
    },
    "phi": {
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "hidden_act": "gelu_new",
        "partial_rotary_factor": 0.5,
        "qk_layernorm": False,
    },
    "mixtral": {
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "router_jitter_noise": 0.0,
    },
}
# Activations whose autograd saves only their input (plus the next linear's saved output); gelu_new
# (GPT-2's and Phi's tanh formula, written out in Python) saves four tensors of the MLP width.
_ACTIVATIONS = {"silu": 1, "swish": 1, "gelu": 1, "relu": 1, "gelu_new": 4, "gelu_pytorch_tanh": 1}


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

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def act_saved(self) -> int:
        """Tensors of the MLP width that the activation function's autograd saves."""
        return _ACTIVATIONS.get(self.act, 1)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a ``config.json`` or a folder holding one). Nothing is downloaded."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"config is {describe(path)}; give the path of a config.json, a folder holding one, or a dict")
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise InputError(f"config {str(path)!r}: no such file (give a config.json or a folder holding one)")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(
            f"config {str(p)!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; fix the file"
        ) from None
    except UnicodeDecodeError:
        raise InputError(f"config {str(p)!r} is not a UTF-8 text file; give a config.json") from None
    except OSError as exc:
        raise InputError(
            f"config {str(p)!r} cannot be read ({exc.strerror or type(exc).__name__}); give a readable config.json"
        ) from None
    except RecursionError:
        raise InputError(
            f"config {str(p)!r} nests too deeply to be a config.json; give a model's config.json"
        ) from None
    if not isinstance(raw, dict):
        raise InputError(
            f"config {str(p)!r} holds a JSON {type(raw).__name__}; give an object of config keys (a config.json)"
        )
    return raw


def normalized_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config's keys with GPT-2's standard-name aliases resolved, ``model_type`` checked."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise InputError(f"config is missing key 'model_type'; accepted: {', '.join(FAMILIES)}")
    if model_type not in FAMILIES:
        raise InputError(f"unknown model_type {model_type!r}; accepted: {', '.join(FAMILIES)}")
    cfg = dict(raw)
    if model_type == "gpt2":
        for std, own in _GPT2_ALIASES.items():
            if own not in cfg and std in cfg:
                cfg[own] = cfg.pop(std)
    missing = [k for k in _REQUIRED[model_type] if k not in cfg]
    if missing:
        raise InputError(
            f"{model_type} config is missing key(s) {', '.join(repr(k) for k in missing)}; add them (the model's sizes)"
        )
    return cfg


def _size(cfg: dict[str, Any], key: str, limit: Limit = MAX_WIDTH) -> int:
    """A positive whole size, no larger than ``limit``: an implausible size is refused in one line before
    anything is built (a billion layers would exhaust memory, not answer a question)."""
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"config key {key!r} is {value!r}; it must be a whole number")
    if value <= 0:
        raise InputError(f"config key {key!r} is {value}; it must be positive")
    if value > limit.value:
        raise InputError(f"config key {key!r} is {value:,}; at most {limit.value:,} is accepted ({limit.why})")
    return value


def _prob(cfg: dict[str, Any], key: str) -> float:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise InputError(f"config key {key!r} is {value!r}; a dropout probability must be in [0, 1)")
    return float(value)


def arch_from_config(raw: dict[str, Any]) -> ArchSpec:
    """Validate a Hugging Face config (a dict from ``config.json``) and read its memory-relevant shape.

    Raises :class:`~trainledger.errors.InputError` for a missing ``model_type`` or size, an unknown
    family, a non-positive size, heads that do not divide the hidden size, and the like.

    Example:
        >>> spec = arch_from_config({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
        ...     "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32})
        >>> spec.num_kv_heads, spec.head_dim, spec.tied
        (32, 128, False)
    """
    cfg = normalized_config(raw)
    family: Family = cfg["model_type"]
    cfg = {**DEFAULTS[family], **cfg}
    gpt2 = family == "gpt2"
    hidden = _size(cfg, "n_embd" if gpt2 else "hidden_size")
    heads = _size(cfg, "n_head" if gpt2 else "num_attention_heads")
    layers = _size(cfg, "n_layer" if gpt2 else "num_hidden_layers", MAX_LAYERS)
    vocab = _size(cfg, "vocab_size", MAX_VOCAB)
    if gpt2:
        inter = 4 * hidden if cfg.get("n_inner") is None else _size(cfg, "n_inner")
    else:
        inter = _size(cfg, "intermediate_size")
    kv = cfg.get("num_key_value_heads")
    kv = heads if kv is None else _size(cfg, "num_key_value_heads")
    head_dim = cfg.get("head_dim")
    if head_dim is None or family not in ("llama", "mistral", "qwen2", "mixtral"):
        if hidden % heads:
            key = "n_head" if gpt2 else "num_attention_heads"
            raise InputError(
                f"{key} {heads} does not divide the hidden size {hidden}; give a head count that divides it"
            )
        head_dim = hidden // heads
    else:
        head_dim = _size(cfg, "head_dim")
    if heads % kv:
        raise InputError(
            f"num_key_value_heads {kv} does not divide num_attention_heads {heads}; "
            "each key/value head must serve a whole number of query heads"
        )
    tied = cfg.get("tie_word_embeddings")
    if not isinstance(tied, bool):
        raise InputError(f"config key 'tie_word_embeddings' is {tied!r}; it must be true or false")
    num_experts = top_k = 0
    if family == "mixtral":
        num_experts = _size(cfg, "num_local_experts", MAX_EXPERTS)
        top_k = _size(cfg, "num_experts_per_tok")
        if top_k > num_experts:
            raise InputError(
                f"num_experts_per_tok {top_k} exceeds num_local_experts {num_experts}; give at most {num_experts}"
            )
    act = cfg.get("activation_function" if gpt2 else "hidden_act")
    if act not in _ACTIVATIONS:
        raise InputError(f"activation {act!r} is not modelled; accepted: {', '.join(_ACTIVATIONS)}")
    rope = cfg.get("rope_parameters") or {}
    if family == "gpt_neox":
        rotary = rope.get("partial_rotary_factor", cfg.get("rotary_pct", 0.25))
    elif family == "phi":
        rotary = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    else:
        rotary = 1.0
    common = dict(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        tied=tied,
        act=act,
        rotary_dim=0 if gpt2 else int(head_dim * float(rotary)),
        num_experts=num_experts,
        top_k=top_k,
    )
    spec = _spec(family, cfg, common)
    from trainledger.analytic._params import num_params

    total = num_params(spec)
    if total > MAX_PARAMS.value:
        raise InputError(
            f"this {family} config has {total:,} parameters; at most {MAX_PARAMS.value:,} are accepted "
            f"({MAX_PARAMS.why}); check its sizes"
        )
    return spec


def _spec(family: Family, cfg: dict[str, Any], common: dict[str, Any]) -> ArchSpec:
    """The family-specific part of :func:`arch_from_config`."""
    gpt2 = family == "gpt2"
    if family in ("llama", "mistral", "qwen2", "mixtral"):
        attn_bias = bool(cfg.get("attention_bias", False)) if family == "llama" else False
        return ArchSpec(
            **common,
            norm="rmsnorm",
            gated_mlp=True,
            qkv_bias=attn_bias or family == "qwen2",
            o_bias=attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
            lm_head_bias=False,
            parallel_residual=False,
            num_norms_per_layer=2,
            learned_positions=0,
            attn_dropout=_prob(cfg, "attention_dropout"),
            resid_dropout=0.0,
            embd_dropout=0.0,
        )
    if gpt2:
        return ArchSpec(
            **common,
            norm="layernorm",
            gated_mlp=False,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            lm_head_bias=False,
            parallel_residual=False,
            num_norms_per_layer=2,
            learned_positions=_size(cfg, "n_positions", MAX_SEQ_LEN),
            attn_dropout=_prob(cfg, "attn_pdrop"),
            resid_dropout=_prob(cfg, "resid_pdrop"),
            embd_dropout=_prob(cfg, "embd_pdrop"),
        )
    if family == "gpt_neox":
        bias = bool(cfg.get("attention_bias", True))
        return ArchSpec(
            **common,
            norm="layernorm",
            gated_mlp=False,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=True,
            lm_head_bias=False,
            parallel_residual=bool(cfg.get("use_parallel_residual", True)),
            num_norms_per_layer=2,
            learned_positions=0,
            attn_dropout=_prob(cfg, "attention_dropout"),
            resid_dropout=_prob(cfg, "hidden_dropout"),
            embd_dropout=0.0,
        )
    return ArchSpec(  # phi
        **common,
        norm="layernorm",
        gated_mlp=False,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        lm_head_bias=True,
        parallel_residual=True,
        num_norms_per_layer=1,
        learned_positions=0,
        attn_dropout=_prob(cfg, "attention_dropout"),
        resid_dropout=_prob(cfg, "resid_pdrop"),
        embd_dropout=_prob(cfg, "embd_pdrop"),
        qk_layernorm=bool(cfg.get("qk_layernorm", False)),
    )
