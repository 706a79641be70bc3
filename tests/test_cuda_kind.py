"""CUDA-kind traces: the step as PyTorch's CUDA kernels would run it, on fake CPU tensors.

Oracles: the dispatcher's rules read from PyTorch's sources (``sdp_utils.cpp``, ``Dropout.cpp``,
``CublasHandlePool.cpp``, ``optimizer.py``), the shapes each CUDA op's meta kernel declares, and the
parameters' own sizes; the analytic model's CUDA variant against the CUDA-kind trace of every family."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from trainledger.devices import MiB, SdpaCall, cublas_workspace_bytes, lookup, sdpa_backend
from trainledger.errors import InputError
from trainledger.examples import EXAMPLES
from trainledger.ledger import Category, Evidence
from trainledger.trace import trace
from trainledger.workload import Workload

BF16 = SdpaCall(
    dtype="bfloat16", head_dim=64, num_heads=8, num_kv_heads=8, has_mask=False, dropout=0.0, requires_grad=True
)


@pytest.mark.parametrize(
    ("card", "change", "backend"),
    [
        ("A100", {}, "flash"),
        ("H100", {}, "cudnn"),  # check_prefer_cudnn_attention: sm90 puts cuDNN first
        ("H100", {"dropout": 0.1}, "flash"),
        ("H100", {"num_kv_heads": 2}, "flash"),  # flash reads grouped heads
        ("H100", {"dtype": "float32"}, "efficient"),  # flash takes fp16/bf16 only
        ("H100", {"dtype": "float32", "num_kv_heads": 2}, "math"),  # memory-efficient: no grouped heads
        ("A100", {"has_mask": True}, "efficient"),  # flash takes no mask
        ("A100", {"head_dim": 320}, "efficient"),  # flash: head dim at most 256
        ("RTX-4090", {"head_dim": 200}, "efficient"),  # sm89 training: (192, 224] is not flash's
        ("RTX-4090", {"head_dim": 200, "requires_grad": False}, "flash"),
        ("V100", {}, "math"),  # sm70: neither flash nor bf16 memory-efficient
        ("V100", {"dtype": "float16"}, "efficient"),
        ("A100", {"dtype": "float32", "head_dim": 66}, "math"),  # not a multiple of the GEMM alignment (4)
    ],
)
def test_sdpa_backend_follows_the_dispatchers_checks(card, change, backend):
    assert sdpa_backend(lookup(card), replace(BF16, **change)) == backend


def test_cudnn_can_be_deprioritized(monkeypatch):
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert sdpa_backend(lookup("H100"), BF16) == "flash"


def test_cublas_workspace_per_compute_capability_and_config():
    assert cublas_workspace_bytes(lookup("A100")) == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert cublas_workspace_bytes(lookup("H200")) == cublas_workspace_bytes(lookup("H100")) == 32 * MiB
    assert cublas_workspace_bytes(lookup("A100"), ":4096:8:16:2") == 4096 * 1024 * 8 + 16 * 1024 * 2
    with pytest.raises(InputError, match="SIZE_KiB:COUNT"):
        cublas_workspace_bytes(lookup("A100"), ":4096")


class _Attention(nn.Module):
    """One self-attention layer through ``F.scaled_dot_product_attention``, then a LayerNorm."""

    def __init__(self, width: int = 64, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.norm = nn.LayerNorm(width)
        self.heads, self.dropout = heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, T, D)
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        y = nn.functional.dropout(y.transpose(1, 2).reshape(B, T, C), self.dropout, self.training)
        return self.norm(y).float().pow(2).mean()


def _attention_step(*, dropout: float = 0.0, dtype: torch.dtype = torch.bfloat16, T: int = 48) -> Workload:
    model = _Attention(dropout=dropout).to(dtype)
    return Workload(model, torch.randn(2, T, 64, dtype=dtype), name="attention")


def _saved(ledger, prefix):
    return [e for e in ledger.entries if e.name.startswith(prefix)]


def test_the_cuda_backend_op_runs_and_autograd_saves_its_log_sum_exp():
    B, H, T = 2, 4, 48
    h100 = trace(_attention_step(), kernel_kind="cuda")
    a100 = trace(_attention_step(), kernel_kind="cuda", cuda_device="a100")
    assert h100.meta["sdpa_backends"] == {"cudnn": 1} and a100.meta["sdpa_backends"] == {"flash": 1}
    lse = [e for e in _saved(h100, "aten._scaled_dot_product_cudnn_attention") if e.dtype == "float32"]
    assert [e.shape for e in lse] == [(B, H, T, 1)] and lse[0].category == Category.ACTIVATIONS
    lse = [e for e in _saved(a100, "aten._scaled_dot_product_flash_attention#") if e.dtype == "float32"]
    assert [(e.shape, e.category) for e in lse] == [((B, H, T), Category.ACTIVATIONS)]
    assert all(e.kernel.startswith("cuda: flash attention") for e in _saved(a100, "aten._scaled_dot_product_flash"))
    cpu = trace(_attention_step(), fake=True, kernel_workspace=False)
    assert _saved(cpu, "aten._scaled_dot_product_flash_attention_for_cpu") and not _saved(
        cpu, "aten._scaled_dot_product_flash_attention#"
    )


def test_memory_efficient_log_sum_exp_is_padded_to_32_rows():
    led = trace(_attention_step(dtype=torch.float32, T=40), kernel_kind="cuda")
    assert led.meta["sdpa_backends"] == {"efficient": 1}
    lse = [
        e
        for e in _saved(led, "aten._scaled_dot_product_efficient_attention")
        if e.dtype == "float32" and len(e.shape) == 3
    ]
    assert [e.shape for e in lse] == [(2, 4, 64)]  # ceil(40 / 32) * 32 rows


def test_dropout_keeps_a_bool_mask_and_attention_no_quadratic_tensors():
    """On the CPU, SDPA with dropout runs the math kernel (T×T tensors saved) and dropout keeps a mask in the
    input's dtype; CUDA runs flash with dropout (RNG state only) and the fused native_dropout (bool mask)."""
    T, numel = 48, 2 * 48 * 64
    cuda = trace(_attention_step(dropout=0.1, T=T), kernel_kind="cuda")
    cpu = trace(_attention_step(dropout=0.1, T=T), fake=True, kernel_workspace=False)
    quadratic = [e for e in cpu.entries if e.category == Category.ACTIVATIONS and e.shape[-2:] == (T, T)]
    assert quadratic and not [e for e in cuda.entries if e.shape[-2:] == (T, T)]
    assert cuda.meta["sdpa_backends"] == {"flash": 1}
    masks = [e for e in _saved(cuda, "aten.native_dropout") if e.category == Category.ACTIVATIONS and e.dtype == "bool"]
    assert [e.numel for e in masks] == [numel] and "native_dropout" in masks[0].kernel
    assert not [e for e in cpu.entries if e.dtype == "bool" and e.category == Category.ACTIVATIONS]


