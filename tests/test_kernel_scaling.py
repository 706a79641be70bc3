"""A convolution too slow to probe whole: its buffers scaled from small instances, checked against full probes."""

from __future__ import annotations

import math

import pytest
import torch

from trainledger.ledger import Evidence
from trainledger.trace._kernels import KernelCall, probe_calls
from trainledger.trace._scaled import conv_of, scaling_of

aten = torch.ops.aten
TOLERANCE = 0.05  # the rule's estimate against the full probe
IM2COL_BF16 = not torch.ops.mkldnn._is_mkldnn_bf16_supported()  # no AVX-512 BF16: bf16 convolutions use im2col


def _conv(n, cin, cout, h, w, k, stride, dtype, *, backward):
    """A convolution call (forward, or backward with all three gradients) on zeros of these sizes."""
    x, weight = torch.zeros(n, cin, h, w, dtype=dtype), torch.zeros(cout, cin, k, k, dtype=dtype)
    geometry = ([stride, stride], [k // 2, k // 2], [1, 1], False, [0, 0], 1)
    if not backward:
        return KernelCall.of(aten.convolution.default, (x, weight, torch.zeros(cout, dtype=dtype), *geometry), {})
    ho, wo = ((side + 2 * (k // 2) - k) // stride + 1 for side in (h, w))
    grad = torch.zeros(n, cout, ho, wo, dtype=dtype)
    with torch.no_grad():
        return KernelCall.of(aten.convolution_backward.default, (grad, x, weight, [cout], *geometry, [True] * 3), {})


MID_SIZE = [  # (n, cin, cout, h, w, k, stride): batches, channels and pixels past the small instance's
    (3, 48, 40, 12, 10, 3, 1),
    (2, 40, 24, 13, 11, 3, 2),
    (4, 36, 20, 9, 9, 1, 1),
]


@pytest.mark.slow
@pytest.mark.skipif(not IM2COL_BF16, reason="this CPU runs bf16 convolutions through oneDNN, not im2col")
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_the_rule_estimates_bf16_convolutions_as_full_probes_measure_them(backward):
    calls = [_conv(*s, torch.bfloat16, backward=backward) for s in MID_SIZE if s[5] == 3]
    whole = probe_calls(calls, max_seconds=math.inf)
    scaled = probe_calls(calls, max_seconds=0.0)
    for call in calls:
        assert whole[call].evidence == Evidence.MEASURED
        assert scaled[call].evidence == Evidence.ESTIMATED, scaled[call].why
        assert scaled[call].nbytes == pytest.approx(whole[call].nbytes, rel=TOLERANCE, abs=1024)
    assert max(whole[c].nbytes for c in calls) > 10_000  # im2col columns of several images: something to scale


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rule_declines_or_matches(dtype):
    """oneDNN's fp32 buffers, and a 1×1 bf16 backward's, are no product of the sizes on some machines: the
    rule must then decline, never guess; where it does estimate, the estimate matches the full probe."""
    calls = [_conv(*s, dtype, backward=b) for s in MID_SIZE for b in (False, True)]
    whole = probe_calls(calls, max_seconds=math.inf)
    scaled = probe_calls(calls, max_seconds=0.0)
    for call in calls:
        got = scaled[call]
        if got.evidence is None:
            assert got.nbytes is None and "no product" in got.why
        else:
            assert got.nbytes == pytest.approx(whole[call].nbytes, rel=TOLERANCE, abs=1024)


@pytest.mark.slow
def test_a_call_over_the_caps_is_scaled_or_left_out_without_running_it():
    big = _conv(64, 512, 512, 256, 256, 3, 1, torch.bfloat16, backward=False)  # 17 TFLOP; days in bf16 here
    norm = KernelCall.of(aten.native_layer_norm.default, (torch.zeros(8, 64), [64], None, None, 1e-5), {})
    found = probe_calls([big, norm], max_seconds=1.0, max_bytes=1024)
    assert found[big].evidence != Evidence.MEASURED and found[big].why
    if IM2COL_BF16:
        assert found[big].evidence == Evidence.ESTIMATED
        assert found[big].nbytes == 64 * 512 * 9 * 256 * 256 * 2  # the columns of every image, bf16
    assert found[norm].evidence is None and found[norm].nbytes is None and "too large" in found[norm].why


def test_only_plain_2d_convolutions_are_scaled_and_others_too_slow_are_left_out():
    x, w = torch.zeros(2, 8, 6, 6), torch.zeros(8, 1, 3, 3)
    grouped = KernelCall.of(aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8), {})
    assert conv_of(grouped) is None and scaling_of(grouped) is None
    assert probe_calls([grouped], max_seconds=0.0)[grouped].why == "too slow to run here"
    assert probe_calls([grouped], max_seconds=math.inf)[grouped].evidence == Evidence.MEASURED
    plain = _conv(2, 8, 8, 6, 6, 3, 1, torch.float32, backward=False)
    assert conv_of(plain).sizes.n == 2 and scaling_of(plain) is not None


@pytest.mark.slow
@pytest.mark.skipif(not IM2COL_BF16, reason="this CPU runs bf16 convolutions through oneDNN, not im2col")
def test_a_trace_with_estimated_kernel_buffers_equals_the_measured_one(monkeypatch):
    from trainledger.trace import _scaled, trace
    from trainledger.workload import Workload

    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(24, 20, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(20, 4, 3))
        net = net.to(torch.bfloat16)
        return Workload(net, torch.zeros(3, 24, 10, 9, dtype=torch.bfloat16), loss_fn=lambda out, _: out.sum())

    def internal(led):
        return [(e.name, e.nbytes, e.evidence) for e in led.entries if e.role == "kernel_internal"]

    measured = trace(build(), fake=True)
    monkeypatch.setattr(_scaled, "MAX_PROBE_SECONDS", 0.0)
    estimated = trace(build(), fake=True)
    assert [n for n, *_ in internal(estimated)] == [n for n, *_ in internal(measured)]
    for (_, got, _), (_, want, _) in zip(internal(estimated), internal(measured), strict=True):
        assert got == pytest.approx(want, rel=TOLERANCE)  # a backward without the input's gradient: 2.2 % under
    assert {e for *_, e in internal(measured)} == {Evidence.MEASURED} and len(internal(measured)) >= 3
    assert {e for *_, e in internal(estimated)} == {Evidence.ESTIMATED}
    assert estimated.peak().bytes == pytest.approx(measured.peak().bytes, rel=0.01)
    assert "evidence estimated" in next(n for n in estimated.notes if "kernel_internal" in n)
