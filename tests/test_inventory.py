"""Inventory bytes against the independent oracle: ``untyped_storage().nbytes()`` over unique storages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests import record_loop
from trainledger import examples
from trainledger.inventory import declared_state_layout, inventory, iter_state_tensors, unique_storage_bytes
from trainledger.ledger import Evidence
from trainledger.state import workload_state
from trainledger.workload import run_step


def oracle_by_category(workload) -> dict[str, int]:
    """Bytes per category computed straight from the objects, without the inventory's code."""
    model, opt = workload.model, workload.get_optimizer()
    params = list(model.parameters())
    model_ptrs = {p.untyped_storage().data_ptr() for p in params}
    masters = [p for g in opt.param_groups for p in g["params"] if p.untyped_storage().data_ptr() not in model_ptrs]
    ref = list(workload.reference.parameters()) if workload.reference is not None else []
    out = {
        "weights": unique_storage_bytes(p for p in params if p.requires_grad),
        "frozen": unique_storage_bytes([p for p in params if not p.requires_grad] + ref),
        "other": unique_storage_bytes(model.buffers()),
        "gradients": unique_storage_bytes([p.grad for p in params + masters if p.grad is not None]),
        "optimizer": unique_storage_bytes([*iter_state_tensors(opt), *masters]),
    }
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("name", ["gpt-tiny", "cnn", "lora", "mlp", "seed-423", "bf16-master", "dpo", "lstm", "moe"])
def test_inventory_bytes_equal_unique_storage_bytes(name):
    # gpt-tiny: tied weights; cnn: BatchNorm buffers + Adam; lora: frozen base; mlp: SGD momentum;
    # seed-423: float64 Adam + reference; bf16-master: bf16 weights with fp32 master copies.
    w = examples.build(name)
    run_step(w, zero_grad=False)
    led = inventory(w.model, w.get_optimizer(), reference=w.reference)
    assert {k[0]: v for k, v in led.bytes_by("category").items()} == oracle_by_category(w)
    assert led.evidence == Evidence.INVENTORIED


def test_tied_weights_count_once():
    w = examples.gpt_tiny()
    led = inventory(w.model)
    tied = [e for e in led.entries if e.aliases]
    assert [(e.name, e.aliases) for e in tied] == [("wte.weight", ("lm_head.weight",))]
    assert led.num_params() == sum(p.numel() for p in w.model.parameters())  # parameters() dedupes too


def test_views_count_nothing():
    base = torch.zeros(10, 10)
    m = nn.Module()
    m.a = nn.Parameter(base)
    m.register_buffer("view", base[2:4])  # a view of the same storage: no new bytes
    led = inventory(m)
    assert sum(e.nbytes for e in led.entries) == 400


def test_frozen_weights_never_go_to_weights():
    w = examples.lora()
    led = inventory(w.model)
    frozen = {e.name for e in led.select(category="frozen")}
    assert frozen == {"inner.0.base.weight", "inner.0.base.bias", "inner.2.base.weight", "inner.2.base.bias"}
    assert all("lora" in e.name for e in led.select(category="weights"))


def test_master_copies_are_labelled():
    w = examples.bf16_master()
    run_step(w, zero_grad=False)
    led = inventory(w.model, w.get_optimizer())
    masters = led.select(category="optimizer", role="master")
    assert len(masters) == 6 and all(e.dtype == "float32" for e in masters)
    assert all(e.dtype == "bfloat16" for e in led.select(category="weights"))
    assert sum(e.numel for e in masters) == led.num_params()


OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {}),
    (torch.optim.AdamW, {"amsgrad": True}),
    (torch.optim.Adagrad, {}),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}),
    (torch.optim.Adafactor, {}),
    (torch.optim.NAdam, {}),
    (torch.optim.ASGD, {}),
    (torch.optim.Rprop, {}),
    (torch.optim.Adamax, {}),
]


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_declared_layout_matches_the_state_after_a_real_step(cls, kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3, bias=False)).to(torch.float64)
    opt = cls(model.parameters(), **kwargs)
    params = list(model.parameters())
    before = inventory(model, opt)
    declared = {(e.name, e.role, e.dtype, e.numel) for e in before.select(category="optimizer")}
    layout = declared_state_layout(opt, params)
    model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    opt.step()
    after = inventory(model, opt)
    real = {(e.name, e.role, e.dtype, e.numel) for e in after.select(category="optimizer")}
    assert declared == real
    assert after.evidence == Evidence.INVENTORIED
    if cls is not torch.optim.Adagrad:  # Adagrad creates its state in __init__
        assert before.evidence == Evidence.DECLARED and layout is not None


