"""One training step's ingredients and how to run the step.

A :class:`Workload` is a model, a batch, a loss and an optimizer. The step every capture runs is
forward, loss, backward, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``; the
``on_phase`` callback lets the tracer and the measurer see where one phase ends and the next begins.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainledger.checks import describe
from trainledger.errors import InputError
from trainledger.inventory import trains_none_of

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
PHASES = ("forward", "backward", "optimizer", "zero_grad")


@dataclass
class Workload:
    """The ingredients of one training step.

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> w = Workload(model, torch.randn(8, 4), loss_fn=lambda out, batch: out.square().mean())
        >>> type(w.get_optimizer()).__name__
        'AdamW'
    """

    model: nn.Module
    batch: Any
    """Passed as ``model(batch)`` for a tensor, ``model(*batch)`` for a tuple or list, ``model(**batch)`` for a dict."""
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    """``loss_fn(output, batch)`` returns a scalar; without it the output must be the loss or carry ``.loss``."""
    optimizer: torch.optim.Optimizer | OptimizerFactory | None = None
    """An optimizer instance, or a factory of the model's trainable parameters (default: AdamW)."""
    reference: nn.Module | None = None
    """A frozen model that takes part in the loss (a DPO reference): its weights are ``frozen``."""
    autocast_dtype: torch.dtype | None = None
    """Run forward and loss under ``torch.autocast`` with this dtype (e.g. ``torch.bfloat16``)."""
    name: str = ""
    _optimizer: torch.optim.Optimizer | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_module(self.model, "Workload model", required=True)
        opt = self.optimizer
        if opt is not None and not isinstance(opt, torch.optim.Optimizer) and not callable(opt):
            raise InputError(
                f"Workload optimizer is {describe(opt)}; accepted: None (AdamW), a torch.optim.Optimizer "
                "instance, or a factory of the parameters such as torch.optim.Adam or "
                "lambda params: torch.optim.Adam(params, lr=1e-3)"
            )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise InputError(
                f"Workload loss_fn is {describe(self.loss_fn)}; accepted: None (the output is the loss) "
                "or a function loss_fn(output, batch) returning a scalar tensor"
            )
        _check_module(self.reference, "Workload reference", required=False)
        if self.autocast_dtype is not None and not isinstance(self.autocast_dtype, torch.dtype):
            raise InputError(
                f"Workload autocast_dtype is {describe(self.autocast_dtype)}; accepted: None or a torch dtype "
                "such as torch.bfloat16"
            )
        if not isinstance(self.name, str):
            raise InputError(f"Workload name is {describe(self.name)}; give a str")

    def get_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer instance, built once from the factory (default AdamW) on first use."""
        if self._optimizer is None:
            opt = self.optimizer
            if opt is None:
                opt = torch.optim.AdamW
            if not isinstance(opt, torch.optim.Optimizer):
                params = [p for p in self.model.parameters() if p.requires_grad]
                if not params:
                    raise InputError("the model has no trainable parameters (all have requires_grad=False)")
                with user_errors("the optimizer factory"):
                    opt = opt(params)
                if not isinstance(opt, torch.optim.Optimizer):
                    raise InputError(
                        f"the optimizer factory returned {describe(opt)}; give a torch.optim.Optimizer instance, or a "
                        "function of the parameters returning one"
                    )
            if not any(p.requires_grad for g in opt.param_groups for p in g["params"]):
                raise InputError("the optimizer holds no trainable parameters; give it the model's parameters")
            if trains_none_of(self.model, opt):
                warnings.warn(
                    f"the Workload's {type(opt).__name__} trains none of {type(self.model).__name__}'s parameters "
                    "(another model's optimizer?): the step's weights are the model's and the optimizer's both, "
                    "and the model is not stepped",
                    stacklevel=3,
                )
            _refuse_closure_step(opt)
            self._optimizer = opt
        return self._optimizer


def _refuse_closure_step(opt: torch.optim.Optimizer) -> None:
    """A step is one forward, one backward and ``optimizer.step()``: an optimizer whose step needs a closure
    (L-BFGS evaluates the loss and its gradient up to ``max_iter`` times inside one step) has no such step."""
    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or wrapped step without a signature: let it run
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise InputError(
            f"{type(opt).__name__}.step() needs a closure (it re-evaluates the loss inside the step): a traced "
            "step is one forward, backward and optimizer.step(); use an optimizer that steps without one"
        )


def _check_module(value: Any, what: str, *, required: bool) -> None:
    if value is None and not required:
        return
    if isinstance(value, nn.Module):
        return
    if isinstance(value, type) and issubclass(value, nn.Module):
        raise InputError(f"{what} is the class {value.__name__}, not a model; give an instance: {value.__name__}(...)")
    accepted = "an nn.Module instance" + ("" if required else " or None")
    raise InputError(f"{what} is {describe(value)}; accepted: {accepted}")


def require_workload(value: Any, caller: str) -> Workload:
    """``value`` if it is a :class:`Workload`; otherwise one line saying how to make one (for ``caller``)."""
    if isinstance(value, Workload):
        return value
    hint = "give trainledger.Workload(model, batch, loss_fn=..., optimizer=...)"
    if isinstance(value, nn.Module):
        hint = "give the model with its batch: trainledger.Workload(model, batch)"
    raise InputError(f"{caller}() takes a trainledger.Workload, not {describe(value)}; {hint}")


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(batch)``, ``model(*batch)`` or ``model(**batch)`` depending on the batch's type."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def compute_loss(workload: Workload, output: Any) -> torch.Tensor:
    """The step's scalar loss, checked: a 0-dim tensor that requires grad."""
    if workload.loss_fn is not None:
        loss = workload.loss_fn(output, workload.batch)
        source = "loss_fn(output, batch)"
    elif isinstance(output, torch.Tensor):
        loss, source = output, "the model's output"
    elif getattr(output, "loss", None) is not None:
        loss, source = output.loss, "the model's output.loss"
    elif isinstance(output, dict) and output.get("loss") is not None:
        loss, source = output["loss"], "the model's output['loss']"
    else:
        raise InputError(
            f"cannot find a loss: the model returned {type(output).__name__}; "
            "give Workload(loss_fn=...) or return a scalar loss (or an object with .loss)"
        )
    if not isinstance(loss, torch.Tensor):
        raise InputError(f"{source} is a {type(loss).__name__}, not a tensor; return a scalar tensor")
    if loss.dim() != 0:
        raise InputError(f"{source} has shape {tuple(loss.shape)}, not a scalar; reduce it (e.g. .mean())")
    if not loss.requires_grad:
        raise InputError(f"{source} does not require grad; it must depend on trainable parameters")
    return loss


