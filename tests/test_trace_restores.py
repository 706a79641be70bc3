"""``trace(workload)`` on a live model gives back what it found: the warm-up and traced steps it runs leave
no mark on the weights, buffers, gradients, optimizer state or random-number state (bitwise)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainledger import Workload, run_step, trace
from trainledger.trace import RESTORED_NOTE


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "opt": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in opt.state_dict()["state"].items()
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "rng": torch.get_rng_state(),
    }


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_trace_leaves_weights_optimizer_state_and_rng_as_it_found_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 1))
    w = Workload(model, torch.randn(6, 8), loss_fn=lambda out, _b: out.square().mean(), optimizer=torch.optim.Adam)
    run_step(w, zero_grad=False)  # state exists, gradients left in place
    before = snapshot(model, w.get_optimizer())
    led = trace(w)
    assert RESTORED_NOTE in led.notes
    assert_same(before, snapshot(model, w.get_optimizer()))


def test_trace_of_a_fresh_optimizer_leaves_it_without_state() -> None:
    model = nn.Linear(4, 2)
    w = Workload(model, torch.randn(3, 4), loss_fn=lambda out, _b: out.sum())
    weights = model.weight.detach().clone()
    trace(w)
    assert not w.get_optimizer().state  # AdamW's lazily made moments are gone again
    assert torch.equal(model.weight, weights) and model.weight.grad is None


class _Drifting(nn.Module):
    """Reassigns a buffer in forward (an EMA kept out of place), draws from a generator of its own, Python's
    and NumPy's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("ema", torch.zeros(6))
        self.noise = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        h = self.linear(x + torch.randn(x.shape, generator=self.noise) * random.random() * float(np.random.rand()))
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return h


def test_a_parameter_beside_the_model_a_reassigned_buffer_and_other_generators_are_given_back():
    """Each was left changed by the two steps a trace runs: a temperature the optimizer trains but the model does
    not hold stayed stepped (its Adam state reset), the module held the traced step's EMA, and the generators
    other than torch's default had moved on."""
    import random

    import numpy as np

    torch.manual_seed(0)
    model = _Drifting()
    temperature = nn.Parameter(torch.ones(6))
    opt = torch.optim.Adam([*model.parameters(), temperature], lr=0.1)
    w = Workload(model, torch.randn(4, 6), loss_fn=lambda out, _b: (out / temperature).square().mean(), optimizer=opt)
    run_step(w)  # the optimizer's state exists before the trace
    ema, before = model.ema, snapshot(model, opt)
    others = (temperature.detach().clone(), model.noise.get_state(), random.getstate(), np.random.get_state()[1].copy())
    assert RESTORED_NOTE in trace(w).notes
    assert_same(snapshot(model, opt), before)
    assert model.ema is ema
    assert torch.equal(temperature, others[0]) and torch.equal(model.noise.get_state(), others[1])
    assert random.getstate() == others[2] and (np.random.get_state()[1] == others[3]).all()


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")  # torch.distributed.optim imports use it
def test_an_optimizer_held_by_another_is_given_back_and_named():
    """``ZeroRedundancyOptimizer`` steps a local optimizer of its own, whose state its own ``state`` does not list:
    the trace names that state as the optimizer's and gives it back (it stayed two steps ahead of the weights)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def zero(ps):
            return ZeroRedundancyOptimizer(list(ps), optimizer_class=torch.optim.Adam, lr=0.1)

        w = Workload(model, torch.randn(4, 8), loss_fn=lambda out, _b: out.square().mean(), optimizer=zero)
        run_step(w)
        local = w.get_optimizer().optim
        before = snapshot(model, local)
        led = trace(w)
        assert_same(before, snapshot(model, local))
        named = {e.role for e in led.entries if e.category.value == "optimizer"}
        assert named == {"exp_avg", "exp_avg_sq", "step"}
        moments = sum(e.nbytes for e in led.entries if e.role in ("exp_avg", "exp_avg_sq"))
        assert moments == 2 * 4 * sum(p.numel() for p in model.parameters())
        assert not [e for e in led.entries if e.role == "captured"]
    finally:
        dist.destroy_process_group()
