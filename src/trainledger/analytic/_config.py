"""Hugging Face ``config.json`` → :class:`ArchSpec`: parsed and validated here, with no torch and no transformers.

Both the analytic model and the model builder (:mod:`trainledger.hf`) read configs through
:func:`arch_from_config`, so a bad config is rejected the same way everywhere, with one line that names
the bad value. Keys a config may omit take the defaults of the family's ``transformers`` config class
(``tests/test_analytic_config.py`` checks them against ``transformers``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainledger.analytic._arch import ACTIVATIONS, FAMILIES, ArchSpec, Family
from trainledger.analytic._params import num_params
from trainledger.checks import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_PARAMS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    MAX_WIDTH,
    Limit,
    describe,
    unreadable_json,
)
from trainledger.errors import InputError

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
    "mistral": {
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "sliding_window": 4096,
    },
    "qwen2": {
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "max_window_layers": 28,
    },
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


_MAX_CONFIG_BYTES = 16 * 2**20
"""The largest config file read: the largest published config.json files are tens of KB."""


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a ``config.json`` or a folder holding one). Nothing is downloaded."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"config is {describe(path)}; give the path of a config.json, a folder holding one, or a dict")
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise InputError(
                f"config folder {str(path)!r} holds no config.json (give a config.json or a folder holding one)"
            )
    if not p.exists():
        raise InputError(f"config {str(path)!r}: no such file (give a config.json or a folder holding one)")
    if not p.is_file():  # /dev/zero, a pipe: read whole, it would never end
        raise InputError(f"config {str(path)!r} is not a regular file; give a config.json")
    if p.stat().st_size > _MAX_CONFIG_BYTES:
        raise InputError(
            f"config {str(path)!r} is {p.stat().st_size:,} bytes; a config.json is a few KB (at most "
            f"{_MAX_CONFIG_BYTES:,} bytes are read): give a model's config.json"
        )
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
    except ValueError as exc:  # an integer of thousands of digits
        raise InputError(f"config {str(p)!r} is not a config.json ({unreadable_json(exc)}); fix the file") from None
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


def unmodelled_activation(raw: dict[str, Any]) -> str | None:
    """The activation of a config of an analytic family when the closed form has no count for it (``None``:
    it has, or the config is no analytic family's): transformers may still build and train the model."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        return None
    act = {**DEFAULTS[family], **normalized_config(raw)}.get(_NAMING[family].act)
    return None if act in ACTIVATIONS else str(act)


def unmodelled(raw: dict[str, Any]) -> str | None:
    """What of a config of an analytic family the closed form has no count for (``None``: nothing): an
    activation outside it, or a GPT-2's cross-attention to an encoder. Transformers still builds and trains
    such a model, so a trace builds it whole."""
    act = unmodelled_activation(raw)
    if act is not None:
        return f"activation {act!r}"
    if raw.get("model_type") == "gpt2" and raw.get("add_cross_attention") is True:
        return "cross-attention (add_cross_attention)"
    return None


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


@dataclass(frozen=True, kw_only=True)
class _Naming:
    """How a family's ``config.json`` names its sizes, and which shape keys it honours."""

    hidden: str = "hidden_size"
    heads: str = "num_attention_heads"
    layers: str = "num_hidden_layers"
    act: str = "hidden_act"
    head_dim: bool = False
    """An explicit ``head_dim`` key is read (otherwise the head size is hidden / heads)."""
    rotary: tuple[str, float] | None = ("", 1.0)
    """The key of the rotary fraction of a head (and its default); ``("", 1.0)``: all of it; ``None``:
    learned positions, no rotary embedding."""
    rotary_head_dim: bool = False
    """The rotary embedding reads an explicit ``head_dim`` key though attention does not (GPT-NeoX: its
    cos/sin are that wide, and turn the first of them of each hidden / heads head)."""


_LLAMA_NAMING = _Naming(head_dim=True)
_NAMING: dict[Family, _Naming] = {
    "llama": _LLAMA_NAMING,
    "mistral": _LLAMA_NAMING,
    "qwen2": _LLAMA_NAMING,
    "mixtral": _LLAMA_NAMING,
    "gpt2": _Naming(hidden="n_embd", heads="n_head", layers="n_layer", act="activation_function", rotary=None),
    "gpt_neox": _Naming(rotary=("rotary_pct", 0.25), rotary_head_dim=True),
    "phi": _Naming(head_dim=True, rotary=("partial_rotary_factor", 0.5)),
}


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
    spec = ArchSpec(**_shape(family, cfg), **_layers(family, cfg))
    if spec.qk_layernorm and spec.head_dim * spec.num_heads != spec.hidden_size:
        raise InputError(
            f"qk_layernorm normalises hidden / heads = {spec.hidden_size // spec.num_heads} features per head, "
            f"but head_dim is {spec.head_dim}; transformers cannot run it: drop head_dim or qk_layernorm"
        )
    total = num_params(spec)
    if total > MAX_PARAMS.value:
        raise InputError(
            f"this {family} config has {total:,} parameters; at most {MAX_PARAMS.value:,} are accepted "
            f"({MAX_PARAMS.why}); check its sizes"
        )
    return spec


def _shape(family: Family, cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields every family has: sizes, heads, MLP width, tying, experts, activation, rotary width."""
    names = _NAMING[family]
    hidden = _size(cfg, names.hidden)
    heads = _size(cfg, names.heads)
    layers = _size(cfg, names.layers, MAX_LAYERS)
    vocab = _size(cfg, "vocab_size", MAX_VOCAB)
    if family == "gpt2":
        inter = 4 * hidden if cfg.get("n_inner") is None else _size(cfg, "n_inner")
    else:
        inter = _size(cfg, "intermediate_size")
    kv = heads if cfg.get("num_key_value_heads") is None else _size(cfg, "num_key_value_heads")
    head_dim = _head_dim(cfg, names, hidden, heads)
    if heads % kv:
        raise InputError(
            f"num_key_value_heads {kv} does not divide num_attention_heads {heads}; "
            "each key/value head must serve a whole number of query heads"
        )
    tied = cfg.get("tie_word_embeddings")
    if not isinstance(tied, bool):
        raise InputError(f"config key 'tie_word_embeddings' is {tied!r}; it must be true or false")
    num_experts, top_k = _experts(cfg) if family == "mixtral" else (0, 0)
    act = cfg.get(names.act)
    if act not in ACTIVATIONS:
        raise InputError(
            f"activation {act!r} is not in the closed form (accepted: {', '.join(ACTIVATIONS)}); "
            "trainledger trace --hf-config PATH --fake traces this model"
        )
    return dict(
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
        rotary_dim=_rotary_dim(cfg, names, head_dim),
        num_experts=num_experts,
        top_k=top_k,
    )


def _head_dim(cfg: dict[str, Any], names: _Naming, hidden: int, heads: int) -> int:
    if names.head_dim and cfg.get("head_dim") is not None:
        return _size(cfg, "head_dim")
    if hidden % heads:
        raise InputError(
            f"{names.heads} {heads} does not divide the hidden size {hidden}; give a head count that divides it"
        )
    return hidden // heads


def _experts(cfg: dict[str, Any]) -> tuple[int, int]:
    num_experts = _size(cfg, "num_local_experts", MAX_EXPERTS)
    top_k = _size(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise InputError(
            f"num_experts_per_tok {top_k} exceeds num_local_experts {num_experts}; give at most {num_experts}"
        )
    return num_experts, top_k


def _rotary_dim(cfg: dict[str, Any], names: _Naming, head_dim: int) -> int:
    """The width of the rotary cos/sin: the rotary fraction of the head (of an explicit ``head_dim`` where
    only the rotary embedding reads it); wider than the head, transformers cannot apply it."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise InputError(f"config key {key!r} is {cfg[key]!r}; it must be an object of rope settings, or null")
    if names.rotary is None:
        return 0
    rotary_head = head_dim
    if names.rotary_head_dim and cfg.get("head_dim") is not None:
        rotary_head = _size(cfg, "head_dim")
    dim = int(rotary_head * _rotary_fraction(cfg, names.rotary))
    if dim > head_dim:
        raise InputError(
            f"the rotary embedding is {dim} wide (head_dim {rotary_head} × the rotary fraction), wider than the "
            f"{head_dim}-wide attention heads (hidden / heads); transformers cannot apply it: drop head_dim"
        )
    if dim % 2:
        raise InputError(
            f"the rotary embedding is {dim} wide (head_dim {rotary_head} × the rotary fraction, rounded down): "
            "rotary embeddings turn features in pairs, and transformers cannot apply an odd width; give a "
            "fraction that makes it even"
        )
    return dim


def _rotary_fraction(cfg: dict[str, Any], rotary: tuple[str, float]) -> float:
    """The fraction of a head that rotary embeddings turn (``rope_parameters``, or the older ``rope_scaling``
    transformers reads it from, wins over the family's own key)."""
    key, default = rotary
    if not key:
        return 1.0
    named = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(named) or {}  # an object: _rotary_dim checked it
    where = f"{named}.partial_rotary_factor" if "partial_rotary_factor" in rope else key
    value = rope["partial_rotary_factor"] if "partial_rotary_factor" in rope else cfg.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise InputError(
            f"config key {where!r} is {value!r}; it must be the share of each head the rotary embedding turns, a "
            "number above 0 and at most 1 (e.g. 0.5)"
        )
    return float(value)


# --- what a family's layers hold ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """What a family's layers hold whatever its config says (the config's switches: ``_SWITCHES``)."""

    norm: Literal["rmsnorm", "layernorm"] = "layernorm"
    gated_mlp: bool = False
    biases: bool = True
    """The q/k/v, output and MLP linears carry a bias."""
    lm_head_bias: bool = False
    parallel_residual: bool = False
    num_norms_per_layer: int = 2
    dropouts: tuple[str | None, str | None, str | None] = ("attention_dropout", None, None)
    """The config keys of the attention, residual and embedding dropout probabilities (``None``: no dropout)."""


_ROTARY_SWIGLU = _Layout(norm="rmsnorm", gated_mlp=True, biases=False)
_LAYOUTS: dict[Family, _Layout] = {
    "llama": _ROTARY_SWIGLU,
    "mistral": _ROTARY_SWIGLU,
    "qwen2": _ROTARY_SWIGLU,
    "mixtral": _ROTARY_SWIGLU,
    "gpt2": _Layout(dropouts=("attn_pdrop", "resid_pdrop", "embd_pdrop")),
    "gpt_neox": _Layout(dropouts=("attention_dropout", "hidden_dropout", "hidden_dropout")),  # emb_dropout too
    # one LayerNorm per layer, read by attention and MLP alike; a head with a bias
    "phi": _Layout(
        lm_head_bias=True,
        parallel_residual=True,
        num_norms_per_layer=1,
        dropouts=("attention_dropout", "resid_pdrop", "embd_pdrop"),
    ),
}


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """A switch of the config: ``true``, ``false`` or absent (``"false"``, a string, is true to Python and refused
    by transformers)."""
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InputError(f"config key {key!r} is {value!r}; it must be true or false")
    return value


def _llama_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = _flag(cfg, "attention_bias", False)
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": _flag(cfg, "mlp_bias", False)}


def _window(cfg: dict[str, Any], first: int = 0) -> dict[str, Any]:
    """A sliding window (``sliding_window``, ``None``: none) over the layers from ``first`` on."""
    if cfg.get("sliding_window") is None:
        return {}
    return {"sliding_window": _size(cfg, "sliding_window", MAX_SEQ_LEN), "sliding_from": first}


def _qwen2_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's biased q/k/v; its window only with ``use_sliding_window``, in the layers from ``max_window_layers``."""
    out: dict[str, Any] = {"qkv_bias": True}
    types = cfg.get("layer_types")
    if types is not None:  # an explicit per-layer pattern (configs saved by transformers ≥ 4.53 carry one)
        sliding_layers = [i for i, t in enumerate(types)] if isinstance(types, list) else []
        sliding_layers = [i for i in sliding_layers if types[i] == "sliding_attention"]
        first = sliding_layers[0] if sliding_layers else len(types) if isinstance(types, list) else 0
        if (
            not isinstance(types, list)
            or not all(t in ("full_attention", "sliding_attention") for t in types)
            or sliding_layers != list(range(first, len(types)))
        ):
            raise InputError(
                f"config key 'layer_types' is {types!r}; modelled are full_attention layers followed by "
                "sliding_attention ones (as use_sliding_window with max_window_layers makes); trace other patterns"
            )
        if sliding_layers and _flag(cfg, "use_sliding_window", False):
            out.update(_window({"sliding_window": 4096, **cfg}, first))
        return out
    if _flag(cfg, "use_sliding_window", False):
        first = cfg.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise InputError(f"config key 'max_window_layers' is {first!r}; it must be a whole number of layers")
        out.update(_window({"sliding_window": 4096, **cfg}, first))  # the window's default, used only if switched on
    return out


def _gpt2_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    if _flag(cfg, "add_cross_attention", False):
        raise InputError(
            "config key 'add_cross_attention' is true: each layer also holds cross-attention to an encoder, which "
            "the closed form has no count for; trace --hf-config CONFIG --fake counts its weights"
        )
    return {
        "learned_positions": _size(cfg, "n_positions", MAX_SEQ_LEN),
        "upcast_attn": _flag(cfg, "reorder_and_upcast_attn", False),
    }


def _gpt_neox_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = _flag(cfg, "attention_bias", True)
    return {"qkv_bias": bias, "o_bias": bias, "parallel_residual": _flag(cfg, "use_parallel_residual", True)}


# What a family's config switches on or off, over its layout.
_SWITCHES: dict[Family, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama_switches,
    "mistral": _window,
    "mixtral": _window,
    "qwen2": _qwen2_switches,
    "gpt2": _gpt2_switches,
    "gpt_neox": _gpt_neox_switches,
    "phi": lambda cfg: {"qk_layernorm": _flag(cfg, "qk_layernorm", False)},
}


def _layers(family: Family, cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of what a family's layers hold: its layout, the config's switches, its dropouts."""
    layout = _LAYOUTS[family]
    out: dict[str, Any] = {
        "norm": layout.norm,
        "gated_mlp": layout.gated_mlp,
        "qkv_bias": layout.biases,
        "o_bias": layout.biases,
        "mlp_bias": layout.biases,
        "lm_head_bias": layout.lm_head_bias,
        "parallel_residual": layout.parallel_residual,
        "num_norms_per_layer": layout.num_norms_per_layer,
        "learned_positions": 0,
    }
    out.update(_SWITCHES.get(family, lambda cfg: {})(cfg))
    attn, resid, embd = (0.0 if key is None else _prob(cfg, key) for key in layout.dropouts)
    return {**out, "attn_dropout": attn, "resid_dropout": resid, "embd_dropout": embd}
