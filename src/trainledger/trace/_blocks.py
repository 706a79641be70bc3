"""Whether the blocks of a deep model are alike where a few traced blocks cannot show it.

A stacked trace (:func:`trainledger.trace.trace_stacked`) traces 3 and 4 blocks and checks that the first
extends exactly to the second; a pattern that repeats only every few layers (every sixth layer attends
globally, the first five layers are dense and the rest experts) passes that check and would be extended
wrongly. The model's skeleton at full depth, built on the meta device (no memory, no trace), shows such a
pattern in its modules: their classes, their parameters' and buffers' shapes and dtypes, and their plain
settings (``sliding_window``, ``is_sliding``, ``use_rope``). The extension repeats the traced model's block
``d-2`` for the blocks ``1 .. n-2`` and keeps its first and last blocks: every block of the full skeleton must
look like the traced block it is made from.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainledger.trace._stack import source_block

_POSITION_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx", "training"})
"""Module attributes that number the block (every block differs in them) or only say train/eval."""
_PLAIN = (bool, int, float, str, type(None))


def _setting(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))


def block_signature(block: nn.Module) -> tuple[Any, ...]:
    """What makes two blocks alike for a trace: each module's path in the block, class, parameters and buffers
    (name, shape, dtype, trainable) and plain settings, its position number aside."""
    out = []
    for path, module in block.named_modules():
        tensors = tuple(
            (kind, name, tuple(t.shape), str(t.dtype), bool(getattr(t, "requires_grad", False)))
            for kind, items in (("param", module._parameters), ("buffer", module._buffers))
            for name, t in items.items()
            if t is not None
        )
        settings = tuple(
            sorted(
                (k, repr(v))
                for k, v in vars(module).items()
                if not k.startswith("_") and k not in _POSITION_NAMES and _setting(v)
            )
        )
        out.append((path, type(module).__qualname__, tensors, settings))
    return tuple(out)


def _module_lists(model: nn.Module, length: int) -> dict[str, nn.ModuleList]:
    return {
        path: m
        for path, m in model.named_modules()
        if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) == length
    }


def blocks_differ(full: nn.Module, base: nn.Module, num_blocks: int, base_depth: int) -> str | None:
    """Why the extension of ``base`` (``base_depth`` blocks) to ``full`` (``num_blocks``) cannot be exact, or
    ``None``: each block of ``full`` looks like the block of ``base`` it is made from. Both are skeletons
    (modules on any device; nothing runs). A model without one module list of ``num_blocks`` blocks matched by
    one of ``base_depth`` at the same path is left to the traces' own checks (``None``)."""
    lists = _module_lists(full, num_blocks)
    bases = _module_lists(base, base_depth)
    common = [p for p in lists if p in bases]
    if len(common) != 1:
        return None
    path = common[0]
    blocks, traced = lists[path], bases[path]
    traced_sigs = [block_signature(b) for b in traced]
    for i, block in enumerate(blocks):
        j = source_block(i, base_depth, num_blocks)
        signature = block_signature(block)
        if signature != traced_sigs[j]:
            where = _first_unlike(signature, traced_sigs[j])
            return f"its blocks differ: {path}.{i} is not like the traced block {j} ({where})"
    return None


def _first_unlike(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    for x, y in zip(a, b, strict=False):
        if x != y:
            name = x[0] or "the block"
            if x[1] != y[1]:
                return f"{name} is a {x[1]}, not a {y[1]}"
            if x[2] != y[2]:
                return f"{name}'s parameters or buffers differ"
            unlike = sorted(set(x[3]) ^ set(y[3]))
            return f"{name}'s {unlike[0][0]} differs" if unlike else f"{name} differs"
    return "a different number of modules"
