"""A stack of identical blocks traced a few blocks deep and extended: equal to the full trace, or refused.

The oracle is the full fake trace of the same model at the same depth: the extended ledger must equal it
event for event (phase, op, module), entry for entry (name, category, sizes, owner, lifetime, last use),
module call for module call, with the same notes and meta and the same peak.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainledger.ledger import Ledger, ModuleCall
from trainledger.trace import trace, trace_stacked
from trainledger.trace._stack import NotRepeating, Stack, find_stack
from trainledger.workload import Workload

HF = Path(__file__).parent / "fixtures" / "hf"


def cli_extended_and_full(cli_json: Any, argv: tuple[str, ...], total: int, note: str) -> tuple[dict, dict]:
    """``trace`` through the command line, extended from 3 and 4 of ``total`` blocks (its first note starting
    with ``note``), and again with ``--full-depth``: the two JSON outputs, their peaks and events compared."""
    extended = cli_json(*argv)
    assert extended["meta"]["blocks"] == {"total": total, "traced": [3, 4], "extended": True}
    assert extended["notes"][0].startswith(note)
    full = cli_json(*argv, "--full-depth")
    assert extended["peak"] == full["peak"] and extended["num_events"] == full["num_events"]
    return extended, full


def assert_same_ledger(extended: Ledger, full: Ledger) -> None:
    """Equal entry for entry and event for event; the extension's own note and meta key aside."""
    assert extended.meta["blocks"]["extended"] is True, extended.notes[0]
    assert extended.notes[0].startswith(f"traced 3 of {extended.meta['blocks']['total']} blocks, extended")
    assert extended.events == full.events
    assert extended.entries == full.entries
    assert extended.calls == full.calls
    assert extended.notes[1:] == full.notes
    unstable = ("blocks", "traced_step_seconds")
    assert {k: v for k, v in extended.meta.items() if k not in unstable} == {
        k: v for k, v in full.meta.items() if k not in unstable
    }
    assert extended.peak() == full.peak()
    assert extended.category_maxima() == full.category_maxima()


# --- the names of a block stack ------------------------------------------------------------------------


def test_shift_renumbers_the_stack_index_only():
    stack = Stack("model.layers")
    name = "optimizer.model.layers.2.block_sparse_moe.experts.3.w1.weight.exp_avg"
    assert stack.block_of(name) == 2
    assert stack.shift(name, 5) == "optimizer.model.layers.7.block_sparse_moe.experts.3.w1.weight.exp_avg"
    assert stack.shift("aten.mm#12", 5) == "aten.mm#12"
    assert stack.block_of("model.layers_norm.1") is None  # another name that merely starts alike


def _calls(*paths: str) -> list[ModuleCall]:
    return [ModuleCall(p, 0, None, i, i + 1) for i, p in enumerate(paths)]


def test_find_stack_needs_one_list_numbered_by_depth():
    at = {3: _calls("h.0", "h.1", "h.2", "h.0.experts.0", "h.0.experts.1"), 4: _calls("h.0", "h.1", "h.2", "h.3")}
    assert find_stack(at).prefix == "h"
    with pytest.raises(NotRepeating, match="several"):
        find_stack(
            {
                3: _calls("a.0", "a.1", "a.2", "b.0", "b.1", "b.2"),
                4: _calls(*(f"{x}.{i}" for x in "ab" for i in range(4))),
            }
        )
    with pytest.raises(NotRepeating, match="no module list"):
        find_stack({3: _calls("a.0", "a.1"), 4: _calls("a.0", "a.1")})


# --- small models whose depth is a constructor argument ------------------------------------------------


class Deep(nn.Module):
    """An input layer, ``depth`` residual blocks (the odd ones different when ``alternate``), a head."""

    def __init__(self, depth: int, *, alternate: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
            if not (alternate and i % 2)
            else nn.Sequential(nn.Linear(16, 16), nn.Tanh())
            for i in range(depth)
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).pow(2).mean()


def deep(depth: int, *, alternate: bool = False) -> Workload:
    torch.manual_seed(0)
    return Workload(Deep(depth, alternate=alternate), torch.randn(4, 8), name="deep")


@pytest.mark.slow
def test_blocks_that_differ_fall_back_to_the_full_trace():
    led = trace_stacked(lambda d: deep(d, alternate=True), 7)
    full = trace(deep(7, alternate=True), fake=True)
    assert led.meta["blocks"] == {"total": 7, "traced": [7], "extended": False}
    assert led.notes[0].startswith("traced all 7 blocks (not extended: ")
    assert led.events == full.events and led.entries == full.entries


