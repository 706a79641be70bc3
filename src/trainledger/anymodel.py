"""Any architecture ``transformers`` builds from a local config: the model class and a batch it trains on.

The analytic model knows seven decoder families (:mod:`trainledger.hf` builds those); tracing needs no
per-family code. This module builds every other architecture that ``transformers`` ships, from a local
``config.json`` and without remote code: the class is the one the config's ``architectures`` names (or the
first one of an explicit ``task``), and the batch is synthesized from the model's main input and the task's
labels — ``input_ids`` and ``labels`` for language models (``decoder_input_ids`` too for encoder–decoders),
answer spans for question answering, ``pixel_values`` with a class per image or per pixel, audio samples or
log-mel features with transcripts, image–text pairs for a contrastive model. The loss is the model's own.
Sizes are read where the config keeps them, its text and vision sub-configs included.

A config whose ``model_type`` transformers does not know and that names remote code (``auto_map``) is
refused: ``trust_remote_code`` is never set. ``auto_map`` beside a known ``model_type`` and a
``quantization_config`` are ignored, and :attr:`AnyConfig.notes` says so in one line each.

Example:
    >>> cfg = load_any_config({"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 512,
    ...     "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64})
    >>> cfg.task, cfg.class_name
    ('masked-lm', 'BertForMaskedLM')
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from trainledger.analytic import Setup, load_config_file
from trainledger.checks import instance_of, whole_number
from trainledger.errors import InputError
from trainledger.hf import (
    config_errors,
    config_rejected,
    declare_unpacked,
    import_transformers,
    optimizer_factory,
    quiet_transformers,
)
from trainledger.trace import EmptyWeights
from trainledger.workload import Workload

_Built = TypeVar("_Built")

TASKS: dict[str, str] = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "semantic-segmentation": "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "contrastive": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
"""The tasks a batch can be synthesized for, each with its ``model_type → classes`` table in transformers
(``contrastive``: image–text models such as CLIP and SigLIP, trained with their own contrastive loss). Without
``architectures`` or ``task`` the first task that has a class for the config's ``model_type`` is taken, in this
order."""

PIXEL_TASKS = frozenset({"image-classification", "semantic-segmentation", "contrastive"})
"""Tasks whose inputs include images (``--image-size`` applies)."""
IMAGE_ONLY_TASKS = frozenset({"image-classification", "semantic-segmentation"})
"""Tasks that read no sequence (``--seq-len`` does not apply; for audio it is the encoder's frames)."""

_DROPPED_KEYS = ("auto_map", "quantization_config", "torch_dtype", "dtype", "attn_implementation", "architectures")


@dataclass(frozen=True, kw_only=True)
class AnyConfig:
    """A local config that transformers can build, and the task it is trained on."""

    raw: dict[str, Any]
    """The config as read (``model_type`` and every size)."""
    task: str
    """A key of :data:`TASKS`."""
    class_name: str
    """The transformers class that ``task`` builds for this ``model_type``."""
    source: str
    """The file it was read from (empty for a dict)."""
    notes: tuple[str, ...] = ()
    """What of the config is ignored, one line each (``auto_map``, ``quantization_config``)."""

    @property
    def model_type(self) -> str:
        return str(self.raw["model_type"])

    @property
    def name(self) -> str:
        return f"{self.model_type}:{Path(self.source).stem if self.source else 'config'}"


def _task_table(task: str) -> dict[str, tuple[str, ...]]:
    """``model_type → classes`` of one task (transformers names one class, or several: DeiT's with a teacher)."""
    from transformers.models.auto import modeling_auto

    table = getattr(modeling_auto, TASKS[task], {})
    return {k: (v,) if isinstance(v, str) else tuple(v) for k, v in table.items()}


def _choose_task(tf: Any, raw: dict[str, Any], task: str | None) -> tuple[str, str]:
    """The task and class: the one asked for, or the one ``architectures`` names, or the first with a class."""
    model_type = raw["model_type"]
    tables = {t: _task_table(t) for t in TASKS}
    offered = [t for t in TASKS if model_type in tables[t]]
    if task is not None:
        if task not in TASKS:
            raise InputError(f"unknown task {task!r}; accepted: {', '.join(TASKS)}")
        if task not in offered:
            raise InputError(
                f"transformers has no {task} model for model_type {model_type!r}; "
                f"accepted for it: {', '.join(offered) or 'none of ' + ', '.join(TASKS)}"
            )
        return task, tables[task][model_type][0]
    named = raw.get("architectures") or []
    named = [n for n in named if isinstance(n, str)] if isinstance(named, list) else []
    for class_name in named:
        for t in offered:
            if class_name in tables[t][model_type]:
                return t, class_name
    if named:
        raise _architectures_error(tf, named, model_type, tables, offered)
    if not offered:
        raise InputError(f"model_type {model_type!r} has no model for any of the tasks {', '.join(TASKS)}")
    return offered[0], tables[offered[0]][model_type][0]


def _architectures_error(
    tf: Any, named: list[str], model_type: str, tables: dict[str, dict[str, tuple[str, ...]]], offered: list[str]
) -> InputError:
    """Why no class the config's ``architectures`` names can be built for its ``model_type``."""
    tasks = f"give --task, one of: {', '.join(offered) or 'none for ' + repr(model_type)}"
    missing = [n for n in named if not hasattr(tf, n)]
    if missing:
        return InputError(
            f"transformers {tf.__version__} has no model class {missing[0]!r} (the config's architectures); "
            f"give a class it ships, or drop architectures and {tasks}"
        )
    # the model types transformers builds that class for, the one its name starts with first
    other = sorted(
        {m for t in TASKS for m, classes in tables[t].items() if named[0] in classes},
        key=lambda m: (not named[0].lower().startswith(m.replace("_", "").replace("-", "")), m),
    )
    if other and model_type not in other:
        types = " or ".join(repr(m) for m in other[:3]) + (" or others" if len(other) > 3 else "")
        return InputError(
            f"the config's architectures name {named[0]!r}, a class of model_type {types}, but its model_type is "
            f"{model_type!r}: give a config whose model_type and architectures agree, or drop architectures "
            f"and {tasks}"
        )
    return InputError(f"architecture {named[0]!r} is none of the tasks a batch can be made for; {tasks}")


def load_any_config(path: str | Path | dict[str, Any], *, task: str | None = None) -> AnyConfig:
    """Read a config that transformers can build without remote code, and choose its task.

    Raises :class:`InputError` for a config without ``model_type``, an architecture transformers does not
    know (remote code is never run), and a task the architecture has no model for.
    """
    raw = dict(path) if isinstance(path, dict) else load_config_file(path)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise InputError("config is missing key 'model_type'; give the model_type transformers names it by")
    tf = import_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        if raw.get("auto_map"):
            raise InputError(
                f"model_type {model_type!r} exists only as remote code (auto_map); trainledger never runs remote "
                "code: give a config of an architecture transformers ships"
            )
        raise InputError(
            f"unknown architecture: transformers {tf.__version__} has no model_type {model_type!r}; "
            "give the model_type of an architecture it ships (bert, t5, vit, llama, ...)"
        )
    _check_values(raw)
    chosen, class_name = _choose_task(tf, raw, task)
    return AnyConfig(
        raw=raw,
        task=chosen,
        class_name=class_name,
        source="" if isinstance(path, dict) else str(path),
        notes=_notes(raw),
    )


# Sizes a model cannot have fewer than one of (transformers builds some with 0 and trains nothing real), or a list
# of them (one per stage of a hierarchical model): checked in the config and in its sub-configs (a text, vision,
# encoder or decoder part)
_AT_LEAST_ONE = (
    "num_attention_heads num_heads n_head num_hidden_layers num_layers n_layer hidden_size d_model n_embd "
    "intermediate_size d_ff d_kv vocab_size encoder_layers decoder_layers encoder_attention_heads "
    "decoder_attention_heads num_key_value_heads"
).split()


def _check_values(raw: dict[str, Any], where: str = "") -> None:
    """One line for a size below one or not a whole number, ``architectures`` that is not a list of class names,
    and a ``torch_dtype`` torch does not have; sub-configs (``text_config``...) are checked the same way."""
    for key in _AT_LEAST_ONE:
        value = raw.get(key)
        for v in value if isinstance(value, list) else [] if value is None else [value]:  # per stage: SegFormer
            whole_number(v, f"{where}{key} in the config")
    names = raw.get("architectures")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise InputError(f"{where}architectures in the config is {names!r}; give a list of class names")
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    if isinstance(dtype, str) and dtype != "auto" and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise InputError(f"{where}torch_dtype {dtype!r} in the config is no dtype torch has (float32, bfloat16, ...)")
    for key, value in raw.items():
        if key.endswith("_config") and isinstance(value, dict) and not where:
            _check_values(value, f"{key}.")


def _notes(raw: dict[str, Any]) -> tuple[str, ...]:
    notes = []
    if raw.get("auto_map"):
        notes.append(f"auto_map ignored: built with transformers' own {raw['model_type']} classes, no remote code")
    if raw.get("quantization_config"):
        method = (raw["quantization_config"] or {}).get("quant_method", "its method")
        notes.append(f"quantization_config ignored: weights are traced in the step's dtype, not quantized ({method})")
    return tuple(notes)


def _transformers_config(cfg: AnyConfig, attn_impl: str, image_size: int | None) -> Any:
    tf = import_transformers()
    # a copy: transformers edits nested dicts (rope_scaling) in place, and cfg.raw is the user's
    kwargs = {k: copy.deepcopy(v) for k, v in cfg.raw.items() if k not in (*_DROPPED_KEYS, "model_type")}
    if image_size is not None and "vision_config" not in kwargs:
        kwargs["image_size"] = _like_its_own(_image_size_of(tf, cfg), image_size)
    with quiet_transformers():
        try:
            config = tf.AutoConfig.for_model(cfg.model_type, **kwargs)
        except config_errors() as exc:
            raise config_rejected(cfg.model_type, exc) from exc
    if image_size is not None and getattr(config, "vision_config", None) is not None:
        config.vision_config.image_size = image_size  # an image–text model's sizes live in its sub-configs
    config.use_cache = False  # a training step keeps no key/value cache
    config._attn_implementation = attn_impl
    return config


def _image_size_of(tf: Any, cfg: AnyConfig) -> Any:
    """The image size the config gives, or its class's default: an int, or (Hiera, Swin v2's some) ``[h, w]``."""
    if "image_size" in cfg.raw:
        return cfg.raw["image_size"]
    with quiet_transformers():
        try:
            return getattr(tf.AutoConfig.for_model(cfg.model_type), "image_size", None)
        except config_errors():
            return None


def _like_its_own(own: Any, side: int) -> Any:
    """``side`` pixels per side in the form the config keeps its image size: ``[side, side]`` where it keeps a
    list (HieraConfig refuses an int), else ``side``."""
    return [side] * len(own) if isinstance(own, (list, tuple)) else side


_POSITIONS = ("max_position_embeddings", "n_positions", "max_target_positions", "max_seq_len")


def max_positions(cfg: AnyConfig) -> int | None:
    """The most tokens the architecture takes (its text model's positions: BERT's 512, Whisper's decoder's
    448), or ``None`` where nothing bounds them (T5's relative positions)."""
    config = _transformers_config(cfg, "eager", None)
    for where in (config.get_text_config(), config):
        for name in _POSITIONS:
            value = getattr(where, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _no_init(mode: Any) -> contextlib.AbstractContextManager[Any]:
    """On fake tensors initial values mean nothing, and some initialisers (ViT's truncated normal) read
    values, which fake tensors cannot give: transformers' own switch skips them."""
    if mode is None:
        return contextlib.nullcontext()
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def build_any_model(
    cfg: AnyConfig,
    *,
    dtype: torch.dtype = torch.float32,
    attn_impl: str = "sdpa",
    image_size: int | None = None,
    mode: Any = None,
    seed: int = 0,
) -> nn.Module:
    """The task's model of ``cfg`` in training mode: under ``mode`` (a ``FakeTensorMode``, or
    :class:`~trainledger.trace.EmptyWeights`: weights on ``meta``) or for real on the CPU.

    An architecture without SDPA attention is built with its eager attention instead.
    """
    tf = import_transformers()
    model_class = getattr(tf, cfg.class_name)
    if mode is None:
        torch.manual_seed(seed)
    for impl in (attn_impl, "eager"):
        config = _transformers_config(cfg, impl, image_size)
        with quiet_transformers(), mode if mode is not None else contextlib.nullcontext(), _no_init(mode):
            try:
                model = model_class._from_config(config, dtype=dtype)
                _cast_bare_parameters(model, dtype)
                if mode is not None:
                    model.tie_weights()  # initialisation, skipped on fake tensors, is where weights are tied
            except ValueError as exc:
                if impl != "eager" and "attention" in str(exc).lower():
                    continue  # no SDPA path for this architecture
                raise InputError(f"transformers cannot build {cfg.class_name}: {one_line(exc)}") from exc
            except RuntimeError as exc:
                if reads_values(exc):
                    raise  # read a value while built: build_fake builds it again without weights
                raise InputError(f"transformers cannot build {cfg.class_name}: {one_line(exc)}") from exc
            except (AssertionError, TypeError, KeyError, IndexError, AttributeError) as exc:
                # a config transformers accepts but its modules do not (a pad token outside the vocabulary)
                said = one_line(exc)
                if isinstance(exc, KeyError):  # a bare key ('evil'): a name the config gives that it has no entry for
                    said = f"{said} is a name transformers has no entry for (an activation, a rope type, ...)"
                raise InputError(f"transformers cannot build {cfg.class_name} from this config: {said}") from exc
        model.train()
        return model
    raise AssertionError("unreachable: eager attention is always tried last")


def _cast_bare_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters made as ``nn.Parameter(torch.FloatTensor(...))`` (XLNet's relative attention) ignore the dtype
    ``_from_config`` builds in and stay fp32, and the step then mixes dtypes and fails: they are cast to ``dtype``,
    as ``model.to(dtype)`` would, except in the modules the model keeps in fp32 itself
    (``_keep_in_fp32_modules``)."""
    if dtype == torch.float32:
        return
    keep = {
        *(getattr(model, "_keep_in_fp32_modules", None) or ()),
        *(getattr(model, "_keep_in_fp32_modules_strict", None) or ()),
    }
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype == torch.float32 and not keep.intersection(name.split(".")):
            p.data = p.data.to(dtype)


# --- one stack of blocks: the depth a stacked trace builds at -------------------------------------------


@dataclass(frozen=True)
class Depth:
    """The config key that sets the depth of an architecture's one stack of blocks, and the depth."""

    key: str
    """``num_hidden_layers``, or the name the config class keeps it under (``n_layer``, ``num_layers``)."""
    num_layers: int
    uneven: str | None
    """Why the config's layers are not all alike (a per-layer list with different entries), or ``None``."""


def depth_of(cfg: AnyConfig) -> Depth | None:
    """How deep the architecture's stack of blocks is, and under which key; ``None`` for a model with several
    stacks of their own sizes (an image–text model's towers) or none.

    Example:
        >>> depth_of(load_any_config({"model_type": "bert", "num_hidden_layers": 24}))
        Depth(key='num_hidden_layers', num_layers=24, uneven=None)
    """
    config = _transformers_config(cfg, "eager", None)
    if getattr(config, "sub_configs", None):
        return None
    num_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        return None
    key = type(config).attribute_map.get("num_hidden_layers", "num_hidden_layers")
    if key not in cfg.raw and "num_hidden_layers" in cfg.raw:
        key = "num_hidden_layers"
    if not _settable(config, key, num_layers):
        return None  # a depth derived from other settings (Funnel's block_sizes): no one key sets it
    uneven = next(
        (
            f"its layers differ ({name})"
            for name, value in vars(config).items()
            if isinstance(value, list | tuple) and len(value) == num_layers > 1 and len({repr(v) for v in value}) > 1
        ),
        None,
    )
    return Depth(key, num_layers, uneven)


def _settable(config: Any, key: str, value: int) -> bool:
    """Whether ``config``'s class lets ``key`` be set (Funnel's ``num_hidden_layers`` is the sum of its
    ``block_sizes``, and setting it raises)."""
    try:
        setattr(copy.copy(config), key, value)
    except (NotImplementedError, AttributeError):  # Funnel's setter raises; a property without one, the other
        return False
    return True


_STAGE_KEYS = frozenset({"out_features", "out_indices", "stage_names"})
"""A backbone's outputs, named by layer (``stage24``): only a ``...Backbone`` class reads them, and a config class
fills them in by default (BEiT's, DINOv2's), so at another depth they name layers that are not there."""


def at_depth(cfg: AnyConfig, depth: Depth, blocks: int) -> AnyConfig:
    """``cfg`` with ``blocks`` layers (per-layer lists, all alike, cut to length; a classifier's unread backbone
    outputs dropped); notes kept once."""
    unread = _STAGE_KEYS if not cfg.class_name.endswith("Backbone") else frozenset()
    raw = {
        k: v[:blocks] if isinstance(v, list) and len(v) == depth.num_layers else v
        for k, v in cfg.raw.items()
        if k not in unread
    }
    raw[depth.key] = blocks
    return replace(cfg, raw=raw)


_SMALL_WIDTHS: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "projection_dim", "projection_size"), 64),
    **dict.fromkeys(("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner"), 128),
    **dict.fromkeys(("num_attention_heads", "num_heads", "n_head", "n_heads", "encoder_attention_heads"), 4),
    "decoder_attention_heads": 4,
    **dict.fromkeys(("head_dim", "d_kv"), 16),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 64),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "top_k"), 2),
}
"""A small instance's widths, by the names configs keep them under (the text and vision sub-configs' too): a
real step of the architecture runs here in seconds at these."""
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
"""The names configs give their key–value heads (Llama's, Falcon's, ChatGLM's)."""
_SMALL_VOCAB = 512
_SMALL_DEPTH = 3
_OTHER_DEPTH_KEYS = ("num_decoder_layers", "encoder_layers", "decoder_layers", "num_hidden_layers", "n_layers")
"""Depths of other stacks (an encoder–decoder's second, a sub-config's), cut to :data:`_SMALL_DEPTH` too."""


