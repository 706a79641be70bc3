"""The tracer's compiled per-op path (``trainledger.trace._native``) records exactly what the Python hook records.

The oracle is the Python hook itself: the same step traced both ways, in one process, must give the same ledger to
the last field (every event, entry, lifetime, module call, note), for models chosen to reach every branch the compiled
path handles or hands back: in-place writes in forward, gradient accumulation in backward, a foreach optimizer's
per-parameter outputs, each conditional kernel probe firing and not firing, Python numbers wrapped as tensors,
detaches autograd asks of the mode itself, checkpointed regions and their RNG states, a user's own dispatch mode
inside the step, sparse outputs. Each test also asserts that the compiled path did the work (most events), so that
a path that silently declined everything could not pass.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from trainledger import examples
from trainledger.trace import _native, trace
from trainledger.trace import _tracer as tracer_module
from trainledger.workload import Workload

compiled = pytest.mark.skipif(_native.module() is None, reason=f"no compiled path here: {_native.status()}")


def _ledger(ledger: Any) -> dict[str, Any]:
    data = ledger.to_dict()
    data["meta"].pop("traced_step_seconds", None)  # the only field that is a timing
    return data


def _both(build: Callable[[], Workload], monkeypatch: pytest.MonkeyPatch) -> tuple[dict, dict, int, int]:
    """The ledger of a fresh workload traced through the Python hook, and through the compiled path; the events the
    compiled path recorded, and the step's events."""
    with monkeypatch.context() as m:
        m.setattr(tracer_module, "_attach_native", lambda _tracer: False)
        python = _ledger(trace(build()))
    with _native_events_counted(monkeypatch) as native_events:
        native = _ledger(trace(build()))
    return python, native, sum(native_events), native["num_events"]


