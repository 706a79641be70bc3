"""The math SDPA backend in a CUDA-kind trace: its composite run op for op with CUDA's fused dropout.

The oracle for the composite is PyTorch's own ``_scaled_dot_product_attention_math``: with the CPU's dropout
in place of CUDA's, ``math_attention`` allocates and frees what the C++ op does, entry for entry and event for
event, across dtypes, masks, grouped heads and scales."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainledger.ledger import Category, Ledger
from trainledger.trace import trace
from trainledger.trace._cuda import math_attention
from trainledger.workload import Workload

B, H, T, D = 2, 4, 12, 8


class _Attention(nn.Module):
    """Projections, an attention function, a loss: the attention's saved tensors are the step's largest."""

    def __init__(self, attend, *, kv_heads: int, dtype: torch.dtype, mask: bool) -> None:
        super().__init__()
        self.q = nn.Linear(D, H * D).to(dtype)
        self.kv = nn.Linear(D, 2 * kv_heads * D).to(dtype)
        self.attend, self.kv_heads = attend, kv_heads
        self.mask = nn.Parameter(torch.randn(T, T, dtype=dtype)) if mask else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(B, T, H, D).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, D).permute(2, 0, 3, 1, 4)
        return self.attend(q, k, v, self.mask).float().square().mean()


def _cpu_dropout(attn: torch.Tensor, p: float) -> torch.Tensor:
    return torch.dropout(attn, p, True)  # at::dropout, as the C++ op calls it


def _entries(ledger: Ledger) -> list[tuple]:
    return [
        (e.name, e.category, e.role, e.dtype, e.shape, e.nbytes, e.alloc_event, e.free_event, e.last_use_event)
        for e in ledger.entries
    ]


_SLOW = pytest.mark.slow  # two traces each, about 2.5 s; one case stays in the fast subset
CASES = [
    # dtype, dropout, causal, float mask, kv heads, scale
    pytest.param(torch.bfloat16, 0.2, True, False, 2, None),
    pytest.param(torch.float32, 0.0, False, False, H, None, marks=_SLOW),
    pytest.param(torch.float32, 0.2, True, False, H, None, marks=_SLOW),
    pytest.param(torch.float16, 0.1, False, True, H, 0.3, marks=_SLOW),
    pytest.param(torch.bfloat16, 0.3, False, True, 1, -0.25, marks=_SLOW),
    pytest.param(torch.float32, 0.1, False, False, 2, 2.0, marks=_SLOW),
]


@pytest.mark.parametrize("reduced", [False, pytest.param(True, marks=_SLOW)], ids=["fp32-math", "reduced-precision"])
@pytest.mark.parametrize(("dtype", "p", "causal", "mask", "kv_heads", "scale"), CASES)
def test_the_composite_allocates_what_the_cpp_op_does(dtype, p, causal, mask, kv_heads, scale, reduced):
    gqa = kv_heads != H

    def cpp(q, k, v, m):
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, m, p, causal, None, scale=scale, enable_gqa=gqa
        )[0]

    def ours(q, k, v, m):
        return math_attention(q, k, v, m, p, causal, scale, gqa, dropout=_cpu_dropout)

    def step(attend) -> Workload:
        torch.manual_seed(0)
        model = _Attention(attend, kv_heads=kv_heads, dtype=dtype, mask=mask)
        return Workload(model, torch.randn(B, T, D, dtype=dtype), name="math-attention")

    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
    try:
        expected, got = (trace(step(f), kernel_workspace=False) for f in (cpp, ours))
        torch.manual_seed(1)
        x = torch.randn(B, H, T, D, dtype=dtype)
        kv = torch.randn(B, kv_heads, T, D, dtype=dtype)
        m = torch.randn(T, T, dtype=dtype) if mask else None
        torch.manual_seed(2)
        want = cpp(x, kv, kv.flip(-1), m)
        torch.manual_seed(2)
        have = ours(x, kv, kv.flip(-1), m)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)
    assert len(expected.entries) > 20
    assert _entries(got) == _entries(expected)
    assert torch.equal(have, want)  # the same values too: the same ops in the same order


def test_a_cuda_kind_trace_on_a_card_that_runs_math_keeps_cudas_bool_dropout_mask():
    """bf16 on a V100 runs the math backend (no fused kernel takes bf16 there). Saved per attention, T×T each:
    the softmax output and the dropped-out weights in fp32 (the op upcasts) and the mask: 1 byte per element
    from CUDA's fused dropout, where the CPU's dropout keeps 4."""

    def sdpa(q, k, v, m):
        return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True)

    def step() -> Workload:
        model = _Attention(sdpa, kv_heads=2, dtype=torch.bfloat16, mask=False)
        return Workload(model, torch.randn(B, T, D, dtype=torch.bfloat16), name="math-attention")

    cuda = trace(step(), kernel_kind="cuda", cuda_device="v100", fake=True)
    cpu = trace(step(), fake=True, kernel_workspace=False)
    assert cuda.meta["sdpa_backends"] == {"math": 1}

    def square(ledger: Ledger) -> dict[str, int]:
        saved = [e for e in ledger.entries if e.category == Category.ACTIVATIONS and e.shape[-2:] == (T, T)]
        return {dtype: sum(e.nbytes for e in saved if e.dtype == dtype) for dtype in {e.dtype for e in saved}}

    n = B * H * T * T
    assert square(cuda) == {"float32": 2 * 4 * n, "bool": n}
    assert square(cpu) == {"float32": 3 * 4 * n}
    (mask,) = [e for e in cuda.entries if e.dtype == "bool" and e.category == Category.ACTIVATIONS]
    assert "native_dropout" in mask.kernel


@pytest.mark.slow  # a Hugging Face step traced, about 6 s
@pytest.mark.parametrize("fixture", ["mistral-small", "qwen2-small"])
def test_analytic_cuda_variant_agrees_where_grouped_heads_in_fp32_run_math_with_dropout(fixture, tmp_path):
    """Grouped key/value heads in fp32 leave only the math kernel on an H100; with attention dropout its mask is
    CUDA's bool one in the trace and in the analytic model alike."""
    pytest.importorskip("transformers")
    import json
    from pathlib import Path

    from trainledger.analytic import Setup, analytic_ledger, arch_from_config
    from trainledger.hf import workload_from_hf_config

    config = json.loads((Path(__file__).parent / "fixtures" / "hf" / f"{fixture}.json").read_text())
    config["attention_dropout"] = 0.1
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    kw = {"micro_batch": 2, "seq_len": 128, "recipe": "fp32", "attn_impl": "sdpa"}
    traced = trace(workload_from_hf_config(path, fake=True, **kw), kernel_kind="cuda")
    assert traced.meta["sdpa_backends"] == {"math": config["num_hidden_layers"]}
    masks = [e for e in traced.entries if e.dtype == "bool" and e.category == Category.ACTIVATIONS]
    assert len(masks) == config["num_hidden_layers"] and all(e.shape[-2:] == (128, 128) for e in masks)
    analytic = analytic_ledger(arch_from_config(config), Setup(device="cuda", **kw))
    a, t = analytic.peak(), traced.peak()
    assert abs(a.bytes - t.bytes) <= 0.01 * t.bytes and a.phase == t.phase == "backward"
    acts = analytic.category_maxima()["activations"], traced.category_maxima()["activations"]
    assert abs(acts[0] - acts[1]) <= 0.01 * acts[1]