def test_state_kept_in_lists_is_optimizer_state():
    """L-BFGS keeps its history of directions and steps as lists of tensors: optimizer state, counted."""
    model, opt, closure = record_loop.lbfgs()
    for _ in range(2):
        opt.step(closure)
    state = opt.state[model.weight]
    history = [t for key in ("old_dirs", "old_stps", "ro", "al") for t in state[key]]
    assert len(history) > 8  # four full lists, by hand
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in history}
    held |= {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in state.values() if torch.is_tensor(v)}
    led = inventory(model, opt)
    assert led.bytes_by("category")[("optimizer",)] == sum(held.values())
    assert any(e.name == "optimizer.weight.old_dirs[0]" and e.role == "old_dirs" for e in led.entries)


def test_unknown_optimizer_without_layout_is_named_not_hidden():
    class Odd(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    self.state[p]["acc"] = p.detach().clone()
                    float(self.state[p]["acc"].sum())  # reads a value: cannot run on fake tensors

    m = nn.Linear(2, 2)
    led = inventory(m, Odd(m.parameters()))
    assert any("layout is unknown" in n for n in led.notes)


def test_seed_fixture_numbers():
    r = workload_state(examples.seed_423())
    by_cat = {k[0]: v for k, v in r.ledger.bytes_by("category").items()}
    assert by_cat["weights"] == 3384 and by_cat["frozen"] == 3384 and by_cat["gradients"] == 3384
    moments = sum(e.nbytes for e in r.ledger.select(category="optimizer") if e.role in ("exp_avg", "exp_avg_sq"))
    assert moments == 6768
    assert [t for _, t in r.payload.running_totals()] == [3384, 6768, 10152, 13536]
    assert sum(e.numel for e in r.ledger.select(category="weights")) == 423


def test_seed_graph_node_count_by_hand():
    # loss = mse(f(x), y) + 0.1 * mse(f(x), ref): f = Linear -> Tanh -> Linear.
    # Nodes: 2 AddmmBackward, 2 TBackward, TanhBackward, 4 AccumulateGrad, 2 MseLossBackward, MulBackward, AddBackward
    r = workload_state(examples.seed_423())
    assert r.num_graph_nodes == 13


def test_recovery_checkpoint_excludes_gradients_and_activations():
    r = workload_state(examples.seed_423())
    assert r.recovery.bytes == 3384 + 6768 + 16  # weights, moments, step counters (4 x fp32)
    assert r.recovery.frozen_bytes == 3384


def test_a_master_weight_optimizer_s_copy_of_an_fp32_weight_is_its_master():
    """A model of bf16 layers and one fp32 weight (a router transformers keeps in fp32): the optimizer copies every
    weight to fp32, that one too. Its copy was counted as a parameter trained beside the model (DeepSeek-V2-Lite's
    count 3,407,872 too many); and the optimizer, training copies only, is not another model's."""
    from trainledger.examples import AdamWWithMasterWeights
    from trainledger.inventory import match_masters, trains_none_of

    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4, bias=False)).to(torch.bfloat16)
    model[1].weight = nn.Parameter(model[1].weight.detach().float())  # the fp32 one
    opt = AdamWWithMasterWeights(model.parameters())
    masters = match_masters(model, opt)
    assert sorted(masters.values()) == ["0.bias", "0.weight", "1.weight"]
    led = inventory(model, opt)
    assert not [e for e in led.entries if e.name.startswith("optimizer.group")]
    assert sum(e.numel for e in led.entries if e.role == "master") == sum(p.numel() for p in model.parameters())
    assert not trains_none_of(model, opt)
    assert trains_none_of(model, torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1))