@pytest.mark.slow
def test_an_extended_cuda_kind_ledger_keeps_every_field_of_every_entry():
    """A CUDA-kind ledger's entries carry what the CUDA kernels change (``kernel``); extended, each entry keeps
    every field, as the CUDA-kind trace at the full depth has it."""
    from dataclasses import fields

    from trainledger.examples import gpt_tiny
    from trainledger.trace._stack import _tracer_order, extend

    def build(depth: int) -> Workload:
        return gpt_tiny(n_layer=depth, n_embd=8, n_head=2, seq_len=4, batch_size=1)

    base, deeper, full = (trace(build(d), kernel_kind="cuda") for d in (3, 4, 5))
    extended, _ = extend(base, [], find_stack({3: base.calls, 4: deeper.calls}), base_depth=3, depth=5)
    # cuda_ledger adds the cuBLAS workspace after the tracer's entries: compare both in the tracer's order
    ours, theirs = (sorted(led.entries, key=_tracer_order) for led in (extended, full))
    assert len(ours) == len(theirs) == len(full.entries)
    for a, b in zip(ours, theirs, strict=True):
        for f in fields(a):
            assert getattr(a, f.name) == getattr(b, f.name), (a.name, f.name)
    num_labelled = sum(1 for e in ours if e.kernel)  # the blocks repeated carry their labels too
    assert num_labelled == sum(1 for e in full.entries if e.kernel) > sum(1 for e in base.entries if e.kernel) > 0
    # what the caller of backward holds through it (the loss, the seed) is named on the deeper clock too
    assert (
        extended.meta["freed_after_backward"] == full.meta["freed_after_backward"] != base.meta["freed_after_backward"]
    )


@pytest.mark.slow
def test_a_shallow_model_is_traced_whole():
    led = trace_stacked(deep, 4)
    assert led.meta["blocks"]["extended"] is False
    assert "no deeper than the traces" in led.notes[0]


class Recomputed(nn.Module):
    """An embedding, ``depth`` pre-norm residual MLP blocks each run through ``torch.utils.checkpoint``
    (non-reentrant, the generator's state kept: dropout draws the same mask when the block recomputes), a head."""

    def __init__(self, depth: int, *, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Dropout(0.1))
            for _ in range(depth)
        )
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.inp(ids)  # (B, T, 16)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x).logsumexp(-1).mean()


def recomputed(depth: int, *, reentrant: bool = False) -> Workload:
    torch.manual_seed(0)
    return Workload(Recomputed(depth, reentrant=reentrant), torch.randint(0, 50, (2, 8)), name="recomputed")


def test_a_checkpointed_stack_is_extended_not_traced_whole():
    """Each block's recomputation starts by unpacking the input its checkpoint kept; the unpack is stamped
    with the event before it, the last of the run before (the block above's backward, or the head's for the
    last block), and extended it must stay there: before, the model was traced whole."""
    led = trace_stacked(recomputed, 5, kernel_workspace=False)
    assert led.meta["blocks"] == {"total": 5, "traced": [3, 4], "extended": True}, led.notes[0]
    starts = {c.backward_start: c.path for c in led.calls if re.fullmatch(r"blocks\.\d+", c.path)}
    assert len(starts) == 5
    inputs = [e for e in led.entries if e.last_use_event is not None and e.last_use_event + 1 in starts]
    assert len(inputs) == 5  # each block's input: last used just before that block's backward run


def test_a_reentrant_checkpoint_is_traced_whole_and_the_note_says_why():
    """A reentrant checkpoint recomputes and runs its block's backward inside its own autograd node, which
    belongs to no block: its events split the block runs, and the note names the first and the way out."""
    led = trace_stacked(lambda d: recomputed(d, reentrant=True), 5, kernel_workspace=False)
    assert led.meta["blocks"] == {"total": 5, "traced": [5], "extended": False}
    assert "events outside every block (event " in led.notes[0] and "use_reentrant=False" in led.notes[0]


