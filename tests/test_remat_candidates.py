"""Candidates, costs and predicted peaks on real traced steps, against independent oracles:
FlopCounterMode and hand-counted matmul FLOPs, the re-traced step with the plan applied, brute force."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainledger.errors import InputError
from trainledger.examples import gpt_tiny
from trainledger.remat import (
    Budget,
    InfeasibleBudget,
    Plan,
    Planner,
    Region,
    brute_force,
    chain_savings,
    regions_of,
    replay,
    solve_dp,
    solve_milp,
    structure_fingerprint,
)
from trainledger.trace import trace
from trainledger.workload import Workload, call_model


@pytest.fixture(scope="module")
def planner() -> Planner:
    return Planner.build(gpt_tiny(n_layer=2))


def test_recompute_flops_match_flop_counter_and_hand_count(planner):
    cs = planner.candidates
    w = gpt_tiny(n_layer=2)
    with FlopCounterMode(display=False) as counter:
        call_model(w.model, w.batch)
    counts = counter.get_flop_counts()
    block = cs.candidates[cs.index(Region("blocks.0"))]
    # the early stop drops only the final residual add, which has no FLOPs: all of the block's forward
    assert block.flops == sum(counts["GPT.blocks.0"].values())
    # by hand: B*T = 256 tokens, C = 64; qkv 2·256·64·192, QKᵀ and AV 2·(4·4)·64·64·16 each,
    # proj 2·256·64·64, fc and proj2 2·256·64·256 each
    assert block.flops == 2 * 256 * 64 * 192 + 2 * (2 * 16 * 64 * 64 * 16) + 2 * 256 * 64 * 64 + 2 * (
        2 * 256 * 64 * 256
    )
    attn = cs.candidates[cs.index(Region("blocks.0.attn"))]
    assert (
        attn.flops
        == sum(counts["GPT.blocks.0.attn"].values())
        == 2 * 256 * 64 * 192 + 2 * (2 * 16 * 64 * 64 * 16) + 2 * 256 * 64 * 64
    )
    selective = cs.candidates[cs.index(Region("blocks.0", "selective"))]
    assert selective.flops == 0  # every matmul output is kept; only pointwise ops are recomputed


def test_the_early_stop_is_the_last_op_whose_output_backward_needs(planner):
    cs = planner.candidates
    block = cs.candidates[cs.index(Region("blocks.0"))]
    ops = [cs.plain.events[i].op for i in range(block.stop + 1, block.fwd[1] + 1)]
    # dropout's multiply saves the mask before it runs, and that save ends the recomputation: neither the
    # multiply nor the residual add after it runs again
    assert ops == ["aten.mul.Tensor", "aten.add.Tensor"]


def test_linear_model_adds_exactly(planner):
    cs, model = planner.candidates, planner.model
    rng = random.Random(0)
    n = len(cs.candidates)
    num_checked = 0
    for _ in range(25):
        choice = [j for j in range(n) if rng.random() < 0.4]
        if not model.compatible(choice):
            continue
        assert model.peak(choice) == replay(cs, choice).peak().bytes
        num_checked += 1
    assert num_checked >= 5, f"only {num_checked} of 25 random plans were compatible"


@pytest.mark.slow
def test_predicted_peaks_match_the_retraced_step():
    w = gpt_tiny(n_layer=2)
    p = Planner.build(w)
    cs = p.candidates
    names = [
        [Region("blocks.0"), Region("blocks.1")],
        [Region("blocks.0.attn"), Region("blocks.1.mlp")],
        [Region("blocks.1", "selective")],
    ]
    for regions in names:
        choice = [cs.index(r) for r in regions]
        predicted = replay(cs, choice).peak().bytes
        plan = Plan(regions=regions_of(cs, choice), fingerprint=structure_fingerprint(w.model))
        plan.apply(w.model)
        try:
            traced = trace(w).peak().bytes
        finally:
            plan.remove(w.model)
        assert abs(predicted - traced) <= 0.01 * traced, (regions, predicted, traced)


def test_dp_and_milp_agree_on_the_real_model(planner):
    model = planner.model
    chain_savings(model)  # the GPT is a chain
    for budget in np.linspace(planner.floor_bytes, planner.plain_peak_bytes, 6).astype(int):
        dp, milp = solve_dp(model, int(budget)), solve_milp(model, int(budget))
        assert dp.cost == pytest.approx(milp.cost, rel=1e-9, abs=1e-12)
        assert dp.peak_bytes <= budget and milp.peak_bytes <= budget


def test_brute_force_on_the_real_model_at_the_floor(planner):
    model = planner.model
    assert model.num_candidates <= 16
    best = brute_force(model, planner.floor_bytes)
    assert best is not None and brute_force(model, planner.floor_bytes - 1) is None
    assert solve_milp(model, planner.floor_bytes).cost == pytest.approx(best[1])


def test_impossible_budget_states_the_floor_and_carries_the_best_plan(planner):
    with pytest.raises(InfeasibleBudget) as info:
        planner.solve(planner.floor_bytes - 1)
    err = info.value
    assert err.floor_bytes == planner.floor_bytes and err.budget_bytes == planner.floor_bytes - 1
    assert err.best.predicted_peak_bytes == planner.floor_bytes
    assert f"{planner.floor_bytes:,}" in str(err) and "below the floor" in str(err)
    assert isinstance(err, InputError)
    ok = planner.solve(planner.floor_bytes)
    assert ok.predicted_peak_bytes == planner.floor_bytes


def test_uniform_and_sqrt_n_are_in_the_plan_space(planner):
    blocks = planner.block_candidates()
    assert [planner.candidates.candidates[j].region.path for j in blocks] == ["blocks.0", "blocks.1"]
    uniform = planner.solve(planner.plain_peak_bytes, solver="uniform")
    best = planner.solve(uniform.predicted_peak_bytes)
    assert best.extra_seconds <= uniform.extra_seconds + 1e-12


@pytest.mark.parametrize(
    ("text", "expected"),
    [("50%", 500), ("12.5%", 125), ("2KiB", 2048), ("1e3", 1000), (4096, 4096)],
)
def test_budget_parsing(text, expected):
    assert Budget.parse(text).resolve(1000) == expected


def test_a_budget_is_parsed_once_into_a_typed_value():
    b = Budget.parse("60%")
    assert b == Budget(percent=60.0) and Budget.parse(b) is b
    assert Budget.parse("2KiB") == Budget(nbytes=2048)
    with pytest.raises(InputError, match="is a float"):
        Budget.parse(0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", "not understood"),
        ("-5%", "must be a positive percentage"),
        ("0%", "must be a positive percentage"),
        ("1e9%", "more than 10,000% of the plain peak"),
        ("%", "not understood"),
        ("5 parsecs", "not understood"),
        ("-1GiB", "budget"),
        ("70", "would be 70 bytes; give 70% for a share of the plain peak, or a size with its unit"),
    ],
)
def test_bad_budgets(text, message):
    with pytest.raises(InputError, match=re.escape(message)):
        Budget.parse(text)


def test_percentages_are_of_the_traced_peak(planner):
    p = planner.solve("80%")
    assert p.budget_bytes == planner.plain_peak_bytes * 80 // 100
    assert p.predicted_peak_bytes <= p.budget_bytes


@pytest.mark.slow
def test_unet_with_skip_connections_plan_verified():
    """A U-Net is not a transformer chain: encoder outputs are kept for the decoder. The plan still
    replays exactly enough to land within 1% of the re-traced peak, with bitwise-equal gradients
    (Dropout2d and BatchNorm inside the recomputed regions)."""
    from trainledger.examples import unet_small
    from trainledger.remat import verify

    w = unet_small(batch_size=2)
    p = Planner.build(w)
    chain_savings(p.model)  # backward visits the stages in reverse: a chain for the DP
    budget = (p.plain_peak_bytes + p.floor_bytes) // 2
    plan = p.solve(budget)
    assert plan.solver == "dp" and plan.regions
    assert solve_milp(p.model, budget).cost == pytest.approx(
        p.model.total_cost([p.candidates.index(r) for r in plan.regions])
    )
    v = verify(w, plan, timing=False)
    assert v.within_budget and v.gradients_bitwise_equal and v.num_gradients > 0
    assert abs(v.relative_error) <= 0.01


def test_cpu_flash_attention_is_charged_its_two_matmuls():
    """PyTorch has no FLOP formula for the CPU's flash attention kernel; recomputing it costs what CUDA's does:
    QKᵀ and AV, 2·B·H·T·T·d each. Without dropout the CPU's SDPA runs that kernel (with dropout, the math
    kernel's matmuls, which FlopCounterMode counts)."""
    import importlib.util
    from pathlib import Path

    import torch

    from trainledger.workload import Workload

    spec = importlib.util.spec_from_file_location(
        "sdpa_models_flops", Path(__file__).parent / "fixtures" / "sdpa_models.py"
    )
    assert spec is not None and spec.loader is not None
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    B, T, C, H = 2, 32, 32, 4
    torch.manual_seed(0)
    model = models.Stack(vocab=64, dim=C, num_heads=H, num_layers=2, dropout=0.0)
    idx = torch.randint(0, 64, (B, T + 1))
    planner = Planner.build(Workload(model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()), name="sdpa"))
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in {e.op for e in planner.candidates.plain.events}
    block = planner.candidates.candidates[planner.candidates.index(Region("blocks.0"))]
    N = B * T
    # qkv, proj, fc1; the recomputation stops at the save of fc2's input, so fc2 does not run again
    linears = 2 * N * C * 3 * C + 2 * N * C * C + 2 * N * C * 4 * C
    attention = 2 * (2 * B * H * T * T * (C // H))
    assert block.flops == linears + attention


class _Residual(nn.Module):
    """A block around one module, with an op of its own: ``x + f(x)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


def test_a_stack_of_blocks_that_each_wrap_one_module_is_planned_and_verified():
    """Each block calls one module, the shape of a wrapper: opened as one, its layers were the chain's positions,
    each keeping its input anyway, and no plan recomputed anything (the floor was the plain peak)."""
    from trainledger.remat import verify

    torch.manual_seed(0)
    model = nn.Sequential(*[_Residual(32) for _ in range(4)], nn.Linear(32, 10))
    w = Workload(model, torch.randn(16, 8, 32), loss_fn=lambda out, _: out.square().mean())
    p = Planner.build(w)
    assert p.candidates.positions[:4] == ("0", "1", "2", "3") and len(p.candidates.blocks) == 4
    assert p.floor_bytes < 0.8 * p.plain_peak_bytes
    plan = p.solve((p.plain_peak_bytes + p.floor_bytes) // 2)
    assert plan.regions
    v = verify(w, plan, timing=False)
    assert v.within_budget and v.gradients_bitwise_equal and v.num_gradients == 2 * 4 * 3 + 2
    assert abs(v.relative_error) <= 0.01


def test_a_plan_recomputing_self_attention_runs_under_the_tracer_and_is_verified():
    """``nn.MultiheadAttention`` called as ``attn(x, x, x)`` projects q, k and v in one product only while
    ``query is key``; checkpointed under saved-tensor hooks (the tracer's) the three came back as three tensor
    objects and the recomputation raised ``CheckpointError``."""
    from trainledger.remat import verify

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.1, norm_first=True)
    stack = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)  # norm_first: no nested tensors anyway
    w = Workload(stack, torch.randn(4, 16, 32), loss_fn=lambda out, _: out.square().mean())
    p = Planner.build(w)
    attention = Region("layers.1.self_attn")
    plan = Plan(regions=(attention,), fingerprint=structure_fingerprint(w.model))
    v = verify(w, plan, timing=False)
    assert v.gradients_bitwise_equal and v.num_gradients == 3 * 12
    assert v.traced_peak_bytes == replay(p.candidates, [p.candidates.index(attention)]).peak().bytes


class _Recurrent(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def test_recomputing_an_lstm_costs_its_matmuls():
    """oneDNN's recurrent layer has no FlopCounterMode formula: recomputing an LSTM cost 0 FLOPs. Per time step
    and sequence it multiplies the input and the hidden state by every gate: 2·T·B·(4H·I + 4H·H)."""
    from trainledger.remat import Planner
    from trainledger.workload import Workload

    steps, batch, width, hidden = 20, 8, 32, 48
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, width), _Recurrent(width, hidden), nn.Linear(hidden, width), _Recurrent(width, hidden)
    )
    w = Workload(model, torch.randn(steps, batch, 16), loss_fn=lambda out, _batch: out.square().mean())
    costs = {(c.region.path, c.region.policy): c.flops for c in Planner.build(w, cost="flops").candidates.candidates}
    lstm = 2 * steps * batch * (4 * hidden * width + 4 * hidden * hidden)
    assert costs[("3", "full")] == lstm


class _TanhBlock(nn.Module):
    """Saves no copy of its input (tanh saves its output): the plain step lets the caller update the input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(torch.tanh(x))))


class _InPlaceResidual(nn.Module):
    def __init__(self, *, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.inp = nn.Linear(10, 20)
        self.blocks = nn.ModuleList(_TanhBlock(20) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * 1.0
        for block in self.blocks:
            if self.in_place:
                h += block(h)  # the block's input, written after the block: a checkpoint keeps it as it was
            else:
                h = h + block(h)
        return h.square().mean()


def test_a_call_whose_input_a_later_op_writes_in_place_is_not_a_candidate():
    """PyTorch's checkpoint keeps a call's tensor arguments and checks at the recomputation that none changed: a
    plan over ``h += block(h)`` failed in backward ("modified by an inplace operation"). Such calls are left out
    and the refusal says why; the same model written out of place is planned."""
    torch.manual_seed(0)
    p = Planner.build(Workload(_InPlaceResidual(in_place=True), torch.randn(6, 10)))
    assert not p.candidates.candidates
    with pytest.raises(InputError, match=r"a later op writes in place to a tensor the call was given.*blocks.0"):
        p.solve(p.plain_peak_bytes - 1)
    torch.manual_seed(0)
    out_of_place = Planner.build(Workload(_InPlaceResidual(in_place=False), torch.randn(6, 10)))
    assert {c.region.path for c in out_of_place.candidates.candidates} >= {"blocks.0", "blocks.1", "blocks.2"}


def test_a_peak_no_plan_lowers_is_named_where_it_is():
    """Wide layers on a tiny batch peak in the optimizer step, where nothing recomputed is live: the floor is the
    plain peak, and the error says where the peak is, not that "the best plan recomputes 0 regions"."""
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())  # noqa: E731
    model = nn.Sequential(block(), block(), nn.Linear(256, 4))
    p = Planner.build(Workload(model, torch.randn(2, 256), loss_fn=lambda out, _: out.square().mean()))
    assert p.floor_bytes == p.plain_peak_bytes
    with pytest.raises(InfeasibleBudget) as info:
        p.solve(p.plain_peak_bytes // 2)
    peak = p.candidates.plain.peak()
    assert peak.phase == "optimizer"
    assert f"which no plan lowers: it is at event {peak.event} (optimizer, {peak.op})" in str(info.value)
    assert info.value.best.regions == ()


class _ScaledScores(nn.Module):
    """Attention scores scaled in place after their ``bmm`` (Funnel's ``positional_attn *= cls_mask``)."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.qkv, self.out, self.up, self.down = (
            nn.Linear(32, 96),
            nn.Linear(32, 32),
            nn.Linear(32, 128),
            nn.Linear(128, 32),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.bmm(q, k.transpose(1, 2))
        scores = scores.mul_(0.5) if self.in_place else scores * 0.5
        h = x + self.out(torch.bmm(scores.softmax(-1), v))
        u = self.up(h)
        return h + self.down(F.gelu(u) * torch.sigmoid(u))


def test_no_policy_keeps_an_output_a_later_op_writes_in_place():
    """A selective plan kept the scores' bmm output, which the block then scaled in place: PyTorch raised "Tensor
    cached during selective activation checkpoint has been mutated" in backward (and an exported policy too)."""

    def policies(in_place: bool) -> set[str]:
        torch.manual_seed(0)
        model = nn.Sequential(_ScaledScores(in_place), _ScaledScores(in_place))
        p = Planner.build(Workload(model, torch.randn(4, 48, 32), loss_fn=lambda out, _: out.square().mean()))
        return {c.region.policy for c in p.candidates.candidates if c.region.path == "0"}

    assert "selective" in policies(in_place=False)  # it keeps every matmul's output, the scores' bmm's too
    assert "selective" not in policies(in_place=True)