def test_normalization_statistics_are_fp32_and_labelled():
    cuda = trace(_attention_step(), kernel_kind="cuda")
    cpu = trace(_attention_step(), fake=True, kernel_workspace=False)
    stats = [e for e in _saved(cuda, "aten.native_layer_norm#") if e.shape == (2, 48, 1)]
    assert [e.dtype for e in stats] == ["float32", "float32"] and all("fp32" in e.kernel for e in stats)
    assert [e.dtype for e in _saved(cpu, "aten.native_layer_norm#") if e.shape == (2, 48, 1)] == ["bfloat16"] * 2


def test_foreach_optimizer_holds_every_second_moments_sqrt_at_once_and_the_users_optimizer_is_untouched():
    w = _attention_step(dtype=torch.float32)
    optimizer = torch.optim.AdamW(w.model.parameters())
    w.optimizer = optimizer
    before = [p.detach().clone() for p in w.model.parameters()]
    led = trace(w, kernel_kind="cuda")
    assert [g["foreach"] for g in optimizer.param_groups] == [None] and not optimizer.state
    assert all(torch.equal(a, p) for a, p in zip(before, w.model.parameters(), strict=True))
    sqrt = [e for e in led.entries if e.name.startswith("aten._foreach_sqrt#")]
    second = sum(e.nbytes for e in led.entries if e.role == "exp_avg_sq")
    assert sum(e.nbytes for e in sqrt) == second and len({e.alloc_event for e in sqrt}) == 1
    peak = led.peak()
    assert peak.phase == "optimizer" or peak.by_category["workspace"] >= second
    assert any("fake tensors" in n for n in led.notes)  # a real model ran as a fake step


