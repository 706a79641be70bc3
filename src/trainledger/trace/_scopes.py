"""Which module an op belongs to, in forward and in backward, and every call of every module.

Forward: global module pre/post hooks keep a stack of module paths and record each call (its path, which
call of that module it is, the call it ran inside, its first and last event). Backward: autograd numbers
every node it creates, in order, per thread (``node._sequence_nr()``); each time the module running in
forward changes, the hooks note autograd's next number and the module and call from then on. A node
belongs to the call that was running when it was made: during backward the tracer asks autograd for the
node being executed (``torch._C._current_autograd_node()``) and finds its number among those notes (a
bisection): "which module's gradient is being computed, for which call". ``AccumulateGrad`` nodes are
attributed to the module owning the parameter.

A module called while backward runs is a recomputation (activation checkpointing), not a call of the
step: it is attributed as usual but not recorded as a call, and the nodes it makes (numbered on the
engine's thread, which on CUDA is not the forward's) are labelled in ``node.metadata`` instead, by a walk
back from its outputs; so is a module call on another thread than the one that opened the scopes.
"""

from __future__ import annotations

import contextlib
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainledger.ledger import ROOT_SCOPE, ModuleCall
from trainledger.workload import iter_tensors

LABEL = "trainledger.module"
CALL_LABEL = "trainledger.call"
ROOT = ROOT_SCOPE
NO_CALL = -1


# asked for every op of backward and the optimizer step: bound once, not looked up through ``torch._C``
_current_autograd_node = torch._C._current_autograd_node
# the number autograd gives the next node it makes (where a torch lacks it, every call labels its nodes instead)
_next_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)
_UNNUMBERED = 2**64 - 1  # an ``AccumulateGrad`` node's sequence number (it is made once per leaf, not per op)
_get_ident = threading.get_ident


def in_backward() -> bool:
    """Whether autograd's engine is running a node on this thread (a checkpoint's recomputation runs so)."""
    return _current_autograd_node() is not None


@dataclass(slots=True)
class _Call:
    path: str
    index: int
    parent: int | None
    start: int
    grad: bool
    stop: int = -1
    backward: list[int] = field(default_factory=list)  # first and last backward event, once seen
    writes: dict[str, None] = field(default_factory=dict)  # ordered set of names


