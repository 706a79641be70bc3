"""Plans of steps that run under autocast, and the sweep down to the floor of models whose linear model finds no
plan there. Autocast caches each fp32 weight's low-precision copy until it exits: a copy made inside a recomputed
region is not freed with the region's saved tensors (plans were predicted 2-5% low, over their budgets)."""

from __future__ import annotations

import pytest
import torch

from trainledger.examples import GPT
from trainledger.remat import Planner, pareto, verify
from trainledger.workload import Workload


def _gpt_bf16() -> Workload:
    torch.manual_seed(0)
    model = GPT(vocab_size=128, block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.1)
    idx, tgt = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))
    return Workload(model, (idx, tgt), autocast_dtype=torch.bfloat16, name="gpt-bf16")


def _llama(width: int = 40, vocab: int = 112, seq: int = 20, **kwargs) -> Workload:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.1,
        use_cache=False,  # as a training script sets it (a plan turns it off, and warns)
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    ids = torch.randint(0, vocab, (2, seq))
    return Workload(model, {"input_ids": ids, "labels": ids}, **kwargs)


def _plans_verified(p: Planner, fractions: tuple[float, ...]) -> None:
    for fraction in fractions:
        budget = max(p.floor_bytes, int(fraction * p.plain_peak_bytes))
        plan = p.solve(budget)
        p.restore()
        v = verify(p.workload, plan, timing=False)
        assert v.passed, (fraction, plan.regions, v.to_dict())
        assert v.traced_peak_bytes == plan.predicted_peak_bytes, (fraction, plan.regions)


@pytest.mark.slow
def test_a_plan_under_autocast_keeps_the_weights_cached_copies_until_autocast_exits():
    p = Planner.build(_gpt_bf16())
    _plans_verified(p, (0.92, 0.8, 0.0))  # 0.0: the floor


@pytest.mark.slow
def test_a_hugging_face_llama_under_autocast_is_planned_within_its_budget():
    p = Planner.build(_llama(autocast_dtype=torch.bfloat16))
    _plans_verified(p, (0.8, 0.0))


@pytest.mark.slow
def test_the_sweep_reaches_the_floor_where_the_linear_model_finds_no_plan():
    """On this Llama the MILP is infeasible at the floor's own bytes (the linear model puts the floor plan above
    its replay): the sweep's last row is the floor plan, as ``plan`` returns it there; it raised NoPlan before."""
    res = pareto(_llama(width=32, vocab=128, seq=32), num_budgets=3)
    last = res.rows[-1]
    assert last.budget_bytes == res.floor_bytes
    assert last.ours is not None and last.ours.peak_bytes <= res.floor_bytes