@contextlib.contextmanager
def _native_events_counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The events the compiled path recorded, a number for each step tracer that ends within the block."""
    counted: list[int] = []
    exit_ = tracer_module.StepTracer.__exit__

    def counting_exit(self: tracer_module.StepTracer, *exc: object) -> None:
        exit_(self, *exc)
        counted.append(self.native_events)

    with monkeypatch.context() as m:
        m.setattr(tracer_module.StepTracer, "__exit__", counting_exit)
        yield counted


def _assert_same(build: Callable[[], Workload], monkeypatch: pytest.MonkeyPatch, *, share: float = 0.75) -> None:
    python, native, recorded, events = _both(build, monkeypatch)
    assert events > 0
    assert native == python
    assert recorded >= share * events, f"the compiled path recorded {recorded} of {events} events"


@compiled
@pytest.mark.parametrize("name", sorted(examples.EXAMPLES))
def test_every_built_in_example_traces_the_same_both_ways(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same(lambda: examples.build(name), monkeypatch, share=0.8)


class _InPlace(nn.Module):
    """In-place writes in forward (to a buffer from before the step, to activations), a weight used twice (its
    gradients accumulate), Python numbers the arguments parser wraps as tensors, integer and boolean arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 12)
        self.register_buffer("seen", torch.zeros(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.detach().mean(0))
        h = self.a(x)
        h.mul_(0.5).add_(1.0)
        h = torch.relu(h)
        h = self.a(h) * 2 + self.a(x)  # the same weight three times: gradients added in backward
        mask = (h > 0).sum(dim=1, keepdim=True)  # a boolean sum computes in int64
        return h / (mask + 1) + torch.arange(12) // 3


def _in_place() -> Workload:
    torch.manual_seed(0)
    return Workload(_InPlace(), torch.randn(6, 12), loss_fn=lambda out, _: out.pow(2).mean())


@compiled
def test_writes_accumulations_and_wrapped_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same(_in_place, monkeypatch)


@compiled
@pytest.mark.parametrize("kind", ["foreach", "fused", "single", "sgd"])
def test_each_optimizer_implementation_owns_its_temporaries_alike(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> Workload:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        if kind == "sgd":
            make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
        else:
            option = {"foreach": {"foreach": True}, "fused": {"fused": True}, "single": {"foreach": False}}[kind]
            make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, **option)  # noqa: E731
        return Workload(model, torch.randn(5, 8), optimizer=make, loss_fn=lambda out, _: out.square().mean())

    _assert_same(build, monkeypatch, share=0.6)


class _Probed(nn.Module):
    """Each conditional kernel probe, firing: a product of a transposed, expanded operand (BLAS copies it), an fp32
    activation added to a bf16 one (TensorIterator casts it), a sum to another dtype, a softmax and a LayerNorm of
    a permuted (non-contiguous) map, a bf16 gather by an expanded index, GELU's backward of a permuted gradient;
    and each, not firing, on ordinary tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (4, 6, 16)
        expanded = torch.ones(16, 1).expand(16, 6)
        odd = h @ expanded  # (4, 6, 6): an operand BLAS cannot read in place
        plain = torch.softmax(odd, dim=-1) + torch.softmax(odd.transpose(1, 2), dim=-1)
        mixed = plain + torch.zeros(6, dtype=torch.bfloat16)
        normed = self.norm(mixed.permute(0, 2, 1))
        index = torch.arange(6).view(1, 1, 6).expand(4, 6, 6)
        gathered = torch.gather(normed.bfloat16(), 2, index).float()
        act = F.gelu(gathered.transpose(1, 2)).transpose(1, 2)
        return act.sum(dtype=torch.float64).float() + (odd > 0).sum()


def _probed() -> Workload:
    torch.manual_seed(0)
    return Workload(_Probed(), torch.randn(4, 6, 16), loss_fn=lambda out, _: out)


@compiled
def test_each_conditional_probe_fires_where_the_python_hook_fires_it(monkeypatch: pytest.MonkeyPatch) -> None:
    python, native, _, events = _both(_probed, monkeypatch)
    assert native == python
    internal = [e for e in native["entries"] if e["role"] == "kernel_internal"]
    assert len(internal) >= 3, "the test model no longer makes kernels hold buffers"


class _Checkpointed(nn.Module):
    """Blocks under activation checkpointing with dropout inside: the recomputation runs in backward, and
    checkpoint copies the generator's state."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(10, 10), nn.Dropout(0.2), nn.GELU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return x


@compiled
def test_checkpointed_blocks_and_their_generator_states(monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> Workload:
        torch.manual_seed(0)
        return Workload(_Checkpointed(), torch.randn(7, 10), loss_fn=lambda out, _: out.sum())

    _assert_same(build, monkeypatch)


class _Counting(TorchDispatchMode):
    """A user's mode inside the step: the tracer sees what it passes on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


class _WithUserMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _Counting():
            h = torch.tanh(self.a(x))
        return self.b(h)


@compiled
def test_a_users_dispatch_mode_inside_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> Workload:
        torch.manual_seed(0)
        return Workload(_WithUserMode(), torch.randn(3, 8), loss_fn=lambda out, _: out.sum())

    _assert_same(build, monkeypatch, share=0.5)


class _Sparse(nn.Module):
    """An op returning a sparse tensor from dense ones, and a tensor made sparse and back in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        s = h.detach().relu().to_sparse()
        return h * s.to_dense()


@compiled
def test_sparse_outputs_go_through_the_python_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> Workload:
        torch.manual_seed(0)
        return Workload(_Sparse(), torch.randn(4, 6), loss_fn=lambda out, _: out.sum())

    _assert_same(build, monkeypatch, share=0.5)


@compiled
def test_nothing_stays_registered_after_a_trace_even_one_that_raised() -> None:
    native = _native.module()
    trace(examples.build("mlp"))
    assert native.installed() == 0

    class _Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled() and not hasattr(self, "warm"):
                self.warm = True
                return self.a(x)
            raise RuntimeError("the model broke")

    with pytest.raises(Exception, match="the model broke"):
        trace(Workload(_Fails(), torch.randn(2, 3), loss_fn=lambda out, _: out.sum()))
    assert native.installed() == 0
    # and a dispatch mode of the user's own runs as before
    mode = _Counting()
    with mode:
        torch.ones(2) + 1
    assert mode.calls == 2


def test_turned_off_by_the_environment_it_says_so_and_traces_the_same() -> None:
    code = (
        "from trainledger.trace import _native, trace; from trainledger import examples;"
        "print(_native.status()); print(trace(examples.build('mlp')).peak().bytes)"
    )
    env = {**os.environ, "TRAINLEDGER_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    status, peak = out.strip().splitlines()[-2:]
    assert status == "turned off (TRAINLEDGER_NATIVE=0)"
    assert int(peak) == trace(examples.build("mlp")).peak().bytes


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_compiled_path_is_built_where_a_compiler_is() -> None:
    if _native._torch_version() not in _native.TORCH_VERSIONS:
        assert "built for torch" in _native.status()
    else:
        assert _native.status() == "compiled"


def _loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], *, accumulate: int = 1) -> None:
    """A user's own loop: micro-batches accumulated, the loss computed outside the model, gradients clipped."""
    for i, x in enumerate(batches):
        loss = model(x).square().mean() / accumulate
        loss.backward()
        if (i + 1) % accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)


def _recorded(
    make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]], accumulate: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict, int]:
    from trainledger import record

    model, opt = make()
    torch.manual_seed(1)
    batches = [torch.randn(6, 10) for _ in range(3 * accumulate)]
    with _native_events_counted(monkeypatch) as counted, record(model, opt, steps=1) as rec:
        _loop(model, opt, batches, accumulate=accumulate)
    return _ledger(rec.ledger(step=1)), sum(counted)


@compiled
@pytest.mark.parametrize("accumulate", [1, 2])
def test_record_of_a_users_loop_is_the_same_both_ways(accumulate: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``record``'s tracer works out each op's phase from where it runs; the compiled path applies the same rule."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 20), nn.GELU(), nn.Dropout(0.1), nn.Linear(20, 10))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    with monkeypatch.context() as m:
        m.setattr(tracer_module, "_attach_native", lambda _tracer: False)
        python, _ = _recorded(make, accumulate, monkeypatch)
    native, recorded = _recorded(make, accumulate, monkeypatch)
    assert native == python
    assert recorded >= 0.75 * native["num_events"], f"the compiled path recorded {recorded} of {native['num_events']}"
