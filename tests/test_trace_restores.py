"""``trace(workload)`` on a live model gives back what it found: the warm-up and traced steps it runs leave
no mark on the weights, buffers, gradients, optimizer state or random-number state (bitwise)."""

from __future__ import annotations

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
