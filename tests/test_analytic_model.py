"""The analytic ledger: structure, recomputation policies and parallel degrees, checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainledger.analytic import Setup, arch_from_config, param_tensors
from trainledger.analytic._activations import embedding_saved
from trainledger.analytic._model import analytic_ledger, compact, saved_bytes_per_layer, step_flops
from trainledger.ledger import Category

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
LLAMA7B = arch_from_config(json.loads((FIXTURES / "llama-2-7b.json").read_text()))


def test_peak_is_one_instant_and_state_is_exact():
    led = analytic_ledger(LLAMA7B, Setup(micro_batch=1, seq_len=4096, recipe="bf16", device="cpu"))
    pk = led.peak()
    assert pk.bytes == led.live_bytes(pk.event) == sum(pk.by_category.values())
    assert led.sum_of_category_maxima() >= pk.bytes
    P = led.num_params()
    assert led.bytes_by("category")[("weights",)] == 2 * P
    moments = sum(e.nbytes for e in led.select(category="optimizer") if e.role in ("exp_avg", "exp_avg_sq"))
    assert moments == 4 * P  # pure bf16: moments in bf16
    assert all(e.evidence.value == "analytic" for e in led.entries)


def test_selective_recomputation_drops_exactly_the_attention_core():
    base = {"micro_batch": 2, "seq_len": 1024, "recipe": "bf16", "attn_impl": "eager"}
    none = saved_bytes_per_layer(LLAMA7B, Setup(**base))
    sel = saved_bytes_per_layer(LLAMA7B, Setup(**base, remat="selective"))
    B, nh, T = 2, 32, 1024
    # eager keeps the fp32 softmax (4 B) and its bf16 cast (2 B) per head and query/key pair
    assert none - sel == (4 + 2) * B * nh * T * T
    led_none = analytic_ledger(LLAMA7B, Setup(**base))
    led_sel = analytic_ledger(LLAMA7B, Setup(**base, remat="selective"))
    assert led_none.category_maxima()["activations"] - led_sel.category_maxima()["activations"] == 32 * (none - sel)


def test_full_recomputation_keeps_each_layer_input():
    s = Setup(micro_batch=1, seq_len=4096, recipe="bf16", remat="full")
    led = analytic_ledger(LLAMA7B, s)
    kept = [e for e in led.select(category="activations") if e.name.endswith("checkpoint.input")]
    assert len(kept) == 32 and all(e.nbytes == 2 * 4096 * 4096 for e in kept)
    every4 = analytic_ledger(LLAMA7B, Setup(micro_batch=1, seq_len=4096, recipe="bf16", remat="full", remat_every=4))
    assert sum(e.name.endswith("checkpoint.input") for e in every4.entries) == 8


def test_pipeline_first_stage_holds_p_micro_batches():
    p = 4
    s = Setup(micro_batch=1, seq_len=2048, recipe="bf16", pipeline_parallel=p, pipeline_stage=0)
    led = analytic_ledger(LLAMA7B, s)
    layers = {e.name.split(".")[2] for e in led.select(category="weights") if e.name.startswith("model.layers.")}
    assert layers == {str(i) for i in range(8)}  # 32 layers over 4 stages
    per_layer = saved_bytes_per_layer(LLAMA7B, s)
    assert saved_bytes_per_layer(LLAMA7B, Setup(**{**s.__dict__, "remat": "full"})) == 2 * 2048 * 4096
    emb = sum(x.nbytes for x in embedding_saved(LLAMA7B, s, 1))
    held = sum(e.nbytes for e in led.select(category="activations") if e.persistent)  # earlier micro-batches
    assert held == (p - 1) * (8 * per_layer + emb)
    last = analytic_ledger(LLAMA7B, Setup(**{**s.__dict__, "pipeline_stage": p - 1}))
    assert not any(e.persistent for e in last.select(category="activations"))  # one micro-batch in flight
    assert "lm_head.weight" in {e.name for e in last.entries} and "lm_head.weight" not in {e.name for e in led.entries}


def test_tensor_parallel_divides_the_split_weights_only():
    t = 4
    led = analytic_ledger(LLAMA7B, Setup(micro_batch=1, seq_len=2048, recipe="bf16", tensor_parallel=t))
    expected = sum((-(-p.numel // t) if p.tp_split else p.numel) for p in param_tensors(LLAMA7B))
    assert led.num_params() == expected
    norms = sum(p.numel for p in param_tensors(LLAMA7B) if not p.tp_split)
    assert norms == 65 * 4096  # two RMSNorms per layer and the final one stay whole


def test_compact_keeps_the_peak():
    s = Setup(micro_batch=2, seq_len=2048)
    led = analytic_ledger(LLAMA7B, s)
    small = compact(led)
    assert len(small.entries) < 0.6 * len(led.entries)
    assert abs(small.peak().bytes - led.peak().bytes) <= 4 * len(led.entries)  # merged step counters only
    assert small.peak().event == led.peak().event


@pytest.mark.parametrize("recipe", ["bf16-master", "bf16", "fp32"])
@pytest.mark.parametrize("stage", ["zero0", "zero1", "zero2", "zero3"])
def test_compact_keeps_every_ranks_peak(recipe, stage):
    """``fit`` shards the compacted step: each rank's peak is the whole step's (a micro-batch of 1 peaks in the
    optimizer step with bf16-master, where its fp32 master gradients, merged per lifetime, were kept whole on
    every rank: 48.8 GB at ZeRO-2 against the whole step's 37.7)."""
    from trainledger.shard import ShardConfig, shard

    led = analytic_ledger(LLAMA7B, Setup(micro_batch=1, seq_len=2048, recipe=recipe))
    whole, merged = (
        shard(x, ShardConfig(world_size=8, strategy=stage, engine="deepspeed")).ranks[0].peak().bytes
        for x in (led, compact(led))
    )
    assert abs(merged - whole) <= 4 * len(led.entries)  # merged step counters only


def test_step_flops_by_hand():
    """2·N·(matmul parameters) + attention 4·N·T·(nh·hd) per layer + the head; full remat adds a forward."""
    s = Setup(micro_batch=1, seq_len=4096)
    fwd, re = step_flops(LLAMA7B, s)
    N, H, I, L, V, T = 4096, 4096, 11008, 32, 32000, 4096
    per_layer = 2 * N * (4 * H * H + 3 * H * I) + 4 * N * T * H
    assert fwd == L * per_layer + 2 * N * H * V and re == 0
    _, re_full = step_flops(LLAMA7B, Setup(micro_batch=1, seq_len=4096, remat="full"))
    assert re_full == L * per_layer


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_divides_state_by_the_world(stage):
    from trainledger.analytic._estimate import estimate

    cfg = json.loads((FIXTURES / "llama-2-7b.json").read_text())
    r = estimate(cfg, Setup(micro_batch=1, seq_len=2048, device="cpu"), world=8, stage=str(stage))
    persistent = {
        c: sum(e.nbytes for e in r.ledger.entries if e.category == Category(c) and e.persistent)
        for c in ("weights", "optimizer")
    }
    P = r.num_params
    assert persistent["optimizer"] == pytest.approx(12 * P / 8, rel=1e-3)  # master + two moments, divided
    assert persistent["weights"] == pytest.approx(2 * P / (8 if stage == 3 else 1), rel=1e-3)


def test_the_analytic_model_imports_no_torch():
    """Pure arithmetic on configs and ledgers: no torch or transformers import anywhere in the package."""
    import ast

    import trainledger.analytic as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("torch", "transformers") for n in names), (path.name, names)


def test_notes_say_where_a_setup_is_not_validated_or_changes_nothing():
    def notes(**setup: object) -> str:
        return " ".join(analytic_ledger(LLAMA7B, Setup(micro_batch=1, seq_len=512, **setup)).notes)  # type: ignore[arg-type]

    assert "exact for the Llama family" in notes(lora_rank=8)  # the usual targets, q_proj and v_proj
    assert "not validated" in notes(lora_rank=8, lora_targets=("down_proj",))
    assert "changes nothing here" in notes(remat="selective")  # sdpa keeps no T×T tensor to drop
    assert "changes nothing here" not in notes(remat="selective", attn_impl="eager")
