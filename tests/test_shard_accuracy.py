"""Held-out models (``tests/fixtures/shard_models.py``) run on gloo ranks: every rank's predicted peak
equals its trace, and the collectives counted at every ``c10d`` call equal the prediction.

Each case names the cause it guards (see ``docs/shard.md``); ``python -m benchmarks.shard_accuracy``
runs the whole set on 2, 3 and 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainledger.shard.launch import RunConfig, run
from trainledger.sources import load_workload
from trainledger.workload import Workload

MODELS = Path(__file__).parent / "fixtures" / "shard_models.py"

CASES = [
    ("lm_loss_fn", 3),  # the loss outside the model runs between the root's hooks
    ("lm_depth1", 3),  # one unit, the root: gloo's worker threads let go of its buffers
    ("uneven_mlp", 2),  # rows no rank count divides; each unit's last gradient held through its reduce
    ("lm_sgd_gate", 2),  # a (1, C) gate: rank 1 holds no real row of it; SGD's momentum
    ("lm_lora", 1),  # ZeroRedundancyOptimizer: the rank's own parameters, in its own order
    ("conv_net", 0),  # DDP: buffers broadcast, buckets rebuilt (the first one small)
    ("conv_unet", 3),  # convolutions' buffers follow the thread count: a rank's, not one whole process's
    ("routed_experts", 3),  # the root's final reduce-scatter: the loss and its seed are still held
    ("routed_experts", 1),  # the loss gone as the optimizer begins, whatever the rank's parameter order
    ("parameter_chain", 3),  # a ParameterList: parameters of the root, not units
    ("mixed_dtype", 3),  # a bf16 unit of an fp32 model reduce-scatters bf16 gradients
    ("mixed_dtype", 0),  # ... and DDP keeps a bucket per dtype, each gradient in its own
    ("nested_lists", 3),  # lists of lists: the layers are the units, not the lists FSDP cannot wrap
    ("checkpointed_blocks", 2),  # checkpoint() keeps the RNG state before FSDP's pre-forward gathers the block
    ("frozen_stem", 3),  # a frozen first unit fed the batch: prefetched in backward for nothing
    ("frozen_stem", 2),  # ... and kept gathered until backward's final callback
    ("detached_middle", 3),  # a unit under no_grad; the trainable unit before it gets no gradient to reduce
    ("master_weights", 1),  # a rank's optimizer makes fp32 masters and their gradients for its own parameters
    ("bare_sequential", 3),  # the model is an nn.Sequential: its children are the units (it had none)
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stage"), CASES)
def test_held_out_model_predicted_equals_traced(name, stage):
    res = run(RunConfig(model=f"{MODELS}:{name}", world_size=2, strategy=f"zero{stage}", timeout_seconds=300))
    ranks = res.to_dict()["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["predicted_peak_bytes"] == r["traced_peak_bytes"], r["predicted_peak"]
        assert r["collectives"] == r["predicted_collectives"]
    for report in res.ranks:  # every free of the traced step happened where the rank dropped the buffer
        assert report.ledger is not None and "frees_on_other_threads" not in report.ledger.meta


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stage"), [("lm_tied", 3), ("frozen_stem", 2), ("uneven_mlp", 1)])
def test_one_rank_predicted_equals_traced(name, stage):
    """On one rank FSDP2 copies each shard into its parameter without a flat buffer or a collective, and DDP
    still keeps its buckets and calls its all-reduce."""
    res = run(RunConfig(model=f"{MODELS}:{name}", world_size=1, strategy=f"zero{stage}", timeout_seconds=300))
    (rank,) = res.to_dict()["ranks"]
    assert rank["predicted_peak_bytes"] == rank["traced_peak_bytes"], rank["predicted_peak"]
    assert rank["collectives"] == rank["predicted_collectives"]
    assert bool(rank["collectives"]) == (stage < 2)


def test_held_out_models_vary_what_sharding_cares_about():
    """The held-out factories build, and between them cover the axes the set is meant to vary."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("shard_models_check", MODELS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    configs = module.VARIANTS.values()
    assert {c.num_layers for c in configs} >= {1, 2, 3, 4, 5, 6}
    # rows that 2, 3 or 4 ranks do not divide evenly: 100 (by 3), the vocabularies 257 (by any) and 1000 (by 3)
    assert {c.width for c in configs} >= {48, 64, 72, 100} and {c.vocab_size for c in configs} >= {257, 1000}
    assert {c.tie for c in configs} == {"none", "head_takes_embedding", "head_declared_first"}
    assert {c.frozen for c in configs} == {"none", "embeddings", "first_blocks", "lora"}
    assert {c.loss for c in configs} == {"model", "loss_fn"} and {c.wrapped for c in configs} == {True, False}
    assert {c.optimizer for c in configs} == {"adamw", "adamw_groups", "adam", "sgd"}
    assert {c.dtype for c in configs} == {torch.float32, torch.bfloat16}
    assert {c.dropout > 0 for c in configs} == {True, False} and {c.bias for c in configs} == {True, False}
    for name in ("lm_tied", "lm_head_declared_first", "lm_lora", "uneven_mlp", "conv_net"):
        w = load_workload(f"{MODELS}:{name}")
        assert isinstance(w, Workload)
    tied = load_workload(f"{MODELS}:lm_head_declared_first").model
    assert next(iter(tied.named_parameters()))[0] == "head.weight" and tied.head.weight is tied.wte.weight
    frozen = [n for n, p in load_workload(f"{MODELS}:lm_lora").model.named_parameters() if not p.requires_grad]
    assert frozen and all(".base." in n for n in frozen)