def test_declared_entries_device_and_json(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    led = trace(EXAMPLES["mlp"](), kernel_kind="cuda", cuda_device="a100-40gb", world_size=4)
    (workspace,) = [e for e in led.entries if e.role == "cublas_workspace"]
    assert (workspace.nbytes, workspace.evidence, workspace.persistent) == (32 * MiB, Evidence.DECLARED, True)
    assert led.device == "cuda" and {e.device for e in led.entries} == {"cuda"}
    assert (led.meta["kernel_kind"], led.meta["cuda_device"]) == ("cuda", "A100-40GB")
    outside = {o["name"]: o["bytes"] for o in led.meta["outside_allocator"]}
    assert outside == {"cuda_context": lookup("a100-40gb").context_bytes, "nccl_buffers": 2 * 4 * MiB * 16}
    data = led.to_dict()
    assert "kernel" in data["entries"][-1] and all("kernel" not in e or e["kernel"] for e in data["entries"])
    assert led.peak().bytes == sum(e.nbytes for e in led.entries if e.live_at(led.peak().event))


def test_bad_kernel_kinds_are_refused():
    with pytest.raises(InputError, match="kernel kind 'rocm'"):
        trace(EXAMPLES["mlp"](), kernel_kind="rocm")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="kernel_kind='cuda'"):
        trace(EXAMPLES["mlp"](), cuda_device="h100")
    with pytest.raises(InputError, match="with --device-kind cpu"):
        trace(EXAMPLES["moe"](), kernel_kind="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in EXAMPLES if n != "moe"])
def test_every_built_in_example_traces_with_cuda_kernels(name):
    led = trace(EXAMPLES[name](), kernel_kind="cuda")
    assert led.device == "cuda" and any(e.role == "cublas_workspace" for e in led.entries)
    assert led.peak().bytes > cublas_workspace_bytes(lookup("H100"))


FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*-small.json")), ids=lambda p: p.stem)
@pytest.mark.parametrize(("attn", "recipe"), [("sdpa", "bf16"), ("sdpa", "fp32"), ("eager", "fp32")])
def test_analytic_cuda_variant_within_1_percent_of_the_cuda_kind_trace(path, attn, recipe):
    """Peak, phase and the activations' maximum (2 × 128 tokens puts the peak in backward); on the default H100
    bf16 SDPA runs cuDNN or flash (grouped heads), fp32 memory-efficient or math (grouped heads)."""
    pytest.importorskip("transformers")
    from trainledger.analytic import Setup, analytic_ledger, arch_from_config
    from trainledger.hf import workload_from_hf_config

    if "mixtral" in path.stem:  # torch's fake grouped matmul takes bf16 only
        recipe = "bf16"
    kw = {"micro_batch": 2, "seq_len": 128, "recipe": recipe, "attn_impl": attn}
    traced = trace(workload_from_hf_config(path, fake=True, **kw), kernel_kind="cuda")
    analytic = analytic_ledger(arch_from_config(json.loads(path.read_text())), Setup(device="cuda", **kw))
    a, t = analytic.peak(), traced.peak()
    assert abs(a.bytes - t.bytes) <= 0.01 * t.bytes and a.phase == t.phase == "backward"
    acts = analytic.category_maxima()["activations"], traced.category_maxima()["activations"]
    assert abs(acts[0] - acts[1]) <= 0.01 * acts[1]


def test_cli_trace_and_estimate_name_the_kernel_kind_first(cli, cli_json):
    code, out, _ = cli("trace", "--model", "mlp", "--device-kind", "cuda", "--device", "a100")
    assert code == 0 and out.splitlines()[1].startswith("kernels: cuda as on A100-80GB")
    assert "cuda_context 536,870,912 bytes" in out.splitlines()[2]
    data = cli_json("trace", "--model", "mlp", "--device-kind", "cuda")
    assert (data["kernel_kind"], data["device"], data["meta"]["cuda_device"]) == ("cuda", "cuda", "H100-80GB-SXM")
    code, out, _ = cli("estimate", "--hf-config", str(FIXTURES / "llama-small.json"), "--device", "l4")
    assert code == 0 and out.startswith("kernels: cuda as on L4")
    code, _, err = cli("trace", "--model", "mlp", "--device-kind", "cuda", "--measure")
    assert code == 2 and "--device-kind cuda" in err


def test_cuda_autocast_lists_are_the_builds_autocast_cuda_kernels():
    """Every op holding an ``AutocastCUDA`` kernel in this build has exactly one policy, and no other op has one."""
    from trainledger.trace._autocast import _FP32, _LOWER, _PROMOTE, _SET_OPT_DTYPE, POLICIES, autocast_ops

    lists = [*_LOWER.split(), *_FP32.split(), *_SET_OPT_DTYPE.split(), *_PROMOTE.split()]
    assert len(lists) == len(set(lists))
    assert set(POLICIES) == autocast_ops("AutocastCUDA")


class _Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(32, 32), nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x).softmax(-1)).sum()