def run_step(
    workload: Workload,
    *,
    on_phase: Callable[[str], None] | None = None,
    on_loss: Callable[[torch.Tensor], None] | None = None,
    zero_grad: bool = True,
) -> None:
    """One training step: forward, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``.

    Arguments:
        on_phase: called with each phase name as it begins (``forward``, ``backward``, ``optimizer``,
            ``zero_grad``) and with ``"end"`` after the last.
        on_loss: called with the loss before backward (e.g. to count the autograd graph).
        zero_grad: ``False`` leaves the gradients in place (to inventory them).
    """
    require_workload(workload, "run_step")
    note = on_phase or (lambda _phase: None)
    optimizer = workload.get_optimizer()
    note("forward")
    with autocast(workload):
        output = call_model(workload.model, workload.batch)
        loss = compute_loss(workload, output)
    del output
    if on_loss is not None:
        on_loss(loss)
    note("backward")
    loss.backward()
    del loss
    note("optimizer")
    optimizer.step()
    if zero_grad:
        note("zero_grad")
        optimizer.zero_grad(set_to_none=True)
    note("end")


def autocast(workload: Workload) -> contextlib.AbstractContextManager[Any]:
    if workload.autocast_dtype is None:
        return contextlib.nullcontext()
    device = next(workload.model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=workload.autocast_dtype)


@contextlib.contextmanager
def user_errors(what: str) -> Iterator[None]:
    """Errors raised by the user's model, loss or optimizer become one clear line."""
    try:
        yield
    except InputError:
        raise
    except SystemExit as exc:  # the user's code exiting is theirs to explain, not a silent exit of ours
        raise InputError(f"{what} called sys.exit({exc.code!r}) in the model, loss or optimizer") from None
    except Exception as exc:
        message = " ".join(str(exc).split())[:300]
        hint = _CHECKPOINT_HINT if type(exc).__name__ == "CheckpointError" else ""
        raise InputError(f"{what} raised {type(exc).__name__}: {message}{hint}") from exc


_CHECKPOINT_HINT = (
    " (a recomputation saved other tensors than its forward did: a checkpointed region inside another's, such as a "
    "plan applied to a model that checkpoints its own layers, which recomputes the inner one plainly; a "
    "checkpointed call that passes one tensor as several arguments, such as self-attention's attn(x, x, x), which "
    "under saved-tensor hooks, as tracing uses, PyTorch recomputes with distinct tensors: checkpoint a function that "
    "takes the tensor once; or a module that works otherwise when run again, such as one reading a key/value cache "
    "its first run filled: turn the cache off)"
)


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block on ``count`` intra-op threads (``torch.set_num_threads``), then restore the count.

    What CPU kernels allocate inside an op depends on it (oneDNN's convolutions keep scratch per thread),
    and so do timings: a trace, a measurement or a timed step states or fixes the count it ran at.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def quiet_gc(*, generation: int = 2) -> Iterator[None]:
    """Collect garbage first, then keep the cyclic collector paused for the duration.

    Garbage from earlier steps freed by the collector at a random moment inside a traced or measured
    step would otherwise show up (or not) in the allocator's counts; pausing it makes both repeatable.

    Arguments:
        generation: the oldest generation collected first (``gc.collect(generation)``). A full collection
            (2) walks every object of the process, a quarter of a second with torch imported on a loaded
            machine; the young ones (1) hold the garbage of the steps just run and cost under a
            millisecond. Measured steps want the allocator's counts clean of all garbage; a trace counts
            storages by their own lifetimes, so the pause alone makes it repeatable.
    """
    was_enabled = gc.isenabled()
    gc.collect(generation)
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def profiler_stderr_filtered(noise: str = "USDT:") -> Iterator[None]:
    """The profiler's native layer prints ``USDT:`` trace lines straight to file descriptor 2, where no
    Python setting reaches them: point fd 2 at a temporary file for the duration, then pass on every
    line but those (so real warnings and errors still reach the user)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True) if not line.startswith(noise.encode())]
            if kept:
                os.write(2, b"".join(kept))


def count_autograd_nodes(loss: torch.Tensor) -> int:
    """Number of autograd graph nodes reachable from ``loss`` (``AccumulateGrad`` leaves included).

    This is a node count: not FLOPs, not bytes.
    """
    seen: set[int] = set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return len(seen)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a batch: a tensor, or nested tuples, lists and dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_tensors(v)
