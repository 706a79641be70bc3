"""A Hugging Face config traced a few blocks deep and extended to its layer count (``trace --hf-config --fake``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainledger.hf import HFConfig, load_hf_config
from trainledger.ledger import Category, Ledger
from trainledger.trace import trace_stacked
from trainledger.workload import Workload

BuildAt = Callable[[HFConfig], Workload]
"""Builds the step's workload from a config, with every other step setting fixed."""


def _layer_key(family: str) -> str:
    return "n_layer" if family == "gpt2" else "num_hidden_layers"


def _uneven_layers(raw: dict[str, Any], num_layers: int) -> str | None:
    """Why the config's layers are not all alike (per-layer settings), or ``None``."""
    for key, value in raw.items():
        if isinstance(value, list) and len(value) == num_layers and len({repr(v) for v in value}) > 1:
            return f"its layers differ ({key})"
    window_layers = raw.get("max_window_layers")
    if raw.get("use_sliding_window") and isinstance(window_layers, int) and 0 < window_layers < num_layers:
        return f"its first {window_layers} layers attend through a sliding window, the others do not"
    return None


def _at_depth(raw: dict[str, Any], key: str, num_layers: int, depth: int) -> dict[str, Any]:
    """The config with ``depth`` layers (per-layer lists, all alike, cut to length)."""
    out = {k: v[:depth] if isinstance(v, list) and len(v) == num_layers else v for k, v in raw.items()}
    out[key] = depth
    return out


def trace_hf_stacked(
    path: str | Path,
    build_at: BuildAt,
    *,
    progress: Any = None,
    kernel_kind: str = "cpu",
    cuda_device: Any = None,
    world_size: int = 1,
) -> tuple[Ledger, int]:
    """Trace the config's step on fake tensors, a few blocks deep, extended to its layer count (see
    :func:`trainledger.trace.trace_stacked`); a config whose layers differ is traced whole. ``kernel_kind``
    and ``cuda_device`` as for :func:`trainledger.trace.trace`.

    Returns the ledger and the number of parameters, trainable and frozen, counted from its weights since
    no full-depth model is built."""
    cfg = load_hf_config(path)
    num_layers = cfg.spec.num_layers
    key = _layer_key(cfg.spec.family)
    uneven = _uneven_layers(cfg.raw, num_layers)

    def build(depth: int) -> Workload:
        if depth == num_layers:
            return build_at(cfg)
        # the same source, so that the workload is named after the config as a full-depth build is
        return build_at(replace(load_hf_config(_at_depth(cfg.raw, key, num_layers, depth)), source=cfg.source))

    ledger = trace_stacked(
        build,
        num_layers,
        fake=True,
        progress=progress,
        differs=uneven,
        kernel_kind=kernel_kind,  # type: ignore[arg-type]
        cuda_device=cuda_device,
        world_size=world_size,
    )
    return ledger, weights_numel(ledger)


def weights_numel(ledger: Ledger) -> int:
    """The parameters, trainable and frozen, counted from a ledger's weights: a stacked trace builds no
    full-depth model to count them on."""
    return sum(e.numel for e in ledger.entries if e.category in (Category.WEIGHTS, Category.FROZEN))


SMALL_WIDTHS: dict[str, int] = {
    "hidden_size": 64,
    "n_embd": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "vocab_size": 512,
    "head_dim": 16,
}
"""A small instance's widths: what a real step runs here in well under a second."""
_SMALL_HEADS = 4
SMALL_DEPTH = 3


def small_config(path: str | Path) -> HFConfig:
    """The config's architecture, 3 blocks deep and narrow (its other settings kept), named as the config:
    a real instance on which a plan made at full size can be run and its gradients compared."""
    cfg = load_hf_config(path)
    raw = _at_depth(cfg.raw, _layer_key(cfg.spec.family), cfg.spec.num_layers, min(SMALL_DEPTH, cfg.spec.num_layers))
    raw.update({k: v for k, v in SMALL_WIDTHS.items() if raw.get(k) is not None})
    for heads in ("num_attention_heads", "n_head"):
        if raw.get(heads):
            kv = raw.get("num_key_value_heads") or raw[heads]
            raw[heads] = _SMALL_HEADS
            if "num_key_value_heads" in raw:
                raw["num_key_value_heads"] = max(1, _SMALL_HEADS * kv // cfg.raw[heads])
    if raw.get("n_inner") is not None:
        raw["n_inner"] = 128
    return replace(load_hf_config(raw), source=cfg.source)
