"""What a trace must give back: the weights, buffers, gradients, optimizer state and random-number state it found.

:func:`trace` runs a warm-up step and the traced step on the user's live objects; both change the weights,
the optimizer's moments and step counts, BatchNorm's running statistics and the generator's state. A
:class:`TrainingState` taken before and restored after makes the trace invisible to the training it
observes. Tensors are copied to the host (a device copy would double the device memory being measured)
and written back in place, so references the user holds to parameters or optimizer state stay valid.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainledger.trace._tracer import local_tensor

RESTORED_NOTE = (
    "the model's weights, buffers and gradients, the optimizer's state and the random-number generators' state "
    "were restored after the steps run to observe this one: training continues as if it had not been traced"
)


@dataclass
class GeneratorStates:
    """Every generator a step may draw from, as it is now: put back with :meth:`restore`."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    others: list[tuple[Callable[[Any], Any], Any]]
    """``(what sets its state, the state)`` for Python's ``random``, NumPy's global generator (when NumPy is loaded),
    and ``torch.Generator`` objects the modules hold."""

    @classmethod
    def of(cls, modules: list[nn.Module]) -> GeneratorStates:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda, _other_generators(modules))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        for set_state, state in self.others:
            set_state(state)


@dataclass
class TrainingState:
    """A host copy of everything a training step changes. Take it with :meth:`of`, put it back with
    :meth:`restore`."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    """``(live tensor, host copy)`` for parameters and buffers (their local shard for a ``DTensor``)."""
    grads: list[tuple[nn.Parameter, torch.Tensor | None]]
    optimizers: list[tuple[torch.optim.Optimizer, dict[Any, dict[str, Any]], list[dict[str, Any]]]]
    """Per optimizer: its state per parameter (tensors as host copies) and its groups' settings."""
    generators: GeneratorStates
    slots: list[tuple[dict[str, Any], str, Any]]
    """``(a module's _parameters or _buffers, name, what it held)``: a forward that assigns a new tensor to a
    buffer (``self.ema = 0.9 * self.ema + ...``) leaves the module holding another object, put back too."""

    @classmethod
    def of(cls, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> TrainingState:
        seen: set[int] = set()
        tensors, grads = [], []
        slots = [
            (table, name, value)
            for module in modules
            for sub in module.modules()
            for table in (sub._parameters, sub._buffers)
            for name, value in table.items()
        ]
        # the parameters the optimizers train beside the modules (a temperature only the loss reads) too
        trained = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        for t in [*(t for module in modules for t in [*module.parameters(), *module.buffers()]), *trained]:
            if id(t) not in seen:
                seen.add(id(t))
                tensors.append((t, _host_copy(t)))
                if isinstance(t, nn.Parameter):
                    grads.append((t, None if t.grad is None else _host_copy(t.grad)))
        opts = [
            (
                opt,
                {
                    p: {k: _host_copy(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in s.items()}
                    for p, s in opt.state.items()
                },
                [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
            )
            for opt in optimizers
        ]
        return cls(tensors, grads, opts, GeneratorStates.of(modules), slots)

    @torch.no_grad()
    def restore(self) -> None:
        for table, name, value in self.slots:
            if table.get(name) is not value:
                table[name] = value
        for live, saved in self.tensors:
            local_tensor(live).copy_(saved)
        for p, g in self.grads:
            if g is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == g.shape and p.grad.dtype == g.dtype:
                local_tensor(p.grad).copy_(g)
            else:
                p.grad = g.to(p.device)
        for opt, state, groups in self.optimizers:
            _restore_optimizer(opt, state, groups)
        self.generators.restore()


def _other_generators(modules: list[nn.Module]) -> list[tuple[Callable[[Any], Any], Any]]:
    """``(what sets a generator's state, the state now)`` for Python's ``random``, NumPy's global generator (when
    NumPy is loaded) and each ``torch.Generator`` a module holds."""
    found: list[tuple[Callable[[Any], Any], Any]] = [(random.setstate, random.getstate())]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        found.append((numpy.random.set_state, numpy.random.get_state()))
    held = {
        id(v): v for m in modules for sub in m.modules() for v in vars(sub).values() if isinstance(v, torch.Generator)
    }
    found += [(g.set_state, g.get_state()) for g in held.values()]
    return found


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    local = local_tensor(t)
    return local.detach().to("cpu", copy=True)


def _restore_optimizer(
    opt: torch.optim.Optimizer, state: dict[Any, dict[str, Any]], groups: list[dict[str, Any]]
) -> None:
    for p in [p for p in opt.state if p not in state]:  # state the steps created lazily
        del opt.state[p]
    for p, saved in state.items():
        live = opt.state[p]
        for k in [k for k in live if k not in saved]:
            del live[k]
        for k, v in saved.items():
            current = live.get(k)
            if not isinstance(v, torch.Tensor):
                live[k] = v
            elif isinstance(current, torch.Tensor) and current.shape == v.shape and current.dtype == v.dtype:
                local_tensor(current).copy_(v)
            else:
                live[k] = v.to(local_tensor(p).device)
    for group, saved_group in zip(opt.param_groups, groups, strict=True):
        group.update(saved_group)