class ModuleScopes:
    """Tracks the current module path and call; install with ``open()``, always ``close()`` (idempotent).

    Arguments:
        roots: ``(prefix, module)`` pairs; the first is the model, whose every call starts a new count
            of calls for every module (so call numbers restart with each forward of the model).
        clock: the number of events so far (a call starts at ``clock()`` and stops at ``clock()``).
        outside: the module path that backward ops of nodes made outside every module call are attributed
            to (``trace`` gives the loss's scope: the loss and what the step computes around the model).
    """

    def __init__(
        self,
        roots: Iterable[tuple[str, nn.Module]],
        *,
        clock: Callable[[], int] = lambda: 0,
        outside: str = "",
    ) -> None:
        self.names: dict[int, str] = {}
        self.param_owner: dict[int, str] = {}
        self._root_id: int | None = None
        for prefix, root in roots:
            if self._root_id is None:
                self._root_id = id(root)
            for name, mod in root.named_modules(remove_duplicate=False):
                path = ".".join(p for p in (prefix, name) if p) or prefix or ROOT
                self.names.setdefault(id(mod), path)
                for _name, p in mod.named_parameters(recurse=False):
                    self.param_owner.setdefault(id(p), path)
        self.stack: list[str] = []
        self.calls: list[_Call] = []
        self.outer_call_began = -1
        """The event clock when a module outside the model was last called outside the model's modules (DDP's
        wrapper, which makes its gradient buckets before it calls the model; a loss module): ``-1``, none."""
        self.recomputed: dict[str, None] = {}
        """The outermost modules called while backward ran (the model's own activation checkpointing)."""
        self._call_stack: list[int] = []
        self.scope: tuple[str, int] = ("", NO_CALL)
        """The module path and call running now, kept as each call starts and returns: read for every op of
        forward, where building it from the stacks cost more than its module hooks."""
        self._counts: dict[str, int] = {}
        self.clock = clock
        self._outside = (outside, NO_CALL)
        # where the module running in forward changed: autograd's next sequence number then (ascending), and
        # the module and call from then on; a node made at number ``s`` belongs to the last one at or below it
        self._numbers: list[int] = []
        self._owners: list[tuple[str, int]] = []
        self._labelled = False  # some call labelled its nodes in ``node.metadata`` (see _pre): read it first
        self._thread = _get_ident()
        # per open call: None, or for a call whose nodes get labels, the nodes its inputs had (they bound the walk)
        self._boundaries: list[set[int] | None] = []
        self._handles: list[RemovableHandle] = []

    def open(self) -> None:
        self._thread = _get_ident()
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Take the module hooks off while the block runs: a compiled module's call, which dynamo would
        otherwise trace them into (changing the graph it compiles)."""
        if not self._handles:
            yield
            return
        for h in self._handles:
            h.remove()
        try:
            yield
        finally:
            self.open()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stack.clear()
        self._call_stack.clear()
        self._boundaries.clear()
        self.scope = ("", NO_CALL)

    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            if not self.stack:  # a module outside the model (DDP's wrapper, a loss module), called at the top
                self.outer_call_began = self.clock()
            return
        self.stack.append(name)
        backward = in_backward()
        labelled = backward or _next_sequence_nr is None or _get_ident() != self._thread
        if labelled:
            # its nodes are numbered on another thread than the forward's (or after it): labelled by a walk in
            # _post, bounded by the graph that existed before this call (its inputs' nodes)
            self._boundaries.append({id(t.grad_fn) for t in iter_tensors(args) if t.grad_fn is not None})
            self._labelled = True
        else:
            self._boundaries.append(None)
        if backward:
            if name not in self.recomputed and not any(path in self.recomputed for path in self.stack[:-1]):
                self.recomputed[name] = None
            self._call_stack.append(NO_CALL)
            self.scope = (name, NO_CALL)
            return
        if id(module) == self._root_id:
            self._counts.clear()
        index = self._counts.get(name, 0)
        self._counts[name] = index + 1
        parent = self._call_stack[-1] if self._call_stack and self._call_stack[-1] != NO_CALL else None
        self.scope = scope = (name, len(self.calls))
        self._call_stack.append(len(self.calls))
        self.calls.append(_Call(name, index, parent, self.clock(), torch.is_grad_enabled()))
        if not labelled:
            self._numbers.append(_next_sequence_nr())
            self._owners.append(scope)

    def _post(self, module: nn.Module, _args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None or not self.stack or self.stack[-1] != name:
            return
        self.stack.pop()
        call = self._call_stack.pop()
        self.scope = (self.stack[-1], self._call_stack[-1]) if self.stack else ("", NO_CALL)
        stop = self._boundaries.pop()
        if stop is not None:
            label_graph(output, name, call, stop=stop)
        if call != NO_CALL:
            self.calls[call].stop = self.clock()
            if stop is None:
                self._numbers.append(_next_sequence_nr())
                self._owners.append(self.scope if self.stack else self._outside)

    def backward_begins(self) -> None:
        """Nodes made from now on (a reentrant checkpoint's recomputation outside its modules, a double
        backward's graph) belong to no module call of the forward."""
        if _next_sequence_nr is not None:
            self._numbers.append(_next_sequence_nr())
            self._owners.append(("", NO_CALL))

    def recomputed_modules(self) -> list[str]:
        """:attr:`recomputed`, in the order of the model's modules."""
        order = {name: i for i, name in enumerate(self.names.values())}
        return sorted(self.recomputed, key=lambda name: order.get(name, len(order)))

    def forward_scope(self) -> tuple[str, int]:
        """The module path and call running now (``current`` and ``current_call`` in one call)."""
        return self.scope

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    @property
    def current_call(self) -> int:
        """The call running now (``NO_CALL`` outside every module, or in a recomputation)."""
        return self._call_stack[-1] if self._call_stack else NO_CALL

    def backward_scope(self) -> tuple[str, int]:
        """The module path and call whose autograd node is running (``("", NO_CALL)`` when none is)."""
        node = _current_autograd_node()
        if node is None:
            return "", NO_CALL
        if self._labelled:
            meta = node.metadata
            label = meta.get(LABEL)
            if label is not None:
                return label, meta.get(CALL_LABEL, NO_CALL)
        number = node._sequence_nr()
        if number == _UNNUMBERED:
            variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter it accumulates into
            return (self.param_owner.get(id(variable), ""), NO_CALL) if variable is not None else ("", NO_CALL)
        i = bisect_right(self._numbers, number)
        return self._owners[i - 1] if i else self._outside

    # --- after the step ------------------------------------------------------------------------------

    def module_calls(
        self, event_calls: Sequence[int], phases: Sequence[str], writes: Iterable[tuple[int, int | None, str]]
    ) -> tuple[ModuleCall, ...]:
        """The calls as ledger records.

        Arguments:
            event_calls: per event, the call it ran in (``NO_CALL``: none).
            phases: per event, its phase.
            writes: ``(event, alloc_event, name)`` of every in-place write in forward to a storage allocated
                at ``alloc_event`` (``None``: before the step).
        """
        calls = self.calls
        # a call's backward span covers its own backward events and its inner calls': each call's own first
        # and last, then folded into its parent from the innermost out (a parent is recorded before its calls)
        spans: dict[int, list[int]] = {}
        for e, (c, phase) in enumerate(zip(event_calls, phases, strict=True)):
            if phase == "backward" and c != NO_CALL:
                span = spans.get(c)
                if span is None:
                    spans[c] = [e, e]
                else:
                    span[1] = e
        for c in range(len(calls) - 1, -1, -1):
            span = spans.get(c)
            if span is None:
                continue
            calls[c].backward = span
            parent = calls[c].parent
            if parent is not None:
                outer = spans.get(parent)
                if outer is None:
                    spans[parent] = list(span)
                else:
                    outer[0], outer[1] = min(outer[0], span[0]), max(outer[1], span[1])
        for e, alloc, name in writes:
            c = event_calls[e]
            while c != NO_CALL and c is not None:
                if alloc is None or alloc < calls[c].start:
                    calls[c].writes[name] = None
                c = calls[c].parent
        return tuple(
            ModuleCall(
                path=c.path,
                index=c.index,
                parent=c.parent,
                start=c.start,
                stop=max(c.start, c.stop),
                backward_start=c.backward[0] if c.backward else None,
                backward_stop=c.backward[1] + 1 if c.backward else None,
                grad=c.grad,
                writes=tuple(c.writes),
            )
            for c in calls
        )


def label_graph(output: Any, name: str, call: int = NO_CALL, *, stop: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Label the autograd nodes a module's forward created with the module's path and call.

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
            meta[CALL_LABEL] = call
        elif not label.startswith(prefix):
            continue
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None and not _is_accumulate_grad(nxt))


_ACCUMULATES: dict[type, bool] = {}


def _is_accumulate_grad(node: Any) -> bool:
    """Whether an autograd node accumulates into a leaf (it has ``variable``); asked once per node type,
    since ``hasattr`` on every other node raises and catches an AttributeError."""
    kind = type(node)
    found = _ACCUMULATES.get(kind)
    if found is None:
        found = _ACCUMULATES[kind] = hasattr(node, "variable")
    return found
