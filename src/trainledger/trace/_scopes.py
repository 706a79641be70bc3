"""Which module an op belongs to, in forward and in backward.

Forward: global module pre/post hooks keep a stack of module paths. Backward: every autograd node a
module's forward created is labelled with that module's path (in ``node.metadata``) by walking back from
the module's outputs once it returns; inner modules return first, so each node keeps its innermost
module. During backward the tracer asks autograd for the node being executed
(``torch._C._current_autograd_node()``) and reads the label: "which module's gradient is being
computed". ``AccumulateGrad`` nodes are attributed to the module owning the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainledger.ledger import ROOT_SCOPE
from trainledger.workload import iter_tensors

LABEL = "trainledger.module"


class ModuleScopes:
    """Tracks the current module path; install with ``open()``, always ``close()`` (idempotent)."""

    def __init__(self, roots: Iterable[tuple[str, nn.Module]]) -> None:
        self.names: dict[int, str] = {}
        self.param_owner: dict[int, str] = {}
        for prefix, root in roots:
            for name, mod in root.named_modules(remove_duplicate=False):
                path = ".".join(p for p in (prefix, name) if p) or prefix or ROOT_SCOPE
                self.names.setdefault(id(mod), path)
                for _name, p in mod.named_parameters(recurse=False):
                    self.param_owner.setdefault(id(p), path)
        self.stack: list[str] = []
        self._boundaries: list[set[int]] = []
        self._handles: list[RemovableHandle] = []

    def open(self) -> None:
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stack.clear()
        self._boundaries.clear()

    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)
            # the graph that existed before this forward: its inputs' nodes bound the walk in _post
            self._boundaries.append({id(t.grad_fn) for t in iter_tensors(args) if t.grad_fn is not None})

    def _post(self, module: nn.Module, _args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None or not self.stack or self.stack[-1] != name:
            return
        self.stack.pop()
        label_graph(output, name, stop=self._boundaries.pop())

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def backward_scope(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        label = node.metadata.get(LABEL)
        if label is not None:
            return label
        variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter it accumulates into
        if variable is not None:
            return self.param_owner.get(id(variable), "")
        return ""


def label_graph(output: Any, name: str, *, stop: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Label the autograd nodes a module's forward created with the module's path.

    Walks back from ``output``. Nodes already labelled by a submodule (their label starts with
    ``name + "."``) keep their label and are walked through; the walk stops at the module's input nodes
    (``stop``), at nodes of modules that are not submodules (they ran before), and at leaves.
    """
    prefix = name + "."
    seen: set[int] = set()
    stack = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        key = id(node)
        if key in seen or key in stop:
            continue
        seen.add(key)
        meta = node.metadata
        label = meta.get(LABEL)
        if label is None:
            meta[LABEL] = name
        elif not label.startswith(prefix):
            continue
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None and not hasattr(nxt, "variable"))