def test_autocast_runs_cudas_lists_softmax_and_layer_norm_in_fp32():
    def step() -> Workload:
        w = Workload(_Softmax(), torch.randn(16, 32), name="autocast")
        w.autocast_dtype = torch.bfloat16
        return w

    def saved(led, op):
        return [e.dtype for e in led.entries if e.name.startswith(op) and e.category == Category.ACTIVATIONS]

    cuda = trace(step(), kernel_kind="cuda")
    cpu = trace(step(), fake=True, kernel_workspace=False)
    assert saved(cuda, "aten._softmax#") == ["float32"] and saved(cpu, "aten._softmax#") == ["bfloat16"]
    # linear runs in low precision on both: its input's bf16 cast is saved for the weight's gradient
    assert saved(cuda, "aten._to_copy#") == saved(cpu, "aten._to_copy#") == ["bfloat16"]
    assert any("autocast with CUDA's op lists" in n for n in cuda.notes)
    after = trace(step(), fake=True, kernel_workspace=False)  # the CPU's own autocast kernels are back
    assert saved(after, "aten._softmax#") == ["bfloat16"]


def test_stacked_cuda_trace_equals_the_whole_model_traced():
    from trainledger.examples import gpt_tiny
    from trainledger.trace import trace_stacked

    def build(depth: int) -> Workload:
        return gpt_tiny(n_layer=depth, n_embd=16, n_head=2, seq_len=8, batch_size=2)

    stacked = trace_stacked(build, 6, kernel_kind="cuda", cuda_device="a100")
    whole = trace(build(6), kernel_kind="cuda", cuda_device="a100")
    assert stacked.meta["blocks"]["extended"] and stacked.meta["cuda_device"] == "A100-80GB"
    assert stacked.peak() == whole.peak() and len(stacked.entries) == len(whole.entries)
    assert sorted(e.kernel for e in stacked.entries) == sorted(e.kernel for e in whole.entries)
