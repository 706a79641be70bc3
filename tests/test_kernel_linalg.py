"""Linear-algebra kernels hold LAPACK workspace and factor copies inside one op: probed like convolutions, and the
matrix exponential, whose temporaries depend on its input's norm, probed at that norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainledger.measure import measure
from trainledger.trace import KERNEL_INTERNAL, KernelCall, kernel_internal_bytes
from trainledger.workload import Workload


class _EighPreconditioned(torch.optim.Optimizer):
    """A Shampoo-like step: each weight's gradient preconditioned by an eigendecomposition of its statistics."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                state = self.state[p]
                if not state:
                    state["statistics"] = torch.eye(p.shape[0]) * 1e-3
                state["statistics"].add_(p.grad @ p.grad.T)
                values, vectors = torch.linalg.eigh(state["statistics"])
                p.add_(vectors @ torch.diag(values.rsqrt()) @ vectors.T @ p.grad, alpha=-group["lr"])


def _orthogonal() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.orthogonal(nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 4))
    return Workload(model, torch.randn(8, 16), loss_fn=lambda out, _: out.square().mean())


def _shampoo_like() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 4))
    return Workload(
        model, torch.randn(8, 24), loss_fn=lambda out, _: out.square().mean(), optimizer=_EighPreconditioned
    )


@pytest.mark.parametrize("build", [_orthogonal, _shampoo_like], ids=["orthogonal-matrix-exp", "eigh-optimizer"])
def test_linear_algebra_steps_are_traced_to_the_allocators_count(build):
    m = measure(build(), num_steps=1)
    internal = [e for e in m.traced.entries if e.role == KERNEL_INTERNAL]
    assert internal  # before these ops were probed, the trace was 31,756 and 2,136 bytes short
    assert 0 <= m.peak_bytes - m.traced.peak().bytes <= 16  # an optimizer's scalars made inside a kernel


def test_the_matrix_exponential_is_probed_at_its_inputs_norm():
    op = torch.ops.aten.linalg_matrix_exp.default
    small, large = torch.randn(16, 16) * 1e-3 / 16, torch.randn(16, 16)
    calls = [KernelCall.of(op, (t,), {}) for t in (small, large)]
    measured = kernel_internal_bytes(calls)
    assert measured[calls[0]] < measured[calls[1]]  # a lower degree of its series: fewer temporaries
    assert measured[calls[1]] == kernel_internal_bytes([KernelCall.of(op, (large * 3,), {})]).popitem()[1]