class _BiasedBlock(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.table = nn.Parameter(torch.randn(16)) if first else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None:
            bias = torch.tanh(self.table) * 2
        assert bias is not None
        return x + torch.tanh(self.fc(x)) + bias, bias


class SharedBias(nn.Module):
    """Residual blocks that all add a bias the first one computes, as T5's block 0 computes the relative position
    bias every block adds: its gradient is summed from the last block down (the last block's starts the sum, each
    block below adds one op more) and freed in block 0's backward, from one end of the stack to the other."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_BiasedBlock(i == 0) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, bias = self.inp(x), None
        for block in self.blocks:
            x, bias = block(x, bias)
        return x.pow(2).mean()


def shared_bias(depth: int) -> Workload:
    torch.manual_seed(0)
    return Workload(SharedBias(depth), torch.randn(4, 8), name="shared-bias")


@pytest.mark.slow
@pytest.mark.parametrize("fake", [True, False])
@pytest.mark.parametrize("model", ["residual", "checkpointed"])
def test_a_stack_extends_to_the_full_trace(model: str, fake: bool):
    build, depth = {"residual": (deep, 9), "checkpointed": (recomputed, 7)}[model]
    assert_same_ledger(trace_stacked(build, depth, fake=fake), trace(build(depth), fake=fake))


@pytest.mark.slow
@pytest.mark.parametrize("fake", [True, False])
def test_a_gradient_summed_across_the_stack_is_traced_whole_as_the_engine_allocates_it(fake: bool):
    # Every block's gradient of the shared bias is a view (summed to the bias's shape), so the engine adds the
    # first two out of place (one 64-byte buffer, in the second block from the top) and the rest in place into it:
    # that block runs differently from the others, and the stack is traced whole, equal to the full trace.
    from torch.profiler import ProfilerActivity, profile

    from trainledger.workload import run_step

    w = shared_bias(4)
    run_step(w)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(w)
    untraced = sorted(e.cpu_memory_usage for e in prof.events() if e.name == "aten::add" and e.cpu_memory_usage)
    led = trace(shared_bias(4))
    adds = sorted(
        e.nbytes for e in led.entries if e.alloc_event is not None and led.events[e.alloc_event].op == "aten.add.Tensor"
    )
    assert adds == untraced == [64] + [256] * 8  # 8 residual adds in forward, the bias's sum in backward
    stacked, full = trace_stacked(shared_bias, 7, fake=fake), trace(shared_bias(7), fake=fake)
    assert stacked.meta["blocks"]["extended"] is False and "not extended" in stacked.notes[0]
    assert stacked.entries == full.entries and stacked.events == full.events and stacked.peak() == full.peak()


@pytest.mark.parametrize(("num_blocks", "depths"), [(0, (3, 4)), (True, (3, 4)), (9, (2, 3)), (9, (4,)), (9, (4, 3))])
def test_bad_depths_are_refused(num_blocks: Any, depths: tuple[int, ...]):
    from trainledger.errors import InputError

    with pytest.raises(InputError):
        trace_stacked(deep, num_blocks, depths=depths)


def test_a_kernel_call_is_sized_by_what_it_returns_too():
    """An embedding's backward returns the table's gradient from small inputs: too large to run here is
    decided on all its tensors."""
    from trainledger.trace._kernels import KernelCall

    grad, idx = torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)
    call = KernelCall.of(torch.ops.aten.embedding_dense_backward.default, (grad, idx, 1000, -1, False), {})
    assert call is not None and call.tensor_bytes == grad.nbytes + idx.nbytes + 1000 * 8 * 4


# --- Hugging Face families ------------------------------------------------------------------------------

FAMILIES = ["llama", "mistral", "qwen2", "gpt2", "gpt-neox", "phi", "mixtral"]


def hf_builder(family: str, **step: Any) -> Any:
    from trainledger.hf import workload_from_hf_config

    cfg = json.loads((HF / f"{family}-small.json").read_text())
    key = "n_layer" if cfg["model_type"] == "gpt2" else "num_hidden_layers"
    return lambda depth: workload_from_hf_config({**cfg, key: depth}, micro_batch=1, seq_len=16, fake=True, **step)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_extends_to_the_full_fake_trace(family: str):
    pytest.importorskip("transformers")
    build = hf_builder(family)
    assert_same_ledger(trace_stacked(build, 7), trace(build(7), fake=True))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_with_gradient_checkpointing_extends_to_the_full_fake_trace(family: str):
    """transformers' own checkpointing of every decoder layer (``remat="full"``): before, GPT-2 and Phi were
    traced whole (the input of each layer but the last last used in the head's backward)."""
    pytest.importorskip("transformers")
    build = hf_builder(family, remat="full")
    assert_same_ledger(trace_stacked(build, 7), trace(build(7), fake=True))


@pytest.mark.slow
def test_cli_says_how_many_blocks_it_traced(tmp_path: Path, cli, cli_json):
    pytest.importorskip("transformers")
    cfg = {**json.loads((HF / "gpt2-small.json").read_text()), "n_layer": 6}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    argv = ("trace", "--hf-config", str(path), "--fake", "--seq-len", "16")
    extended, full = cli_extended_and_full(cli_json, argv, 6, "traced 3 of 6 blocks, extended")
    assert "blocks" not in full["meta"]
    assert extended["meta"]["model"] == full["meta"]["model"] == "gpt2:config"
    code, out, _ = cli(*argv)
    assert code == 0 and "traced 3 of 6 blocks, extended" in " ".join(out.split())


def test_full_depth_without_a_fake_hf_trace_is_refused(cli):
    code, out, err = cli("trace", "--model", "mlp", "--full-depth")
    assert code == 2 and not out
    assert err.strip().count("\n") == 0 and "--full-depth" in err
