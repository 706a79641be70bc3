"""The CPU RNG state a user's own checkpoint keeps: traced as the profiler sees it.

``torch.utils.checkpoint.checkpoint(..., preserve_rng_state=True)`` copies the CPU generator's state
(``torch.get_rng_state()``, a uint8 tensor made outside the dispatcher) when each checkpointed call starts,
and keeps it until that call's backward is over. The trace must hold one entry per call, alive as long as
the profiler's allocation events say: the traced peak equals the profiler's to the byte.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.test_matmul_copies import _Block, _entries
from tests.test_stack import HF, assert_same_ledger
from trainledger.hf import workload_from_hf_config
from trainledger.ledger import Category
from trainledger.measure import measure
from trainledger.trace import RNG_STATE_ROLE, trace, trace_stacked
from trainledger.workload import Workload


class _Residual(nn.Module):
    """Residual blocks of Linear(64, 256) / GELU / Linear(256, 64), the ones in ``checkpointed`` checkpointed."""

    def __init__(self, depth: int, checkpointed: frozenset[int], *, preserve: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(depth))
        self.checkpointed, self.preserve = checkpointed, preserve

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i in self.checkpointed:
                x = x + checkpoint(block, x, use_reentrant=False, preserve_rng_state=self.preserve)
            else:
                x = x + block(x)
        return x


def residual(depth: int = 2, checkpointed: tuple[int, ...] | None = None, *, preserve: bool = True) -> Workload:
    """``depth`` blocks (all checkpointed unless ``checkpointed`` says which) on x of shape (32, 64, 64), loss
    ``out.sum()``."""
    torch.manual_seed(0)
    which = frozenset(range(depth) if checkpointed is None else checkpointed)
    model = _Residual(depth, which, preserve=preserve)
    return Workload(model, torch.randn(32, 64, 64), loss_fn=lambda out, _: out.sum(), name="residual")


def _states(led):
    return [e for e in led.entries if e.role == RNG_STATE_ROLE]


CASES = {"both": ((0, 1), True), "one": ((1,), True), "unpreserved": ((0, 1), False)}


@pytest.mark.parametrize("case", CASES)
def test_a_checkpointed_models_peak_equals_the_profilers(case):
    which, preserve = CASES[case]
    m = measure(residual(checkpointed=which, preserve=preserve), num_steps=1)
    assert m.traced.peak().bytes == m.peak_bytes
    led = m.traced
    states = _states(led)
    nbytes = torch.get_rng_state().nbytes
    assert all((e.category, e.dtype, e.nbytes) == (Category.OTHER, "uint8", nbytes) for e in states)
    kept = [e for e in states if led.events[e.alloc_event].phase == "forward"]
    forked = [e for e in states if led.events[e.alloc_event].phase == "backward"]
    assert len(kept) == len(forked) == (len(which) if preserve else 0) and len(states) == 2 * len(kept)
    for e, block in zip(kept, which if preserve else (), strict=True):
        # copied before the call's first op, kept until the call's backward lets go of it
        (call,) = [c for c in led.calls if c.path == f"blocks.{block}"]
        assert e.alloc_event == call.start and e.owner == "(root)"  # the caller of checkpoint(block, ...)
        assert call.backward_start < e.free_event <= call.backward_stop
    for e, block in zip(forked, reversed(which) if preserve else (), strict=True):
        # the recomputation forks the generator (``torch.random.fork_rng``): the state it goes back to after
        (call,) = [c for c in led.calls if c.path == f"blocks.{block}"]
        assert call.backward_start <= e.alloc_event < e.free_event < call.backward_stop


def test_a_fake_trace_sees_the_same_states():
    real, fake = trace(residual()), trace(residual(), fake=True)
    assert len(_states(real)) == 4  # two calls: each one's state, and its recomputation's fork
    assert _entries(fake) == _entries(real)
    assert fake.peak().bytes == real.peak().bytes


def test_the_step_leaves_the_generator_as_it_was():
    w = residual()
    before = torch.get_rng_state()
    trace(w)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.get_rng_state is torch.random.get_rng_state  # the observer is gone


@pytest.mark.slow
def test_a_checkpointed_stack_extends_its_states():
    """transformers' own checkpointing on every decoder layer: the extension repeats each layer's states."""
    pytest.importorskip("transformers")
    cfg = json.loads((HF / "llama-small.json").read_text())

    def build(depth: int) -> Workload:
        layers = {**cfg, "num_hidden_layers": depth}
        return workload_from_hf_config(layers, micro_batch=1, seq_len=16, fake=True, remat="full")

    extended, full = trace_stacked(build, 7), trace(build(7), fake=True)
    assert len(_states(full)) == 2 * 7  # each layer's state, and its recomputation's fork
    assert_same_ledger(extended, full)


def test_the_declared_size_of_the_cpu_generator_state_is_torchs():
    """The analytic model declares the state by its size; the trace measures it."""
    from trainledger.declared import CPU_RNG_STATE_BYTES

    assert torch.get_rng_state().nbytes == CPU_RNG_STATE_BYTES
