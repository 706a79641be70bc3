"""A checkpointed region recomputed in backward runs CUDA's kernels too, in a CUDA-kind trace. One oracle is
``torch.utils.checkpoint`` itself: it compares every tensor the recomputation saves with the forward's (shape,
dtype) and raised on the difference when the recomputed dropout made the CPU's float mask."""

from __future__ import annotations

import re

import pytest
from torch.utils.checkpoint import checkpoint

from trainledger.examples import gpt_tiny
from trainledger.ledger import Ledger
from trainledger.trace import trace

NUM_LAYERS = 2
DROPOUTS_PER_BLOCK = 3  # gpt_tiny: attention weights, attention output, MLP output


def _dropouts(ledger: Ledger) -> int:
    """The dropouts the CUDA-kind trace substituted, as its note counts them."""
    (note,) = [n for n in ledger.notes if "dropouts as native_dropout" in n]
    found = re.search(r"(\d+) dropouts as native_dropout", note)
    assert found is not None
    return int(found.group(1))


@pytest.mark.slow  # three traces, about 6 s
def test_a_checkpointed_block_recomputes_with_cudas_fused_dropout():
    def build():
        return gpt_tiny(n_layer=NUM_LAYERS, n_embd=16, n_head=2, seq_len=8, batch_size=2)

    plain = trace(build(), kernel_kind="cuda")
    workload = build()
    for block in workload.model.blocks:
        block.forward = lambda *a, f=block.forward: checkpoint(f, *a, use_reentrant=False)
    ledger = trace(workload, kernel_kind="cuda")  # raised CheckpointError (a float mask recomputed)
    # each block's dropouts run again in its recomputation, substituted as in the forward
    assert _dropouts(ledger) == _dropouts(plain) + NUM_LAYERS * DROPOUTS_PER_BLOCK
    # the forward's masks are dropped (the blocks are checkpointed); the recomputation's are CUDA's bool ones
    recomputed = [e for e in ledger.entries if e.role == "backward_temporary" and e.dtype == "bool"]
    assert len(recomputed) >= NUM_LAYERS * DROPOUTS_PER_BLOCK
