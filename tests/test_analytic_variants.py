"""The analytic model on config variants off the fixtures' path, against the fake trace of the same step.

Oracle: the tracer (``trace`` of ``workload_from_setup`` on fake tensors, both kernel kinds), the same
comparison ``benchmarks/analytic_sweep.py`` makes: the peak and every category's maximum within 1%. Each
case is a family and an option the analytic model once got wrong.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainledger.analytic import FAMILIES

pytest.importorskip("transformers")

from benchmarks.analytic_sweep import BASE, OPTIONS, combine, compare

WRONG = [
    # explicit head_dim: Phi's attention reads it; GPT-NeoX's rotary embedding reads it, its attention does not
    ("phi", {"head_dim": 32}, {}),
    ("phi", {"head_dim": 8}, {}),
    ("gpt_neox", {"head_dim": 32}, {}),
    # activations: relu keeps its output only; gelu_new's formula keeps four tensors in a gated MLP too
    ("llama", {"hidden_act": "relu"}, {}),
    ("llama", {"hidden_act": "gelu_new"}, {}),
    ("mixtral", {"hidden_act": "gelu_new"}, {}),
    ("gpt2", {"activation_function": "relu"}, {}),
    ("gpt_neox", {"hidden_act": "relu"}, {}),
    # GPT-NeoX-20B's gelu_fast: the same tanh formula written otherwise, seven tensors kept (it was refused)
    ("gpt_neox", {"hidden_act": "gelu_fast"}, {}),
    ("llama", {"hidden_act": "gelu_fast"}, {}),
    ("phi", {"hidden_act": "relu"}, {}),
    # a rotary fraction given in rope_scaling wins over the family's own key
    ("phi", {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.25}}, {}),
    # Phi's LayerNorm over each query and key head keeps its input and statistics
    ("phi", {"qk_layernorm": True}, {}),
    # a sliding window shorter than the sequence puts a mask into SDPA: grouped heads repeated, the mask kept
    ("mistral", {"sliding_window": 16}, {}),
    ("mixtral", {"sliding_window": 16}, {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, {}),
    # with every layer checkpointed the rotary cos/sin are held by the checkpoints, not saved
    ("llama", {}, {"remat": "full"}),
    # GPT-2's eager attention from fp32 copies of q and k, softmax in fp32
    ("gpt2", {"reorder_and_upcast_attn": True}, {"attn_impl": "eager"}),
]


# Both kernel kinds run in the whole suite; the fast subset keeps the CPU kind (each case traces a model).
KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("family", "config", "step"), WRONG, ids=[f"{f}-{c}{s}" for f, c, s in WRONG])
def test_estimate_within_1_percent_of_the_trace_on_a_variant(family, config, step, kind):
    row = compare(family, f"{config} {step}", config, step, (1, "0"), kind)
    assert row.status == "ok", (row.status, row.diffs, row.detail)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_a_tied_heads_gradient_is_made_in_the_heads_backward(kind):
    """GPT-2 under full recomputation peaks in the first layer's recomputed backward, where the tied embedding's
    gradient (made by the head's matmul) already lives. The peak within 1%; the workspace's maximum is still
    1.6% high there (a recomputed layer's transients, listed in benchmarks/results/analytic_sweep.md)."""
    row = compare("gpt2", "--remat full", {}, {"remat": "full"}, (1, "0"), kind)
    assert abs(row.peak_diff) <= 0.01
    assert {c for c, *_ in row.diffs} <= {"workspace"}


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_option_combinations_agree_with_the_trace_or_are_refused(data):
    """Two to four of the sweep's options at once, in either kernel kind: within 1% on the peak and every
    category's maximum, or refused in one line (by the estimate, or by transformers for the trace)."""
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    # full recomputation's temporaries are approximated (the estimate's notes say so; the remaining gaps are
    # listed in benchmarks/results/analytic_sweep.md): left out here
    pool = [o for o in OPTIONS if family in o.families and "remat" not in o.step]
    picked = data.draw(
        st.lists(st.sampled_from(pool), min_size=2, max_size=4, unique_by=lambda o: o.name), label="options"
    )
    kind = data.draw(st.sampled_from(["cpu", "cuda"]), label="kind")
    config, step, world = combine(picked)
    row = compare(family, " + ".join(o.name for o in picked), config, step, world, kind)
    assert row.status != "differs", (row.option, row.diffs, row.detail)
    assert all("\n" not in part for part in row.detail.split("; "))


def test_qwen2_layer_types_are_read_or_refused_in_one_line():
    """transformers ≥ 4.53 saves ``layer_types`` with a Qwen2 config: full layers then sliding ones are the
    pattern ``max_window_layers`` makes (read as such); any other pattern is refused, not guessed."""
    from trainledger.analytic import arch_from_config
    from trainledger.errors import InputError

    cfg = {"model_type": "qwen2", **BASE["qwen2"], "use_sliding_window": True, "sliding_window": 16}
    spec = arch_from_config({**cfg, "layer_types": ["full_attention", "sliding_attention"]})
    assert (spec.sliding_window, spec.sliding_from) == (16, 1)
    assert arch_from_config({**cfg, "max_window_layers": 1}) == spec
    assert arch_from_config({**cfg, "layer_types": ["full_attention"] * 2}).sliding_window == 0
    with pytest.raises(InputError, match="full_attention layers followed by sliding_attention") as err:
        arch_from_config({**cfg, "layer_types": ["sliding_attention", "full_attention"]})
    assert "\n" not in str(err.value)