def _narrowed(raw: dict[str, Any], *, widths: bool = True) -> dict[str, Any]:
    """``raw`` with every stack's depth cut to :data:`_SMALL_DEPTH` and (``widths``) the widths of
    :data:`_SMALL_WIDTHS` where it sets them larger, key–value heads in the same ratio to the heads, a vocabulary
    of 512 that still holds every special token; its sub-configs alike."""
    out = dict(raw)
    for key in _OTHER_DEPTH_KEYS:
        depth = raw.get(key)
        if isinstance(depth, int) and not isinstance(depth, bool) and depth > _SMALL_DEPTH:
            out[key] = _SMALL_DEPTH
    if raw.get("attention_type") == "block_sparse":
        # BigBird runs full attention on a sequence of at most (5 + 2 x random blocks) x block_size tokens, with
        # modules of its own: blocks small enough that a small instance's sequence still takes the sparse path
        out.update(block_size=2, num_random_blocks=1)
    for key, value in raw.items():
        if key.endswith("_config") and isinstance(value, dict):
            out[key] = _narrowed(value, widths=widths)
    if not widths:
        return out
    for key, small in _SMALL_WIDTHS.items():
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > small:
            out[key] = small
    for head_key in ("num_attention_heads", "n_head"):
        heads = raw.get(head_key)
        if not isinstance(heads, int) or heads <= 0 or out[head_key] == heads:
            continue
        for kv_key in _KV_HEADS:  # grouped-query attention: key-value heads in the same ratio to the heads
            kv = raw.get(kv_key)
            if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0:
                out[kv_key] = max(1, out[head_key] * kv // heads)
    special = [v for k, v in raw.items() if k.endswith("_token_id") and isinstance(v, int) and not isinstance(v, bool)]
    vocab = raw.get("vocab_size")
    if isinstance(vocab, int) and vocab > _SMALL_VOCAB and max(special, default=0) < _SMALL_VOCAB:
        out["vocab_size"] = _SMALL_VOCAB
    return out


def _changes(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """The settings ``after`` sets otherwise than ``before``, sub-configs' by their dotted names."""
    out: list[tuple[str, Any]] = []
    for key, value in after.items():
        if isinstance(value, dict) and isinstance(before.get(key), dict):
            out += _changes(before[key], value, f"{prefix}{key}.")
        elif value != before.get(key):
            out.append((f"{prefix}{key}", value))
    return out


def small_instance(cfg: AnyConfig) -> tuple[AnyConfig, str]:
    """``cfg``'s architecture 3 blocks deep and narrow (see :data:`_SMALL_WIDTHS`), its other settings kept: a
    real instance on which a plan made at full size can be run and its gradients compared. Where the narrow
    config does not build and run a forward on the meta device where the shallow one does (widths some other
    setting depends on), only the depths are cut. Returns the config and what it is, in words.

    Example:
        >>> cfg = load_any_config({"model_type": "bert", "architectures": ["BertForMaskedLM"],
        ...     "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096})
        >>> small, what = small_instance(cfg)
        >>> small.raw["hidden_size"], small.raw["num_hidden_layers"], what
        (64, 3, '3 blocks deep, hidden_size 64, num_attention_heads 4, intermediate_size 128')
    """
    depth = depth_of(cfg)
    stack = at_depth(cfg, depth, min(_SMALL_DEPTH, depth.num_layers)) if depth is not None else cfg
    shallow = replace(stack, raw=_narrowed(stack.raw, widths=False))
    narrow = replace(stack, raw=_narrowed(stack.raw))
    cut = [f"{k} {v}" for k, v in _changes(stack.raw, shallow.raw)]
    deep = f"{stack.raw[depth.key]} blocks deep" if depth is not None else ", ".join(cut) or "its depth the config's"
    widths = [f"{k} {v}" for k, v in _changes(shallow.raw, narrow.raw)]
    # the narrow config is kept unless it fails where the shallow one does not (a forward may fail on the meta
    # device for reasons of its own, as a read of a random draw: then neither says anything of the widths)
    if widths and not _forward_runs(narrow) and _forward_runs(shallow):
        return shallow, f"{deep}, its widths the config's (a narrower one does not run)"
    return narrow, ", ".join([deep, *widths])


def _forward_runs(cfg: AnyConfig) -> bool:
    """Whether the task's model of ``cfg`` builds and runs a forward to its loss on the meta device (shapes only,
    nothing computed): widths that another setting depends on fail here."""
    try:
        model = skeleton(cfg)
        batch = _batch(cfg, model, Setup(micro_batch=1, seq_len=8), torch.float32, torch.device("meta"), 0)
        with torch.no_grad(), quiet_transformers():
            out = model(**batch)
        return getattr(out, "loss", None) is not None
    except Exception:  # any failure of the model's own code: this config does not run
        return False


def skeleton(cfg: AnyConfig, *, dtype: torch.dtype = torch.float32, image_size: int | None = None) -> nn.Module:
    """The task's model of ``cfg`` on the meta device: its modules, no memory, nothing run."""
    return build_any_model(cfg, dtype=dtype, image_size=image_size, mode=torch.device("meta"))


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line, at most 300 characters (its type's name where it has none)."""
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def default_seq_len(cfg: AnyConfig, wanted: int) -> int:
    """``wanted`` tokens, or fewer when the architecture has fewer positions (BERT's 512)."""
    positions = max_positions(cfg)
    return wanted if positions is None else min(wanted, positions)


def _check_step(cfg: AnyConfig, setup: Setup, image_size: int | None, fake: bool) -> None:
    """What the step of an architecture outside the analytic families cannot take."""
    if not isinstance(fake, bool):
        raise InputError(f"fake {fake!r} must be True or False")
    unsupported = {
        "lora_rank": setup.lora_rank,
        "reference": setup.reference,
        "remat": setup.remat != "none",
        "tensor_parallel": setup.tensor_parallel > 1,
        "pipeline_parallel": setup.pipeline_parallel > 1,
    }
    given = [k for k, v in unsupported.items() if v]
    if given:
        raise InputError(
            f"{', '.join(given)}: only for the analytic families' causal-LM step; a {cfg.model_type} "
            f"{cfg.task} step is traced plain: drop {'it' if len(given) == 1 else 'them'}"
        )
    if image_size is not None and (not isinstance(image_size, int) or image_size < 1):
        raise InputError(f"image size {image_size!r} must be a whole number of pixels above 0, e.g. 224")
    if image_size is not None and cfg.task not in PIXEL_TASKS:
        raise InputError(f"image size applies to tasks that read images; a {cfg.task} step reads none: drop it")
    positions = None if cfg.task in IMAGE_ONLY_TASKS else max_positions(cfg)
    if positions is not None and setup.seq_len > positions:
        raise InputError(
            f"sequence length {setup.seq_len:,} is above the {positions:,} positions of this {cfg.model_type} "
            "config; give at most that"
        )


@dataclass(frozen=True)
class _Draw:
    """Values of the batch: random for a real build, zeros made in ``mode`` for a fake one (the same shapes)."""

    mode: Any
    gen: torch.Generator
    dtype: torch.dtype

    def ints(self, shape: tuple[int, ...], high: int, low: int = 0) -> torch.Tensor:
        if self.mode is not None:
            return torch.zeros(shape, dtype=torch.long)
        return torch.randint(low, max(high, low + 1), shape, generator=self.gen)

    def floats(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        return (
            torch.zeros(shape, dtype=dtype)
            if self.mode is not None
            else torch.randn(shape, generator=self.gen).to(dtype)
        )


def _image_side(config: Any) -> tuple[int, int, int]:
    """Channels, height and width of the images a (vision) config takes (square unless it names two sides)."""
    size = getattr(config, "image_size", None) or 224
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return getattr(config, "num_channels", 3), height, width


def _audio(model: nn.Module, setup: Setup, draw: _Draw) -> dict[str, torch.Tensor]:
    """Audio inputs: raw samples (``input_values``, as many as make ``seq_len`` frames after a wav2vec2-style
    convolutional front end; for the Audio Spectrogram Transformer a spectrogram of its window) or log-mel
    features (``input_features``: Whisper's fixed 30-second window, or
    ``seq_len`` frames of filterbank features)."""
    config, b, t = model.config, setup.micro_batch, setup.seq_len
    mels = getattr(config, "num_mel_bins", None)
    frames = getattr(config, "max_length", None)
    if model.main_input_name == "input_values" and mels and isinstance(frames, int):
        # the Audio Spectrogram Transformer: a spectrogram of its fixed window, frames by mel bins (its position
        # embeddings are sized for that many frames)
        return {"input_values": draw.floats((b, frames, mels))}
    if model.main_input_name == "input_values":
        hop = math.prod(getattr(config, "conv_stride", None) or (1,))
        return {"input_values": draw.floats((b, t * hop))}
    if mels and getattr(config, "max_source_positions", None):  # Whisper: 2 frames per encoder position
        return {"input_features": draw.floats((b, mels, 2 * config.max_source_positions))}
    width = getattr(config, "input_feat_per_channel", None) or mels or getattr(config, "feature_size", None)
    if not width:
        raise InputError(
            f"{type(model).__name__} takes input_features whose shape its config does not name; "
            "trainledger cannot synthesize them: give --model file.py:factory with a batch of your own"
        )
    return {"input_features": draw.floats((b, t, width * getattr(config, "input_channels", 1)))}


def _token_ids(config: Any, task: str, setup: Setup, draw: _Draw) -> torch.Tensor:
    """Random token ids; an encoder–decoder classifier reads the state at each row's one end-of-sequence token
    (BART's), so there each row ends with it and holds it nowhere else."""
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        # CANINE reads Unicode code points and hashes them: no vocabulary to draw from
        raise InputError(
            f"{type(config).__name__} has no vocab_size to draw token ids from; trace it with --model file.py:factory "
            "and a batch of your own"
        )
    eos = getattr(config, "eos_token_id", None)
    if not (task == "sequence-classification" and config.is_encoder_decoder and isinstance(eos, int)):
        return draw.ints((setup.micro_batch, setup.seq_len), vocab)
    ids = draw.ints((setup.micro_batch, setup.seq_len - 1), vocab - 1)
    ids = ids + (ids >= eos).long()  # every id but eos
    return torch.cat([ids, torch.full((setup.micro_batch, 1), eos, dtype=torch.long)], dim=1)


def _inputs(model: nn.Module, task: str, setup: Setup, draw: _Draw) -> dict[str, Any]:
    """What the model reads: token ids, images, audio, or (``contrastive``) token ids and images."""
    config, b = model.config, setup.micro_batch
    name = model.main_input_name
    if name in ("input_values", "input_features"):
        return _audio(model, setup, draw)
    vision = getattr(config, "vision_config", None) or config
    pixels = {"pixel_values": draw.floats((b, *_image_side(vision)))}
    if name == "pixel_values":
        return pixels
    if name != "input_ids":
        raise InputError(
            f"{type(model).__name__} reads {name!r}, which trainledger cannot synthesize; "
            "give --model file.py:factory with a batch of your own"
        )
    ids = {"input_ids": _token_ids(config, task, setup, draw)}
    if task == "contrastive":  # image–text pairs; the model computes its own contrastive loss when asked
        return {**ids, **pixels, "return_loss": True}
    return ids


def _class_labels(config: Any, draw: _Draw, b: int) -> torch.Tensor:
    """One label per example: a class, or a float for regression (one label) and multi-label problems."""
    if config.problem_type == "multi_label_classification":
        return draw.floats((b, config.num_labels), torch.float32)
    if config.num_labels == 1 or config.problem_type == "regression":
        return draw.floats((b,), torch.float32)
    return draw.ints((b,), config.num_labels)


def _targets(model: nn.Module, task: str, inputs: dict[str, Any], setup: Setup, draw: _Draw) -> dict[str, Any]:
    """The labels of the task (its model computes the loss from them)."""
    config, b, t = model.config, setup.micro_batch, setup.seq_len
    if task in ("causal-lm", "masked-lm"):  # every position (shifted inside for a causal LM)
        return {"labels": inputs["input_ids"]}
    if task in ("seq2seq", "speech-seq2seq"):  # the decoder's targets; its inputs, shifted, beside them
        targets = draw.ints((b, t), config.get_text_config().vocab_size)
        return {"decoder_input_ids": targets, "labels": targets}
    if task in ("sequence-classification", "image-classification", "audio-classification"):
        return {"labels": _class_labels(config, draw, b)}
    if task == "token-classification":
        return {"labels": draw.ints((b, t), config.num_labels)}
    if task == "question-answering":
        return {"start_positions": draw.ints((b,), t), "end_positions": draw.ints((b,), t)}
    if task == "semantic-segmentation":  # a class per pixel, at the images' size
        _, height, width = inputs["pixel_values"].shape[1:]
        return {"labels": draw.ints((b, height, width), config.num_labels)}
    if task == "ctc":  # transcripts of half as many tokens as frames; 0 is CTC's blank (the padding token)
        return {"labels": draw.ints((b, max(1, t // 2)), config.vocab_size, low=1)}
    return {}  # contrastive: the pairs are their own targets


def _batch(cfg: AnyConfig, model: nn.Module, setup: Setup, dtype: torch.dtype, mode: Any, seed: int) -> dict[str, Any]:
    """The task's inputs and labels: random for a real build, zeros made in ``mode`` (a ``FakeTensorMode`` or the
    meta device) for a fake one (same shapes)."""
    draw = _Draw(mode, torch.Generator().manual_seed(seed), dtype)
    with mode if mode is not None else contextlib.nullcontext():
        inputs = _inputs(model, cfg.task, setup, draw)
        return {**inputs, **_targets(model, cfg.task, inputs, setup, draw)}


def workload_from_any_config(
    config: str | Path | dict[str, Any] | AnyConfig,
    setup: Setup,
    *,
    task: str | None = None,
    image_size: int | None = None,
    fake: bool = False,
    seed: int = 0,
) -> Workload:
    """One training step of any architecture transformers builds from a local config, ready for
    :func:`trainledger.trace.trace`.

    Arguments:
        config: a ``config.json``, a folder holding one, the config as a dict, or a loaded :class:`AnyConfig`.
        setup: micro-batch, sequence length (text tasks), precision recipe, optimizer and attention
            implementation; LoRA, a reference model, recomputation and model parallelism are refused.
        task: a key of :data:`TASKS` (default: from ``architectures``).
        image_size: pixels per side for image classification (default: the config's ``image_size``).
        fake: build for a fake trace (full size, nothing allocated): under ``FakeTensorMode``, or with its
            weights on ``meta`` where the model reads tensor values while it is built (see :func:`build_fake`).
        seed: seeds the weights and the batch of a real build.

    Example:
        >>> cfg = {"model_type": "t5", "vocab_size": 256, "d_model": 32, "d_kv": 8, "d_ff": 64,
        ...        "num_layers": 2, "num_heads": 4}
        >>> w = workload_from_any_config(cfg, Setup(micro_batch=2, seq_len=16), fake=True)
        >>> sorted(w.batch), w.name
        (['decoder_input_ids', 'input_ids', 'labels'], 't5:config')
    """
    cfg = config if isinstance(config, AnyConfig) else load_any_config(config, task=task)
    setup = instance_of(setup, Setup, "setup", "give a trainledger.Setup(micro_batch=..., seq_len=..., ...)")
    _check_step(cfg, setup, image_size, fake)
    dtype = getattr(torch, setup.weight_dtype)
    build = partial(build_any_model, cfg, dtype=dtype, attn_impl=setup.attn_impl, image_size=image_size, seed=seed)
    model, made_in = build_fake(lambda mode: build(mode=mode)) if fake else (build(), None)
    if fake:
        declare_unpacked(model)
    batch = _batch(cfg, model, setup, dtype, made_in, seed)
    return Workload(model, batch, optimizer=optimizer_factory(setup), name=cfg.name)


_READS_VALUES = ("DataDependentOutputException", "DynamicOutputShapeException")


def reads_values(exc: BaseException) -> bool:
    """Whether ``exc`` is a fake tensor refusing to give a value (what :func:`build_fake` builds again for)."""
    return type(exc).__name__ in _READS_VALUES


def build_fake(build: Callable[[Any], _Built]) -> tuple[_Built, Any]:
    """``build(mode)`` under a ``FakeTensorMode``, and the mode; a model that reads a tensor's value while it is
    built (``torch.linspace(0, rate, depth).item()``, which fake tensors cannot give) is built again under
    :class:`~trainledger.trace.EmptyWeights`, its weights on ``meta``, and comes with the meta device, where its
    batch is made. Either traces with ``trace(workload, fake=True)``.

    A model that reads the value of one of its weights, or of a buffer too large to stay real, is one line.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        return build(mode), mode
    except RuntimeError as exc:
        if not reads_values(exc):
            raise
    try:
        return build(EmptyWeights()), torch.device("meta")
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc):
            raise
        raise InputError(
            "the model reads the values of its weights while it is built, which a build without them (on the "
            f"meta device) cannot give ({' '.join(str(exc).split())[:200]}): trace it without --fake"
        ) from None
